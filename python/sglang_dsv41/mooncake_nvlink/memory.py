"""``MemoryAccess`` implementations: CUDA (production), host-only, and injected classification.

``cuda_memory_access()`` calls the CUDA runtime library through the package's
one binding (``cuda_libs``; torch ships the library), so the same code runs
where only torch is installed.
"""

from __future__ import annotations

import ctypes
from typing import Iterable, Optional

from sglang_dsv41.mooncake_nvlink import cuda_libs
from sglang_dsv41.mooncake_nvlink.routing import (
    MemoryAccessError,
    MemoryKind,
    RegionTable,
)

_CUDA_MEMORY_TYPE_DEVICE = 2  # cudaMemoryTypeDevice; 0 unregistered, 1 host, 3 managed


def _payload_address(payload: bytes, offset: int) -> tuple[int, object]:
    """Address of ``payload[offset]`` without copying, plus the object keeping it alive."""
    if not isinstance(payload, bytes):
        payload = bytes(payload)
    holder = ctypes.c_char_p(payload)
    return ctypes.cast(holder, ctypes.c_void_p).value + offset, (holder, payload)


class HostMemory:
    """Plain host memory through ctypes; classifies everything as host."""

    def kind_of(self, ptr: int) -> MemoryKind:
        return MemoryKind.HOST

    def read(self, ptr: int, length: int) -> bytes:
        return ctypes.string_at(int(ptr), int(length))

    def write(self, dst: int, payload: bytes, offset: int, length: int) -> None:
        if offset < 0 or offset + length > len(payload):
            raise MemoryAccessError("write source range outside the payload")
        src, keep = _payload_address(payload, offset)
        ctypes.memmove(int(dst), src, int(length))
        del keep


class InjectedKinds(HostMemory):
    """Host memory whose classification is injected: pointers in ``device_regions`` count as device.

    For machines without a GPU: drives the host/device split while every byte
    really lives in host memory.
    """

    def __init__(self, device_regions: Iterable[tuple[int, int]]):
        self.device_regions = RegionTable(device_regions)

    def kind_of(self, ptr: int) -> MemoryKind:
        if self.device_regions.containing(int(ptr), 1) is not None:
            return MemoryKind.DEVICE
        return MemoryKind.HOST


class _CtypesRuntime:
    """The four runtime calls ``CudaMemory`` makes."""

    name = "ctypes-libcudart"

    def __init__(self, runtime: cuda_libs.CudaRuntime):
        self.lib, self.path = runtime.lib, runtime.path

    def pointer_type(self, ptr: int) -> tuple[int, int, int]:
        attr = cuda_libs.PointerAttributes()
        err = self.lib.cudaPointerGetAttributes(ctypes.byref(attr), ctypes.c_void_p(ptr))
        if err:
            self.lib.cudaGetLastError()  # clear it so later CUDA calls are not poisoned
        return err, attr.type, attr.device

    def memcpy(self, dst: int, src: int, length: int) -> int:
        return self.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), length, cuda_libs.MEMCPY_DEFAULT)

    def get_device(self) -> tuple[int, int]:
        dev = ctypes.c_int(-1)
        err = self.lib.cudaGetDevice(ctypes.byref(dev))
        return err, dev.value

    def set_device(self, device: int) -> int:
        return self.lib.cudaSetDevice(device)


def _load_runtime() -> _CtypesRuntime:
    try:
        return _CtypesRuntime(cuda_libs.cuda_runtime())
    except cuda_libs.CudaLibraryError as exc:
        raise MemoryAccessError(str(exc)) from exc


class CudaMemory:
    """Classifies with cudaPointerGetAttributes; device pointers are copied with cudaMemcpy.

    Calls run on the device that was current when this object was built: a
    worker thread's default device 0 would otherwise get a CUDA context of its
    own on another rank's GPU.
    """

    def __init__(self, runtime=None, device: Optional[int] = None):
        self.runtime = runtime if runtime is not None else _load_runtime()
        try:
            err, current = self.runtime.get_device()
        except Exception as exc:  # a runtime without a driver behind it
            raise MemoryAccessError(f"CUDA runtime unusable: {exc}") from exc
        if err:
            raise MemoryAccessError(f"cudaGetDevice failed with error {err} (no usable GPU?)")
        self.device = current if device is None else device

    @property
    def backend(self) -> str:
        return self.runtime.name

    def _on_device(self) -> None:
        err, current = self.runtime.get_device()
        if err or current != self.device:
            err = self.runtime.set_device(self.device)
            if err:
                raise MemoryAccessError(f"cudaSetDevice({self.device}) failed with error {err}")

    def kind_of(self, ptr: int) -> MemoryKind:
        self._on_device()
        err, mem_type, _ = self.runtime.pointer_type(int(ptr))
        if err:
            # Unknown is not host: reading a device pointer as host memory crashes.
            raise MemoryAccessError(
                f"cudaPointerGetAttributes({int(ptr):#x}) failed with error {err}"
            )
        return MemoryKind.DEVICE if mem_type == _CUDA_MEMORY_TYPE_DEVICE else MemoryKind.HOST

    def read(self, ptr: int, length: int) -> bytes:
        if self.kind_of(ptr) is MemoryKind.HOST:
            return ctypes.string_at(int(ptr), int(length))
        out = ctypes.create_string_buffer(int(length))
        err = self.runtime.memcpy(ctypes.addressof(out), int(ptr), int(length))
        if err:
            raise MemoryAccessError(f"cudaMemcpy from {int(ptr):#x} ({length} bytes) failed: {err}")
        return out.raw

    def write(self, dst: int, payload: bytes, offset: int, length: int) -> None:
        if offset < 0 or offset + length > len(payload):
            raise MemoryAccessError("write source range outside the payload")
        src, keep = _payload_address(payload, offset)
        if self.kind_of(dst) is MemoryKind.HOST:
            ctypes.memmove(int(dst), src, int(length))
        else:
            err = self.runtime.memcpy(int(dst), src, int(length))
            if err:
                raise MemoryAccessError(f"cudaMemcpy to {int(dst):#x} ({length} bytes) failed: {err}")
        del keep


def cuda_memory_access(device: Optional[int] = None) -> CudaMemory:
    """The production ``MemoryAccess``; raises MemoryAccessError when no CUDA runtime is usable."""
    return CudaMemory(_load_runtime(), device=device)
