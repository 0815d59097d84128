"""Test-only stand-in for the CPU build of ``sgl_kernel`` (a hardware kernel library).

The PyPI ``sglang-kernel`` wheel is CUDA-only and fails to import on a CPU
machine, while sglang 0.5.23's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports
these CPU-only names from it when its modules load. The e2e server gets this
module first on PYTHONPATH. None of these kernels may run with ``torch_native``
attention and pytorch sampling on a CPU without the AMX kernel ops; every call
appends its name to the file named by ``SGLANG_DSV41_E2E_KERNEL_CALLS`` and
raises, and the tests fail when that file exists.
"""

import os

CALL_LOG_ENV = "SGLANG_DSV41_E2E_KERNEL_CALLS"


def _must_not_run(name):
    def kernel(*args, **kwargs):
        path = os.environ.get(CALL_LOG_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as log:
                log.write(f"{os.getpid()} {name}\n")
        raise RuntimeError(f"sgl_kernel stand-in: {name} was called; the e2e test expects no kernel call")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


# Exactly the names sglang 0.5.23 imports from sgl_kernel when the CPU engine
# serves a Llama (found by recording every attribute looked up on the module).
for _name in (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rmsnorm",
    "verify_tree_greedy_cpu",
):
    globals()[_name] = _must_not_run(_name)
del _name
