"""The CUDA calls ``CudaIpcTransport`` makes, answered from a table: the hardware is all it stands in for."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_dsv41.mooncake_nvlink.kv_staging.peer import HANDLE_BYTES


def handle(n: int) -> bytes:
    """A made-up exported CUDA IPC handle, one per ``n``."""
    return bytes([n]) * HANDLE_BYTES


class StandInCuda:
    """The CUDA calls CudaIpcTransport makes, over a table of exported allocations.

    ``allocations``: handle -> (bytes, where the mapping starts inside the
    allocation the driver reports: 0 for a proper base).
    """

    def __init__(self, allocations: dict[bytes, tuple[int, int]]):
        self.allocations = allocations
        self.open, self.closed, self.next_base = {}, [], 0x7F00_0000_0000
        # Plain functions, not bound methods: the transport sets ctypes argtypes on them.
        self.lib = SimpleNamespace(
            cudaIpcGetMemHandle=lambda *a: 1, cudaIpcOpenMemHandle=lambda *a: self._open_handle(*a),
            cudaIpcCloseMemHandle=lambda ptr: self._close(ptr), cudaGetLastError=lambda: 0,
            cudaSetDevice=lambda device: 0)
        self.cuMemGetAddressRange_v2 = lambda *a: self._range(*a)

    @staticmethod
    def error(code: int) -> str:
        return f"{code} (stand-in error)"

    def _open_handle(self, ptr_ref, raw, flags):
        handle = bytes(raw)
        if handle not in self.allocations:
            return 400  # cudaErrorInvalidResourceHandle: not a handle this host exported
        size, inside = self.allocations[handle]
        base = self.next_base
        self.next_base += 1 << 36
        self.open[base + inside] = (base, size)
        ptr_ref._obj.value = base + inside
        return 0

    def _close(self, ptr):
        self.closed.append(ptr.value)
        self.open.pop(ptr.value, None)
        return 0

    def _range(self, base_ref, size_ref, ptr):
        for start, (base, size) in self.open.items():
            if base <= ptr.value < base + size:
                base_ref._obj.value, size_ref._obj.value = base, size
                return 0
        return 1  # CUDA_ERROR_INVALID_VALUE
