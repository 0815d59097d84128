"""The mooncake_nvlink feature's patch-table entries: what each hook changes and why there.

Plain data; ``plugin.table`` assembles every feature's entries in one order.
"""

from __future__ import annotations

from sglang_dsv41.plugin.spec import Feature, HookKind, Patch, Role, roles

FEATURE = Feature(
    name="mooncake_nvlink",
    summary='keep intra-node NVLink for device memory, host blocks beside it',
    design_note="docs/design/mooncake_nvlink.md",
    remove_when="Mooncake's intra-node NVLink transport accepts host memory regions, or sglang stops registering host regions under it; every entry goes with it",
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        id="MC-NVL-REGIONS",
        group="mooncake_nvlink",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._registerable_regions",
        kind=HookKind.AFTER,
        hook="sglang_dsv41.mooncake_nvlink.hooks:after_registerable_regions",
        roles=roles(Role.SCHEDULER),
        reason="Under Mooncake's intra-node NVLink transport one host region fails the whole "
        "batch registration and every later transfer; register device regions only and log "
        "what was left out. Also builds the per-manager routing state used by MC-NVL-TRANSFER.",
        source="the original fork's disaggregation/mooncake/conn.py (_registerable_regions NVLink filter, "
        "_nvlink_intra_transport_active, _is_device_pointer)",
        signature="(self)",
        ast_sha="ae8f174a1cd8a137",
    ),
    Patch(
        id="MC-NVL-TRANSFER",
        group="mooncake_nvlink",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._transfer_data",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.mooncake_nvlink.hooks:around_transfer_data",
        roles=roles(Role.SCHEDULER),
        reason="The funnel of KV, state and aux sends: device-sourced blocks go to the engine, "
        "host-sourced ones as host-block frames on the decode endpoint's ordered zmq socket "
        "(found in transfer_infos), ahead of the completion status. Aux takes this path too, "
        "so send_aux needs no hook.",
        source="the original fork's disaggregation/mooncake/conn.py (_transfer_data split, _send_host_blocks_tcp, "
        "send_aux TCP routing)",
        signature="(self, mooncake_session_id, transfer_blocks)",
        ast_sha="1dfbc019c800fbb0",
    ),
    Patch(
        id="MC-NVL-AUX-RECV",
        group="mooncake_nvlink",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._handle_aux_data",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.mooncake_nvlink.hooks:around_handle_aux_data",
        roles=roles(Role.SCHEDULER),
        reason="Decode thread: host-block frames travel as AUX_DATA with a tag; write them only "
        "inside published regions with the exact declared length and for a room a request still "
        "waits for; drop and log anything else, failing a waiting room's request (it would wait "
        "for aux that never comes, or decode from stale aux or state); never let a bad frame stop "
        "the thread. Avoids replacing the start_decode_thread closure.",
        source="the original fork's disaggregation/mooncake/conn.py (STATE_DATA_HEADER, _handle_state_data, "
        "_host_transfer_regions)",
        signature="(self, msg: List[bytes])",
        ast_sha="be999ecf897db34a",
    ),
)
