"""The launch_guards feature's patch-table entries: what each hook changes and why there.

Plain data; ``plugin.table`` assembles every feature's entries in one order.
"""

from __future__ import annotations

from sglang_dsv41.plugin.spec import Feature, HookKind, Patch, Role, roles

FEATURE = Feature(
    name="launch_guards",
    summary='`sglang serve` never lands in a known-crash layout',
    remove_when="sglang's own validation refuses these layouts, or a GPU re-test on the pinned release shows they no longer crash",
    design_note="docs/design/launch_guards.md",
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        id="GUARD-LAUNCH",
        group="launch_guards",
        target="sglang.srt.arg_groups.model_hook.handle_model_capability_adjustments",
        kind=HookKind.RESOLUTION,
        hook="sglang_dsv41.launch_guards.hooks:guard_resolved_layout",
        roles=roles(Role.LAUNCHER),
        reason="The known-crash rules of launch_guards/rules.py (the same rules `plan` "
        "reports) applied in the launcher's argument resolution, before any process starts. "
        "Decoder SWA bounded replay that sglang turned on by default for DSpark with DP "
        "attention (it never does under prefill CP) is turned off with one log line; the same layout with "
        "--enable-decoder-swa-bounded-replay given explicitly, and an explicit prefill CUDA "
        "graph under DeepSeek-V4 prefill CP that would be captured and never replayed (unless "
        "SGLANG_DSV41_CP_BCG=1), stop the launcher with one line naming the flags; so does DSpark "
        "under that opt-in's CP breakable prefill graph until verify-cp-bcg.sh has compared the "
        "draft's acceptance length eager against graph (SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED). "
        "The verdict and the launcher's patch count are left on the server's arguments for the "
        "schedulers to publish. A wrapper "
        "of this resolution step, the model-capability step: it runs after every step that "
        "decides what the rules read, and sglang's replay default has no step of its own.",
        source="the original fork's compose field notes (cp4 + dspark + replay; dp + dspark + "
        "replay); upstream model_runner._prefill_cuda_graph_allows_context_parallel",
        signature="(server_args: Any)",
        ast_sha="2e15e28db8c51606",
    ),
)
