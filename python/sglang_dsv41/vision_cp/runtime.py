"""DeepSeek-V4.1 vision under prefill context parallelism: model-build rules and the
scoped view that lets sglang's constructor build the vision tower under CP.

Why a scoped view: sglang 0.5.23 refuses to build the V4.1 vision tower whenever
attention CP is wider than one rank, in the middle of a long constructor. The
eager CP runner of this package merges image features on the full extend layout
before the shard, which makes CP safe for the CUDA interleave strategy. Instead
of copying the constructor, the adapter lets that single guard read a CP width
of one; every other read (and every other check of the constructor) sees the
real values, and the view ends before the vision tower itself is built. The
rebinding is of module globals, for the duration of one constructor call; model
construction runs on one thread of the scheduler process.

Plain Python: nothing here imports sglang.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

V41_MODEL_TYPE = "deepseek_v41"
INTERLEAVE = "interleave"


class VisionCPBuildRefused(ValueError):
    """The platform or CP strategy cannot run V4.1 vision under context parallelism."""


def builds_vision_tower(config: Any) -> bool:
    """Whether sglang builds the V4.1 vision tower for ``config`` (its own condition)."""
    return (
        getattr(config, "model_type", None) == V41_MODEL_TYPE
        and int(getattr(config, "vision_n_layers", 0) or 0) > 0
        and not getattr(config, "language_model_only", False)
    )


def check_vision_cp_platform(*, attn_cp_size: int, is_cuda: bool, is_npu: bool,
                             strategy: str) -> None:
    """Refuse V4.1 vision under CP anywhere but CUDA with the interleave strategy.

    ``strategy`` is the lower-case name of the process's CP strategy ("interleave",
    "zigzag" or "none" when no prefill CP strategy is bound).
    """
    if attn_cp_size <= 1:
        return
    if is_cuda and not is_npu and strategy == INTERLEAVE:
        return
    platform = "npu" if is_npu else ("cuda" if is_cuda else "non-cuda")
    raise VisionCPBuildRefused(
        "DeepSeek-V4.1 vision with context parallelism requires CUDA and the "
        f"interleave CP strategy (--cp-strategy interleave); got platform={platform}, "
        f"cp strategy={strategy}, attention CP size={attn_cp_size}. NPU and zigzag "
        "CP are not supported; serve text only with --language-model-only or drop CP."
    )


class SingleRankCPView:
    """Read-through view of a parallel context that reports attention CP width 1."""

    __slots__ = ("_real",)

    def __init__(self, real: Any) -> None:
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name: str) -> Any:
        if name == "attn_cp_size":
            return 1
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the single-rank CP view is read-only")


class CPGuardLift:
    """Rebinds ``module.get_parallel`` to a single-rank-CP view until the vision
    tower class is about to be instantiated, then restores the module and checks
    the platform. Used as a context manager around the model constructor.

    ``tower_name`` is the module global the constructor calls to build the tower;
    ``check`` runs (with the real bindings restored) right before the tower is built.
    """

    def __init__(self, module: ModuleType, *, tower_name: str,
                 check: Callable[[], None]) -> None:
        self._module = module
        self._tower_name = tower_name
        self._check = check
        self._saved: dict[str, Any] = {}
        self.tower_built = False

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def _restore(self) -> None:
        for name, value in self._saved.items():
            setattr(self._module, name, value)
        self._saved.clear()

    def _build_tower(self, *args, **kwargs):
        real_tower = self._saved[self._tower_name]
        self._restore()
        self._check()
        self.tower_built = True
        return real_tower(*args, **kwargs)

    def __enter__(self) -> "CPGuardLift":
        module = self._module
        real_get_parallel = module.get_parallel
        self._saved = {
            "get_parallel": real_get_parallel,
            self._tower_name: getattr(module, self._tower_name),
        }
        module.get_parallel = lambda: SingleRankCPView(real_get_parallel())
        setattr(module, self._tower_name, self._build_tower)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()
