"""Mooncake NVLink routing: device-block throughput and side-channel latency, from one run.

Compares, on the same engine pair and the same blocks:
- engine:  ``batch_transfer_sync_write`` with prebuilt lists (the raw engine);
- funnel:  upstream ``_transfer_data``'s body (zip the blocks, then the engine);
- routed:  our ``TransferRouter.route`` (classify, split, engine; no host block);
and, in GPU mode, the all-TCP workaround (protocol tcp, host and device regions
registered together, device blocks over tcp). Then the side channel: latency
from handing one host block to the router until the receiver has written it
and acknowledged a marker sent after it on the same socket.

    PYTHONPATH=python python benchmarks/mooncake_routing.py --mode cpu
    PYTHONPATH=python python benchmarks/mooncake_routing.py --mode gpu [--gpu 0 --peer-gpu 0]

CPU mode: Mooncake tcp on 127.0.0.1, host memory, the "device" buffers'
classification injected. GPU mode: MC_INTRANODE_NVLINK=1, protocol
nvlink_intra, device buffers from torch, pinned host buffers, CUDA
classification. Imports torch, mooncake and sglang_dsv41.core only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MiB = 1 << 20
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

    from sglang_dsv41.core.memory_access import InjectedKinds, cuda_memory_access

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
    from sglang_dsv41.core.mooncake_routing import plan_registration

    regions = [(device_buf.data_ptr(), dev_bytes), (host_buf.data_ptr(), host_bytes)]
    plan = plan_registration(regions, memory.kind_of)
    to_register = plan.register if args.register == "device" else regions
    ptrs, lens = zip(*to_register)
    rc = engine.batch_register_memory(list(ptrs), list(lens))
    if rc != 0:
        raise RuntimeError(f"batch_register_memory({args.register}) returned {rc}")
    return torch, engine, memory, plan, device_buf, host_buf


def run_receiver(args) -> None:
    from sglang_dsv41.core.mooncake_routing import HostBlockReceiver, RegionTable, is_host_block_message

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
    from sglang_dsv41.core.mooncake_routing import KindTable, SideChannel, TransferRouter

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


# --- orchestration (parent process)


def run_pair(args, protocol: str, register: str, engine_only: bool, peer_gpu: int) -> dict:
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(here, "..", "python"),
                                                      env.get("PYTHONPATH")]))
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    common = ["--mode", args.mode, "--protocol", protocol, "--register", register,
              "--device-mib", str(args.device_mib), "--host-mib", str(args.host_mib),
              "--channel", args.channel]
    rx = subprocess.Popen([sys.executable, __file__, "--role", "receiver", "--gpu", str(args.gpu), *common],
                          env=env, stdout=subprocess.PIPE, text=True)
    line = rx.stdout.readline()
    if not line.startswith("READY "):
        rx.kill()
        raise RuntimeError(f"receiver failed to start: {line!r}")
    tx_args = [sys.executable, __file__, "--role", "sender", "--gpu", str(peer_gpu), *common,
               "--peer", line[len("READY "):].strip(), "--shapes", args.shapes,
               "--latency-sizes", args.latency_sizes, "--iters", str(args.iters),
               "--rounds", str(args.rounds)]
    if engine_only:
        tx_args.append("--engine-only")
    tx = subprocess.run(tx_args, env=env, stdout=subprocess.PIPE, text=True, timeout=600)
    rx.wait(60)
    lines = [l for l in tx.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"sender failed (rc={tx.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--gpu", type=int, default=0, help="receiver GPU")
    p.add_argument("--peer-gpu", type=int, default=None, help="sender GPU (default: --gpu)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--channel", choices=["zmq", "socket"], default=None)
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
        return run_receiver(args)
    if args.role == "sender":
        return run_sender(args)

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


if __name__ == "__main__":
    main()
