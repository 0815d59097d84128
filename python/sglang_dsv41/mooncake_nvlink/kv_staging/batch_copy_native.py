"""A paged write's table, page check and launch in one native call.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading

MODULE = "sglang_dsv41_paged_write"

# write_pages's status codes (first item of the tuple it returns)
WRITTEN = 0  # detail: table bytes
PAGE_OUTSIDE = 1  # detail: index of the page array holding a page at or past its limit; nothing launched
TABLE_TOO_LARGE = 2  # detail: table bytes (no kernel's parameter holds them); nothing launched
CONTEXT_FAILED = 3  # detail: CUDA driver error; nothing launched
LAUNCH_FAILED = 4  # detail: CUDA driver error
SYNC_FAILED = 5  # detail: CUDA driver error (the copy may have partly landed)
NOT_PAGES = 6  # detail: index of a page array that is not 1-D int32/int64, or -1 when the lengths
#                do not add up to the table; nothing launched

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int (*ctx_get_t)(void **);
typedef int (*ctx_set_t)(void *);
typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void *, void **, void **);
typedef int (*sync_t)(void *);

#define MAX_KERNELS 8

static PyObject *done(int status, long long detail) {
    return Py_BuildValue("(iL)", status, detail);
}

/* Converts one page array into int64 words at out; returns -1 if a page is at or past limit
   (negative pages, read as unsigned, are past every limit), 1 if the buffer is not an array of
   4- or 8-byte integers in the host's byte order, else 0. */
static int put_pages(const Py_buffer *v, uint64_t limit, int64_t *out) {
    Py_ssize_t n = v->shape[0];
    if (v->format && (strchr(v->format, '>') || strchr(v->format, '!')))
        return 1;  /* not in this host's byte order (x86 and arm64 hosts are little-endian) */
    char kind = v->format ? v->format[strlen(v->format) - 1] : 'B';
    int is_signed = (kind == 'i' || kind == 'l' || kind == 'q');
    int is_unsigned = (kind == 'I' || kind == 'L' || kind == 'Q');
    if (!(is_signed || is_unsigned) || (v->itemsize != 4 && v->itemsize != 8))
        return 1;
    uint64_t worst = 0;
    if (v->itemsize == 8) {
        const uint64_t *p = (const uint64_t *)v->buf;
        memcpy(out, p, (size_t)n * 8);
        for (Py_ssize_t i = 0; i < n; i++) worst = p[i] > worst ? p[i] : worst;
    } else if (is_signed) {
        const int32_t *p = (const int32_t *)v->buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            out[i] = p[i];
            uint64_t u = (uint64_t)(int64_t)p[i];
            worst = u > worst ? u : worst;
        }
    } else {
        const uint32_t *p = (const uint32_t *)v->buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            out[i] = p[i];
            worst = p[i] > worst ? p[i] : worst;
        }
    }
    return worst >= limit ? -1 : 0;
}

static PyObject *write_pages(PyObject *self, PyObject *args) {
    Py_buffer head;
    PyObject *pages, *limits, *kernels, *driver;
    unsigned long long table_addr, stream, context;
    long long capacity, words;
    unsigned int programs, threads;
    if (!PyArg_ParseTuple(args, "y*O!O!KLLO!IIKKO!", &head, &PyTuple_Type, &pages, &PyTuple_Type, &limits,
                          &table_addr, &capacity, &words, &PyTuple_Type, &kernels, &programs, &threads,
                          &stream, &context, &PyTuple_Type, &driver))
        return NULL;
    int64_t *table = (int64_t *)(uintptr_t)table_addr;
    Py_ssize_t arrays = PyTuple_GET_SIZE(pages);
    Py_ssize_t head_words = head.len / 8;
    long long used = words * 8;
    if (PyTuple_GET_SIZE(limits) != arrays || PyTuple_GET_SIZE(driver) != 4 || head_words > words) {
        PyBuffer_Release(&head);
        PyErr_SetString(PyExc_ValueError, "write_pages: arguments disagree");
        return NULL;
    }
    if (used > capacity) {
        PyBuffer_Release(&head);
        return done(6, -1);
    }
    memcpy(table, head.buf, (size_t)head_words * 8);
    PyBuffer_Release(&head);
    long long at = head_words;
    for (Py_ssize_t k = 0; k < arrays; k++) {
        Py_buffer v;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(pages, k), &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            return done(6, k);
        }
        unsigned long long limit = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(limits, k));
        if (PyErr_Occurred()) {
            PyBuffer_Release(&v);
            return NULL;
        }
        if (v.ndim != 1 || at + v.shape[0] > words) {
            PyBuffer_Release(&v);
            return done(6, v.ndim != 1 ? k : -1);
        }
        int bad = put_pages(&v, limit, table + at);
        at += v.shape[0];
        PyBuffer_Release(&v);
        if (bad > 0) return done(6, k);
        if (bad < 0) return done(1, k);
    }
    if (at != words) return done(6, -1);

    void *function = NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(kernels);
    for (Py_ssize_t i = 0; i < count && i < MAX_KERNELS; i++) {
        long long size;
        unsigned long long fn;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(kernels, i), "LK", &size, &fn)) return NULL;
        if (used <= size) {
            function = (void *)(uintptr_t)fn;
            break;
        }
    }
    if (function == NULL) return done(2, used);
    ctx_get_t ctx_get = (ctx_get_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(driver, 0));
    ctx_set_t ctx_set = (ctx_set_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(driver, 1));
    launch_t launch = (launch_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(driver, 2));
    sync_t sync = (sync_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(driver, 3));
    if (PyErr_Occurred()) return NULL;

    int status = 0, err = 0;
    void *params[1] = {(void *)table};
    Py_BEGIN_ALLOW_THREADS
    void *previous = NULL;
    err = ctx_get(&previous);
    if (!err && previous != (void *)(uintptr_t)context) err = ctx_set((void *)(uintptr_t)context);
    else if (!err) previous = NULL;  /* ours already: nothing to give back */
    if (err) {
        status = 3;
    } else {
        err = launch(function, programs, 1, 1, threads, 1, 1, 0, (void *)(uintptr_t)stream, params, NULL);
        if (err) status = 4;
        else if ((err = sync((void *)(uintptr_t)stream)) != 0) status = 5;
        if (previous) ctx_set(previous);
    }
    Py_END_ALLOW_THREADS
    return done(status, status ? err : used);
}

static PyMethodDef methods[] = {
    {"write_pages", write_pages, METH_VARARGS, "Fill, check and launch one paged write; synchronous."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "MODULE_NAME", NULL, -1, methods};

PyMODINIT_FUNC PyInit_MODULE_NAME(void) { return PyModule_Create(&module); }
""".replace("MODULE_NAME", MODULE)


class NativeWriteError(RuntimeError):
    """The native writer cannot be built or loaded here."""


def driver_calls() -> tuple[int, int, int, int]:
    """Addresses of cuCtxGetCurrent, cuCtxSetCurrent, cuLaunchKernel, cuStreamSynchronize."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                     for name in ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuLaunchKernel", "cuStreamSynchronize"))
    except (OSError, AttributeError) as exc:
        raise NativeWriteError(f"the CUDA driver library does not serve its calls: {exc}") from exc


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeWriteError("no C compiler (cc, gcc or clang; or CC) to build it")
    return cc


_built: dict = {}  # the module, or why it could not be built: once per process
_build_lock = threading.Lock()


def build():
    """The compiled module (built on first use, once per process); NativeWriteError says why not."""
    with _build_lock:
        if "module" not in _built and "error" not in _built:
            try:
                _built["module"] = _build()
            except NativeWriteError as exc:
                _built["error"] = exc
        if "error" in _built:
            raise _built["error"]
        return _built["module"]


def _build():
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise NativeWriteError(f"no Python headers in {include}")
    cc = _compiler()
    workdir = tempfile.mkdtemp(prefix="sglang-dsv41-native-")
    try:
        src = os.path.join(workdir, f"{MODULE}.c")
        so = os.path.join(workdir, MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
        with open(src, "w") as f:
            f.write(SOURCE)
        try:
            run = subprocess.run([cc, src, "-O2", "-shared", "-fPIC", f"-I{include}", "-o", so],
                                 capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NativeWriteError(f"{cc} did not run: {exc}") from exc
        if run.returncode != 0:
            first = (run.stderr or run.stdout).strip().splitlines()[:1]
            raise NativeWriteError(f"{cc} failed ({run.returncode})" + (f": {first[0]}" if first else ""))
        loader = importlib.machinery.ExtensionFileLoader(MODULE, so)
        spec = importlib.util.spec_from_file_location(MODULE, so, loader=loader)
        try:
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
        except ImportError as exc:
            raise NativeWriteError(f"the built module does not load: {exc}") from exc
        return module
    finally:  # the loaded library stays mapped
        shutil.rmtree(workdir, ignore_errors=True)
