"""The Triton kernel behind ``CudaBatchCopy``: a whole batch of local copies in one launch.

Imported lazily by ``batch_copy`` (this module needs triton). The launch table
is one int64 device array of the batch's three columns, written by
``batch_copy.fill_launch_table``:

    [src x N | dst x N | length x N]

The grid is (N, pieces): program (e, p) copies bytes [p * chunk, (p + 1) *
chunk) of entry e, and returns at once where the entry is shorter. ``chunk``
(bytes, a power of two, at least ``MIN_CHUNK_BYTES``) is picked per batch by
the host so that the grid stays a small multiple of the useful programs.

``WORD`` is what the batch's alignment allows: 16 (every pointer and length a
multiple of 16: 128-bit loads and stores), 8 (64-bit), 1 (bytes).
"""

from __future__ import annotations

import triton
import triton.language as tl

MIN_CHUNK_BYTES = 32768  # small enough to spread one entry over many SMs
BLOCK_ELEMENTS = {16: 1024, 8: 1024, 1: 4096}  # elements per step (8 KiB or 4 KiB)


@triton.jit(do_not_specialize=["n_entries", "chunk"])
def batch_copy_kernel(table, n_entries, chunk, WORD: tl.constexpr, BLOCK: tl.constexpr):
    entry = tl.program_id(0).to(tl.int64)
    first_byte = tl.program_id(1).to(tl.int64) * chunk
    nbytes = tl.load(table + 2 * n_entries + entry)
    if first_byte < nbytes:
        src = tl.load(table + entry)
        dst = tl.load(table + n_entries + entry)
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
