"""Real sglang 0.5.23 PD handshake pieces on 127.0.0.1, for the pd-handshake tests.

Everything here is sglang's own code: ``CommonKVBootstrapServer`` (aiohttp on
127.0.0.1), ``CommonKVManager.__init__`` in prefill mode (registers its rank over
HTTP PUT) and decode mode, ``try_ensure_parallel_info`` (HTTP GET),
``CommonKVReceiver.init`` (per-rank HTTP GETs, marks dummy links). Only what needs
a GPU is absent: the KV pool is described by hand-written ``KVArgs`` values.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from dataclasses import dataclass

import requests

from sglang.srt.disaggregation.base.conn import KVArgs, StateType
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
)
from sglang.srt.disaggregation.utils import DisaggregationMode, filter_kv_indices_for_cp_rank
from sglang.srt.runtime_context import get_context, get_parallel

from sglang_dsv41.plugin.table import by_id
from sglang_dsv41.plugin.testing import patches_installed

PATCH_ID = "PDH-PAIRING"
POOLS = ("mla", "hybrid_mla", "other")
PAGE_SIZE = 256
KV_DTYPE = "fp8_e4m3"
TOTAL_PAGES = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the hook
@contextlib.contextmanager
def plugin_hook_installed():
    """Install the table's PDH-PAIRING hook the way HookRegistry does; restore after."""
    assert by_id()[PATCH_ID].target.endswith("CommonKVManager.try_ensure_parallel_info")
    original = CommonKVManager.__dict__["try_ensure_parallel_info"]
    with patches_installed(PATCH_ID):
        yield original


# ---------------------------------------------------------------- bootstrap server
def stop_bootstrap_server(server: CommonKVBootstrapServer) -> None:
    """Stop sglang's bootstrap server without leaving a task pending.

    Its ``close()`` stops the event loop while the periodic entry-cleanup task
    still waits in a sleep; the loop is then closed and the task is destroyed
    pending ("Task was destroyed but it is pending!" at garbage collection).
    Cancelling the server's background tasks on its own loop first lets the
    loop's final cleanup run finish them.
    """
    loop = getattr(server, "_loop", None)
    if loop is not None and loop.is_running():
        cancelled = threading.Event()

        def cancel_background_tasks():
            for task in list(server._background_tasks):
                task.cancel()
            cancelled.set()

        loop.call_soon_threadsafe(cancel_background_tasks)
        if not cancelled.wait(5):
            raise RuntimeError(f"bootstrap server on port {server.port} did not cancel its tasks")
    server.close()
    if server.thread.is_alive():
        raise RuntimeError(f"bootstrap server thread on port {server.port} did not stop")


class BootstrapServer:
    """sglang's Python bootstrap server on 127.0.0.1, closed on exit."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.server = None

    def __enter__(self):
        self.server = CommonKVBootstrapServer("127.0.0.1", self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                if requests.get(f"http://{self.addr}/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"bootstrap server on {self.addr} did not come up")
            time.sleep(0.02)

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.server is not None:
            stop_bootstrap_server(self.server)
            self.server = None
            # The port is reused by restart tests: wait until nothing answers there.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    requests.get(f"http://{self.addr}/health", timeout=0.2)
                except requests.RequestException:
                    return
                time.sleep(0.02)
            raise RuntimeError(f"bootstrap server on {self.addr} did not stop")

    def put(self, payload: dict) -> requests.Response:
        return requests.put(f"http://{self.addr}/route", json=payload, timeout=5)

    def server_info(self) -> requests.Response:
        query = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        return requests.get(f"http://{self.addr}/route?{query}", timeout=5)


# ---------------------------------------------------------------- shapes
@dataclass(frozen=True)
class PrefillShape:
    tp: int
    cp: int = 1
    dp: int = 1  # attention-DP groups (--dp-size N --enable-dp-attention)

    @property
    def attn_tp(self) -> int:
        return self.tp // self.cp // self.dp

    def __str__(self):
        return f"P(tp{self.tp},cp{self.cp},dp{self.dp})"


@dataclass(frozen=True)
class DecodeShape:
    tp: int
    dp: int = 1

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    def __str__(self):
        return f"D(tp{self.tp},dp{self.dp})"


def prefill_shapes(max_gpus: int = 8) -> list[PrefillShape]:
    out = []
    for tp in (1, 2, 4, 8):
        if tp > max_gpus:
            continue
        for cp in (1, 2, 4, 8):
            for dp in (1, 2, 4, 8):
                if tp % (cp * dp) == 0:
                    out.append(PrefillShape(tp, cp, dp))
    return out


def decode_shapes(max_gpus: int = 8) -> list[DecodeShape]:
    return [DecodeShape(tp, dp) for tp in (1, 2, 4, 8) if tp <= max_gpus
            for dp in (1, 2, 4, 8) if tp % dp == 0]


# ---------------------------------------------------------------- KV description
LAYOUT_FIELDS = dict(
    mla_compression_ratios=[0, 2, 1],
    kv_layer_ids=[1, 2],
    kv_item_lens=[512, 1024],
    state_types=[StateType.SWA, StateType.DSV4_REQUEST_STATE, StateType.SWA],
    state_item_lens=[[512], [32768], [512]],
)


def make_kv_args(pool: str, *, page_size: int = PAGE_SIZE, kv_dtype: str = KV_DTYPE,
                 engine_rank: int = 0, **layout_changes) -> KVArgs:
    """A DeepSeek-V4-shaped KVArgs (the fields the handshake reads; no buffers)."""
    args = KVArgs()
    fields = {**LAYOUT_FIELDS, **layout_changes}
    for name, value in fields.items():
        setattr(args, name, value)
    args.kv_cache_dtype_str = kv_dtype
    args.kv_layout = None
    args.page_size = page_size
    args.engine_rank = engine_rank
    args.system_dp_rank = 0
    args.pp_rank = 0
    args.rust_http_port = None
    args.is_hybrid_mla_backend = pool == "hybrid_mla"
    return args


def server_args_context(*, tp: int, cp: int = 1, dp: int = 1, dspark: bool,
                        mode: str, bootstrap_port: int = 0, draft_tokens: int = 6,
                        pp: int = 1):
    fields = dict(
        tp_size=tp, attn_cp_size=cp, attn_dp_size=dp, dp_size=1,
        host="127.0.0.1", port=30000, disaggregation_mode=mode,
        speculative_algorithm="DSPARK" if dspark else None,
        speculative_num_draft_tokens=draft_tokens if dspark else None,
    )
    if bootstrap_port:
        fields["disaggregation_bootstrap_port"] = bootstrap_port
    if pp != 1:
        fields["pp_size"] = pp
    return get_context().override_server_args(**fields)


def _close(manager: CommonKVManager) -> None:
    manager.server_socket.close(linger=0)
    manager._zmq_ctx.term()


# ---------------------------------------------------------------- prefill side
@dataclass
class PrefillRank:
    dp: int
    cp: int
    tp: int
    manager: CommonKVManager
    sends_kv: bool          # not a dummy CP rank
    kv_pages: frozenset     # the logical pages this rank sends when it sends
    sends_state: bool       # sends the CP-replicated state


@contextlib.contextmanager
def prefill_server(shape: PrefillShape, *, dspark: bool, pool: str, server: BootstrapServer,
                   kv_args_changes: dict | None = None, draft_tokens: int = 6, only=None):
    """Every rank of one prefill server registers with ``server`` through its real __init__.

    ``only(dp, cp, tp)`` picks a subset of ranks (a prefill still starting up).
    """
    ranks: dict[int, PrefillRank] = {}
    with server_args_context(tp=shape.tp, cp=shape.cp, dp=shape.dp, dspark=dspark,
                             mode="prefill", bootstrap_port=server.port,
                             draft_tokens=draft_tokens):
        for dp, cp, tp in itertools.product(range(shape.dp), range(shape.cp), range(shape.attn_tp)):
            if only is not None and not only(dp, cp, tp):
                continue
            with get_parallel().override(attn_tp_rank=tp, attn_cp_rank=cp, attn_dp_rank=dp,
                                         attn_dcp_rank=0, pp_group=None):
                manager = CommonKVManager(
                    make_kv_args(pool, **(kv_args_changes or {})), DisaggregationMode.PREFILL,
                    get_context().server_args, pool == "mla",
                )
                pages = list(range(TOTAL_PAGES))
                if manager.enable_all_cp_ranks_for_transfer:
                    sent, _ = filter_kv_indices_for_cp_rank(
                        manager, pages, slice(0, TOTAL_PAGES), total_pages=TOTAL_PAGES)
                    pages = list(sent)
                ranks[manager.rank_port] = PrefillRank(
                    dp, cp, tp, manager,
                    sends_kv=not manager.is_dummy_cp_rank,
                    kv_pages=frozenset(pages),
                    sends_state=not manager._should_skip_cp_replicated_state_transfer(),
                )
    try:
        yield ranks
    finally:
        for rank in ranks.values():
            _close(rank.manager)


# ---------------------------------------------------------------- decode side
def decode_managers(shape: DecodeShape, *, dspark: bool, pool: str,
                    kv_args_changes: dict | None = None, draft_tokens: int = 6,
                    pp: int = 1) -> list:
    """One attention-DP group of a decode server: engine ranks 0..attn_tp-1.

    decode.py sets ``engine_rank = tp_rank % attn_tp_size``, so every DP group of a
    decode server maps exactly like this one. ``pp`` is ``--pp-size`` (PP rank 0).
    """
    managers = []
    with server_args_context(tp=shape.tp, dp=shape.dp, dspark=dspark, mode="decode",
                             draft_tokens=draft_tokens, pp=pp):
        for tp in range(shape.attn_tp):
            with get_parallel().override(attn_tp_rank=tp, attn_cp_rank=0, attn_dp_rank=0,
                                         attn_dcp_rank=0, pp_group=None):
                manager = CommonKVManager(
                    make_kv_args(pool, engine_rank=tp, **(kv_args_changes or {})),
                    DisaggregationMode.DECODE, get_context().server_args, pool == "mla",
                )
            _record_mapping_calls(manager)
            managers.append(manager)
    return managers


def publish_prefill(server: BootstrapServer, *, attn_tp_size: int = 1, attn_cp_size: int = 1,
                    pp_size: int = 1, **published) -> None:
    """Register a prefill's ranks with ``server`` by hand, as a remote one would over PUT.

    For values no real prefill of this process can produce (``--pp-size`` 4, a size
    of 0, a malformed layout); one row per rank, at least one.
    """
    for tp, cp, pp in itertools.product(range(max(attn_tp_size, 1)), range(max(attn_cp_size, 1)),
                                        range(max(pp_size, 1))):
        row = dict(
            attn_tp_size=attn_tp_size, attn_tp_rank=tp, attn_cp_size=attn_cp_size,
            attn_cp_rank=cp, attn_dp_size=1, attn_dp_rank=0, pp_size=pp_size, pp_rank=pp,
            system_dp_size=1, system_dp_rank=0, rank_ip="127.0.0.1", rank_port=free_port(),
            page_size=PAGE_SIZE, kv_cache_dtype=KV_DTYPE, **published,
        )
        response = server.put(row)
        if response.status_code != 200:
            raise RuntimeError(f"bootstrap server refused {row}: {response.text}")


def _record_mapping_calls(manager: CommonKVManager) -> None:
    """Count calls of the real rank mapping on this manager (instance attribute)."""
    real = manager._resolve_rank_mapping
    manager.mapping_calls = []

    def resolve_rank_mapping(info):
        manager.mapping_calls.append(info)
        return real(info)

    manager._resolve_rank_mapping = resolve_rank_mapping


def close_managers(managers) -> None:
    for m in managers:
        _close(m)


_rooms = itertools.count(1000)


def receiver_links(manager: CommonKVManager, addr: str, prefill_dp_rank: int):
    """Run sglang's receiver init for one request; return it (bootstrap_infos = links).

    ``_register_kv_args`` (a backend message to each prefill rank) is the only piece
    not run: CommonKVManager leaves its message format to the transfer backends.
    """
    receiver = CommonKVReceiver(manager, addr, next(_rooms))
    receiver._register_kv_args = lambda: True
    receiver.init(prefill_dp_rank)
    return receiver
