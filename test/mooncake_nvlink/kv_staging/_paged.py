"""Test helper: a paged write seen as the block list upstream builds for the same call."""

from __future__ import annotations


def runs_of(entries, src_pages, dst_pages) -> list[tuple[int, int, int]]:
    """Entry by entry, each page run (both sides going up by one) as one (src, dst, length) block."""
    blocks = []
    pairs = list(zip(src_pages, dst_pages))
    for s_base, d_base, item in entries:
        run = None
        for s, d in pairs:
            if run and s == run[0] + run[2] and d == run[1] + run[2]:
                run[2] += 1
                continue
            if run:
                blocks.append((s_base + run[0] * item, d_base + run[1] * item, run[2] * item))
            run = [s, d, 1]
        blocks.append((s_base + run[0] * item, d_base + run[1] * item, run[2] * item))
    return blocks


def runs_of_paged(copies) -> list[tuple[int, int, int]]:
    """``runs_of`` over several ``PagedCopy`` in order, or ``PagesOutsideBuffers`` as any copier raises."""
    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import pages_outside

    outside = pages_outside(copies)
    if outside is not None:
        raise outside
    return [b for c in copies
            for b in runs_of(c.entries.tolist(), c.src_pages.tolist(), c.dst_pages.tolist())]
