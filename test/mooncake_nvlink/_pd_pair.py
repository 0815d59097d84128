"""A real sglang 0.5.23 Mooncake PD transfer between two processes on 127.0.0.1.

``python _pd_pair.py <full|group|none> <config json>``. The parent imports
sglang once (and loads the plugin: ``full`` = the real entry point with every
patch, ``group`` = only this issue's table entries, ``none`` = stock), then
forks a prefill and a decode process. Each builds its own Mooncake engine (tcp
protocol), sglang's real MooncakeKVManager, bootstrap server, KVSender and
KVReceiver, over buffers in host memory. Only hardware is stood in for: which
buffers count as device memory is injected (``InjectedKinds``), because this
machine has no GPU.

Two transfers run one after the other. Room A is the real path. Room B is a
negative control for the ordering check: the prefill side holds its host-block
frames back until after the completion status, which the decode side's
snapshot at status time must notice.

Prints ``RESULT {"prefill": {...}, "decode": {...}}``.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

T0 = time.monotonic()
PLUGIN = sys.argv[1]
CFG = json.loads(sys.argv[2])

PLUGIN_APPLIED: list[str] = []
if PLUGIN == "full":  # the real plugin path: entry point, checks, every patch
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_dsv41.plugin.verify import role_status
    from sglang_dsv41.plugin.spec import Role

    PLUGIN_APPLIED = [p.id for p in role_status(Role.SCHEDULER)[0]]
elif PLUGIN == "group":  # only this group's entries (to debug without the others)
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_dsv41.loader import register_patch
    from sglang_dsv41.plugin.table import PATCHES

    for _patch in PATCHES:
        if _patch.group in ("mooncake_nvlink", "kv_staging"):
            register_patch(_patch)
    HookRegistry.apply_hooks()

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, StateType  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVReceiver  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import (  # noqa: E402
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (  # noqa: E402
    init_mooncake_transfer_engine,
)
from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from sglang_dsv41.mooncake_nvlink.memory import InjectedKinds  # noqa: E402
from sglang_dsv41.mooncake_nvlink.routing import (  # noqa: E402
    AUX_DATA_HEADER,
    HOST_BLOCKS_TAG,
    encode_host_blocks,
    is_host_block_message,
)

T_IMPORTED = time.monotonic() - T0

LAYERS = 2
PAGES = 16
KV_ITEM = 256  # bytes per page of each K or V buffer
AUX_ITEMS = [64, 40]  # bytes per slot of the two aux buffers
AUX_SLOTS = 8
STATE_ITEM = [96, 160]  # one MAMBA component, two per-layer entries
STATE_SLOTS = 4
ROOMS = {
    # room: (src pages, dst pages, src aux, dst aux, src state, dst state, reorder host frames)
    # (destination page 0 is nobody's: a write meant for no room shows as a stray write)
    "A": (CFG["room"], [3, 4, 5, 9, 10], [8, 1, 2, 12, 7], 2, 5, 1, 3, False),
    "B": (CFG["room"] + 1, [1, 14], [5, 6], 6, 1, 2, 0, True),
}
BOOTSTRAP = f"127.0.0.1:{CFG['bootstrap_port']}"
# KV peer-write runs: {"env": {...}, "fail_peer_write_at": n (prefill peer write), "foreign_host": true (the decode
# exports its peer map under another host's identity), "host_kv_entry": i (KV
# buffer i is host memory on both sides), "decode_exits": true (after both rooms the
# decode process ends; the prefill reports when it let go of it)}
STAGING = CFG.get("staging")


def pattern(tag: int, size: int) -> bytes:
    return bytes((tag * 131 + i * 7 + (i >> 8)) % 251 + 1 for i in range(size))


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError(what)


class Side:
    """Buffers, KVArgs and manager of one side, built after the fork."""

    def __init__(self, role: str):
        self.role = role
        self.prefill = role == "prefill"
        args = prepare_server_args([
            "--model-path", CFG["model"], "--device", "cpu", "--host", "127.0.0.1",
            "--skip-tokenizer-init",
            "--disaggregation-mode", role,
            "--disaggregation-transfer-backend", "mooncake",
            "--disaggregation-bootstrap-port", str(CFG["bootstrap_port"]),
        ])
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        # One rank and no torch.distributed groups: the manager only keeps a
        # reference to the pipeline group (used when pp_size > 1).
        get_parallel().override_permanently(pp_group=None)
        # The parent imported sglang, which made this class's zmq context; a
        # context must not cross a fork.
        CommonKVReceiver._ctx = zmq.Context()

        engine = init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
        self.registered: list[list[int]] = []
        batch_register = engine.batch_register

        def recording_batch_register(ptrs, lens):
            self.registered.extend([int(p), int(n)] for p, n in zip(ptrs, lens))
            return batch_register(ptrs, lens)

        engine.batch_register = recording_batch_register

        def alloc(size, tag):
            buf = ctypes.create_string_buffer(pattern(tag, size) if self.prefill else b"", size)
            return buf, ctypes.addressof(buf)

        self.kv = [alloc(PAGES * KV_ITEM, 10 + i) for i in range(2 * LAYERS)]
        self.aux = [alloc(AUX_SLOTS * n, 20 + i) for i, n in enumerate(AUX_ITEMS)]
        self.state = [alloc(STATE_SLOTS * n, 30 + i) for i, n in enumerate(STATE_ITEM)]
        # Stand-in for hardware: KV pools and state entry 0 are "device" memory,
        # aux buffers and state entry 1 are host memory.
        host_kv = (STAGING or {}).get("host_kv_entry")  # one KV buffer in host memory, both sides
        self.device_regions = [(p, PAGES * KV_ITEM) for i, (_, p) in enumerate(self.kv) if i != host_kv]
        self.device_regions.append((self.state[0][1], STATE_SLOTS * STATE_ITEM[0]))
        self.host_regions = [(p, AUX_SLOTS * n) for (_, p), n in zip(self.aux, AUX_ITEMS)]
        if host_kv is not None:
            self.host_regions.append((self.kv[host_kv][1], PAGES * KV_ITEM))
        self.host_regions.append((self.state[1][1], STATE_SLOTS * STATE_ITEM[1]))
        if PLUGIN != "none":
            from sglang_dsv41.mooncake_nvlink import hooks as mooncake_nvlink

            mooncake_nvlink.set_memory_access(InjectedKinds(self.device_regions))
        if STAGING is not None:
            self.setup_staging()

        kv_args = KVArgs()
        kv_args.engine_rank = 0
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = 0
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "bfloat16"
        kv_args.kv_layout = None
        kv_args.prefill_start_layer = 0
        kv_args.prefill_end_layer = LAYERS
        kv_args.kv_data_ptrs = [p for _, p in self.kv]
        kv_args.kv_data_lens = [PAGES * KV_ITEM] * (2 * LAYERS)
        kv_args.kv_item_lens = [KV_ITEM] * (2 * LAYERS)
        kv_args.kv_layer_ids = list(range(LAYERS)) * 2
        kv_args.num_draft_entries = 0
        kv_args.kv_head_num = 2
        kv_args.total_kv_head_num = 2
        kv_args.page_size = 1
        kv_args.aux_data_ptrs = [p for _, p in self.aux]
        kv_args.aux_data_lens = [AUX_SLOTS * n for n in AUX_ITEMS]
        kv_args.aux_item_lens = list(AUX_ITEMS)
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        kv_args.state_types = [StateType.MAMBA]
        kv_args.state_data_ptrs = [[p for _, p in self.state]]
        kv_args.state_data_lens = [[STATE_SLOTS * n for n in STATE_ITEM]]
        kv_args.state_item_lens = [list(STATE_ITEM)]
        kv_args.state_layer_ids = [[0, 1]]
        kv_args.state_dim_per_tensor = [[]]
        kv_args.state_slice_outer_counts = [[]]
        kv_args.state_conv_shard_groups = [[]]
        kv_args.is_hybrid_mla_backend = False
        kv_args.swa_kv_cache_layout = None
        kv_args.mla_compression_ratios = None

        # The launcher starts the bootstrap server before any scheduler builds its manager.
        self.server = (
            MooncakeKVBootstrapServer(host="127.0.0.1", port=CFG["bootstrap_port"])
            if self.prefill else None
        )
        mode = DisaggregationMode.PREFILL if self.prefill else DisaggregationMode.DECODE
        self.mgr = MooncakeKVManager(kv_args, mode, args, is_mla_backend=False)
        self.result = {
            "t_imported": round(T_IMPORTED, 1),
            "plugin_applied": PLUGIN_APPLIED,
            "registered": self.registered,
            "device_regions": [list(r) for r in self.device_regions],
            "host_regions": [list(r) for r in self.host_regions],
        }

    # --- KV peer writes (opt-in): settings and the transport's stand-in

    def setup_staging(self):
        from sglang_dsv41.mooncake_nvlink.kv_staging import hooks as kv_staging

        os.environ.update({k: str(v) for k, v in STAGING.get("env", {}).items()})
        kv_staging.set_peer_transport(self.peer_transport())

    def peer_transport(self):
        """Cross-process host writes (process_vm_writev): peer writes without a GPU."""
        import dataclasses

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "helpers"))
        from host_peer import HostCmaTransport

        fail_at = STAGING.get("fail_peer_write_at") if self.prefill else None
        foreign = STAGING.get("foreign_host") and not self.prefill

        class CountingCma(HostCmaTransport):
            writes = 0

            def export(self, regions):
                peer = super().export(regions)
                return dataclasses.replace(peer, host="another-host") if foreign else peer

            def write_pages(self, target, copies):
                type(self).writes += 1
                if fail_at is not None and type(self).writes == fail_at:
                    raise RuntimeError(f"injected peer write failure at write {fail_at}")
                return super().write_pages(target, copies)

        self.transport = CountingCma()
        return self.transport

    def staging_state(self):
        from sglang_dsv41.mooncake_nvlink.kv_staging import hooks as kv_staging

        return kv_staging.state_of(self.mgr)

    # --- expected contents on the decode side

    @staticmethod
    def slices(spec) -> dict[str, list[tuple[int, int, bytes]]]:
        """Per decode buffer: (offset, length, expected bytes) written by one room."""
        _, src_pages, dst_pages, src_aux, dst_aux, src_state, dst_state, _ = spec
        out: dict[str, list] = {}
        for i in range(2 * LAYERS):
            src = pattern(10 + i, PAGES * KV_ITEM)
            out[f"kv{i}"] = [(d * KV_ITEM, KV_ITEM, src[s * KV_ITEM:(s + 1) * KV_ITEM])
                             for s, d in zip(src_pages, dst_pages)]
        for i, n in enumerate(AUX_ITEMS):
            src = pattern(20 + i, AUX_SLOTS * n)
            out[f"aux{i}"] = [(dst_aux * n, n, src[src_aux * n:(src_aux + 1) * n])]
        for i, n in enumerate(STATE_ITEM):
            src = pattern(30 + i, STATE_SLOTS * n)
            out[f"state{i}"] = [(dst_state * n, n, src[src_state * n:(src_state + 1) * n])]
        return out

    def buffers(self) -> dict[str, bytes]:
        out = {f"kv{i}": b.raw for i, (b, _) in enumerate(self.kv)}
        out.update({f"aux{i}": b.raw for i, (b, _) in enumerate(self.aux)})
        out.update({f"state{i}": b.raw for i, (b, _) in enumerate(self.state)})
        return out

    @staticmethod
    def mismatches(snapshot: dict[str, bytes], expected) -> list[str]:
        return sorted(
            name for name, parts in expected.items()
            if any(snapshot[name][o:o + n] != data for o, n, data in parts)
        )

    def receiver_state(self):
        return self.mgr.__dict__.get("_dsv41_host_block_receiver")

    # --- prefill

    def run_prefill(self, release):
        held: list[list[bytes]] = []
        reorder = {"on": False}
        send_locked = self.mgr._send_multipart_locked

        def reordering_send(endpoint, parts, is_ipv6=False):
            # Negative control: hold host-block frames back until after the next
            # other message (the completion status).
            if reorder["on"] and is_host_block_message(parts):
                held.append((endpoint, parts, is_ipv6))
                return
            send_locked(endpoint, parts, is_ipv6=is_ipv6)
            while held:
                e, p, v = held.pop(0)
                send_locked(e, p, is_ipv6=v)

        self.mgr._send_multipart_locked = reordering_send
        for name, spec in ROOMS.items():
            room, src_pages, _, src_aux, _, src_state, _, reorder_host = spec
            reorder["on"] = reorder_host
            sender = MooncakeKVSender(self.mgr, BOOTSTRAP, room)
            wait_for(lambda: sender.poll() in (KVPoll.WaitingForInput, KVPoll.Failed), 90,
                     f"room {name}: decode never sent its transfer metadata")
            sender.init(num_kv_indices=len(src_pages), aux_index=src_aux)
            sender.send(np.array(src_pages, dtype=np.int32), state_indices=[[src_state]])
            final = wait_for(
                lambda: {KVPoll.Success: "success", KVPoll.Failed: "failed"}.get(sender.poll()),
                60, f"room {name}: prefill transfer never concluded",
            )
            self.result[f"status_{name}"] = final  # KVPoll.Failed is 0: compare names
        # Sessions sglang gave up on: every later request to that decode would fail at once.
        self.result["failed_sessions"] = sorted(self.mgr.failed_sessions)
        if getattr(self, "transport", None) is not None:
            self.result["peer_writes"] = type(self.transport).writes
            self.result["open_peer_maps"] = self.transport.open_mappings
        release.wait(120)  # stay up until decode has its verdict
        if STAGING and STAGING.get("decode_exits"):  # the decode process ends after its verdict
            self.watch_the_decode_go()

    def watch_the_decode_go(self):
        """How long the prefill takes to let go of a decode whose process ended."""
        sessions = sorted(self.mgr.decode_kv_args_table)
        started = time.monotonic()
        try:
            wait_for(lambda: self.transport.open_mappings == 0 and self.mgr.failed_sessions, 60,
                     "the prefill never let go of the ended decode")
        except TimeoutError:
            pass
        self.result["after_decode_exit"] = {
            "seconds": round(time.monotonic() - started, 1), "decode_sessions": sessions,
            "failed_sessions": sorted(self.mgr.failed_sessions),
            "open_peer_maps": self.transport.open_mappings,
        }

    # --- decode

    def inject_bad_frames(self) -> int:
        """Malformed and out-of-region host-block frames straight into decode's socket."""
        import struct

        aux0 = self.aux[0][1]
        end_state1 = self.state[1][1] + STATE_SLOTS * STATE_ITEM[1]
        room = str(CFG["room"]).encode()
        bad = [
            encode_host_blocks(1, [(aux0 - 4096, b"x" * 16)]),  # outside every region
            encode_host_blocks(1, [(end_state1 - 8, b"y" * 16)]),  # crosses a region's end
            encode_host_blocks(1, [(aux0, b"z" * 8), (12345, b"w" * 8)]),  # one bad block of two
            [AUX_DATA_HEADER, room, HOST_BLOCKS_TAG, struct.pack(">QQ", aux0, 64), b"q" * 8],
            [AUX_DATA_HEADER, room, HOST_BLOCKS_TAG, b"\0" * 15, b"q"],  # truncated table
            [AUX_DATA_HEADER, b"-1", HOST_BLOCKS_TAG, struct.pack(">QQ", aux0, 1), b"q"],
            [AUX_DATA_HEADER, room, HOST_BLOCKS_TAG,
             struct.pack(">QQ", aux0, (1 << 64) - 1 - aux0), b"q"],  # huge declared length
            [AUX_DATA_HEADER, room, HOST_BLOCKS_TAG],  # too few frames
        ]
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"tcp://{self.mgr.local_ip}:{self.mgr.rank_port}")
        for frames in bad:
            sock.send_multipart(frames)
        sock.close()
        return len(bad)

    def run_decode(self):
        if PLUGIN != "none":
            sent = self.inject_bad_frames()
            wait_for(lambda: self.receiver_state() and self.receiver_state().messages_dropped >= sent,
                     30, "bad frames were not all seen")
            self.result["bad_frames_dropped"] = self.receiver_state().messages_dropped
            self.result["untouched_after_bad_frames"] = all(
                v == bytes(len(v)) for v in self.buffers().values()
            )

        # Snapshot the buffers when the decode thread applies a Success status:
        # every host block of that transfer must already be written by then.
        at_status: dict[int, dict] = {}
        apply_status = self.mgr.apply_prefill_status

        def apply_and_snapshot(**kw):
            if kw.get("status") == KVPoll.Success and kw.get("bootstrap_room") not in at_status:
                at_status[kw["bootstrap_room"]] = self.buffers()
            return apply_status(**kw)

        self.mgr.apply_prefill_status = apply_and_snapshot
        wait_for(lambda: self.mgr.try_ensure_parallel_info(BOOTSTRAP), 90, "no prefill info")
        expected_all: dict[str, list] = {}
        for name, spec in ROOMS.items():
            room, _, dst_pages, _, dst_aux, _, dst_state, _ = spec
            receiver = MooncakeKVReceiver(self.mgr, BOOTSTRAP, room)
            receiver.init(prefill_dp_rank=0)
            receiver.send_metadata(np.array(dst_pages, dtype=np.int32), aux_index=dst_aux,
                                   state_indices=[[dst_state]])
            final = wait_for(
                lambda: {KVPoll.Success: "success", KVPoll.Failed: "failed"}.get(receiver.poll()),
                60, f"room {name}: decode transfer never concluded",
            )
            self.result[f"status_{name}"] = final  # KVPoll.Failed is 0: compare names
            expected = self.slices(spec)
            # Late host frames (room B) may land just after the status: give them a moment.
            time.sleep(0.3)
            self.result[f"mismatch_{name}"] = self.mismatches(self.buffers(), expected)
            self.result[f"mismatch_at_status_{name}"] = (
                self.mismatches(at_status[room], expected) if room in at_status else None
            )
            for key, parts in expected.items():
                expected_all.setdefault(key, []).extend(parts)
        # Nothing written outside the rooms' destination slices.
        buffers = self.buffers()
        stray = []
        for key, data in buffers.items():
            clean = bytearray(data)
            for o, n, _ in expected_all.get(key, []):
                clean[o:o + n] = bytes(n)
            if any(clean):
                stray.append(key)
        self.result["stray_writes"] = stray
        rs = self.receiver_state()
        self.result["host_messages_written"] = rs.messages_written if rs else 0
        if STAGING is not None:
            state = self.staging_state()
            if state is not None and state.exported is not None:
                self.result["exported"] = [[r.ptr, r.length] for r in state.exported.regions]
        if PLUGIN != "none":
            self.result["waiting_room_after_bad_frame"] = self.bad_frame_for_a_waiting_room()
        self.result["decode_thread_alive"] = self.mgr._worker_threads[0].is_alive()

    def bad_frame_for_a_waiting_room(self) -> dict:
        """A host-block frame the receiver drops (outside every region), for a room a request
        here still waits for (never given pages, so the prefill sends it nothing)."""
        room = CFG["room"] + 7
        receiver = MooncakeKVReceiver(self.mgr, BOOTSTRAP, room)
        receiver.init(prefill_dp_rank=0)
        waiting = receiver.poll()
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"tcp://{self.mgr.local_ip}:{self.mgr.rank_port}")
        sock.send_multipart(encode_host_blocks(room, [(self.aux[0][1] - 4096, b"x" * 16)]))
        sock.close()
        final = wait_for(lambda: {KVPoll.Failed: "failed"}.get(receiver.poll()), 30,
                         "the waiting room was not failed")
        try:
            receiver.failure_exception()
            reason = None
        except Exception as exc:
            reason = str(getattr(exc, "failure_reason", exc))
        return {"before": str(waiting), "status": final, "reason": reason}


def side_main(role, queue, release):
    result = {"role": role}
    try:
        side = Side(role)
        result = side.result
        side.run_prefill(release) if role == "prefill" else side.run_decode()
    except Exception as exc:  # reported, the test decides
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["t_done"] = round(time.monotonic() - T0, 1)
    if PLUGIN != "none":  # what the hooks counted for sglang_dsv41_side_channel_*
        from sglang_dsv41 import metrics

        result["plugin_metrics"] = metrics.totals()
    queue.put((role, result))
    time.sleep(0.5)
    os._exit(0)


if __name__ == "__main__":
    ctx = mp.get_context("fork")
    queue, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=side_main, args=(r, queue, release)) for r in ("prefill", "decode")]
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.monotonic() + CFG.get("timeout", 240)
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                role, res = queue.get(timeout=1)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            results[role] = res
            if role == "decode":
                release.set()
    finally:
        release.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    print("RESULT " + json.dumps(results), flush=True)
