"""A DeepSeek-V4 PD retraction on a decode bound to one of two prefill DP ranks, as plain data.

Run in a fresh interpreter after ``load_plugins()`` (or with the plugin left out).
Everything is sglang 0.5.23's own code on 127.0.0.1: the bootstrap server, two
prefill DP ranks registering through ``CommonKVManager.__init__``, the prefill
``CommonKVSender`` that records a room's DP rank, the decode's
``DecodePreallocQueue.add`` (a retraction on a DeepSeek-V4 pool turning into a
rebootstrap), ``_resolve_pending_reqs`` and ``CommonKVReceiver.init`` (bound to
the rank the room was recorded with), ``_send_kv_metadata`` (which sends the
recompute under the ``early`` policy) and ``submit_prefill_recompute`` (its HTTP
POST), then the prefill ``DataParallelController``'s dispatch function for the
configured balancing method.

Stood in for: the prefill's HTTP server (a local server that records the
``/generate`` body; the prefill turns it into ``GenerateReqInput`` and the
tokenized request as sglang does), the prefill schedulers (zmq PULL sockets
behind the controller's PUSH sockets), the backend's wire format of the decode's
two messages (``CommonKVManager`` leaves it to Mooncake/NIXL), and the GPU KV pool
(a ``DeepSeekV4TokenToKVPool`` without buffers: only its type is read).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
import time
from array import array
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import requests
import torch
import zmq

from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVSender,
)
from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    ReqToMetadataIdxAllocator,
    TransferBackend,
)
from sglang.srt.managers.data_parallel_controller import (
    DataParallelController,
    DPBudget,
    LoadBalanceMethod,
)
from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams

METHODS = ("round_robin", "total_requests", "total_tokens", "follow_bootstrap_room")
PREFILL_DP = 2
PAGE_SIZE = 64
_rooms = itertools.count(4242)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefillHttp:
    """Stands in for the prefill's HTTP server: records each ``/generate`` body."""

    def __init__(self):
        bodies = self.bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers["Content-Length"])
                bodies.append((self.path, json.loads(self.rfile.read(length))))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def bootstrap_server():
    port = free_port()
    server = CommonKVBootstrapServer("127.0.0.1", port)
    addr = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            if requests.get(f"http://{addr}/health", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"bootstrap server on {addr} did not come up")
        time.sleep(0.02)
    try:
        yield server, port
    finally:
        loop = server._loop
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in list(server._background_tasks)])
        time.sleep(0.1)
        server.close()


def kv_args(engine_rank: int) -> KVArgs:
    """A DeepSeek-V4-shaped description of the KV pool (no buffers are touched)."""
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = [], [], [576]
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
    args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], []
    args.state_types, args.state_layer_ids, args.kv_layer_ids = [], [], [0]
    args.mla_compression_ratios = [0]
    args.kv_cache_dtype_str = "fp8_e4m3"
    args.kv_layout = None
    args.page_size = PAGE_SIZE
    args.engine_rank = engine_rank
    args.system_dp_rank = 0
    args.pp_rank = 0
    args.rust_http_port = None
    args.is_hybrid_mla_backend = False
    return args


def server_args(mode: str, method: str, *, bootstrap_port: int = 0, http_port: int = 30000):
    dp = PREFILL_DP if mode == "prefill" else 1
    fields = dict(
        tp_size=dp, attn_cp_size=1, attn_dp_size=dp, dp_size=1, host="127.0.0.1",
        port=http_port, disaggregation_mode=mode, load_balance_method=method,
        disaggregation_decode_allocation_policy="early",
    )
    if bootstrap_port:
        fields["disaggregation_bootstrap_port"] = bootstrap_port
    return get_context().override_server_args(**fields)


def prefill_controller(method: str, pulls: list) -> DataParallelController:
    """The prefill DP controller's dispatch state (its __init__ would spawn the schedulers)."""
    ctx = zmq.Context.instance()
    dpc = DataParallelController.__new__(DataParallelController)
    dpc.load_balance_method = LoadBalanceMethod.from_str(method)
    dpc.workers, dpc._active_workers = [], list(range(PREFILL_DP))
    dpc.status = [True] * PREFILL_DP
    dpc.round_robin_counter = 0
    dpc.dp_budget = DPBudget(PREFILL_DP)
    for rank in range(PREFILL_DP):
        name = f"inproc://prefill-dp-{method}-{rank}"
        pull = ctx.socket(zmq.PULL)
        pull.bind(name)
        push = ctx.socket(zmq.PUSH)
        push.connect(name)
        pulls.append(pull)
        dpc.workers.append(push)
    # The same choice __init__ makes from --load-balance-method.
    dpc.dispatching = getattr(dpc, f"{method}_scheduler")
    return dpc


def tokenized(obj: GenerateReqInput) -> TokenizedGenerateReqInput:
    """The tokenized request the prefill's TokenizerManager builds from ``obj``."""
    params = SamplingParams(**obj.sampling_params)
    return TokenizedGenerateReqInput(
        input_text=None, input_ids=array("q", obj.input_ids), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=params,
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
        token_ids_logprob=None, stream=False, rid=obj.rid,
        bootstrap_host=obj.bootstrap_host, bootstrap_port=obj.bootstrap_port,
        bootstrap_room=obj.bootstrap_room, routed_dp_rank=obj.routed_dp_rank,
        disagg_prefill_dp_rank=obj.disagg_prefill_dp_rank,
    )


def landed_on(dpc, pulls, tok) -> int:
    dpc.dispatching(tok)
    landed = [rank for rank, pull in enumerate(pulls) if pull.poll(500)]
    for pull in pulls:
        while pull.poll(0):
            pull.recv()
    assert len(landed) == 1, landed
    return landed[0]


def drained_messages(managers) -> dict:
    """Prefill DP rank -> the decode messages its rank socket received."""
    out = {}
    for dp, manager in managers.items():
        got = []
        while manager.server_socket.poll(200):
            got.append(manager.server_socket.recv_multipart()[0].decode())
        out[dp] = got
    return out


def decode_queue(manager) -> DecodePreallocQueue:
    """The decode's preallocation queue: its state for add, pending resolution and metadata."""
    allocator = PagedTokenToKVPoolAllocator.__new__(PagedTokenToKVPoolAllocator)
    allocator._kvcache = DeepSeekV4TokenToKVPool.__new__(DeepSeekV4TokenToKVPool)
    allocator.page_size = PAGE_SIZE
    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
    queue.token_to_kv_pool_allocator = allocator
    queue.scheduler = Scheduler.__new__(Scheduler)
    queue.scheduler.enable_hisparse = False
    queue.token_to_kv_pool = allocator._kvcache
    queue.num_reserved_decode_tokens = 0
    queue.max_total_num_tokens = 1 << 20
    queue.transfer_backend = TransferBackend.MOONCAKE
    queue.kv_manager = manager
    queue.queue, queue.pending_reqs, queue.retracted_queue = [], [], []
    queue._prefill_dp_rank_queries = {}
    queue._ensure_last_attempt_time, queue._ensure_retry_count = {}, {}
    queue._ensure_retry_interval, queue._max_ensure_retries = 0.0, 3
    queue.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(4)
    queue.transfer_queue = DecodeTransferQueue.__new__(DecodeTransferQueue)
    queue.transfer_queue.enable_staging = False
    queue._num_published_destinations = 0
    return queue


def backend_wire_format(manager) -> None:
    """The decode's two backend messages, reduced to their kind and room."""
    manager.build_receiver_registration_message = lambda: [b"register"]
    manager.build_receiver_metadata_message = lambda **kw: [b"metadata", str(kw["bootstrap_room"]).encode()]


def run(method: str) -> dict:
    out = {"method": method}
    http = PrefillHttp()
    pulls: list = []
    try:
        with bootstrap_server() as (_, bport):
            addr = f"127.0.0.1:{bport}"
            dpc = prefill_controller(method, pulls)
            prefill = {}
            with server_args("prefill", method, bootstrap_port=bport, http_port=http.port):
                for dp in range(PREFILL_DP):
                    with get_parallel().override(attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=dp,
                                                 attn_dcp_rank=0, pp_group=None):
                        prefill[dp] = CommonKVManager(kv_args(0), DisaggregationMode.PREFILL,
                                                      get_context().server_args, True)
            room = next(_rooms)
            prompt = list(range(1, 200))
            original = GenerateReqInput(input_ids=prompt, sampling_params={"max_new_tokens": 32},
                                        rid=f"req-{method}", bootstrap_host="127.0.0.1",
                                        bootstrap_port=bport, bootstrap_room=room)

            def prefill_admits(tok) -> int:
                """The controller dispatches ``tok``; that rank's sender records the room."""
                rank = landed_on(dpc, pulls, tok)
                with server_args("prefill", method, bootstrap_port=bport, http_port=http.port), \
                        get_parallel().override(attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=rank,
                                                attn_dcp_rank=0, pp_group=None):
                    CommonKVSender(prefill[rank], addr, tok.bootstrap_room,
                                   req_has_disagg_prefill_dp_rank=tok.disagg_prefill_dp_rank is not None)
                return rank

            out["original_rank"] = prefill_admits(tokenized(original))

            with server_args("decode", method):
                with get_parallel().override(attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0,
                                             attn_dcp_rank=0, pp_group=None):
                    manager = CommonKVManager(kv_args(0), DisaggregationMode.DECODE,
                                              get_context().server_args, True)
                backend_wire_format(manager)
                queue = decode_queue(manager)
                req = Req(rid=original.rid, origin_input_text="", origin_input_ids=array("q", prompt),
                          sampling_params=SamplingParams(max_new_tokens=32),
                          bootstrap_host="127.0.0.1", bootstrap_port=bport, bootstrap_room=room)
                req.output_ids.extend([7, 8, 9])
                drained_messages(prefill)
                # The scheduler's retraction under memory pressure hands the request back here.
                queue.add(req, is_retracted=True)
                out["rebootstrap"] = bool(queue.queue and queue.queue[0].is_rebootstrap)
                for _ in range(50):
                    queue._resolve_pending_reqs()
                    if not queue.pending_reqs:
                        break
                    time.sleep(0.05)
                decode_req = queue.queue[0]
                receiver = decode_req.kv_receiver
                out["receiver_rank"] = getattr(receiver, "prefill_dp_rank", None)
                queue._send_kv_metadata(decode_req, torch.arange(0, 4 * PAGE_SIZE), PAGE_SIZE)
                manager._prefill_recompute_executor.shutdown(wait=True)
                out["decode_messages"] = drained_messages(prefill)
            (path, body), = http.bodies
            out["recompute_path"] = path
            out["routed_dp_rank"] = body["routed_dp_rank"]
            out["recompute_rank"] = prefill_admits(tokenized(GenerateReqInput(**body)))
            entry = requests.post(f"http://{addr}/query_dp_ranks",
                                  json={"bootstrap_rooms": [room]}, timeout=5).json()
            out["room_entry"] = entry.get(str(room))
            for m in prefill.values():
                m.server_socket.close(linger=0)
            manager.server_socket.close(linger=0)
    finally:
        http.close()
        for p in pulls:
            p.close(linger=0)
    return out


def run_all() -> dict:
    hooked = hasattr(DecodePreallocQueue._submit_prefill_recompute, "__wrapped__")
    return {"hooked": hooked, "runs": [run(method) for method in METHODS]}
