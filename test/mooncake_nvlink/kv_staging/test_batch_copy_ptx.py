"""The parameter-table kernel's PTX, assembled on the CPU with the ptxas Triton ships.

No GPU here: what runs is NVIDIA's own assembler for the GPUs our users run
(H200: sm_90, B200: sm_100, B300: sm_103 with the Blackwell assembler when
present). It must accept every entry, and the table must stay a kernel
parameter read in place: no stack frame, no local-memory copy of it (what an
assembler does with a parameter whose address escapes). The copies themselves
are checked byte by byte on a GPU (test/mooncake_nvlink/kv_staging/test_batch_copy_gpu.py).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_ptx

pytestmark = pytest.mark.timeout(120)


def _assembler(name: str):
    try:
        import triton
    except Exception:  # not installed, or broken: nothing to assemble with
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return path if path.exists() else None


@pytest.mark.parametrize("tool, arch", [("ptxas", "sm_90"), ("ptxas", "sm_100a"), ("ptxas-blackwell", "sm_103")])
def test_every_entry_assembles_without_a_stack_frame(tmp_path, tool, arch):
    ptxas = _assembler(tool)
    if ptxas is None:
        pytest.skip(f"no {tool} in this Triton install")
    source = tmp_path / "paged_copy.ptx"
    source.write_text(batch_copy_ptx.module_ptx())
    proc = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(source), "-o", str(tmp_path / "out.cubin")],
                          capture_output=True, text=True, timeout=90)
    if proc.returncode != 0 and "not defined for option 'arch'" in proc.stderr + proc.stdout:
        pytest.skip(f"this {tool} does not know {arch}")
    assert proc.returncode == 0, proc.stderr
    report = proc.stderr + proc.stdout
    entries = re.findall(r"Function properties for (\w+)", report)
    assert sorted(entries) == sorted(f"dsv41_paged_copy_{size}" for size in batch_copy_ptx.PARAM_SIZES)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(frames) == len(entries) and all(f == ("0", "0", "0") for f in frames), report


def test_the_largest_parameter_is_within_what_cuda_allows():
    # CUDA 12.1 and later: 32764 bytes of kernel parameters; every size a whole number of table words
    assert max(batch_copy_ptx.PARAM_SIZES) <= 32764
    assert all(size % 16 == 0 for size in batch_copy_ptx.PARAM_SIZES)
    assert list(batch_copy_ptx.PARAM_SIZES) == sorted(batch_copy_ptx.PARAM_SIZES)
