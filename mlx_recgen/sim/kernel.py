"""``metal_kernel``: a drop-in for ``mx.fast.metal_kernel`` that runs on the CPU."""

from __future__ import annotations

import ctypes
import re
import threading
import warnings
from typing import Any, Sequence

import numpy as np

from ..backends.mlx_source import (
    dtype_name,
    metal_signature_params,
    metal_source,
    metal_template_def,
)
from . import compiler
from .errors import (
    ERROR_CLASSES,
    KernelRuntimeError,
    MetalCompileError,
    SameValueStoreWarning,
    SimulatorTransformError,
)
from .preprocess import check_metal_rules, to_addrspace_cpp, to_cpp

try:  # mlx is a dependency of the project, but keep the module importable without it
    import mlx.core as mx
except Exception:  # pragma: no cover
    mx = None

_NP = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,  # viewed through uint16
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "bool": np.bool_,
}

_MAX_THREADS_PER_GROUP = 1024
# The threadgroup memory a group may declare: Metal's 32 KiB. Tests of kernels tiled for another
# target's larger group memory (CUDA's) raise it to run them here.
THREADGROUP_BYTES = 32768

# Compiler flags that model Metal's math modes (``compile_options={"math_mode": ...}``):
# "relaxed" allows reassociation, reciprocals and contraction but honours inf and NaN;
# "fast" also assumes no inf/NaN and, like the Metal compiler, defines __FAST_MATH__.
MATH_MODE_FLAGS = {
    "safe": [],
    "relaxed": ["-fno-signed-zeros", "-fno-trapping-math", "-fassociative-math",
                "-freciprocal-math", "-ffp-contract=fast"],
    "fast": ["-ffast-math"],
}


def math_mode(compile_options: Any) -> str:
    """The math mode ``compile_options`` asks for, checked as ``mx.fast.metal_kernel`` checks it."""
    if compile_options is None:
        return "safe"
    if not isinstance(compile_options, dict):
        raise ValueError("[metal_kernel] Expected `compile_options` to be a dict.")
    mode = "safe"
    for key, value in compile_options.items():
        if key != "math_mode":
            raise ValueError(f"[metal_kernel] Unknown compile option `{key}`.")
        if value not in MATH_MODE_FLAGS:
            raise ValueError(
                "[metal_kernel] Expected math_mode to be 'safe', 'relaxed', or 'fast'.")
        mode = value
    return mode


_launch_lock = threading.Lock()


class _BufDesc(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("nbytes", ctypes.c_uint64),
        ("esize", ctypes.c_uint32),
        ("kind", ctypes.c_int32),
        ("name", ctypes.c_char_p),
        ("uninit_check", ctypes.c_int32),
        ("track", ctypes.c_int32),
    ]


class _LaunchDesc(ctypes.Structure):
    _fields_ = [
        ("kernel_name", ctypes.c_char_p),
        ("entry", ctypes.c_void_p),
        ("nbufs", ctypes.c_int32),
        ("bufs", ctypes.POINTER(_BufDesc)),
        ("grid", ctypes.c_uint32 * 3),
        ("tg", ctypes.c_uint32 * 3),
        ("check_unwritten", ctypes.c_int32),
        ("check_races", ctypes.c_int32),
        ("strict_races", ctypes.c_int32),
        ("same_value_stores", ctypes.c_uint64),
        ("warn", ctypes.c_char_p),
        ("warnlen", ctypes.c_int32),
        ("threadgroup_bytes", ctypes.c_uint64),
    ]


def _to_mx(x: Any):
    if mx is not None and isinstance(x, mx.array):
        return x
    if isinstance(x, bool):
        return mx.array(x, dtype=mx.bool_)
    if isinstance(x, int):
        return mx.array(x, dtype=mx.int32)
    if isinstance(x, float):
        return mx.array(x, dtype=mx.float32)
    return mx.array(x)


_TRACED = "function transformations"  # in MLX's error for an eval under compile or vmap


def _to_numpy(x, kernel: str = "") -> np.ndarray:
    """Row-contiguous numpy copy of an mx.array (bfloat16 as uint16 bits)."""
    name = dtype_name(x.dtype)
    if name == "bfloat16":
        x = x.view(mx.uint16)
    try:
        a = np.ascontiguousarray(np.array(x, copy=True))
    except ValueError as exc:
        if _TRACED not in str(exc):
            raise
        raise SimulatorTransformError(
            "backend='metal-sim' cannot run under mx.compile or mx.vmap: the Metal simulator "
            "executes kernels on the CPU through numpy and needs concrete inputs, which these "
            "transformations do not provide. Call it outside the transformation, or use "
            "backend='mlx' (which compiles and vmaps)", kernel=kernel or None) from None
    if a.ndim == 0:
        a = a.reshape(1)
    return a


def _laid_out(x, kernel: str = ""):
    """``(buffer, element strides)`` of an input as MLX passes it to a kernel made with
    ``ensure_row_contiguous=False``: its memory as it lies (transposed, sliced, broadcast), from
    its first element to its last, and its own strides. A bfloat16 array, whose layout the buffer
    protocol does not give, comes as a row-contiguous copy with its strides (the same elements at
    the same indices)."""
    if x.ndim and dtype_name(x.dtype) != "bfloat16":
        try:
            view = np.asarray(memoryview(x))
        except (TypeError, ValueError, RuntimeError):
            view = None
        if view is not None:
            strides = [s // view.itemsize for s in view.strides]
            span = 1 + sum((n - 1) * st for n, st in zip(view.shape, strides)) if view.size else 0
            flat = np.lib.stride_tricks.as_strided(view, shape=(span,), strides=(view.itemsize,))
            return flat, strides
    a = _to_numpy(x, kernel)
    return a.reshape(-1), _row_major_strides(x.shape)


def _row_major_strides(shape) -> list:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def _from_numpy(a: np.ndarray, name: str, shape):
    arr = mx.array(a.reshape(shape))
    if name == "bfloat16":
        arr = arr.view(mx.bfloat16)
    return arr


def _entry_source(kname: str, template: Sequence, params: list[dict]) -> str:
    """C++ of `extern "C" void msl_entry(void**)` calling the kernel with its buffers
    and the current thread's attributes."""
    args = []
    k = 0
    for p in params:
        if p["kind"] == "attr":
            if p["type"] == "uint3":
                args.append(f"uint3(::msl_rt->cur->attrs.{p['name']})")
            else:
                args.append(f"(uint)::msl_rt->cur->attrs.{p['name']}")
            continue
        b = f"((::msl::Buf*)a[{k}])"
        k += 1
        const = "" if p["kind"] == "output" else "const "
        if p["ref"] == "&":
            args.append(f"*({const}{p['type']}*){b}->base")
        else:
            args.append(f"::msl::ptr<{const}{p['type']}>::from_buf({b})")
    targs = metal_template_def(template)
    call = f"{kname}{targs}(\n    " + ",\n    ".join(args) + ");"
    return f'extern "C" void msl_entry(void** a) {{\n  {call}\n}}\n'


def _instantiation_line(kname: str, template) -> str | None:
    if not template:
        return None
    tdef = kname + metal_template_def(template)
    return f'template [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};'


def build_translation_unit(kname: str, text: str, template, params,
                           lines: bool = True) -> tuple[str, str]:
    """(C++ TU for execution, C++ TU for the clang address-space pass).

    ``lines``: element accesses carry their line (see ``preprocess.mark_subscript_lines``)."""
    inst = _instantiation_line(kname, template)
    body = text
    if inst is not None:
        body = body.replace(inst, "")
    msl_name = f"{kname}.metal"
    tu = (
        '#include "msl_shim.h"\n'
        f'#line 1 "{msl_name}"\n'
        + to_cpp(body, lines=lines)
        + '\n#line 1 "msl-sim-entry"\n'
        + _entry_source(kname, template, params)
    )
    as_tu = (
        '#include "msl_addrspace.h"\n'
        f'#line 1 "{msl_name}"\n'
        + to_addrspace_cpp(text)
        + "\n"
    )
    return tu, as_tu


class SourceLines:
    """Maps lines of the generated kernel text to lines of the ``source`` (the body the
    user passed) or of the ``header``, for error messages."""

    _MARK = re.compile(r" @@L(\d+)@@")

    def __init__(self, text: str, source: str, header: str, msl_name: str):
        self.lines = text.splitlines()
        self.msl_name = msl_name
        self.header_lines = header.count("\n") + (0 if header.endswith("\n") or not header else 1)
        pos = text.rfind(source) if source else -1
        self.body_start = text.count("\n", 0, pos) + 1 if pos >= 0 else 0
        self.body_lines = source.count("\n") + 1

    def describe(self, n: int) -> str:
        """"source line 3 (custom_kernel_x.metal:14: `out[i] = x[i];`)"."""
        if self.body_start and self.body_start <= n < self.body_start + self.body_lines:
            where = f"source line {n - self.body_start + 1}"
        elif 1 <= n <= self.header_lines:
            where = f"header line {n}"
        else:
            where = "line"
        code = self.lines[n - 1].strip() if 1 <= n <= len(self.lines) else ""
        return f"{where} ({self.msl_name}:{n}: `{code}`)"

    def expand(self, message: str) -> str:
        return self._MARK.sub(lambda m: " at " + self.describe(int(m.group(1))), message)


class SimKernel:
    """Callable like the object ``mx.fast.metal_kernel`` returns."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options: Any = None,
                 check_races: bool = True, check_addrspace: bool = True,
                 strict_races: bool = False):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options
        self.math_mode = math_mode(compile_options)
        self.check_races = check_races
        self.check_addrspace = check_addrspace
        self.strict_races = strict_races

    # -- compilation ------------------------------------------------------
    def build(self, inputs, output_dtypes, template=None):
        """Compile (or fetch from the cache) for these inputs / dtypes / template.

        Returns (kernel_name, msl_text, params, library)."""
        kname, text = metal_source(self.name, self.input_names, self.output_names, self.source,
                                   self.header, inputs, output_dtypes, template,
                                   self.atomic_outputs)
        params = metal_signature_params(self.input_names, self.output_names, self.source,
                                        inputs, output_dtypes, self.atomic_outputs)
        msl_name = f"{kname}.metal"
        check_metal_rules(text, kname, msl_name)
        tu, as_tu = build_translation_unit(kname, text, template, params)
        flags = MATH_MODE_FLAGS[self.math_mode]
        try:
            lib = compiler.compile_kernel(kname, msl_name, text, tu, flags)
        except MetalCompileError:
            # the line marks are inserted by a textual rule; should they ever meet a
            # construct they do not fit, compile without them (reports lose the line)
            tu, as_tu = build_translation_unit(kname, text, template, params, lines=False)
            lib = compiler.compile_kernel(kname, msl_name, text, tu, flags)
        if self.check_addrspace:
            if compiler.find_clang() is None:
                compiler.warn_no_clang_once()
            else:
                compiler.addrspace_check(kname, msl_name, text, as_tu)
        return kname, text, params, lib

    # -- call ---------------------------------------------------------------
    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=None, init_value=None, verbose=False, stream=None):
        del stream  # always the CPU
        inputs = [_to_mx(x) for x in inputs]
        if len(inputs) != len(self.input_names):
            raise ValueError(f"[metal_kernel] Expected `inputs` to have size "
                             f"{len(self.input_names)} but got size {len(inputs)}.")
        if len(output_shapes) != len(self.output_names):
            raise ValueError(f"[metal_kernel] Expected `output_shapes` to have size "
                             f"{len(self.output_names)} but got size {len(output_shapes)}.")
        if len(output_dtypes) != len(self.output_names):
            raise ValueError(f"[metal_kernel] Expected `output_dtypes` to have size "
                             f"{len(self.output_names)} but got size {len(output_dtypes)}.")
        grid = tuple(int(g) for g in grid)
        threadgroup = tuple(int(t) for t in threadgroup)
        if len(grid) != 3 or len(threadgroup) != 3:
            raise ValueError("[metal_kernel] grid and threadgroup must be 3-tuples")
        if any(g < 0 for g in grid) or any(t <= 0 for t in threadgroup):
            raise ValueError(f"[metal_kernel] invalid grid {grid} / threadgroup {threadgroup}")
        tg_size = threadgroup[0] * threadgroup[1] * threadgroup[2]
        if tg_size > _MAX_THREADS_PER_GROUP:
            raise ValueError(
                f"Thread group size ({tg_size}) is greater than  the maximum allowed threads "
                f"per threadgroup ({_MAX_THREADS_PER_GROUP}).")
        template = list(template or [])
        output_dtypes = list(output_dtypes)
        output_shapes = [tuple(int(d) for d in s) for s in output_shapes]

        kname, text, params, lib = self.build(inputs, output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{text}\n```")

        keep = []  # keep numpy buffers and names alive
        descs = []

        def add(arr: np.ndarray, esize: int, kind: int, name: str, uninit: bool, track: bool):
            keep.append(arr)
            nb = name.encode()
            keep.append(nb)
            descs.append(_BufDesc(arr.ctypes.data, arr.nbytes, esize, kind, nb, int(uninit),
                                  int(track)))

        # row-contiguous copies (MLX copies an input that is not), or, for a kernel made with
        # ensure_row_contiguous=False, each input's memory as it lies with its own strides
        laid = [(_to_numpy(x, kname), _row_major_strides(x.shape)) if self.ensure_row_contiguous
                else _laid_out(x, kname) for x in inputs]
        for p in params:
            if p["kind"] == "input":
                a = laid[p["of"]][0]
                add(a, a.itemsize, 0, p["name"], False, False)
            elif p["kind"] == "shape":
                x = inputs[p["of"]]
                a = np.array(x.shape, dtype=np.int32)
                add(a, 4, 3, p["name"], False, False)
            elif p["kind"] == "strides":
                a = np.array(laid[p["of"]][1], dtype=np.int64)
                add(a, 8, 3, p["name"], False, False)
            elif p["kind"] == "ndim":
                a = np.array([inputs[p["of"]].ndim], dtype=np.int32)
                add(a, 4, 3, p["name"], False, False)
        outs = []
        for j, (shape, dt) in enumerate(zip(output_shapes, output_dtypes)):
            name = dtype_name(dt)
            npdt = _NP[name]
            n = int(np.prod(shape)) if shape else 1
            if init_value is None:
                a = np.empty(n, dtype=npdt)
                a.view(np.uint8)[:] = 0xFF  # garbage: NaN for floats, -1 for integers
            else:
                full = mx.full((n,), init_value, dtype=dt)
                a = _to_numpy(full, kname).reshape(n).copy()
            outs.append((a, name, shape))
        for p in params:
            if p["kind"] == "output":
                a = outs[p["of"]][0]
                add(a, a.itemsize, 1, p["name"], init_value is None, True)

        arr = (_BufDesc * max(len(descs), 1))(*descs)
        ld = _LaunchDesc()
        ld.kernel_name = kname.encode()
        ld.entry = ctypes.cast(lib.msl_entry, ctypes.c_void_p).value
        ld.nbufs = len(descs)
        ld.bufs = arr
        ld.grid[:] = grid
        ld.tg[:] = threadgroup
        ld.check_unwritten = int(init_value is None)
        ld.check_races = int(self.check_races)
        ld.strict_races = int(self.strict_races)
        warn = ctypes.create_string_buffer(4096)
        ld.warn = ctypes.cast(warn, ctypes.c_char_p)
        ld.warnlen = len(warn)
        ld.threadgroup_bytes = THREADGROUP_BYTES
        err = ctypes.create_string_buffer(8192)
        rt = compiler.runtime()
        with _launch_lock:
            rc = rt.msl_launch(ctypes.byref(ld), err, len(err))
        lines = SourceLines(text, self.source, self.header, f"{kname}.metal")
        if rc != 0:
            cls = ERROR_CLASSES.get(rc, KernelRuntimeError)
            raw = err.value.decode(errors="replace")
            m = SourceLines._MARK.search(raw)
            raise cls(lines.expand(raw), kernel=kname, line=int(m.group(1)) if m else None)
        if ld.same_value_stores:
            warnings.warn(SameValueStoreWarning(
                f"{ld.same_value_stores} store(s) of a value an element already held from "
                f"another thread with no ordering between them (harmless on the GPU; "
                f"strict_races=True makes them errors); the first: "
                + lines.expand(warn.value.decode(errors="replace"))), stacklevel=2)
        return [_from_numpy(a, name, shape) for a, name, shape in outs]


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options: Any = None,
                 **sim_options) -> SimKernel:
    """Drop-in for ``mx.fast.metal_kernel`` that executes the kernel on the CPU with
    Metal's execution model and checks (see docs/simulator.md).

    Extra keyword options: ``check_races=True``, ``check_addrspace=True``,
    ``strict_races=False`` (report stores of an identical value from unordered threads as
    :class:`DataRaceError` instead of a :class:`SameValueStoreWarning`)."""
    return SimKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                     atomic_outputs, compile_options, **sim_options)
