"""Every environment variable this package reads, with its default and meaning.

The README's "Runtime switches" table is generated from this list
(`sglang-dsv41 settings-doc`), and a test checks that the table is current and
that every variable name the package reads is listed here. Names come from the
modules that read them, so a rename cannot leave this list behind. Plain data:
importing this never imports sglang.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_dsv41.plugin.pin import ALLOW_DRIFT_ENV
from sglang_dsv41.cp_bcg.setting import ACCEPTANCE_TOLERANCE, CP_BCG_ENV, DSPARK_VERIFIED_ENV, MEASURING
from sglang_dsv41.mooncake_nvlink.kv_staging.setting import (
    DEFAULT_MIN_BLOCKS,
    MAX_MIN_BLOCKS,
    MIN_BLOCKS_ENV,
    REMOVED_SETTINGS,
    STAGING_ENV,
)
from sglang_dsv41.mooncake_nvlink.routing import NVLINK_INTRA_ENV_FLAGS, PROTOCOL_ENV
from sglang_dsv41.owner_broadcast.routing import ENV_MIN_SAVING, ENV_MODE, ENV_PER_IMAGE_COST


@dataclass(frozen=True)
class Setting:
    names: tuple[str, ...]
    default: str
    meaning: str


SETTINGS: tuple[Setting, ...] = (
    Setting(
        names=(ALLOW_DRIFT_ENV,),
        default="unset",
        meaning='`1`: run even when the installed sglang or a patched function differs from the pin: one loud warning per patch instead of exiting (for investigating an upgrade only)',
    ),
    Setting(
        names=(ENV_MODE,),
        default="guarded",
        meaning="vision owner-broadcast where the TP or CP group replicates work; each scheduler logs the decision once. Every image chunk is routed from its metadata, the same way on every rank: spans the group already holds (`known`), and chunks where sharing the encode would not save time (one image, tiny images, too little work to spread), run stock sglang's path; the rest go through the owner protocol, with its agreement. `guarded` (default; also `1`): an encoder failure on one rank in any chunk that encodes is the same error on every rank, naming the rank and phase, so no rank waits in a collective its peers never enter (sglang 0.5.23 ends a scheduler on any forward error, so the server still goes down, as stock does): stock-routed encodes run inside a status-only session (two status rounds, about +0.5 ms per such chunk on two H200s). Only `known` chunks run with no collective: a rank that lost a known span re-encodes it alone, and if that fails, it fails alone, as in stock sglang. `auto`: the same routes without the status-only session, for the last half millisecond: a rank whose encoder fails on any stock-routed chunk fails alone (its scheduler exits and the server goes down). `always`: every image chunk through the protocol (every chunk guarded by the agreement, known ones included, at a few status rounds each). `0`: off (every rank encodes every image, as stock sglang does)",
    ),
    Setting(
        names=(ENV_PER_IMAGE_COST, ENV_MIN_SAVING),
        default="4096, 4096",
        meaning="the `guarded`/`auto` routing's cost model, in ViT patches: an image costs its patches plus the per-image cost (default 4096); the protocol is taken when it takes at least the minimum saving (default 4096) off the busiest rank's encoder work; the protocol spreads the images over the ranks by the same cost, and sends an image some rank already holds from that rank's cache. Defaults come from the H200 runs in BENCHMARKS.md; a bad value stops the model build naming the variable",
    ),
    Setting(
        names=(*NVLINK_INTRA_ENV_FLAGS, PROTOCOL_ENV),
        default="unset (Mooncake's own default transport)",
        meaning="`MC_INTRANODE_NVLINK` or `MC_INTRA_NVLINK` set, or `MOONCAKE_PROTOCOL=nvlink_intra`: Mooncake's intra-node NVLink transport (read, not set, by this package): device memory is registered with the engine, host-resident blocks (aux, some state) travel on the ordered zmq side channel",
    ),
    Setting(
        names=(STAGING_ENV,),
        default="0",
        meaning="`peer`, on both the prefill and the decode servers, with Mooncake's intra-node NVLink transport: KV peer writes. A DeepSeek-V4.1 request's KV is hundreds of small blocks, each costing the engine a fixed time; instead the decode exports its engine-registered KV and state memory as CUDA IPC handles in its registration, and the prefill writes each KV or state send with one batched copy straight into the decode's pages (a request's last chunk, KV and state, as one copy), synchronized before the status that completes the request. No extra memory, nothing built or run on the decode. A map that cannot be opened (another host or IPC namespace) or one the decode's word does not fit (regions outside what its handles map) sends that decode's batches the direct way, counted in `sglang_dsv41_kv_staging_batches_total`; a failed peer write fails that request only. Without the intra-node NVLink transport it has no effect (one warning). `1` (slot staging) was removed; it and any value but unset/`0`/`peer` stop the server with one line when the plugin loads, before the model; a prefill that cannot set itself up (no Triton) stops when its transfer manager starts. A prefill probes each decode it maps every 2 s: one that stops answering (ended, restarted) is unmapped and counted failed with sglang. Design: docs/design/kv_staging.md. **Experimental**: measured with prefill and decode sharing one GPU (H200, then H100; BENCHMARKS.md)",
    ),
    Setting(
        names=(MIN_BLOCKS_ENV,),
        default=str(DEFAULT_MIN_BLOCKS),
        meaning=f"the fewest blocks (buffers x pages) a send needs to be peer-written at once (1..{MAX_MIN_BLOCKS}); smaller sends go the direct way. A request's held last sends are written whatever their size",
    ),
    Setting(
        names=REMOVED_SETTINGS,
        default="unset",
        meaning="slot staging's sizes; slot staging was removed, so any of them set stops the server with one line saying to unset it",
    ),
    Setting(
        names=(CP_BCG_ENV,),
        default="0",
        meaning="`1`: DeepSeek-V4 text prefill with interleave CP (`--enable-prefill-cp --cp-strategy interleave`, attention CP = TP, PP 1, no DP attention, EP 1 or TP, no decoder SWA bounded replay, no vision tower unless `--language-model-only`) runs in the breakable prefill CUDA graph instead of eagerly; the resolved `cuda_graph_config.prefill.backend` becomes `breakable` unless set explicitly. Unset or `0` (default): stock behaviour. Any other value stops the server at plugin load. **Unverified on GPU**: capture and replay have not run; until `sglang-dsv41 verify --features cp_bcg` (or `deploy/b300-build/verify-cp-bcg.sh MODEL_PATH [TP]`, the same check) has passed on a B300 node, keep it off in production. To report a run, attach its `verify-report.json` (tokens, acceptance lengths, TTFT ratio) and the stdout table together with the image tag and TP to an issue",
    ),
    Setting(
        names=(DSPARK_VERIFIED_ENV,),
        default="unset",
        meaning=f"With `{CP_BCG_ENV}=1`, a DSpark server whose CP prefill would run in the breakable graph refuses to start (one line) unless this holds the value `sglang-dsv41 verify --features cp_bcg` (`deploy/b300-build/verify-cp-bcg.sh`) prints after comparing the draft's acceptance length eager against graph (`<sglang release>:<eager>:<graph>`, passing when the graph's is at most {ACCEPTANCE_TOLERANCE:.0%} lower) on this sglang release. Greedy tokens cannot show a corrupted draft input (the target verifies every draft token); the acceptance length can. `{MEASURING}` is what verify's own opt-in server runs with, never a deployment",
    ),
    Setting(
        names=("SGLANG_PLUGINS",),
        default="unset (every installed plugin)",
        meaning="sglang's own plugin filter: it must include `dsv41` when set (`doctor` checks)",
    ),
)

BEGIN = "<!-- runtime-switches: generated by `sglang-dsv41 settings-doc`; edit python/sglang_dsv41/plugin/settings.py -->"
END = "<!-- runtime-switches: end -->"


def render_table() -> str:
    lines = [BEGIN, "", "| variable | default | effect |", "|---|---|---|"]
    for setting in SETTINGS:
        names = ", ".join(f"`{n}`" for n in setting.names)
        lines.append(f"| {names} | {setting.default} | {setting.meaning} |")
    lines += ["", END]
    return "\n".join(lines)


def replace_table(readme_text: str) -> str:
    """The README text with its generated table replaced by the current one."""
    if BEGIN not in readme_text or END not in readme_text:
        raise ValueError("it has no generated runtime-switches table (the begin and end markers)")
    start, end = readme_text.index(BEGIN), readme_text.index(END) + len(END)
    return readme_text[:start] + render_table() + readme_text[end:]
