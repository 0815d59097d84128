"""A patched upstream module that fails to import: the refusal names the real error.

Here the CPU engine's kernel library fails to import (a stand-in ``sgl_kernel``
on PYTHONPATH that raises ImportError, as the CUDA-only wheel does on a machine
without a GPU driver), so ``sglang.srt.models.deepseek_v4`` and other patched
modules cannot be imported. The process must stop naming the patch, the module
and that ImportError, not a missing attribute of the parent package.
"""

from __future__ import annotations

import pytest

from conftest import run_python

pytestmark = pytest.mark.timeout(600)

BROKEN_KERNEL = "stand-in sgl_kernel: common_ops library missing on this test machine"

LOAD = """
from sglang.srt.plugins import load_plugins
try:
    load_plugins()
except SystemExit as exc:
    print("REFUSED", exc)
else:
    print("LOADED")
from sglang_dsv41.loader import UpstreamImportError, resolve_upstream
try:
    resolve_upstream("sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM")
except UpstreamImportError as exc:
    print("RESOLVE", exc)
"""


@pytest.fixture
def broken_kernel_path(tmp_path):
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"raise ImportError({BROKEN_KERNEL!r})\n")
    return tmp_path


def test_refusal_names_the_import_error_not_an_attribute(broken_kernel_path):
    import os

    path = os.pathsep.join(p for p in (str(broken_kernel_path), os.environ.get("PYTHONPATH")) if p)
    proc = run_python(LOAD, env={"PYTHONPATH": path, "SGLANG_USE_CPU_ENGINE": "1"}, timeout=500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "LOADED" not in proc.stdout
    refused = next(l for l in proc.stdout.splitlines() if l.startswith("REFUSED"))
    assert "refusing to start" in refused
    assert "patch VCP-PREPARE (sglang.srt.models.deepseek_v4." in proc.stdout
    assert f"cannot import sglang.srt.models.deepseek_v4: ImportError: {BROKEN_KERNEL}" in proc.stdout
    assert "has no attribute" not in out
    resolved = next(l for l in proc.stdout.splitlines() if l.startswith("RESOLVE"))
    assert f"cannot import sglang.srt.models.deepseek_v4: ImportError: {BROKEN_KERNEL}" in resolved
