"""Mooncake NVLink routing: device-block throughput and side-channel latency, from one run.

Compares, on the same engine pair and the same blocks:
- engine:  ``batch_transfer_sync_write`` with prebuilt lists (the raw engine);
- funnel:  upstream ``_transfer_data``'s body (zip the blocks, then the engine);
- routed:  our ``TransferRouter.route`` (classify, split, engine; no host block);
and, in GPU mode, the all-TCP workaround (protocol tcp, host and device regions
registered together, device blocks over tcp). Then the side channel: latency
from handing one host block to the router until the receiver has written it
and acknowledged a marker sent after it on the same socket.

    PYTHONPATH=python python benchmarks/mooncake_nvlink/mooncake_routing.py --mode cpu
    PYTHONPATH=python python benchmarks/mooncake_nvlink/mooncake_routing.py --mode gpu [--gpu 0 --peer-gpu 0]

CPU mode: Mooncake tcp on 127.0.0.1, host memory, the "device" buffers'
classification injected. GPU mode: MC_INTRANODE_NVLINK=1, protocol
nvlink_intra, device buffers from torch, pinned host buffers, CUDA
classification. Imports torch, mooncake and sglang_dsv41.mooncake_nvlink's plain
modules (routing, memory, kv_staging's peer writes; no sglang) only.

``--pattern dsv41``: the blocks sglang 0.5.23 sends for one DeepSeek-V4.1
request, per request instead of per batch. Several paths from one run, on the same
engine pair and buffers, in interleaved rounds:
- stock:      upstream's call structure: one ``_transfer_data`` body (zip, then
              the engine) per prefill chunk's KV batch, then one per state call;
- routed:     the same batches through ``TransferRouter.route``;
- contiguous: one write of the request's total bytes as a single block;
- held:       peer writes (``SGLANG_DSV41_KV_STAGING=peer``) as the plugin
              sends a request on a transfer worker: the receiver exports its
              destination buffers (CUDA IPC on the GPU, its host memory for
              ``process_vm_writev`` in CPU mode, test/helpers/host_peer.py) and
              hands the map over in the handshake; the sender writes the KV
              calls of earlier chunks each at once from their page lists
              (``PeerWrites``), then holds the last chunk's KV call and the
              state calls and writes them as one batch, as before the
              request's status (--no-peer leaves it out). Each call's layout
              is built and checked beforehand, as the plugin does once per
              kind of call. A table after it shows where a held request's
              time goes (earlier chunks, holding, the write).
The paths take turns; a turn is two requests of one path, and the second is
the one timed: its previous request went the same way, as on a transfer worker
of a server (the first follows another path, whose Python and driver work
leave this thread's caches cold: its ratio is shown as "after other"). A time
is the median over rounds of each round's median, routed/stock the median over
rounds of each round's ratio.

Geometry (``DSV41_*`` below), read from sglang's own ``DeepSeekV4TokenToKVPool``
built on the CPU for a V4.1-Flash-shaped layer plan (test/mooncake_nvlink/
test_dsv41_pattern.py rebuilds the pool and checks every number here):
43 layers, 256-token pages, sliding window 128, main KV layout ``v41`` (fp8, 528
bytes per token, pages padded to 512), ratio-1/2 compressed KV in ``v41_fp4``
(288 bytes per token), fp4 indexer (index_head_dim 128: 68 bytes per token),
KV storage on 4 source layers (one ratio-1, three ratio-2), no ratio-4/128 layer.
- 8 KV buffers (``get_contiguous_buf_infos``), bytes per 256-token page:
  ratio-1 KV 73,728; ratio-1 indexer 17,408; 3 x ratio-2 KV 36,864;
  3 x ratio-2 indexer 8,704 (227,840 bytes per page in all);
- sliding-window state (``get_state_buf_infos``): 43 buffers of 135,168-byte
  pages; the window's 128 tokens sit in one page per layer;
- request state (``get_request_state_buf_infos``): 3 buffers, one 8,192-byte row.
Blocks merge only where both sides' page ids are consecutive (upstream's
``group_concurrent_contiguous``); a batch lists its blocks buffer by buffer, as
``_send_kvcache_generic`` builds them. Page layouts: contiguous (both sides
consecutive), runs of 8 (runs of 8 consecutive pages, one page apart), fragmented
(no two pages consecutive). Prompts: 8k tokens (one chunk) and 32k (16k chunks).

    PYTHONPATH=python python benchmarks/mooncake_nvlink/mooncake_routing.py --pattern dsv41 --mode cpu
    PYTHONPATH=python python benchmarks/mooncake_nvlink/mooncake_routing.py --pattern dsv41 --mode gpu --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "helpers"))
from dsv41_kv_pattern import (  # noqa: E402  the request pattern, shared with the tests
    DSV41_CASES,
    FLAT_BUFFER,
    dsv41_batches,
    dsv41_buffer_sizes,
    dsv41_paged_calls,
    print_peer_goals,
)

AUTHKEY = b"dsv41-mooncake-bench"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- side channel: zmq like production when available, else a stdlib socket


def _no_delay(conn) -> None:
    """No Nagle delay on a multiprocessing connection (small frames, then a marker)."""
    import socket

    sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.close()  # a duplicate descriptor; the option stays on the socket


class Channel:
    def __init__(self, kind: str, **kw):
        self.kind = kind
        self.__dict__.update(kw)

    @staticmethod
    def available() -> str:
        try:
            import zmq  # noqa: F401

            return "zmq"
        except ImportError:
            return "socket"

    # receiver side
    @classmethod
    def listen(cls, kind: str) -> "Channel":
        if kind == "zmq":
            import zmq

            ctx = zmq.Context()
            pull = ctx.socket(zmq.PULL)
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            return cls(kind, ctx=ctx, pull=pull, push=None, port=port)
        from multiprocessing.connection import Listener

        listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
        return cls(kind, listener=listener, conn=None, port=listener.address[1])

    def accept(self, first: list[bytes] | None = None) -> None:
        if self.kind == "zmq":
            import zmq

            hello = self.pull.recv_multipart()  # [b"HELLO", ack port]
            self.push = self.ctx.socket(zmq.PUSH)
            self.push.connect(f"tcp://127.0.0.1:{int(hello[1])}")
        else:
            self.conn = self.listener.accept()
            _no_delay(self.conn)

    # sender side
    @classmethod
    def connect(cls, kind: str, port: int) -> "Channel":
        if kind == "zmq":
            import zmq

            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.connect(f"tcp://127.0.0.1:{port}")
            pull = ctx.socket(zmq.PULL)
            ack_port = pull.bind_to_random_port("tcp://127.0.0.1")
            push.send_multipart([b"HELLO", str(ack_port).encode()])
            return cls(kind, ctx=ctx, push=push, pull=pull)
        from multiprocessing.connection import Client

        conn = Client(("127.0.0.1", port), authkey=AUTHKEY)
        _no_delay(conn)
        return cls(kind, conn=conn)

    def send(self, frames: list[bytes]) -> None:
        if self.kind == "zmq":
            self.push.send_multipart(frames)
        else:
            self.conn.send(frames)

    def recv(self, timeout_s: float = 120) -> list[bytes]:
        if self.kind == "zmq":
            if not self.pull.poll(int(timeout_s * 1000)):
                raise TimeoutError("no message on the side channel")
            return self.pull.recv_multipart()
        if not self.conn.poll(timeout_s):
            raise TimeoutError("no message on the side channel")
        return self.conn.recv()

    def close(self) -> None:
        """Flush what is queued: zmq sends from a background thread."""
        if self.kind == "zmq":
            for sock in (self.push, self.pull):
                if sock is not None:
                    sock.close(linger=10_000)
            self.ctx.term()
        else:
            self.conn.close()


# --- buffers and engine (in the child processes)


def setup(args, sender: bool):
    if args.protocol == "nvlink_intra":
        os.environ.setdefault("MC_INTRANODE_NVLINK", "1")
    else:
        os.environ.pop("MC_INTRANODE_NVLINK", None)
    import torch

    from sglang_dsv41.mooncake_nvlink.memory import InjectedKinds, cuda_memory_access

    gpu = args.mode == "gpu"
    if gpu:
        torch.cuda.set_device(args.gpu)
    dev = torch.device("cuda", args.gpu) if gpu else torch.device("cpu")
    dev_bytes = args.device_mib * MiB
    host_bytes = args.host_mib * MiB
    if sender:
        i = torch.arange(dev_bytes // 8, dtype=torch.int64, device=dev)
        device_buf = (i * 2654435761 + 12345).view(torch.uint8)[:dev_bytes].contiguous()
    else:
        device_buf = torch.zeros(dev_bytes, dtype=torch.uint8, device=dev)
    host_buf = torch.zeros(host_bytes, dtype=torch.uint8, pin_memory=gpu)
    if sender:
        host_buf.copy_(torch.randint(0, 256, (host_bytes,), dtype=torch.uint8))
    if gpu:
        torch.cuda.synchronize()
        memory = cuda_memory_access(device=args.gpu)
    else:
        memory = InjectedKinds([(device_buf.data_ptr(), dev_bytes)])

    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", args.protocol, "")
    if rc != 0:
        raise RuntimeError(f"Mooncake initialize({args.protocol}) returned {rc}")
    from sglang_dsv41.mooncake_nvlink.routing import plan_registration

    regions = [(device_buf.data_ptr(), dev_bytes), (host_buf.data_ptr(), host_bytes)]
    plan = plan_registration(regions, memory.kind_of)
    to_register = plan.register if args.register == "device" else regions
    ptrs, lens = zip(*to_register)
    rc = engine.batch_register_memory(list(ptrs), list(lens))
    if rc != 0:
        raise RuntimeError(f"batch_register_memory({args.register}) returned {rc}")
    return torch, engine, memory, plan, device_buf, host_buf


def run_receiver(args) -> None:
    from sglang_dsv41.mooncake_nvlink.routing import HostBlockReceiver, RegionTable, is_host_block_message

    torch, engine, memory, plan, device_buf, host_buf = setup(args, sender=False)
    rx = HostBlockReceiver(
        RegionTable([(device_buf.data_ptr(), device_buf.numel()), (host_buf.data_ptr(), host_buf.numel())]),
        memory,
    )
    channel = Channel.listen(args.channel)
    print("READY " + json.dumps({
        "session": f"127.0.0.1:{engine.get_rpc_port()}", "device": device_buf.data_ptr(),
        "host": host_buf.data_ptr(), "port": channel.port,
    }), flush=True)
    channel.accept()
    while True:
        frames = channel.recv(timeout_s=3600)
        if is_host_block_message(frames):
            rx.handle(frames)
        elif frames[0] == b"PING":
            channel.send([b"ACK", frames[1]])
        elif frames[0] == b"CHECK":  # [CHECK, offset, length] of the device buffer
            off, n = int(frames[1]), int(frames[2])
            if args.mode == "gpu":
                torch.cuda.synchronize()
            channel.send([b"CHECKED", digest(device_buf[off:off + n])])
        elif frames[0] == b"BYE":
            channel.send([b"BYE", str(rx.messages_written).encode(), str(rx.messages_dropped).encode()])
            break
    channel.close()
    os._exit(0)


def digest(tensor) -> bytes:
    """sha256 of a uint8 tensor's bytes (no numpy: the GPU machine may lack it)."""
    import ctypes
    import hashlib

    host = tensor.cpu().contiguous()
    return hashlib.sha256(ctypes.string_at(host.data_ptr(), host.numel())).digest()


def timed(fn, iters: int) -> float:
    """Median seconds of ``iters`` calls of fn (which returns an rc that must be 0)."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        rc = fn()
        times.append(time.perf_counter() - t0)
        if rc != 0:
            raise RuntimeError(f"transfer failed with rc={rc}")
    return statistics.median(times)


def run_sender(args) -> None:
    from sglang_dsv41.mooncake_nvlink.routing import KindTable, SideChannel, TransferRouter

    peer = json.loads(args.peer)
    torch, engine, memory, plan, device_buf, host_buf = setup(args, sender=True)
    channel = Channel.connect(args.channel, peer["port"])
    session = peer["session"]
    router = TransferRouter(KindTable(plan.classified, memory.kind_of), memory)
    side = SideChannel(room=1, send=channel.send)
    src_dev, src_host = device_buf.data_ptr(), host_buf.data_ptr()
    out = {"throughput": [], "latency": []}

    def funnel(blocks):
        srcs, dsts, lens = zip(*blocks)
        return engine.batch_transfer_sync_write(session, list(srcs), list(dsts), list(lens))

    for block_kib, count in json.loads(args.shapes):
        bb = block_kib * 1024
        if bb * count > device_buf.numel():
            continue
        blocks = [(src_dev + i * bb, peer["device"] + i * bb, bb) for i in range(count)]
        lists = [list(x) for x in zip(*blocks)]
        cases = {"engine": lambda: engine.batch_transfer_sync_write(session, *lists)}
        if not args.engine_only:
            cases["funnel"] = lambda: funnel(blocks)
            cases["routed"] = lambda: router.route(blocks, funnel, lambda: side)
        for fn in cases.values():  # warm-up (connections, IPC handles)
            timed(fn, 2)
        medians = {name: [] for name in cases}
        for _ in range(args.rounds):  # interleaved rounds, so drift hits every case alike
            for name, fn in cases.items():
                medians[name].append(timed(fn, args.iters))
        row = {"block_kib": block_kib, "blocks": count, "mib": bb * count / MiB}
        # CPU cost of the two Python paths alone (engine call replaced by a no-op).
        def noop_funnel(bl):
            srcs, dsts, lens = zip(*bl)
            list(srcs), list(dsts), list(lens)
            return 0

        cost = {}
        for name, fn in (("funnel", lambda: noop_funnel(blocks)),
                         ("routed", lambda: router.route(blocks, noop_funnel, lambda: side))):
            cost[name] = min(timed(fn, 20) for _ in range(5))
        row["route_overhead_ns_per_block"] = (cost["routed"] - cost["funnel"]) / count * 1e9
        row["funnel_ns_per_block"] = cost["funnel"] / count * 1e9
        for name, ms in medians.items():
            row[f"{name}_gbps"] = bb * count / statistics.median(ms) / 1e9
        channel.send([b"CHECK", b"0", str(bb * count).encode()])
        reply = channel.recv()
        row["byte_exact"] = reply[1] == digest(device_buf[: bb * count])
        out["throughput"].append(row)
        log(f"  {block_kib} KiB x {count}: " + ", ".join(
            f"{k[:-5]} {v:.2f} GB/s" for k, v in row.items() if k.endswith("_gbps")))

    if not args.engine_only:
        for size in json.loads(args.latency_sizes):
            if size > host_buf.numel() // 2:
                continue
            blocks = [(src_host, peer["host"], size)]
            reps = 50 if size <= MiB else 10
            times = []
            for k in range(reps + 2):
                t0 = time.perf_counter()
                rc = router.route(blocks, funnel, lambda: side)
                channel.send([b"PING", str(k).encode()])
                ack = channel.recv()
                if rc != 0 or ack[0] != b"ACK":
                    raise RuntimeError(f"side channel failed: rc={rc}, {ack[:1]}")
                if k >= 2:
                    times.append(time.perf_counter() - t0)
            out["latency"].append({"bytes": size, "median_us": statistics.median(times) * 1e6,
                                   "p90_us": sorted(times)[int(0.9 * len(times))] * 1e6})
            log(f"  side channel {size} B: {out['latency'][-1]['median_us']:.0f} us median")
        # The host bytes really arrived (the last latency block is the largest).
    channel.send([b"BYE"])
    bye = channel.recv()
    out["receiver_messages_written"], out["receiver_messages_dropped"] = int(bye[1]), int(bye[2])
    out["memory_backend"] = getattr(memory, "backend", type(memory).__name__)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


def setup_dsv41(args, sender: bool):
    """Both sides' buffers (device; one pinned host aux buffer) and a registered engine."""
    if args.protocol == "nvlink_intra":
        os.environ.setdefault("MC_INTRANODE_NVLINK", "1")
    else:
        os.environ.pop("MC_INTRANODE_NVLINK", None)
    import torch

    from sglang_dsv41.mooncake_nvlink.memory import InjectedKinds, cuda_memory_access
    from sglang_dsv41.mooncake_nvlink.routing import plan_registration

    gpu = args.mode == "gpu"
    if gpu:
        torch.cuda.set_device(args.gpu)
    dev = torch.device("cuda", args.gpu) if gpu else torch.device("cpu")
    buffers = []
    for i, n in enumerate(dsv41_buffer_sizes()):
        # 16 MiB at least on the GPU: each tensor gets a cudaMalloc segment of its
        # own, so a registered pointer is an allocation base, as sglang's pools are.
        t = torch.zeros(max(n, 16 * MiB) if gpu else n, dtype=torch.uint8, device=dev)[:n]
        if sender:
            k = torch.arange(n, dtype=torch.int64, device=dev)
            t.copy_(((k * 7 + (k >> 9) + i * 131) % 251 + 1).to(torch.uint8))  # never 0
            del k
        buffers.append(t)
    aux = torch.zeros(1 * MiB, dtype=torch.uint8, pin_memory=gpu)  # host: left out, as in sglang
    if gpu:
        torch.cuda.synchronize()
        memory = cuda_memory_access(device=args.gpu)
    else:
        memory = InjectedKinds([(t.data_ptr(), t.numel()) for t in buffers])
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", args.protocol, "")
    if rc != 0:
        raise RuntimeError(f"Mooncake initialize({args.protocol}) returned {rc}")
    regions = [(t.data_ptr(), t.numel()) for t in buffers] + [(aux.data_ptr(), aux.numel())]
    plan = plan_registration(regions, memory.kind_of)
    if len(plan.register) != len(buffers):
        raise RuntimeError(f"expected {len(buffers)} device regions, classified {len(plan.register)}")
    ptrs, lens = zip(*plan.register)
    rc = engine.batch_register_memory(list(ptrs), list(lens))
    if rc != 0:
        raise RuntimeError(f"batch_register_memory returned {rc}")
    return torch, engine, memory, plan, buffers, aux


def peer_transport(args):
    """The peer-write transport of this side, or None when the peer path is left out.

    GPU: CUDA IPC handles of the receiver's buffers, written with the paged
    copy on this process's GPU. CPU: the receiver's host memory, written with
    process_vm_writev.
    """
    if args.pattern != "dsv41" or args.no_peer:
        return None
    if args.mode == "gpu":
        from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import CudaBatchCopy
        from sglang_dsv41.mooncake_nvlink.kv_staging.peer import CudaIpcTransport

        return CudaIpcTransport(CudaBatchCopy(args.gpu), args.gpu)
    from host_peer import HostCmaTransport  # the tests' stand-in for the GPU

    return HostCmaTransport()


def encode_peer_frames(frames: list[bytes]) -> list[str]:
    """Peer-map frames as text for the JSON handshake (hex)."""
    return [bytes(f).hex() for f in frames]


def decode_peer_frames(texts: list[str]) -> list[bytes]:
    return [bytes.fromhex(t) for t in texts]


def _spans_digest(torch, buffers, spans, dst: bool) -> bytes:
    import hashlib

    h = hashlib.sha256()
    for b, s_off, d_off, n in spans:
        off = d_off if dst else s_off
        h.update(digest(buffers[b][off:off + n]))
    return h.digest()


def run_dsv41_receiver(args) -> None:
    torch, engine, memory, plan, buffers, aux = setup_dsv41(args, sender=False)
    channel = Channel.listen(args.channel)
    peer_map = None
    transport = peer_transport(args)
    if transport is not None:  # the buffers the engine writes into, as the decode side exports them
        from sglang_dsv41.mooncake_nvlink.kv_staging.peer import PeerMapError, encode_peer_map

        try:
            exported = transport.export([(t.data_ptr(), t.numel()) for t in buffers])
        except PeerMapError as exc:
            log(f"error: the receiver cannot export its buffers for peer writes: {exc} "
                "(--no-peer leaves the peer path out)")
            os._exit(2)
        peer_map = encode_peer_frames(encode_peer_map(exported))
    print("READY " + json.dumps({
        "session": f"127.0.0.1:{engine.get_rpc_port()}",
        "addrs": [t.data_ptr() for t in buffers], "port": channel.port, "peer_map": peer_map,
    }), flush=True)
    channel.accept()
    while True:
        frames = channel.recv(timeout_s=3600)
        if frames[0] == b"PING":
            channel.send([b"PONG"])
        elif frames[0] == b"CLEAR":
            for t in buffers:
                t.zero_()
            if args.mode == "gpu":
                torch.cuda.synchronize()
            channel.send([b"CLEARED"])
        elif frames[0] == b"CHECK":  # [CHECK, json spans]: digest of the dst spans, nonzero bytes
            if args.mode == "gpu":
                torch.cuda.synchronize()
            spans = json.loads(frames[1])
            nonzero = sum(int(torch.count_nonzero(t).item()) for t in buffers[:FLAT_BUFFER])
            channel.send([b"CHECKED", _spans_digest(torch, buffers, spans, dst=True), str(nonzero).encode()])
        elif frames[0] == b"BYE":
            channel.send([b"BYE"])
            break
    channel.close()
    os._exit(0)


def run_dsv41_sender(args) -> None:
    from sglang_dsv41.mooncake_nvlink.routing import KindTable, SideChannel, TransferRouter

    peer = json.loads(args.peer)
    torch, engine, memory, plan, buffers, aux = setup_dsv41(args, sender=True)
    channel = Channel.connect(args.channel, peer["port"])
    session = peer["session"]
    router = TransferRouter(KindTable(plan.classified, memory.kind_of), memory)
    side = SideChannel(room=1, send=channel.send)
    src_addrs = [t.data_ptr() for t in buffers]
    dst_addrs = peer["addrs"]

    def funnel(blocks):  # upstream MooncakeKVManager._transfer_data's body
        if not blocks:
            return 0
        srcs, dsts, lens = zip(*blocks)
        return engine.batch_transfer_sync_write(session, list(srcs), list(dsts), list(lens))

    def routed(blocks):
        return router.route(blocks, funnel, lambda: side)

    held_request, peer_counts = None, {}
    transport = peer_transport(args)
    if transport is not None and peer.get("peer_map"):
        import numpy as np

        from sglang_dsv41.mooncake_nvlink.kv_staging.peer import PagedLayout, PeerWrites, bind_layout, find_peer_map

        peer_map = find_peer_map(decode_peer_frames(peer["peer_map"]))
        if peer_map is None:
            raise RuntimeError("the receiver's peer-map frames hold no peer map")
        target = transport.open(peer_map)
        kinds = KindTable(plan.classified, memory.kind_of)
        writes = PeerWrites()

        def add(bound, src_pages, dst_pages):
            why_not = writes.add_pages(bound, src_pages, dst_pages)
            if why_not is not None:
                writes.discard()
                raise RuntimeError(f"a call was refused: {why_not}")
            peer_counts["peer_pages"] = peer_counts.get("peer_pages", 0) + 1

        def held_request(paged, kv_calls):
            """As the plugin sends a request in peer mode: the KV of earlier chunks each at once, then
            the last chunk's KV and the state calls held and written as one batch (before the status)."""
            earlier, last = paged[:max(kv_calls - 1, 0)], paged[max(kv_calls - 1, 0):]

            def run():
                t0 = time.perf_counter()
                for call in earlier:
                    add(*call)
                    writes.flush()
                t1 = time.perf_counter()
                for call in last:
                    add(*call)
                t2 = time.perf_counter()
                writes.flush()
                t3 = time.perf_counter()
                held_phases.append((t1 - t0, t2 - t1, t3 - t2))
                peer_counts["held_writes"] = peer_counts.get("held_writes", 0) + 1
                return 0
            return run

    def request(call, batches):
        def run():
            for blocks in batches:
                rc = call(blocks)
                if rc != 0:
                    return rc
            return 0
        return run

    rows = []
    held_phases: list[tuple] = []  # per held request: earlier chunks, holding, the write
    for name, tokens, layout in DSV41_CASES:
        if args.cases and name not in args.cases:
            continue
        spans = dsv41_batches(tokens, layout)
        batches = [[(src_addrs[b] + so, dst_addrs[b] + do, n) for b, so, do, n in batch] for batch in spans]
        nbytes = sum(n for batch in spans for *_, n in batch)
        flat = [[(src_addrs[FLAT_BUFFER], dst_addrs[FLAT_BUFFER], nbytes)]]
        paths = {"stock": request(funnel, batches), "routed": request(routed, batches),
                 "contiguous": request(funnel, flat)}
        if held_request is not None:
            # the layouts the plugin learns and checks once per kind of call, and sglang's int32 page arrays
            paged, kv_calls = [], 0
            for bufs, items, sp, dp in dsv41_paged_calls(tokens, layout):
                kv_calls += bufs[0] == 0  # the KV buffers come first in the index space
                bound, why_not = bind_layout(
                    PagedLayout.of([(src_addrs[b], dst_addrs[b], item) for b, item in zip(bufs, items)]),
                    target, kinds.device_bytes_from)
                if bound is None:
                    raise RuntimeError(f"{name}: the page path cannot serve a call of this request: {why_not}")
                paged.append((bound, np.array(sp, dtype=np.int32), np.array(dp, dtype=np.int32)))
            paths["held"] = held_request(paged, kv_calls)
        for fn in paths.values():  # warm-up: connections, IPC handles
            timed(fn, 3)
        held_phases.clear()
        samples = {k: [] for k in paths}
        after_other = {k: [] for k in paths}
        names = list(paths)
        for _ in range(args.rounds):
            times = {k: [] for k in paths}
            firsts = {k: [] for k in paths}
            for it in range(args.iters):  # in turns, so drift hits every path alike
                for k in names[it % len(names):] + names[:it % len(names)]:
                    # A turn is two requests: the first follows another path, the second its own
                    # kind, as on a transfer worker, whose previous request went the same way.
                    firsts[k].append(timed(paths[k], 1))
                    if k == "held":
                        held_phases.pop()
                    times[k].append(timed(paths[k], 1))
            for k in paths:
                samples[k].append(statistics.median(times[k]))
                after_other[k].append(statistics.median(firsts[k]))
        timed_phases = list(held_phases)  # of the timed requests (the byte-exact run below adds one)
        # The Python cost alone: the engine call replaced by a no-op.
        def noop(blocks):
            if blocks:
                srcs, dsts, lens = zip(*blocks)
                list(srcs), list(dsts), list(lens)
            return 0

        python = {"stock": request(noop, batches),
                  "routed": request(lambda b: router.route(b, noop, lambda: side), batches)}
        python_us = {k: min(timed(fn, 50) for _ in range(5)) * 1e6 for k, fn in python.items()}
        # Byte-exact: clear the receiver, move the request once through each moving path.
        all_spans = [sp for batch in spans for sp in batch]
        exact = True
        moving = ["routed"] + (["held"] if held_request is not None else [])
        ways_of = {}
        for k in moving:
            channel.send([b"CLEAR"])
            channel.recv()
            peer_counts.clear()
            rc = paths[k]()
            ways_of[k] = dict(peer_counts)
            channel.send([b"CHECK", json.dumps(all_spans).encode()])
            reply = channel.recv()
            exact = exact and (rc == 0 and int(reply[2]) == nbytes
                               and reply[1] == _spans_digest(torch, buffers, all_spans, dst=False))
        row = {"case": name, "tokens": tokens, "layout": layout, "calls": len(spans),
               "blocks": sum(len(b) for b in spans), "bytes": nbytes, "byte_exact": exact}
        for k, v in samples.items():
            row[f"{k}_us"] = statistics.median(v) * 1e6
            row[f"{k}_rounds_us"] = [x * 1e6 for x in v]
            row[f"{k}_after_other_us"] = statistics.median(after_other[k]) * 1e6
        # throughput ratio, paired within each round (1.0 = routing costs nothing)
        row["routed_over_stock"] = statistics.median(
            s / r for s, r in zip(samples["stock"], samples["routed"]))
        row["stock_x_contiguous"] = row["stock_us"] / row["contiguous_us"]
        row["routed_x_contiguous"] = row["routed_us"] / row["contiguous_us"]
        row["python_stock_us"], row["python_routed_us"] = python_us["stock"], python_us["routed"]
        for k in ("held",) if held_request is not None else ():
            row[f"{k}_x_contiguous"] = row[f"{k}_us"] / row["contiguous_us"]
            row[f"{k}_x_contiguous_after_other"] = row[f"{k}_after_other_us"] / row["contiguous_after_other_us"]
            row[f"{k}_over_stock"] = statistics.median(
                s / r for s, r in zip(samples["stock"], samples[k]))
            row[f"{k}_batches"] = ways_of[k]  # of the byte-exact request: how its calls went
        if timed_phases:
            earlier, hold, write = zip(*timed_phases)
            row["held_phases_us"] = {"earlier": statistics.median(earlier) * 1e6,
                                     "hold": statistics.median(hold) * 1e6,
                                     "write": statistics.median(write) * 1e6}
        rows.append(row)
        log(f"  {name}: {row['blocks']} blocks, {nbytes / 1e6:.1f} MB: stock {row['stock_us']:.0f} us, "
            f"routed {row['routed_us']:.0f} us, contiguous {row['contiguous_us']:.0f} us, "
            f"routed/stock {row['routed_over_stock']:.3f}"
            + (f", held {row['held_us']:.0f} us ({row['held_x_contiguous']:.1f}x contiguous)"
               if held_request is not None else "")
            + f", exact {exact}")
    # The side channel's own round trip.
    pings = []
    for _ in range(200):
        t0 = time.perf_counter()
        channel.send([b"PING"])
        channel.recv()
        pings.append(time.perf_counter() - t0)
    ping_us = statistics.median(pings[20:]) * 1e6
    log(f"  side channel round trip (zmq or socket, no GPU work): median {ping_us:.0f} us")
    channel.send([b"BYE"])
    channel.recv()
    print("RESULT " + json.dumps({"rows": rows, "channel_round_trip_us": ping_us,
                                  "memory_backend": getattr(memory, "backend", type(memory).__name__)}),
          flush=True)
    os._exit(0)


def print_dsv41(run: dict, title: str, gpu: bool = True) -> None:
    print(f"\n{title}")
    print(f"{'request':>16} {'calls':>5} {'blocks':>6} {'MB':>6} {'stock us':>9} {'routed us':>10} "
          f"{'contig us':>10} {'routed/stock':>13} {'stock x contig':>15} {'us/block':>9} {'py +us':>7} {'exact':>6}")
    for r in run["rows"]:
        per_block = (r["stock_us"] - r["contiguous_us"]) / max(r["blocks"] - 1, 1)
        print(f"{r['case']:>16} {r['calls']:>5} {r['blocks']:>6} {r['bytes'] / 1e6:6.1f} "
              f"{r['stock_us']:9.0f} {r['routed_us']:10.0f} {r['contiguous_us']:10.0f} "
              f"{r['routed_over_stock']:13.3f} {r['stock_x_contiguous']:14.1f}x {per_block:9.2f} "
              f"{r['python_routed_us'] - r['python_stock_us']:7.1f} {str(r['byte_exact']):>6}")
    if any("held_us" in r for r in run["rows"]):
        path = "held"
        print(f"\n{'request':>16} {path + ' us':>9} {'contig us':>10} {path + ' x contig':>15} "
              f"{'after other':>12} {'stock x contig':>15} {'stock/' + path:>12}  ways")
        for r in run["rows"]:
            ways = ", ".join(f"{k} {v}" for k, v in sorted(r[f"{path}_batches"].items()))
            print(f"{r['case']:>16} {r[f'{path}_us']:9.0f} {r['contiguous_us']:10.0f} "
                  f"{r[f'{path}_x_contiguous']:14.2f}x {r[f'{path}_x_contiguous_after_other']:11.2f}x "
                  f"{r['stock_x_contiguous']:14.1f}x {r[f'{path}_over_stock']:12.2f}  {ways}")
        print("held: what the plugin does on a transfer worker: earlier chunks' KV calls each written at "
              "once from their page lists, the last chunk's KV call and the state calls held and written "
              "as one batch; after other: the same ratio for the first request of each turn, which "
              "follows another path; ways: calls, and held writes (one per request)")
        print_held_phases(run["rows"])
        print_peer_goals({r["case"]: r[f"{path}_x_contiguous"] for r in run["rows"]}, path=path, gpu=gpu)
    print("us/block: (stock - contiguous) / (blocks - 1); py +us: what the routing adds per request "
          "in Python alone (engine call replaced by a no-op)")


def print_held_phases(rows) -> None:
    """Where a held request's time goes, medians over its timed requests."""
    rows = [r for r in rows if "held_phases_us" in r]
    if not rows:
        return
    print(f"\n{'request':>16} {'earlier us':>11} {'hold us':>8} {'write us':>9}")
    for r in rows:
        ph = r["held_phases_us"]
        print(f"{r['case']:>16} {ph['earlier']:11.1f} {ph['hold']:8.1f} {ph['write']:9.1f}")
    print("earlier: the KV of earlier chunks, each written at once; hold: the last chunk's calls held; "
          "write: the held calls written as one")


def summarize_dsv41(runs: list[dict]) -> list[dict]:
    """Per case: median and range over runs of routed/stock and stock x contiguous."""
    out = []
    for i, first in enumerate(runs[0]["rows"]):
        rows = [run["rows"][i] for run in runs]
        entry = {"case": first["case"], "blocks": first["blocks"], "bytes": first["bytes"],
                 "byte_exact": all(r["byte_exact"] for r in rows)}
        for key in ("routed_over_stock", "stock_x_contiguous", "routed_x_contiguous",
                    "stock_us", "routed_us", "contiguous_us",
                    "held_us", "held_x_contiguous", "held_x_contiguous_after_other", "held_over_stock"):
            if key not in first:
                continue
            vals = [r[key] for r in rows]
            entry[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        out.append(entry)
    return out


# --- orchestration (parent process)


def run_pair(args, protocol: str, register: str, engine_only: bool, peer_gpu: int) -> dict:
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(here, "..", "python"),
                                                      env.get("PYTHONPATH")]))
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    common = ["--mode", args.mode, "--protocol", protocol, "--register", register,
              "--device-mib", str(args.device_mib), "--host-mib", str(args.host_mib),
              "--channel", args.channel, "--pattern", args.pattern]
    if args.no_peer:
        common.append("--no-peer")
    rx = subprocess.Popen([sys.executable, __file__, "--role", "receiver", "--gpu", str(args.gpu), *common],
                          env=env, stdout=subprocess.PIPE, text=True)
    line = rx.stdout.readline()
    if not line.startswith("READY "):
        rx.kill()
        raise RuntimeError(f"receiver failed to start: {line!r}")
    tx_args = [sys.executable, __file__, "--role", "sender", "--gpu", str(peer_gpu), *common,
               "--peer", line[len("READY "):].strip(), "--iters", str(args.iters),
               "--rounds", str(args.rounds)]
    if args.pattern == "dsv41":
        tx_args += [f"--case={c}" for c in args.cases or []]
    else:
        tx_args += ["--shapes", args.shapes, "--latency-sizes", args.latency_sizes]
    if engine_only:
        tx_args.append("--engine-only")
    tx = subprocess.run(tx_args, env=env, stdout=subprocess.PIPE, text=True, timeout=600)
    rx.wait(60)
    lines = [l for l in tx.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"sender failed (rc={tx.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def _missing_gpus(*wanted: int) -> str:
    """Why the GPUs asked for cannot be used here, or "" when they can."""
    try:
        import torch
    except ImportError as exc:
        return f"needs torch with CUDA ({exc})"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    absent = sorted({g for g in wanted if not 0 <= g < count})
    return f"needs GPU {', '.join(map(str, absent))}; this machine has {count}" if absent else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--gpu", type=int, default=0, help="receiver GPU")
    p.add_argument("--peer-gpu", type=int, default=None, help="sender GPU (default: --gpu)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--channel", choices=["zmq", "socket"], default=None)
    p.add_argument("--pattern", choices=["blocks", "dsv41"], default="blocks",
                   help="blocks: fixed block shapes (default); dsv41: DeepSeek-V4.1 requests")
    p.add_argument("--case", dest="cases", action="append", default=None,
                   help="dsv41: run only this request case (repeatable), e.g. '32k fragmented'")
    p.add_argument("--repeat", type=int, default=1, help="dsv41: independent runs (fresh processes)")
    p.add_argument("--no-peer", action="store_true", help="dsv41: leave the peer-write path out")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    # internal (child processes)
    p.add_argument("--role", choices=["receiver", "sender"])
    p.add_argument("--protocol", default=None)
    p.add_argument("--register", choices=["device", "all"], default="device")
    p.add_argument("--device-mib", type=int, default=None)
    p.add_argument("--host-mib", type=int, default=None)
    p.add_argument("--peer")
    p.add_argument("--shapes")
    p.add_argument("--latency-sizes")
    p.add_argument("--engine-only", action="store_true")
    args = p.parse_args()
    if args.role == "receiver":
        return run_dsv41_receiver(args) if args.pattern == "dsv41" else run_receiver(args)
    if args.role == "sender":
        return run_dsv41_sender(args) if args.pattern == "dsv41" else run_sender(args)
    if args.mode == "gpu":
        missing = _missing_gpus(args.gpu, args.gpu if args.peer_gpu is None else args.peer_gpu)
        if missing:
            print(f"mooncake_routing.py: --mode gpu {missing}", file=sys.stderr)
            sys.exit(2)
    if args.pattern == "dsv41":
        return main_dsv41(args)
    if args.cases or args.repeat != 1:
        p.error("--case and --repeat apply to --pattern dsv41 only")

    gpu = args.mode == "gpu"
    args.channel = args.channel or Channel.available()
    args.iters = args.iters or (10 if gpu else 5)
    args.device_mib = args.device_mib or (128 if gpu else 16)
    args.host_mib = args.host_mib or (32 if gpu else 4)
    # (KiB per block, blocks): large KV pages, per-page KV, many small blocks
    args.shapes = json.dumps([[1024, 64], [64, 512], [4, 2048]] if gpu else [[64, 128], [4, 1024]])
    args.latency_sizes = json.dumps([256, 4096, 65536, MiB, 8 * MiB] if gpu else [256, 4096, 65536, MiB])
    peer_gpu = args.gpu if args.peer_gpu is None else args.peer_gpu
    protocol = "nvlink_intra" if gpu else "tcp"
    log(f"[{args.mode}] {protocol}, side channel over {args.channel}, GPU {peer_gpu} -> {args.gpu}"
        if gpu else f"[cpu] tcp on 127.0.0.1, side channel over {args.channel}")
    main_run = run_pair(args, protocol, "device", engine_only=False, peer_gpu=peer_gpu)
    tcp_run = None
    if gpu:
        log("[gpu] all-TCP workaround: protocol tcp, host and device regions registered")
        tcp_run = run_pair(args, "tcp", "all", engine_only=True, peer_gpu=peer_gpu)

    print(f"\nMooncake NVLink routing benchmark ({args.mode} mode, {protocol}"
          f"{', GPU %d -> GPU %d' % (peer_gpu, args.gpu) if gpu else ''}; "
          f"median of {args.rounds} rounds x {args.iters} batches; memory: {main_run['memory_backend']})")
    print(f"{'shape':>16} {'engine GB/s':>12} {'funnel GB/s':>12} {'routed GB/s':>12} "
          f"{'routed/engine':>14} {'routed/funnel':>14} {'all-TCP GB/s':>13} {'exact':>6}")
    for i, row in enumerate(main_run["throughput"]):
        tcp = tcp_run["throughput"][i]["engine_gbps"] if tcp_run else None
        shape = f"{row['block_kib']} KiB x {row['blocks']}"
        print(f"{shape:>16} {row['engine_gbps']:12.3f} {row['funnel_gbps']:12.3f} {row['routed_gbps']:12.3f} "
              f"{row['routed_gbps'] / row['engine_gbps']:13.3f}x {row['routed_gbps'] / row['funnel_gbps']:13.3f}x "
              f"{(f'{tcp:.3f}' if tcp is not None else 'n/a'):>13} {str(row['byte_exact']):>6}")
    print("\nPython cost without the engine (engine call replaced by a no-op), per block:")
    for row in main_run["throughput"]:
        print(f"  {row['block_kib']} KiB x {row['blocks']}: upstream funnel "
              f"{row['funnel_ns_per_block']:.0f} ns, routing adds {row['route_overhead_ns_per_block']:.0f} ns")
    print(f"\nside channel ({args.channel}): host block routed, written and acknowledged")
    print(f"{'bytes':>10} {'median us':>10} {'p90 us':>10}")
    for row in main_run["latency"]:
        print(f"{row['bytes']:>10} {row['median_us']:10.0f} {row['p90_us']:10.0f}")
    print(f"receiver host-block messages: written {main_run['receiver_messages_written']}, "
          f"dropped {main_run['receiver_messages_dropped']}")
    if not gpu:
        print("all-TCP workaround: n/a in CPU mode (the engine is tcp already)")


def main_dsv41(args) -> None:
    gpu = args.mode == "gpu"
    known = [name for name, _, _ in DSV41_CASES]
    unknown = [c for c in args.cases or [] if c not in known]
    if unknown:
        sys.exit(f"error: unknown --case {unknown[0]!r}; choose from {', '.join(known)}")
    if args.repeat < 1 or args.rounds < 1 or (args.iters is not None and args.iters < 1):
        sys.exit("error: --repeat, --rounds and --iters must be at least 1")
    args.channel = args.channel or Channel.available()
    args.iters = args.iters or (20 if gpu else 3)
    args.device_mib = args.device_mib or 1
    args.host_mib = args.host_mib or 1
    peer_gpu = args.gpu if args.peer_gpu is None else args.peer_gpu
    protocol = "nvlink_intra" if gpu else "tcp"
    where = f"GPU {peer_gpu} -> GPU {args.gpu}" if gpu else "127.0.0.1"
    runs = []
    for i in range(args.repeat):
        log(f"[{args.mode}] DeepSeek-V4.1 requests, {protocol}, {where}, run {i + 1} of {args.repeat}")
        runs.append(run_pair(args, protocol, "device", engine_only=False, peer_gpu=peer_gpu))
        print_dsv41(runs[-1], f"DeepSeek-V4.1 request pattern, run {i + 1} of {args.repeat} ({args.mode} "
                    f"mode, {protocol}, {where}; paths in turns, {args.rounds} rounds x {args.iters} requests, "
                    f"times: median of the round medians, routed/stock: median of the round ratios; "
                    f"memory: {runs[-1]['memory_backend']})", gpu=args.mode == "gpu")
    summary = summarize_dsv41(runs)
    if args.repeat > 1:
        print(f"\nover {args.repeat} runs: median [min - max]")
        print(f"{'request':>16} {'routed/stock':>24} {'stock x contiguous':>24} {'exact':>6}")
        for e in summary:
            ros, sxc = e["routed_over_stock"], e["stock_x_contiguous"]
            print(f"{e['case']:>16} {ros['median']:10.3f} [{ros['min']:.3f} - {ros['max']:.3f}] "
                  f"{sxc['median']:9.1f}x [{sxc['min']:.1f} - {sxc['max']:.1f}] {str(e['byte_exact']):>6}")
        for path in ("held",):
            if f"{path}_x_contiguous" not in summary[0]:
                continue
            print(f"\n{'request':>16} {path + ' us':>24} {path + ' x contiguous':>24} {'after other':>24} "
                  f"{'stock / ' + path:>24}")
            for e in summary:
                u, a, o, b = (e[f"{path}_us"], e[f"{path}_x_contiguous"], e[f"{path}_x_contiguous_after_other"],
                              e[f"{path}_over_stock"])
                print(f"{e['case']:>16} {u['median']:9.0f} [{u['min']:.0f} - {u['max']:.0f}] "
                      f"{a['median']:9.2f}x [{a['min']:.2f} - {a['max']:.2f}] "
                      f"{o['median']:9.2f}x [{o['min']:.2f} - {o['max']:.2f}] "
                      f"{b['median']:9.2f} [{b['min']:.2f} - {b['max']:.2f}]")
            print_peer_goals({e["case"]: e[f"{path}_x_contiguous"]["median"] for e in summary},
                             " (median over runs)", path=path, gpu=args.mode == "gpu")
    worst = min(e["routed_over_stock"]["median"] for e in summary)
    exact = all(e["byte_exact"] for e in summary)
    print(f"\nworst routed/stock (median over runs): {worst:.3f}; every request byte-exact: {exact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "protocol": protocol, "where": where, "rounds": args.rounds,
                       "iters": args.iters, "peer": not args.no_peer, "runs": runs, "summary": summary}, f, indent=1)
    if not exact:
        sys.exit(1)


if __name__ == "__main__":
    main()
