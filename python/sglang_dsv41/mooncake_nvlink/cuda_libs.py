"""The CUDA runtime and driver libraries as this package calls them: one ctypes binding each.

Every call the package makes is declared here, with its argument types, and
bound once per process. The runtime already loaded in the process (torch's)
comes first, so calls share torch's device context and streams. Nothing here
imports torch; tests hand stand-ins with the same calls to the classes that
use these.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

HANDLE_BYTES = 64  # cudaIpcMemHandle_t


class CudaLibraryError(RuntimeError):
    """No loadable CUDA runtime or driver library, or one without a call we need."""


class PointerAttributes(ctypes.Structure):
    # The CUDA 11+ layout, plus room in case a newer runtime writes more fields.
    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        ("_reserved", ctypes.c_ubyte * 256),
    ]


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]  # opaque; may hold NUL bytes


_vp, _ci, _size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
RUNTIME_CALLS = {
    "cudaGetLastError": [],
    "cudaGetDevice": [ctypes.POINTER(_ci)],
    "cudaSetDevice": [_ci],
    "cudaPointerGetAttributes": [ctypes.POINTER(PointerAttributes), _vp],
    "cudaMemcpy": [_vp, _vp, _size, _ci],
    "cudaMemcpyAsync": [_vp, _vp, _size, _ci, _vp],
    "cudaStreamSynchronize": [_vp],
    "cudaIpcGetMemHandle": [ctypes.POINTER(IpcHandle), _vp],
    "cudaIpcOpenMemHandle": [ctypes.POINTER(_vp), IpcHandle, ctypes.c_uint],
    "cudaIpcCloseMemHandle": [_vp],
}
DRIVER_CALLS = {
    "cuDeviceGet": [ctypes.POINTER(_ci), _ci],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_vp), _ci],
    "cuCtxGetCurrent": [ctypes.POINTER(_vp)],
    "cuCtxSetCurrent": [_vp],
    "cuMemGetAddressRange_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(_size), ctypes.c_uint64],
}
MEMCPY_HOST_TO_DEVICE = 1
MEMCPY_DEFAULT = 4  # direction inferred from the pointers (unified addressing)


def _bind(lib: ctypes.CDLL, calls: dict) -> None:
    for name, args in calls.items():
        fn = getattr(lib, name)  # AttributeError: a library without the call
        fn.argtypes, fn.restype = args, _ci


class CudaRuntime:
    """The bound runtime library (``lib``) and its error text."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        _bind(lib, RUNTIME_CALLS)
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [_ci], ctypes.c_char_p
        self.lib, self.path = lib, path

    def error(self, code: int) -> str:
        text = self.lib.cudaGetErrorString(code)
        return f"{code} ({text.decode(errors='replace') if text else 'unknown'})"


def libcudart_candidates() -> list[str]:
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    found: list[str] = []
    for base in sys.path:
        for pattern in ("nvidia/*/lib/libcudart.so*", "nvidia/cu*/lib/libcudart.so*",
                        "torch/lib/libcudart*.so*"):
            found.extend(sorted(glob.glob(os.path.join(base, pattern)), reverse=True))
    return names + found


_lock = threading.Lock()
_runtimes: dict[bool, CudaRuntime] = {}
_driver: list[ctypes.CDLL] = []


def cuda_runtime(loaded_only: bool = False) -> CudaRuntime:
    """The CUDA runtime; ``loaded_only``: only one already in the process (torch's own)."""
    with _lock:
        if loaded_only in _runtimes:
            return _runtimes[loaded_only]
        mode = (os.RTLD_NOLOAD | os.RTLD_LAZY) if loaded_only else ctypes.DEFAULT_MODE
        errors = []
        for candidate in libcudart_candidates():
            try:
                runtime = _runtimes[loaded_only] = CudaRuntime(ctypes.CDLL(candidate, mode=mode), candidate)
                return runtime
            except (OSError, AttributeError) as exc:
                errors.append(f"{candidate}: {exc}")
    raise CudaLibraryError("no CUDA runtime library found (" + "; ".join(errors[:3]) + ")")


def process_runtime() -> CudaRuntime:
    """The runtime torch already loaded (the same current device and contexts as its kernels), else any."""
    try:
        return cuda_runtime(loaded_only=True)
    except CudaLibraryError:
        return cuda_runtime()


def cuda_driver() -> ctypes.CDLL:
    """The CUDA driver library (libcuda), bound."""
    with _lock:
        if _driver:
            return _driver[0]
        errors = []
        for name in ("libcuda.so.1", "libcuda.so"):
            try:
                lib = ctypes.CDLL(name)
                _bind(lib, DRIVER_CALLS)
            except (OSError, AttributeError) as exc:
                errors.append(f"{name}: {exc}")
                continue
            _driver.append(lib)
            return lib
    raise CudaLibraryError("the CUDA driver library is not loadable (" + "; ".join(errors) + ")")
