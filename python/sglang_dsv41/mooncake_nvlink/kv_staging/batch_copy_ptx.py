"""The paged copy kernel with its launch table passed as a kernel parameter.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import ctypes

THREADS = 256
VECTORS_PER_STEP = 4
# Parameter sizes compiled, smallest first: a launch copies the whole declared
# parameter, so a small table takes a small kernel. The last is the CUDA limit
# (32764 bytes) rounded down to whole 16-byte rows.
PARAM_SIZES = (4096, 16384, 32752)
_ENTRY = "dsv41_paged_copy_{size}"


def _step_ptx(vectors: int) -> list[str]:
    """One step of a thread: ``vectors`` 16-byte loads, then their stores, each past the piece's end skipped.

    Offsets from the thread's first byte (rd29) go up by one vector per thread
    (rd30); rd26/rd27 are the piece's source and destination, rd28 its bytes.
    """
    lines = ["    mov.u64 %rd32, %rd29;"]
    for v in range(vectors):
        if v:
            lines.append("    add.u64 %rd32, %rd32, %rd30;")
            lines.append(f"    setp.lt.u64 %q{v}, %rd32, %rd28;")
        lines.append(f"    add.u64 %s{v}, %rd26, %rd32;")
        lines.append(f"    add.u64 %d{v}, %rd27, %rd32;")
    for v in range(vectors):
        guard = f"@%q{v} " if v else ""
        regs = ", ".join(f"%v{4 * v + k}" for k in range(4))
        lines.append(f"    {guard}ld.global.v4.u32 {{{regs}}}, [%s{v}];")
    for v in range(vectors):
        guard = f"@%q{v} " if v else ""
        regs = ", ".join(f"%v{4 * v + k}" for k in range(4))
        lines.append(f"    {guard}st.global.v4.u32 [%d{v}], {{{regs}}};")
    return lines


def _entry_ptx(size: int) -> str:
    """One kernel taking a ``size``-byte table; register names are local to the entry."""
    lines = [
        f".visible .entry {_ENTRY.format(size=size)}(",
        f"    .param .align 16 .b8 table[{size}]",
        ")",
        f".maxntid {THREADS}, 1, 1",
        "{",
        "    .reg .pred %p<4>;",
        f"    .reg .pred %q<{VECTORS_PER_STEP}>;",
        "    .reg .b32 %r<4>;",
        f"    .reg .b32 %v<{4 * VECTORS_PER_STEP}>;",
        "    .reg .b64 %rd<33>;",
        f"    .reg .b64 %s<{VECTORS_PER_STEP}>;",
        f"    .reg .b64 %d<{VECTORS_PER_STEP}>;",
        "    mov.u64 %rd0, table;",            # the table's address in the parameter space
        "    ld.param.u64 %rd1, [table];",     # S
        "    ld.param.u64 %rd2, [table+8];",   # chunk
        "    mov.u32 %r0, %ctaid.x;",
        "    cvt.u64.u32 %rd3, %r0;",          # this program
        # segment: the first s with program < end[s] (lo, hi in rd4, rd5)
        "    mov.u64 %rd4, 0;",
        "    sub.u64 %rd5, %rd1, 1;",
        "SEARCH:",
        "    setp.ge.u64 %p0, %rd4, %rd5;",
        "    @%p0 bra FOUND;",
        "    add.u64 %rd6, %rd4, %rd5;",
        "    shr.u64 %rd6, %rd6, 1;",
        "    shl.b64 %rd7, %rd6, 3;",
        "    add.u64 %rd7, %rd7, %rd0;",
        "    ld.param.u64 %rd8, [%rd7+16];",   # end[mid]
        "    setp.lt.u64 %p1, %rd3, %rd8;",
        "    add.u64 %rd9, %rd6, 1;",
        "    selp.u64 %rd5, %rd6, %rd5, %p1;",
        "    selp.u64 %rd4, %rd4, %rd9, %p1;",
        "    bra.uni SEARCH;",
        "FOUND:",
        "    mov.u64 %rd10, 0;",               # the segment's first program: end[s - 1], 0 for s = 0
        "    setp.eq.u64 %p2, %rd4, 0;",
        "    @%p2 bra.uni FIRST;",
        "    shl.b64 %rd11, %rd4, 3;",
        "    add.u64 %rd11, %rd11, %rd0;",
        "    ld.param.u64 %rd10, [%rd11+8];",
        "FIRST:",
        "    sub.u64 %rd12, %rd3, %rd10;",     # unit
        "    mad.lo.u64 %rd13, %rd4, 5, %rd1;",
        "    shl.b64 %rd13, %rd13, 3;",
        "    add.u64 %rd13, %rd13, %rd0;",     # row s starts at byte 16 + 8 * (S + 5 s)
        "    ld.param.u64 %rd14, [%rd13+16];", # page-0 source
        "    ld.param.u64 %rd15, [%rd13+24];", # page-0 destination
        "    ld.param.u64 %rd16, [%rd13+32];", # bytes per page
        "    ld.param.u64 %rd17, [%rd13+40];", # where the source pages start (word index)
        "    ld.param.u64 %rd18, [%rd13+48];", # page pairs
        "    add.u64 %rd19, %rd16, %rd2;",
        "    sub.u64 %rd19, %rd19, 1;",
        "    div.u64 %rd19, %rd19, %rd2;",     # pieces per page
        "    div.u64 %rd20, %rd12, %rd19;",    # page pair
        "    mul.lo.u64 %rd21, %rd20, %rd19;",
        "    sub.u64 %rd21, %rd12, %rd21;",
        "    mul.lo.u64 %rd21, %rd21, %rd2;",  # first byte of the piece in the page
        "    add.u64 %rd22, %rd17, %rd20;",
        "    shl.b64 %rd22, %rd22, 3;",
        "    add.u64 %rd22, %rd22, %rd0;",
        "    ld.param.u64 %rd23, [%rd22];",    # source page
        "    shl.b64 %rd24, %rd18, 3;",
        "    add.u64 %rd24, %rd24, %rd22;",
        "    ld.param.u64 %rd25, [%rd24];",    # destination page
        "    mad.lo.u64 %rd26, %rd23, %rd16, %rd14;",
        "    add.u64 %rd26, %rd26, %rd21;",    # source of the piece
        "    mad.lo.u64 %rd27, %rd25, %rd16, %rd15;",
        "    add.u64 %rd27, %rd27, %rd21;",    # destination of the piece
        "    sub.u64 %rd28, %rd16, %rd21;",
        "    min.u64 %rd28, %rd28, %rd2;",     # bytes of the piece
        "    mov.u32 %r1, %tid.x;",
        "    mul.wide.u32 %rd29, %r1, 16;",    # this thread's first byte
        "    mov.u32 %r2, %ntid.x;",
        "    mul.wide.u32 %rd30, %r2, 16;",    # one vector per thread
        f"    mul.lo.u64 %rd31, %rd30, {VECTORS_PER_STEP};",
        "STEP:",
        "    setp.ge.u64 %p0, %rd29, %rd28;",
        "    @%p0 bra.uni DONE;",
        *_step_ptx(VECTORS_PER_STEP),
        "    add.u64 %rd29, %rd29, %rd31;",
        "    bra.uni STEP;",
        "DONE:",
        "    ret;",
        "}",
    ]
    return "\n".join(lines)


def module_ptx() -> str:
    """The PTX module: one entry per size in ``PARAM_SIZES``."""
    # PTX 8.1 (CUDA 12.1) is the first to allow kernel parameters over 4 KiB.
    head = ".version 8.1\n.target sm_70\n.address_size 64\n"
    return head + "\n".join(_entry_ptx(size) for size in PARAM_SIZES) + "\n"


class ParamKernelError(RuntimeError):
    """The parameter-table kernel cannot be loaded or launched here."""


_CUDA_SUCCESS = 0
_CU_JIT_ERROR_LOG_BUFFER = 5
_CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6


class ParamTableKernel:
    """The kernels of ``module_ptx`` loaded into the current CUDA context.

    ``launch(table_ptr, nbytes, programs, stream)`` copies ``nbytes`` of table
    from host memory at ``table_ptr`` into the smallest kernel's parameter
    that holds them; the host memory may be reused as soon as it returns.
    """

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise ParamKernelError(f"no CUDA driver library: {exc}") from exc
        vp, ui, ci = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        version = ctypes.c_int(0)
        lib.cuDriverGetVersion.argtypes, lib.cuDriverGetVersion.restype = [ctypes.POINTER(ci)], ci
        if lib.cuDriverGetVersion(ctypes.byref(version)) or version.value < 12010:
            raise ParamKernelError(f"CUDA driver {version.value} takes no kernel parameter over 4 KiB "
                                   "(needs 12.1 or later)")
        lib.cuModuleLoadDataEx.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, ui,
                                           ctypes.POINTER(ci), ctypes.POINTER(vp)]
        lib.cuModuleLoadDataEx.restype = ci
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        lib.cuModuleGetFunction.restype = ci
        lib.cuLaunchKernel.argtypes = [vp, ui, ui, ui, ui, ui, ui, ui, vp, vp, vp]
        lib.cuLaunchKernel.restype = ci
        log = ctypes.create_string_buffer(8192)
        options = (ci * 2)(_CU_JIT_ERROR_LOG_BUFFER, _CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        values = (vp * 2)(ctypes.addressof(log), ctypes.sizeof(log))
        module = vp()
        err = lib.cuModuleLoadDataEx(ctypes.byref(module), module_ptx().encode(), 2, options, values)
        if err:
            detail = log.value.decode(errors="replace").strip()
            raise ParamKernelError(f"the PTX of the parameter-table kernel does not load (CUDA error {err})"
                                   + (f": {detail}" if detail else ""))
        self._functions = []
        for size in PARAM_SIZES:
            fn = vp()
            err = lib.cuModuleGetFunction(ctypes.byref(fn), module, _ENTRY.format(size=size).encode())
            if err:
                raise ParamKernelError(f"kernel {_ENTRY.format(size=size)} missing from its module (CUDA error {err})")
            self._functions.append((size, fn))
        self._module = module
        self._launch = lib.cuLaunchKernel
        self._threads = THREADS  # what the module was built for
        self.max_bytes = PARAM_SIZES[-1]
        # for a native caller: (parameter bytes, CUfunction address), smallest first, and threads per program
        self.kernels = tuple((size, fn.value) for size, fn in self._functions)
        self.threads = self._threads
        self._params: dict[int, ctypes.Array] = {}  # kernelParams per table buffer: one pointer, to it

    def params_for(self, table_ptr: int) -> ctypes.Array:
        """The kernelParams array pointing at ``table_ptr`` (one per table buffer, kept)."""
        params = self._params.get(table_ptr)
        if params is None:
            params = self._params[table_ptr] = (ctypes.c_void_p * 1)(table_ptr)
        return params

    def launch(self, table_ptr: int, nbytes: int, programs: int, stream: int) -> int:
        """The CUDA driver's error code of the launch (0: launched)."""
        for size, fn in self._functions:
            if nbytes <= size:
                return self._launch(fn, programs, 1, 1, self._threads, 1, 1, 0, stream, self.params_for(table_ptr),
                                    None)
        raise ParamKernelError(f"a launch table of {nbytes} bytes exceeds the kernel parameter "
                               f"({self.max_bytes} bytes)")
