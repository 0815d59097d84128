"""One process of the Mooncake NVLink routing GPU test (receiver or sender).

Imports only torch, mooncake and sglang_dsv41.mooncake_nvlink.{memory,routing}
(PYTHONPATH=python), so it runs on the GPU machine, which has no sglang.

    python _gpu_worker.py receiver '<cfg json>'
    python _gpu_worker.py sender '<cfg json>' '<receiver READY json>'

cfg: {"gpu": 0, "device": "cuda"|"cpu", "protocol": "nvlink_intra"|"tcp",
      "routing": true|false, "nvlink_env": true|false}. With routing, regions go through
``plan_registration`` (device only) and batches through ``TransferRouter``
(host blocks on a socket side channel); without it, every region is
registered in one batch, as stock sglang does. ``device=cpu`` is a dry run for
machines without a GPU: "device" buffers are host tensors whose
classification is injected, and the protocol must be tcp.

Buffers (same geometry on both sides; the sender fills, the receiver checks):
KV: 4 device buffers; aux: 2 pinned host buffers; state: state0 device on both
sides, state1 pinned host on both, state2 pinned host on the sender and device
on the receiver (a host block written into device memory).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Client, Listener

ROLE = sys.argv[1]
CFG = json.loads(sys.argv[2])
# Mooncake reads this at initialize; the dry run sets it too (the CPU wheel ignores it).
if CFG.get("protocol") == "nvlink_intra" or CFG.get("nvlink_env"):
    os.environ.setdefault("MC_INTRANODE_NVLINK", "1")
else:
    os.environ.pop("MC_INTRANODE_NVLINK", None)

import torch  # noqa: E402

from sglang_dsv41.mooncake_nvlink.memory import InjectedKinds, cuda_memory_access  # noqa: E402
from sglang_dsv41.mooncake_nvlink.routing import (  # noqa: E402
    HostBlockReceiver,
    KindTable,
    MemoryKind,
    RegionTable,
    SideChannel,
    TransferRouter,
    is_host_block_message,
    nvlink_intra_reason,
    plan_registration,
)

KV_BUFFERS = 4
KV_PAGES = 64
KV_ITEM = 64 * 1024  # 4 MiB per KV buffer: its own cudaMalloc segment
AUX_ITEMS = [512, 4096]
AUX_SLOTS = 16
STATE_ITEMS = [128 * 1024, 32 * 1024, 8 * 1024]
STATE_SLOTS = 8
# (src slot, dst slot) pairs of the one transfer the test makes
KV_PAIRS = [(3, 0), (4, 1), (5, 2), (40, 63), (41, 10)]
AUX_PAIR = (2, 7)
STATE_PAIR = (1, 5)
AUTHKEY = b"dsv41-mooncake-gpu-test"
MIN_DEVICE_ALLOC = 16 << 20


def pattern(tag: int, n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 7 + (i >> 9) + tag * 131) % 251 + 1).to(torch.uint8)


class Buffers:
    def __init__(self, sender: bool):
        self.on_gpu = CFG["device"] == "cuda"
        dev = torch.device("cuda", CFG["gpu"]) if self.on_gpu else torch.device("cpu")

        def device_buf(n, tag):
            # At least 16 MiB per tensor: torch then gives it a cudaMalloc segment of its
            # own, so the registered pointer is an allocation base, as sglang's KV pools are.
            t = torch.zeros(max(n, MIN_DEVICE_ALLOC), dtype=torch.uint8, device=dev)[:n]
            if sender:
                t.copy_(pattern(tag, n))
            return t

        def host_buf(n, tag):
            t = torch.zeros(n, dtype=torch.uint8, pin_memory=self.on_gpu)
            if sender:
                t.copy_(pattern(tag, n))
            return t

        self.kv = [device_buf(KV_PAGES * KV_ITEM, 10 + i) for i in range(KV_BUFFERS)]
        self.aux = [host_buf(AUX_SLOTS * n, 20 + i) for i, n in enumerate(AUX_ITEMS)]
        state2 = host_buf if sender else device_buf
        self.state = [
            device_buf(STATE_SLOTS * STATE_ITEMS[0], 30),
            host_buf(STATE_SLOTS * STATE_ITEMS[1], 31),
            state2(STATE_SLOTS * STATE_ITEMS[2], 32),
        ]
        if self.on_gpu:
            torch.cuda.synchronize()
        self.device_tensors = self.kv + [self.state[0]] + ([] if sender else [self.state[2]])

    def all(self):
        return self.kv + self.aux + self.state

    def regions(self):
        return [(t.data_ptr(), t.numel()) for t in self.all()]

    def memory(self):
        if self.on_gpu:
            return cuda_memory_access(device=CFG["gpu"])
        # Dry run: these host tensors play the device buffers.
        return InjectedKinds([(t.data_ptr(), t.numel()) for t in self.device_tensors])


def make_engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", CFG["protocol"], "")
    if rc != 0:
        raise RuntimeError(f"Mooncake initialize({CFG['protocol']}) returned {rc}")
    return engine


def register(engine, bufs, memory, out):
    regions = bufs.regions()
    if CFG["routing"]:
        plan = plan_registration(regions, memory.kind_of)
        out["left_out"] = len(plan.left_out)
        out["classified"] = {k.value: sum(1 for *_, kk in plan.classified if kk is k) for k in MemoryKind}
        to_register = plan.register
    else:
        plan = None
        to_register = regions
    ptrs, lens = zip(*to_register)
    out["register_rc"] = engine.batch_register_memory(list(ptrs), list(lens))
    out["registered"] = len(to_register)
    return plan


def expected_receiver() -> list[torch.Tensor]:
    """Receiver buffers after the transfer: zeros except the transferred slots."""
    out = []
    for i in range(KV_BUFFERS):
        src, dst = pattern(10 + i, KV_PAGES * KV_ITEM), torch.zeros(KV_PAGES * KV_ITEM, dtype=torch.uint8)
        for s, d in KV_PAIRS:
            dst[d * KV_ITEM:(d + 1) * KV_ITEM] = src[s * KV_ITEM:(s + 1) * KV_ITEM]
        out.append(dst)
    for i, n in enumerate(AUX_ITEMS):
        src, dst = pattern(20 + i, AUX_SLOTS * n), torch.zeros(AUX_SLOTS * n, dtype=torch.uint8)
        s, d = AUX_PAIR
        dst[d * n:(d + 1) * n] = src[s * n:(s + 1) * n]
        out.append(dst)
    for i, n in enumerate(STATE_ITEMS):
        src, dst = pattern(30 + i, STATE_SLOTS * n), torch.zeros(STATE_SLOTS * n, dtype=torch.uint8)
        s, d = STATE_PAIR
        dst[d * n:(d + 1) * n] = src[s * n:(s + 1) * n]
        out.append(dst)
    return out


def transfer_blocks(src: Buffers, dst_addrs: list[int]):
    """(src, dst, len) blocks: KV pages, one aux slot per buffer, one state slot per entry."""
    blocks = []
    bufs = src.all()
    for i in range(KV_BUFFERS):
        for s, d in KV_PAIRS:
            blocks.append((bufs[i].data_ptr() + s * KV_ITEM, dst_addrs[i] + d * KV_ITEM, KV_ITEM))
    for j, n in enumerate(AUX_ITEMS):
        i = KV_BUFFERS + j
        s, d = AUX_PAIR
        blocks.append((bufs[i].data_ptr() + s * n, dst_addrs[i] + d * n, n))
    for j, n in enumerate(STATE_ITEMS):
        i = KV_BUFFERS + len(AUX_ITEMS) + j
        s, d = STATE_PAIR
        blocks.append((bufs[i].data_ptr() + s * n, dst_addrs[i] + d * n, n))
    return blocks


def run_receiver():
    out = {"role": "receiver", "nvlink_intra": nvlink_intra_reason()}
    if CFG["device"] == "cuda":
        torch.cuda.set_device(CFG["gpu"])
    bufs = Buffers(sender=False)
    memory = bufs.memory()
    out["memory_backend"] = getattr(memory, "backend", type(memory).__name__)
    engine = make_engine()
    register(engine, bufs, memory, out)
    rx = HostBlockReceiver(RegionTable(bufs.regions()), memory)
    listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
    ready = dict(out, session=f"127.0.0.1:{engine.get_rpc_port()}",
                 addrs=[t.data_ptr() for t in bufs.all()], side_port=listener.address[1])
    print("READY " + json.dumps(ready), flush=True)
    conn = listener.accept()
    other = 0
    while True:
        frames = conn.recv()
        if frames and frames[0] == b"DONE":
            break
        if is_host_block_message(frames):
            rx.handle(frames)
        else:
            other += 1
    if bufs.on_gpu:
        torch.cuda.synchronize()
    got = [t.cpu() for t in bufs.all()]
    names = [f"kv{i}" for i in range(KV_BUFFERS)] + [f"aux{i}" for i in range(len(AUX_ITEMS))] + [
        f"state{i}" for i in range(len(STATE_ITEMS))]
    out["mismatch"] = [n for n, g, e in zip(names, got, expected_receiver()) if not torch.equal(g, e)]
    out["host_messages_written"] = rx.messages_written
    out["host_messages_dropped"] = rx.messages_dropped
    out["other_messages"] = other
    conn.send(b"ok")
    return out


def run_sender(ready: dict):
    out = {"role": "sender", "nvlink_intra": nvlink_intra_reason()}
    if CFG["device"] == "cuda":
        torch.cuda.set_device(CFG["gpu"])
    bufs = Buffers(sender=True)
    memory = bufs.memory()
    out["memory_backend"] = getattr(memory, "backend", type(memory).__name__)
    engine = make_engine()
    plan = register(engine, bufs, memory, out)
    conn = Client(("127.0.0.1", ready["side_port"]), authkey=AUTHKEY)
    blocks = transfer_blocks(bufs, ready["addrs"])
    session = ready["session"]
    device_batches = []

    def send_device(device_blocks):
        device_batches.append(len(device_blocks))
        srcs, dsts, lens = zip(*device_blocks)
        return engine.batch_transfer_sync_write(session, list(srcs), list(dsts), list(lens))

    if CFG["routing"]:
        kinds = KindTable(plan.classified, memory.kind_of)
        router = TransferRouter(kinds, memory)
        t0 = time.perf_counter()
        out["route_rc"] = router.route(blocks, send_device,
                                       lambda: SideChannel(room=1, send=conn.send))
        out["route_s"] = time.perf_counter() - t0
    else:
        # Stock: the device-to-device KV blocks alone, straight to the engine.
        kv_only = [b for b in blocks if b[2] == KV_ITEM]
        out["device_rc"] = send_device(kv_only)
    out["device_blocks"] = sum(device_batches)
    out["host_blocks"] = len(blocks) - out["device_blocks"] if CFG["routing"] else 0
    conn.send([b"DONE"])
    out["receiver_ack"] = conn.recv() == b"ok"
    return out


if __name__ == "__main__":
    try:
        result = run_receiver() if ROLE == "receiver" else run_sender(json.loads(sys.argv[3]))
    except Exception as exc:
        traceback.print_exc()
        result = {"role": ROLE, "error": f"{type(exc).__name__}: {exc}"}
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
