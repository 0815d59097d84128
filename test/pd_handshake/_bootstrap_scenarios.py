"""Bootstrap-path scenarios, run in a fresh interpreter after sglang's ``load_plugins()``.

Each scenario uses sglang's Python bootstrap server on 127.0.0.1, prefill ranks
registering through ``CommonKVManager.__init__`` (HTTP PUT) and decode managers
calling ``try_ensure_parallel_info`` (HTTP GET) as the plugin installed it. Each
returns plain observations; ``test_plugin_bootstrap_path.py`` asserts on them.
"""

from __future__ import annotations

import time
import traceback

import _pd_harness as H
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import get_dsv41_spec_layout

P, D = H.PrefillShape, H.DecodeShape
MAPPING_FIELDS = ("target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks",
                  "required_dst_info_num", "required_prefill_response_num")


def observe(manager, addr) -> dict:
    """One decode rank's handshake with ``addr``, as plain data."""
    calls = len(manager.mapping_calls)
    out = {"rank": manager.kv_args.engine_rank}
    try:
        out["ready"] = manager.try_ensure_parallel_info(addr)
        out["error"] = None
    except Exception as exc:  # recorded, the test decides what is expected
        out["ready"], out["error"] = None, f"{type(exc).__name__}: {exc}"
    out["cached"] = addr in manager.prefill_info_table
    out["mapping_calls"] = len(manager.mapping_calls) - calls
    if out["cached"]:
        info = manager.prefill_info_table[addr]
        out["mapping"] = {f: getattr(info, f) for f in MAPPING_FIELDS}
        out["published_layout"] = info.dsv41_spec_layout
        out["prefill_attn"] = [info.attn_tp_size, info.attn_cp_size]
    return out


def handshake_all(shape, addr, **kwargs) -> list:
    managers = H.decode_managers(shape, dspark=kwargs.pop("dspark", True),
                                 pool=kwargs.pop("pool", "mla"), **kwargs)
    try:
        return [observe(m, addr) for m in managers]
    finally:
        H.close_managers(managers)


def scenario_plugin_installed() -> dict:
    from sglang_dsv41.plugin.verify import is_installed
    from sglang_dsv41.loader import registered_hook
    from sglang_dsv41.plugin.table import by_id

    patch = by_id()[H.PATCH_ID]
    method = CommonKVManager.__dict__["try_ensure_parallel_info"]
    return {
        "installed": is_installed(patch, registered_hook(H.PATCH_ID)),
        "wrapped": hasattr(method, "__wrapped__"),
    }


def scenario_cp_prefill() -> dict:
    """TP4 x attention CP4 prefill against three decode servers."""
    with H.BootstrapServer() as server, \
            H.prefill_server(P(4, 4), dspark=True, pool="mla", server=server):
        return {
            "tp4_decode": handshake_all(D(4), server.addr),
            "dp4_decode": handshake_all(D(4, 4), server.addr),
            "tp2_decode": handshake_all(D(2), server.addr),
        }


def scenario_tp_prefill_with_dp_decode() -> dict:
    with H.BootstrapServer() as server, \
            H.prefill_server(P(4), dspark=True, pool="mla", server=server):
        return {
            "dp4_decode": handshake_all(D(4, 4), server.addr),
            "dp4_decode_hybrid": handshake_all(D(4, 4), server.addr, pool="hybrid_mla"),
            "dp4_decode_non_mla": handshake_all(D(4, 4), server.addr, pool="other"),
        }


def scenario_not_ready_then_ready() -> dict:
    """A decode asks while only half of the prefill's ranks have registered."""
    with H.BootstrapServer() as server:
        with H.prefill_server(P(4, 4), dspark=True, pool="mla", server=server,
                              only=lambda dp, cp, tp: cp < 2):
            pass
        managers = H.decode_managers(D(4), dspark=True, pool="mla")
        try:
            early = observe(managers[0], server.addr)
            with H.prefill_server(P(4, 4), dspark=True, pool="mla", server=server,
                                  only=lambda dp, cp, tp: cp >= 2):
                pass
            late = observe(managers[0], server.addr)
        finally:
            H.close_managers(managers)
        return {"early": early, "late": late}


def _layout(draft_tokens: int) -> dict:
    with H.server_args_context(tp=1, dspark=True, mode="prefill", draft_tokens=draft_tokens):
        return get_dsv41_spec_layout(H.make_kv_args("mla"))


def scenario_reregister_with_different_layout() -> dict:
    """A prefill rank re-registers with another DSpark layout while the server runs."""
    with H.BootstrapServer() as server, \
            H.prefill_server(P(2), dspark=True, pool="mla", server=server):
        payload = dict(
            attn_tp_size=2, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0,
            attn_dp_size=1, attn_dp_rank=0, pp_size=1, pp_rank=0, system_dp_size=1,
            system_dp_rank=0, rank_ip="127.0.0.1", rank_port=H.free_port(),
            page_size=H.PAGE_SIZE, kv_cache_dtype=H.KV_DTYPE, dsv41_spec_layout=_layout(5),
        )
        put = server.put(payload)
        published = server.server_info().json().get("dsv41_spec_layout")
        return {
            "put_status": put.status_code,
            "put_text": put.text,
            "published_draft_tokens": published["num_draft_tokens"],
            "registered_count": server.server._registered_count,
            "decode_same_layout": handshake_all(D(2), server.addr),
            "decode_new_layout": handshake_all(D(2), server.addr, draft_tokens=5),
        }


def scenario_restart() -> dict:
    """The prefill (and with it its bootstrap server) restarts with another layout."""
    port = H.free_port()
    out = {}
    watcher = H.decode_managers(D(4, 4), dspark=True, pool="mla")[0]
    idle = H.decode_managers(D(4, 4), dspark=True, pool="mla")[0]
    first = H.BootstrapServer(port)
    try:
        with first, H.prefill_server(P(4, 4), dspark=True, pool="mla", server=first):
            out["watcher_first"] = observe(watcher, first.addr)
            out["idle_first"] = observe(idle, first.addr)
            # sglang's heartbeat checker, made quick (its floor of 2 s is applied
            # at construction only).
            watcher.heartbeat_interval, watcher.max_failures = 0.2, 1
            heartbeat = watcher._start_heartbeat_checker_thread()
        start = time.monotonic()
        while first.addr in watcher.prefill_info_table and time.monotonic() - start < 15:
            time.sleep(0.05)
        out["watcher_dropped_peer"] = first.addr not in watcher.prefill_info_table
        with H.BootstrapServer(port) as second, \
                H.prefill_server(P(4, 4), dspark=True, pool="mla", server=second,
                                 draft_tokens=5):
            out["watcher_after_restart"] = observe(watcher, second.addr)
            out["idle_after_restart"] = observe(idle, second.addr)
            idle._handle_node_failure(second.addr)
            out["idle_after_node_failure"] = observe(idle, second.addr)
        with H.BootstrapServer(port) as third, \
                H.prefill_server(P(4), dspark=True, pool="mla", server=third):
            out["watcher_after_reshape"] = observe(watcher, third.addr)
        watcher._heartbeat_shutdown.set()
        heartbeat.join(timeout=5)
        out["heartbeat_stopped"] = not heartbeat.is_alive()
    finally:
        first.close()
        H.close_managers([watcher, idle])
    return out


SCENARIOS = {
    name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")
}


def run_all() -> dict:
    results = {}
    for name, fn in SCENARIOS.items():
        start = time.monotonic()
        try:
            results[name] = {"ok": True, "value": fn()}
        except Exception:
            results[name] = {"ok": False, "value": traceback.format_exc()}
        results[name]["seconds"] = round(time.monotonic() - start, 2)
    return results

