"""The one ctypes binding of the CUDA runtime and driver (no GPU needed)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from sglang_dsv41.mooncake_nvlink import cuda_libs

PACKAGE = Path(cuda_libs.__file__).resolve().parents[1]


def test_no_other_module_loads_a_cuda_library():
    loads = re.compile(r"CDLL\(|cdll\.|LoadLibrary|dlopen")
    found = [f"{p.relative_to(PACKAGE)}:{n}" for p in PACKAGE.rglob("*.py") if p.name != "cuda_libs.py"
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if loads.search(line) and "libc.so" not in line and 'find_library("c")' not in line]
    assert not found, found


def test_the_runtime_found_here_has_every_call_bound_as_declared():
    try:
        runtime = cuda_libs.cuda_runtime()
    except cuda_libs.CudaLibraryError as exc:  # a machine without any CUDA runtime library
        assert "no CUDA runtime library found" in str(exc)
        return
    for name, args in cuda_libs.RUNTIME_CALLS.items():
        fn = getattr(runtime.lib, name)
        assert fn.argtypes == args and fn.restype is ctypes.c_int, name
    assert cuda_libs.cuda_runtime() is runtime  # bound once per process
    assert "(" in runtime.error(1)


def test_a_library_without_a_declared_call_is_refused():
    class Partial:
        cudaGetLastError = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)

    with pytest.raises(AttributeError):
        cuda_libs.CudaRuntime(Partial(), "partial")


def test_without_a_driver_the_error_names_it():
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(cuda_libs.CudaLibraryError, match="CUDA driver library is not loadable"):
            cuda_libs.cuda_driver()
    else:
        lib = cuda_libs.cuda_driver()
        assert all(getattr(lib, name).argtypes == args for name, args in cuda_libs.DRIVER_CALLS.items())
