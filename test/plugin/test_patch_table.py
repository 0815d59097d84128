"""The patch table is the single list of patches, and it matches installed sglang 0.5.23."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

import sglang_dsv41
from conftest import REPO_ROOT
from sglang_dsv41.plugin import drift
from sglang_dsv41.plugin.spec import HookKind
from sglang_dsv41.plugin.table import FEATURES, PATCHES
from sglang_dsv41.tools.docs import render


def test_ids_are_unique_and_entries_complete():
    ids = [p.id for p in PATCHES]
    assert len(ids) == len(set(ids))
    for p in PATCHES:
        assert re.fullmatch(r"[A-Z]+(-[A-Z0-9]+)+", p.id), p.id
        assert p.roles, p.id
        assert p.reason.strip() and p.source.strip() and p.group.strip(), p.id
        assert re.fullmatch(r"[0-9a-f]{16}", p.ast_sha), f"{p.id}: fingerprint not generated"


def test_every_hook_module_is_in_the_table_and_every_hook_resolves():
    named = {p.hook_module() for p in PATCHES}
    on_disk = {
        m.name for m in pkgutil.walk_packages(sglang_dsv41.__path__, "sglang_dsv41.")
        if not m.ispkg and m.name.rsplit(".", 1)[1].startswith("hooks")
    }
    assert on_disk - named == set(), "hook modules with no patch-table entry"
    for p in PATCHES:
        fn = getattr(importlib.import_module(p.hook_module()), p.hook_name())
        assert callable(fn), p.id


# The registration order before the table was split by feature: hooks on one
# function (DeepseekV4ForCausalLM.__init__: VCP-BUILD then OWN-GROUP) nest by it.
ORDER = (
    ("ACT-SCHED", "before", "sglang.srt.managers.scheduler.Scheduler.__init__"),
    ("ACT-TOKENIZER", "before", "sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__"),
    ("ACT-ROUTER", "before", "sglang.srt.managers.multi_tokenizer_mixin.MultiTokenizerRouter.__init__"),
    ("ACT-DETOK", "before", "sglang.srt.managers.detokenizer_manager.DetokenizerManager.__init__"),
    ("ACT-DPC", "before", "sglang.srt.managers.data_parallel_controller.DataParallelController.__init__"),
    ("ACT-DTR-VERIFY", "before", "sglang.srt.managers.multi_tokenizer_mixin.MultiDetokenizerRouter.__init__"),
    ("ACT-DTR-START", "around", "sglang.srt.entrypoints.engine.Engine._launch_detokenizer_subprocesses"),
    ("VCP-ARGS", "before", "sglang.srt.arg_groups.deepseek_v4_hook.validate_deepseek_v41_features"),
    ("VCP-BUILD", "around", "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.__init__"),
    ("VCP-PREPARE", "new_attribute", "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.prepare_model_inputs"),
    ("VCP-RUNNER", "replace", "sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_extend_cp"),
    ("OWN-GROUP", "after", "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.__init__"),
    ("OWN-FENCE", "around", "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.prepare_language_model_inputs"),
    ("OWN-ADMIT", "after", "sglang.srt.managers.schedule_batch.Req.extend_image_inputs"),
    ("OWN-TEXT-EMBED", "replace", "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM._prepare_mm_embeddings"),
    ("OWN-ENCODE", "around", "sglang.srt.managers.mm_schedule._batch_encode_per_image_misses"),
    ("MC-NVL-REGIONS", "after", "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._registerable_regions"),
    ("MC-NVL-TRANSFER", "around", "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._transfer_data"),
    ("MC-NVL-AUX-RECV", "around", "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._handle_aux_data"),
    ("MC-KVS-MAP-SEND", "around", "sglang.srt.disaggregation.common.conn.CommonKVReceiver._send_bootstrap_message"),
    ("MC-KVS-MAP-READ", "around", "sglang.srt.disaggregation.mooncake.conn.KVArgsRegisterInfo.from_zmq"),
    ("MC-KVS-PAGES", "around", "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_kvcache_generic"),
    ("MC-KVS-WORKER", "around", "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.transfer_worker"),
    ("MC-KVS-STATE", "around", "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.maybe_send_extra"),
    ("MC-KVS-CONCLUDE", "around", "sglang.srt.disaggregation.common.conn.CommonKVManager.conclude_transfer"),
    ("MC-KVS-TEARDOWN", "after", "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.teardown"),
    ("PDH-PAIRING", "around", "sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info"),
    ("PDH-REFUSAL", "around", "sglang.srt.disaggregation.decode.DecodePreallocQueue._ensure_prefill_info"),
    ("PDR-RECOMPUTE-RANK", "before", "sglang.srt.disaggregation.decode.DecodePreallocQueue._submit_prefill_recompute"),
    ("PDR-ABORT-REASON", "after", "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode"),
    ("EMB-ADMIT", "before", "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"),
    ("EMB-BATCH-GEN", "before", "sglang.srt.managers.io_struct.GenerateReqInput._get_positional_embed_overrides_item"),
    ("EMB-BATCH-EMB", "before", "sglang.srt.managers.io_struct.EmbeddingReqInput._get_positional_embed_overrides_item"),
    ("EMB-CAN-SHARE", "new_attribute", "sglang.srt.managers.schedule_policy.PrefillAdder.can_share_extend_batch"),
    ("EMB-ADD-ONE", "around", "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"),
    ("EMB-PREEMPT", "around", "sglang.srt.managers.schedule_policy.PrefillAdder.preempt_to_schedule"),
    ("EMB-INTAKE", "before", "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"),
    ("EMB-LOOKUP", "before", "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs"),
    ("GUARD-LAUNCH", "resolution", "sglang.srt.arg_groups.model_hook.handle_model_capability_adjustments"),
    ("CPBCG-GATE", "around", "sglang.srt.layers.cp.bcg.supports_prefill_cp_bcg"),
    ("CPBCG-INPUT", "around", "sglang.srt.layers.cp.bcg.get_cp_bcg_input_type"),
    ("CPBCG-ENGRAM", "around", "sglang.srt.layers.engram.EngramHasher.forward"),
)


def test_assembled_table_keeps_the_registration_order_entry_by_entry():
    assert [(p.id, p.kind.value, p.target) for p in PATCHES] == list(ORDER)


def test_each_feature_states_its_record_once_and_owns_its_entries():
    names = [f.name for f in FEATURES]
    assert len(names) == len(set(names))
    for p in PATCHES:
        assert p.group in names, p.id
        feature = next(f for f in FEATURES if f.name == p.group)
        package = "mooncake_nvlink.kv_staging" if p.group == "kv_staging" else p.group
        assert p.hook_module().startswith(f"sglang_dsv41.{package}."), (p.id, p.hook)
        assert feature.remove_when_of(p).strip(), f"{p.id}: no remove-when, here or in its feature"
    for f in FEATURES:
        assert f.summary.strip() and f.remove_when.strip(), f.name
        if f.design_note:
            assert (REPO_ROOT / "docs" / "design" / f"{f.name}.md").is_file(), f.name


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.id)
def test_fingerprint_matches_installed_sglang(patch):
    assert drift.patch_problems(patch) == []


def test_installed_sglang_is_the_pinned_release():
    assert drift.version_problem() is None


def test_patches_md_is_generated_from_the_table():
    on_disk = (REPO_ROOT / "docs" / "PATCHES.md").read_text()
    assert on_disk == render(), "docs/PATCHES.md is stale: run `make patches-doc`"
    for p in PATCHES:
        assert f"## {p.id}" in on_disk


def test_new_attribute_that_upstream_defines_is_refused():
    from sglang_dsv41.plugin.spec import Patch, Role
    from sglang_dsv41.plugin import fingerprint as fp

    owner = "sglang.srt.managers.scheduler.Scheduler"
    got = fp.fingerprint(owner)
    shadowing = Patch(
        id="TEST-SHADOW", group="test", target=f"{owner}.get_next_batch_to_run",
        kind=HookKind.NEW_ATTRIBUTE, hook="x:y", roles=frozenset({Role.SCHEDULER}),
        reason="r", source="s", signature=got.signature, ast_sha=got.ast_sha,
    )
    problems = drift.patch_problems(shadowing)
    assert any("would shadow" in p.message for p in problems)


def test_after_hook_on_async_target_is_refused():
    from sglang_dsv41.plugin.spec import Patch, Role
    from sglang_dsv41.plugin import fingerprint as fp

    target = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
    got = fp.fingerprint(target)
    patch = Patch(
        id="TEST-ASYNC", group="test", target=target, kind=HookKind.AFTER, hook="x:y",
        roles=frozenset({Role.LAUNCHER}), reason="r", source="s",
        signature=got.signature, ast_sha=got.ast_sha,
    )
    assert any("async" in p.message for p in drift.patch_problems(patch))


def test_fingerprint_ignores_docstrings_but_not_code(tmp_path):
    import ast
    from sglang_dsv41.plugin.fingerprint import fingerprint_node

    a = ast.parse('def f(x):\n    """doc"""\n    return x + 1\n').body[0]
    b = ast.parse('def f(x):\n    """other doc"""\n\n    return (x + 1)\n').body[0]
    c = ast.parse('def f(x):\n    return x + 2\n').body[0]
    assert fingerprint_node(a) == fingerprint_node(b)
    assert fingerprint_node(a).ast_sha != fingerprint_node(c).ast_sha
