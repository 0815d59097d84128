"""The DeepSeek-V4.1 request pattern of a PD KV transfer, and the peer-write goals judged on it.

The geometry (buffers, page sizes, the send calls of one request as sglang
0.5.23's DeepSeek-V4 pool makes them) is described in
benchmarks/mooncake_nvlink/mooncake_routing.py's docstring; tests and
benchmarks share this one copy. It is the shipped configuration: DSpark on
(every PD topology passes `--speculative-dspark-block-size 5`, six draft
tokens), so a request's last chunk also sends the draft's sliding-window pages
(two draft layers) and its 8-byte request row (``swa_valid_from``).
"""

from __future__ import annotations

DSV41_PAGE_TOKENS = 256
DSV41_SLIDING_WINDOW = 128
DSV41_KV_ITEM_BYTES = (73728, 17408, 36864, 36864, 36864, 8704, 8704, 8704)
DSV41_SWA_LAYERS = 43
DSV41_SWA_ITEM_BYTES = 135168
# With six draft tokens the request-state rings hold 8 rows instead of 2. sglang sends
# them only for an odd prompt length (none of the cases below): they are sized, not sent.
DSV41_REQUEST_STATE_ITEM_BYTES = (32768, 32768, 32768)
DSV41_DRAFT_SWA_LAYERS = 2  # the DSpark draft: one layer per target layer it reads
DSV41_REQUEST_ROW_ITEM_BYTES = 8  # the draft's int64 swa_valid_from, one row per request slot
DSV41_CHUNK_TOKENS = 16384
# (name, prompt tokens, page layout); prompt 0 = the state calls alone
DSV41_CASES = (
    ("8k contiguous", 8192, "contiguous"),
    ("8k runs of 8", 8192, "runs8"),
    ("8k fragmented", 8192, "fragmented"),
    ("32k contiguous", 32768, "contiguous"),
    ("32k runs of 8", 32768, "runs8"),
    ("32k fragmented", 32768, "fragmented"),
    ("state alone", 0, "contiguous"),
)
# Buffer index space shared by both sides: KV, then sliding-window state, request
# state, the draft's sliding-window state, its request row, then one flat buffer for
# the contiguous write.
_KV0 = 0
_SWA0 = _KV0 + len(DSV41_KV_ITEM_BYTES)
_REQ0 = _SWA0 + DSV41_SWA_LAYERS
_DRAFT_SWA0 = _REQ0 + len(DSV41_REQUEST_STATE_ITEM_BYTES)
_ROW0 = _DRAFT_SWA0 + DSV41_DRAFT_SWA_LAYERS
FLAT_BUFFER = _ROW0 + 1
_SRC_FIRST_PAGE, _DST_FIRST_PAGE = 1, 2  # page 0 is the pools' reserved page
_SWA_PAGES, _REQUEST_SLOTS = 4, 64


def dsv41_page_ids(layout: str, count: int, first: int) -> list[int]:
    """Page ids of a request's ``count`` pages under a layout."""
    if layout == "contiguous":
        return [first + i for i in range(count)]
    if layout == "runs8":  # runs of 8, one unused page between runs
        return [first + (i // 8) * 9 + i % 8 for i in range(count)]
    if layout == "fragmented":  # never two consecutive pages
        return [first + 2 * i for i in range(count)]
    raise ValueError(f"unknown page layout {layout!r}")


def merge_consecutive(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src page, dst page, pages): a run continues only while both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


Span = tuple[int, int, int, int]  # (buffer index, src offset, dst offset, length)


PagedCall = tuple[tuple[int, ...], tuple[int, ...], list[int], list[int]]  # (buffers, bytes per page, src pages, dst pages)


def dsv41_paged_calls(tokens: int, layout: str, chunk_tokens: int = DSV41_CHUNK_TOKENS) -> list[PagedCall]:
    """The send calls of one request as sglang makes them: a KV call per prefill chunk, then the state calls."""
    calls: list[PagedCall] = []
    pages = -(-tokens // DSV41_PAGE_TOKENS)
    src_ids = dsv41_page_ids(layout, pages, _SRC_FIRST_PAGE)
    dst_ids = dsv41_page_ids(layout, pages, _DST_FIRST_PAGE)
    chunk_pages = chunk_tokens // DSV41_PAGE_TOKENS
    kv = tuple(range(_KV0, _KV0 + len(DSV41_KV_ITEM_BYTES)))
    for start in range(0, pages, chunk_pages):
        calls.append((kv, DSV41_KV_ITEM_BYTES, src_ids[start:start + chunk_pages],
                      dst_ids[start:start + chunk_pages]))
    # Sliding-window state: the window's pages of every layer (ring pages of the
    # SWA pool, unrelated to the KV page ids); the draft's sliding window sends the
    # same page lists; the request state only for an odd prompt length; then the
    # draft's request row (the request's slot on each side).
    window_first = max(tokens - DSV41_SLIDING_WINDOW, 0) // DSV41_PAGE_TOKENS
    window_pages = max(pages - window_first, 1)
    window_src, window_dst = list(range(1, 1 + window_pages)), list(range(2, 2 + window_pages))
    calls.append((tuple(range(_SWA0, _SWA0 + DSV41_SWA_LAYERS)), (DSV41_SWA_ITEM_BYTES,) * DSV41_SWA_LAYERS,
                  window_src, window_dst))
    if tokens % 2:
        calls.append((tuple(range(_REQ0, _REQ0 + len(DSV41_REQUEST_STATE_ITEM_BYTES))),
                      DSV41_REQUEST_STATE_ITEM_BYTES, [1], [2]))
    calls.append((tuple(range(_DRAFT_SWA0, _DRAFT_SWA0 + DSV41_DRAFT_SWA_LAYERS)),
                  (DSV41_SWA_ITEM_BYTES,) * DSV41_DRAFT_SWA_LAYERS, window_src, window_dst))
    calls.append(((_ROW0,), (DSV41_REQUEST_ROW_ITEM_BYTES,), [1], [2]))
    return calls


def dsv41_batches(tokens: int, layout: str, chunk_tokens: int = DSV41_CHUNK_TOKENS) -> list[list[Span]]:
    """The engine calls of one request: each send call's blocks, buffer by buffer, as upstream builds them."""
    batches: list[list[Span]] = []
    for buffers, items, src, dst in dsv41_paged_calls(tokens, layout, chunk_tokens):
        runs = merge_consecutive(src, dst)
        batches.append([(b, s * item, d * item, n * item)
                        for b, item in zip(buffers, items) for s, d, n in runs])
    return batches


def dsv41_buffer_sizes() -> list[int]:
    """Bytes of every buffer in the shared index space (enough for every case)."""
    max_pages = -(-max(t for _, t, _ in DSV41_CASES) // DSV41_PAGE_TOKENS)
    kv_pages = _DST_FIRST_PAGE + 2 * max_pages + 2  # the fragmented layout spans twice the pages
    sizes = [kv_pages * item for item in DSV41_KV_ITEM_BYTES]
    sizes += [_SWA_PAGES * DSV41_SWA_ITEM_BYTES] * DSV41_SWA_LAYERS
    sizes += [_REQUEST_SLOTS * item for item in DSV41_REQUEST_STATE_ITEM_BYTES]
    sizes += [_SWA_PAGES * DSV41_SWA_ITEM_BYTES] * DSV41_DRAFT_SWA_LAYERS
    sizes.append(_REQUEST_SLOTS * DSV41_REQUEST_ROW_ITEM_BYTES)
    largest = max(sum(sp[3] for b in dsv41_batches(t, lay) for sp in b) for _, t, lay in DSV41_CASES)
    sizes.append(largest)
    return sizes


# Peer-write goals: (request, at most this many times one contiguous write of the same bytes)
PEER_GOALS = (("32k fragmented", 3.0), ("8k contiguous", 2.0))


def print_peer_goals(peer_x_contiguous: dict, over: str = "", path: str = "held", gpu: bool = True) -> None:
    """The goals are set for GPU memory over NVLink; CPU mode moves its bytes other ways (TCP,
    process_vm_writev), so there they are shown but not judged."""
    for case, limit in PEER_GOALS:
        if case in peer_x_contiguous:
            got = peer_x_contiguous[case]
            verdict = ("met" if got <= limit else "NOT met") if gpu else "not judged in CPU mode"
            print(f"goal: {case} {path} within {limit:.0f}x of one contiguous write: {got:.2f}x{over}, {verdict}")
