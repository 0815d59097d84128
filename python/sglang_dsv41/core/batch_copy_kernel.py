"""The Triton kernel behind ``CudaBatchCopy``: a whole batch of local copies in one launch.

Imported lazily by ``batch_copy`` (this module needs triton). The launch table
is one int64 device array, written by ``batch_copy.write_launch_table``:

    [src x N | dst x N | length x N | first program x N | owner (int32) x programs]

Every entry is cut into ``CHUNK_BYTES`` pieces, one program per piece; program
``p`` copies piece ``p - first[owner[p]]`` of entry ``owner[p]``. Entries of
zero length own no program.

``WORD`` is what the batch's alignment allows: 16 (every pointer and length a
multiple of 16: 128-bit loads and stores), 8 (64-bit), 1 (bytes).
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK_BYTES = 32768  # bytes one program copies: small enough to spread an entry over many SMs
BLOCK_ELEMENTS = {16: 1024, 8: 1024, 1: 4096}  # elements per step (8 KiB or 4 KiB)


@triton.jit(do_not_specialize=["n_entries"])
def batch_copy_kernel(table, n_entries, WORD: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    owner = (table + 4 * n_entries).to(tl.pointer_type(tl.int32), bitcast=True)
    entry = tl.load(owner + pid).to(tl.int64)
    src = tl.load(table + entry)
    dst = tl.load(table + n_entries + entry)
    nbytes = tl.load(table + 2 * n_entries + entry)
    first = tl.load(table + 3 * n_entries + entry)
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
    start = (pid - first) * (CHUNK // ELEM)
    offsets = tl.arange(0, BLOCK)
    for step in tl.static_range(0, CHUNK // ELEM, BLOCK):
        index = start + step + offsets
        mask = index < count
        # Pointers loaded from memory carry no alignment facts; WORD is what the host checked.
        src_block = tl.max_contiguous(tl.multiple_of(src_ptr + index, WORD), BLOCK)
        dst_block = tl.max_contiguous(tl.multiple_of(dst_ptr + index, WORD), BLOCK)
        tl.store(dst_block, tl.load(src_block, mask=mask), mask=mask)
