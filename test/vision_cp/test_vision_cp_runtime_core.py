"""sglang_dsv41.vision_cp.runtime on its own (no sglang import): the platform
rule, the single-rank CP view and the scoped lift around a constructor."""

from __future__ import annotations

import types
from types import SimpleNamespace

import pytest

from sglang_dsv41.vision_cp.runtime import (
    CPGuardLift,
    SingleRankCPView,
    VisionCPBuildRefused,
    builds_vision_tower,
    check_vision_cp_platform,
)


def test_only_cuda_interleave_runs_vision_under_cp():
    check_vision_cp_platform(attn_cp_size=4, is_cuda=True, is_npu=False, strategy="interleave")
    for size in (0, 1):  # no CP: nothing to refuse, whatever the platform
        check_vision_cp_platform(attn_cp_size=size, is_cuda=False, is_npu=True, strategy="zigzag")
    refused = [
        (dict(is_cuda=True, is_npu=False, strategy="zigzag"), "platform=cuda, cp strategy=zigzag"),
        (dict(is_cuda=False, is_npu=True, strategy="interleave"), "platform=npu, cp strategy=interleave"),
        (dict(is_cuda=False, is_npu=False, strategy="interleave"), "platform=non-cuda"),
        (dict(is_cuda=True, is_npu=False, strategy="none"), "cp strategy=none"),
    ]
    for kwargs, detail in refused:
        with pytest.raises(VisionCPBuildRefused, match="requires CUDA and the interleave") as err:
            check_vision_cp_platform(attn_cp_size=2, **kwargs)
        assert detail in str(err.value) and "attention CP size=2" in str(err.value)
        assert isinstance(err.value, ValueError)


def test_vision_tower_condition_matches_sglangs():
    v41 = dict(model_type="deepseek_v41", vision_n_layers=2)
    assert builds_vision_tower(SimpleNamespace(**v41))
    assert not builds_vision_tower(SimpleNamespace(**v41, language_model_only=True))
    assert not builds_vision_tower(SimpleNamespace(model_type="deepseek_v41", vision_n_layers=0))
    assert not builds_vision_tower(SimpleNamespace(model_type="deepseek_v4", vision_n_layers=2))


def test_single_rank_view_changes_only_the_cp_width():
    real = SimpleNamespace(attn_cp_size=4, tp_size=4, pp_group=SimpleNamespace(world_size=1))
    view = SingleRankCPView(real)
    assert view.attn_cp_size == 1
    assert view.tp_size == 4 and view.pp_group is real.pp_group
    with pytest.raises(AttributeError):
        view.missing_name
    with pytest.raises(AttributeError, match="read-only"):
        view.tp_size = 1
    assert real.attn_cp_size == 4


def _model_module():
    module = types.ModuleType("fake_model_module")
    real_parallel = SimpleNamespace(attn_cp_size=2, tp_size=2)
    module.get_parallel = lambda: real_parallel
    module.ViT = lambda args: ("tower", args, module.get_parallel().attn_cp_size)
    return module


def _constructor(module, fail_before_tower=False):
    """Reads the CP width like sglang's guard, then builds the tower like sglang."""
    seen = {"guard": module.get_parallel().attn_cp_size}
    if fail_before_tower:
        raise ValueError("refused before the tower")
    seen["tower"] = module.ViT("args")
    seen["after"] = module.get_parallel().attn_cp_size
    return seen


def test_lift_covers_the_guard_and_ends_before_the_tower():
    module = _model_module()
    originals = (module.get_parallel, module.ViT)
    checks = []
    with CPGuardLift(module, tower_name="ViT", check=lambda: checks.append("checked")) as lift:
        assert lift.active
        seen = _constructor(module)
    assert seen == {"guard": 1, "tower": ("tower", "args", 2), "after": 2}
    assert checks == ["checked"] and lift.tower_built and not lift.active
    assert (module.get_parallel, module.ViT) == originals


def test_refused_check_builds_no_tower_and_restores_the_module():
    module = _model_module()
    originals = (module.get_parallel, module.ViT)

    def refuse():
        raise VisionCPBuildRefused("no")

    with pytest.raises(VisionCPBuildRefused):
        with CPGuardLift(module, tower_name="ViT", check=refuse) as lift:
            _constructor(module)
    assert not lift.tower_built
    assert (module.get_parallel, module.ViT) == originals


def test_failure_before_the_tower_restores_the_module():
    module = _model_module()
    originals = (module.get_parallel, module.ViT)
    with pytest.raises(ValueError, match="refused before the tower"):
        with CPGuardLift(module, tower_name="ViT", check=lambda: None) as lift:
            _constructor(module, fail_before_tower=True)
    assert not lift.tower_built
    assert (module.get_parallel, module.ViT) == originals
