"""The kernel-library stand-in really reports a call (what the server tests rely on)."""

from __future__ import annotations

import importlib.util

import pytest

from _e2e_server import KERNEL_CALLS_ENV, STAND_INS


def test_a_called_stand_in_kernel_raises_and_leaves_its_name(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "sgl_kernel_stand_in", STAND_INS / "sgl_kernel" / "__init__.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = tmp_path / "calls.log"
    monkeypatch.setenv(KERNEL_CALLS_ENV, str(calls))
    with pytest.raises(RuntimeError, match="assign_req_to_token_pool_cpu was called"):
        module.assign_req_to_token_pool_cpu(1, 2)
    assert calls.read_text().split()[1] == "assign_req_to_token_pool_cpu"
    assert not hasattr(module, "some_cuda_only_kernel")  # nothing beyond the named CPU kernels
