"""The Triton kernel behind ``CudaBatchCopy``: a whole batch of local copies in one launch.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

MIN_CHUNK_BYTES = 32768  # small enough to spread one entry over many SMs
BLOCK_ELEMENTS = {16: 1024, 8: 1024, 1: 4096}  # elements per step (8 KiB or 4 KiB)


@triton.jit
def _copy_piece(src, dst, first_byte, nbytes, chunk, WORD: tl.constexpr, BLOCK: tl.constexpr):
    """Bytes [first_byte, first_byte + chunk) of one ``nbytes`` entry, clipped at its end."""
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
        # Pointers loaded from memory carry no alignment facts; WORD is what the host checked.
        src_block = tl.max_contiguous(tl.multiple_of(src_ptr + index, WORD), BLOCK)
        dst_block = tl.max_contiguous(tl.multiple_of(dst_ptr + index, WORD), BLOCK)
        tl.store(dst_block, tl.load(src_block, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["n_entries", "chunk"])
def batch_copy_kernel(table, n_entries, chunk, WORD: tl.constexpr, BLOCK: tl.constexpr):
    entry = tl.program_id(0).to(tl.int64)
    first_byte = tl.program_id(1).to(tl.int64) * chunk
    nbytes = tl.load(table + 2 * n_entries + entry)
    if first_byte < nbytes:
        src = tl.load(table + entry)
        dst = tl.load(table + n_entries + entry)
        _copy_piece(src, dst, first_byte, nbytes, chunk, WORD, BLOCK)


@triton.jit(do_not_specialize=["chunk"])
def paged_copy_kernel(table, chunk, WORD: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: its piece of the table (see the module notes)."""
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
    nbytes = tl.load(segment + 2)  # bytes per page, never 0
    pieces = (nbytes + chunk - 1) // chunk
    page = unit // pieces
    pages = table + tl.load(segment + 3)
    src = tl.load(segment) + tl.load(pages + page) * nbytes
    dst = tl.load(segment + 1) + tl.load(pages + tl.load(segment + 4) + page) * nbytes
    _copy_piece(src, dst, (unit - page * pieces) * chunk, nbytes, chunk, WORD, BLOCK)
