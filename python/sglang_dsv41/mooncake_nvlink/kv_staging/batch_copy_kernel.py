"""The Triton kernel behind ``CudaBatchCopy``: every page pair of a batch in one launch.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Elements one step of a program moves: 8 KiB at the 16- and 8-byte widths, 4 KiB byte-wise.
WORD_BLOCK = tl.constexpr(1024)
BYTE_BLOCK = tl.constexpr(4096)


@triton.jit
def _copy_piece(src, dst, first_byte, nbytes, chunk, WORD: tl.constexpr, BLOCK: tl.constexpr):
    """Bytes [first_byte, first_byte + chunk) of one ``nbytes`` page, clipped at its end."""
    if WORD == 1:
        ELEM: tl.constexpr = 1
        src_ptr = src.to(tl.pointer_type(tl.uint8))
        dst_ptr = dst.to(tl.pointer_type(tl.uint8))
        count = nbytes
    else:
        ELEM: tl.constexpr = 8
        src_ptr = src.to(tl.pointer_type(tl.int64))
        dst_ptr = dst.to(tl.pointer_type(tl.int64))
        # The hint keeps the tail mask in whole words, so 16-byte accesses survive it.
        count = tl.multiple_of(nbytes // 8, WORD // 8)
    # chunk is a multiple of BLOCK elements; saying so keeps the mask in whole vectors.
    start = tl.multiple_of(first_byte // ELEM, BLOCK)
    stop = tl.minimum(count, start + chunk // ELEM)
    offsets = tl.arange(0, BLOCK)
    for step in range(0, stop - start, BLOCK):
        index = start + tl.multiple_of(step, BLOCK) + offsets
        mask = index < count
        # Pointers loaded from memory carry no alignment facts; the branch below checked WORD.
        src_block = tl.max_contiguous(tl.multiple_of(src_ptr + index, WORD), BLOCK)
        dst_block = tl.max_contiguous(tl.multiple_of(dst_ptr + index, WORD), BLOCK)
        tl.store(dst_block, tl.load(src_block, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["chunk"])
def paged_copy_kernel(table, chunk):
    """Program p: its piece of the table (see the design note).

    Each buffer's access width is chosen here from its own addresses and page
    size, so DSpark's 8-byte request row rides in the same launch as the
    16-byte KV pages; one compiled kernel serves every width.
    """
    program = tl.program_id(0).to(tl.int64)
    segments = tl.load(table)
    lo = program * 0
    hi = segments - 1
    while lo < hi:  # the first segment whose end is past this program
        mid = (lo + hi) // 2
        below = program < tl.load(table + 2 + mid)
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid + 1)
    first = tl.where(lo > 0, tl.load(table + 1 + lo), 0)  # word 1 (the chunk) is read but unused for lo = 0
    unit = program - first
    segment = table + 2 + segments + 5 * lo
    src_base = tl.load(segment)
    dst_base = tl.load(segment + 1)
    nbytes = tl.load(segment + 2)  # bytes per page, never 0
    pieces = (nbytes + chunk - 1) // chunk
    page = unit // pieces
    pages = table + tl.load(segment + 3)
    src = src_base + tl.load(pages + page) * nbytes
    dst = dst_base + tl.load(pages + tl.load(segment + 4) + page) * nbytes
    first_byte = (unit - page * pieces) * chunk
    # Every page of a buffer shares the alignment of its page-0 addresses and page size.
    bits = src_base | dst_base | nbytes
    if (bits & 15) == 0:
        _copy_piece(src, dst, first_byte, nbytes, chunk, 16, WORD_BLOCK)
    elif (bits & 7) == 0:
        _copy_piece(src, dst, first_byte, nbytes, chunk, 8, WORD_BLOCK)
    else:
        _copy_piece(src, dst, first_byte, nbytes, chunk, 1, BYTE_BLOCK)
