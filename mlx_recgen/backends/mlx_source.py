"""Pure-Python replicas of how MLX assembles the full text of a custom kernel.

``mx.fast.metal_kernel`` and ``mx.fast.cuda_kernel`` only take the *body* of a
kernel; MLX generates the signature (one parameter per input/output, shape and
stride buffers for the names the body mentions, the thread attributes the body
mentions), the template instantiation and a mangled kernel name.  The functions
here rebuild that text exactly, so that

* ``rec.source(...)`` can show the code a Mac (or an NVIDIA GPU) compiles, and
* the Metal simulator (``mlx_recgen.sim``) compiles the very same text.

They follow ``write_signature``/``write_template``/``make_template_hash`` of
``mlx/backend/common/metal_kernel.cpp`` and ``build_kernel`` of
``mlx/backend/cuda/custom_kernel.cpp``.

``inputs`` may be ``mx.array`` objects or anything with ``.dtype``, ``.ndim``
and ``.size``; dtypes may be ``mx.Dtype`` values or their names
(``"float32"``, ``"bfloat16"``, ...).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "METAL_ATTRIBUTES",
    "MAX_CONSTANT_ARRAY_SIZE",
    "dtype_name",
    "metal_type",
    "cuda_type",
    "shape_infos",
    "metal_attributes_used",
    "metal_template_def",
    "metal_kernel_name",
    "metal_signature_params",
    "metal_source",
    "cuda_kernel_name",
    "cuda_source",
]

# Inputs with fewer elements than this are passed in the `constant` address space.
MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute name, MSL type) in the order MLX emits them.
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# Both backends spell the fixed-width integers and bool the same way.
_COMMON_TYPES = {"bool": "bool", "float32": "float", "float64": "double"}
_COMMON_TYPES.update({f"{u}int{w}": f"{u}int{w}_t" for u in ("", "u") for w in (8, 16, 32, 64)})

_METAL_TYPES = {**_COMMON_TYPES, "float16": "float16_t", "bfloat16": "bfloat16_t",
                "complex64": "complex64_t"}

_CUDA_TYPES = {**_COMMON_TYPES, "float16": "__half", "bfloat16": "__nv_bfloat16",
               "complex64": "mlx::core::cu::complex64_t"}


def dtype_name(dtype: Any) -> str:
    """Canonical name of a dtype: ``mx.float32`` / ``"float32"`` / numpy dtype -> ``"float32"``."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype)
        if name.startswith("mlx.core."):
            name = name[len("mlx.core."):]
    if name == "bool_":
        name = "bool"
    if name not in _METAL_TYPES:
        raise TypeError(f"unsupported dtype {dtype!r}")
    return name


def _is_dtype(value: Any) -> bool:
    if isinstance(value, (bool, int)):
        return False
    if isinstance(value, str):
        return value in _METAL_TYPES or value == "bool_"
    return type(value).__name__ == "Dtype"


def metal_type(dtype: Any) -> str:
    """MSL type string MLX uses for a dtype (``get_type_string``)."""
    return _METAL_TYPES[dtype_name(dtype)]


def cuda_type(dtype: Any) -> str:
    """CUDA type string MLX uses for a dtype (``dtype_to_cuda_type``)."""
    return _CUDA_TYPES[dtype_name(dtype)]


def shape_infos(source: str, input_names: Sequence[str]) -> list[tuple[bool, bool, bool]]:
    """For each input: does the body mention ``<name>_shape``, ``_strides``, ``_ndim``?"""
    return [
        (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def metal_attributes_used(source: str) -> list[tuple[str, str]]:
    """The thread attributes whose name occurs in the body (substring search, like MLX)."""
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def _template_value_metal(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(int(value))
    if _is_dtype(value):
        return metal_type(value)
    raise TypeError(
        "[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, `int` or `bool`."
    )


def _template_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if _is_dtype(value):
        return "typename"
    raise TypeError(
        "[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, `int` or `bool`."
    )


def metal_template_def(template: Sequence[tuple[str, Any]] | None) -> str:
    """``<float, 3, 1>`` (``write_template``); empty string without template arguments."""
    if not template:
        return ""
    return "<" + ", ".join(_template_value_metal(v) for _, v in template) + ">"


def _template_hash(template_def: str) -> str:
    # '<' and '>' become '_', ", " becomes '_', then the last character is dropped.
    out: list[str] = []
    i = 0
    while i < len(template_def):
        c = template_def[i]
        if c in "<>":
            out.append("_")
        elif c == "," and i + 1 < len(template_def) and template_def[i + 1] == " ":
            out.append("_")
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)[:-1]


def _ndim(x: Any) -> int:
    return int(x.ndim)


def _size(x: Any) -> int:
    return int(x.size)


def metal_kernel_name(
    name: str,
    inputs: Sequence[Any],
    output_dtypes: Sequence[Any],
    template: Sequence[tuple[str, Any]] | None = None,
) -> str:
    """The mangled kernel name MLX gives a metal_kernel call."""
    kname = "custom_kernel_" + name
    if template:
        kname += "_" + _template_hash(metal_template_def(template))
    for x in inputs:
        kname += "_" + metal_type(x.dtype)
        if _ndim(x) == 0:
            kname += "s"
        elif _size(x) < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for d in output_dtypes:
        kname += "_" + metal_type(d)
    return kname


def metal_signature_params(
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    inputs: Sequence[Any],
    output_dtypes: Sequence[Any],
    atomic_outputs: bool = False,
) -> list[dict]:
    """Structured description of the generated parameter list, in order.

    Each entry: ``{"kind": "input"|"shape"|"strides"|"ndim"|"output"|"attr",
    "name", "space" ("device"|"constant"|None), "type" (MSL element type),
    "ref" ("*"|"&"|""), "index" (buffer index or None), "of" (input index for
    shape/strides/ndim, output index for outputs)}``.
    """
    infos = shape_infos(source, input_names)
    params: list[dict] = []
    index = 0
    for i, (n, x) in enumerate(zip(input_names, inputs)):
        space = "constant" if _size(x) < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if _ndim(x) == 0 else "*"
        params.append(dict(kind="input", name=n, space=space, type=metal_type(x.dtype),
                           ref=ref, index=index, of=i))
        index += 1
        if _ndim(x) > 0:
            has_shape, has_strides, has_ndim = infos[i]
            if has_shape:
                params.append(dict(kind="shape", name=n + "_shape", space="constant",
                                   type="int", ref="*", index=index, of=i))
                index += 1
            if has_strides:
                params.append(dict(kind="strides", name=n + "_strides", space="constant",
                                   type="int64_t", ref="*", index=index, of=i))
                index += 1
            if has_ndim:
                params.append(dict(kind="ndim", name=n + "_ndim", space="constant",
                                   type="int", ref="&", index=index, of=i))
                index += 1
    for j, (n, d) in enumerate(zip(output_names, output_dtypes)):
        t = metal_type(d)
        if atomic_outputs:
            t = f"atomic<{t}>"
        params.append(dict(kind="output", name=n, space="device", type=t, ref="*",
                           index=index, of=j))
        index += 1
    for attr, t in metal_attributes_used(source):
        params.append(dict(kind="attr", name=attr, space=None, type=t, ref="",
                           index=None, of=None))
    return params


def _check_counts(input_names, inputs, output_names, output_dtypes, tag):
    if not output_names:
        raise ValueError(f"{tag} Must specify at least one output.")
    if len(inputs) != len(input_names):
        raise ValueError(
            f"{tag} Expected `inputs` to have size {len(input_names)} but got size {len(inputs)}."
        )
    if len(output_dtypes) != len(output_names):
        raise ValueError(
            f"{tag} Expected `output_dtypes` to have size {len(output_names)} "
            f"but got size {len(output_dtypes)}."
        )


def metal_source(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str,
    inputs: Sequence[Any],
    output_dtypes: Sequence[Any],
    template: Sequence[tuple[str, Any]] | None = None,
    atomic_outputs: bool = False,
) -> tuple[str, str]:
    """Return ``(kernel_name, full_text)`` exactly as ``mx.fast.metal_kernel`` builds them.

    (MLX compiles ``utils.h`` + this text; the simulator supplies its own equivalent of
    ``utils.h``.)
    """
    input_names = list(input_names)
    output_names = list(output_names)
    inputs = list(inputs)
    output_dtypes = list(output_dtypes)
    template = list(template or [])
    _check_counts(input_names, inputs, output_names, output_dtypes, "[metal_kernel]")

    kname = metal_kernel_name(name, inputs, output_dtypes, template)
    infos = shape_infos(source, input_names)
    attributes = [f"  {t} {a} [[{a}]]" for a, t in metal_attributes_used(source)]

    parts: list[str] = [header]
    if template:
        parts.append(
            "template <" + ", ".join(f"{_template_kind(v)} {n}" for n, v in template) + ">\n"
        )
    parts.append(f"[[kernel]] void {kname}(\n")

    index = 0
    for i, (n, x) in enumerate(zip(input_names, inputs)):
        location = "constant" if _size(x) < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if _ndim(x) == 0 else "*"
        parts.append(f"  const {location} {metal_type(x.dtype)}{ref} {n} [[buffer({index})]],\n")
        index += 1
        if _ndim(x) > 0:
            has_shape, has_strides, has_ndim = infos[i]
            if has_shape:
                parts.append(f"  const constant int* {n}_shape [[buffer({index})]],\n")
                index += 1
            if has_strides:
                parts.append(f"  const constant int64_t* {n}_strides [[buffer({index})]],\n")
                index += 1
            if has_ndim:
                parts.append(f"  const constant int& {n}_ndim [[buffer({index})]],\n")
                index += 1

    # MLX compares the running buffer index (which counts shape/stride buffers too)
    # with len(inputs) + len(outputs) - 1 to decide how to close an output line;
    # replicate that comparison as is.
    n_in, n_out = len(inputs), len(output_names)
    for j, (n, d) in enumerate(zip(output_names, output_dtypes)):
        t = metal_type(d)
        if atomic_outputs:
            t = f"atomic<{t}>"
        line = f"  device {t}* {n} [[buffer({index})]]"
        if index < n_in + n_out - 1 or attributes:
            line += ",\n"
        else:
            line += ") {\n"
        parts.append(line)
        index += 1

    for k, attr in enumerate(attributes):
        parts.append(attr + (",\n" if k < len(attributes) - 1 else ") {\n"))

    parts.append(source)
    parts.append("\n}\n")

    if template:
        tdef = kname + metal_template_def(template)
        parts.append(
            f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n'
        )
    return kname, "".join(parts)


_CUDA_DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

"""
# What the generated kernels use of MLX's device header, for compiling their text without MLX
# (nvcc here, standalone programs): the fixed-size shape and strides arrays MLX passes
MLX_CUDA_HEADER_STAND_IN = """#include <cstdint>
#include <cuda/std/array>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define MAX_NDIM 8
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;"""


def without_mlx_header(text: str) -> str:
    """A kernel's CUDA text (``cuda_source``) with MLX's device header replaced by
    ``MLX_CUDA_HEADER_STAND_IN``."""
    return text.replace('#include "mlx/backend/cuda/device/utils.cuh"', MLX_CUDA_HEADER_STAND_IN)


def cuda_kernel_name(name: str, template: Sequence[tuple[str, Any]] | None = None) -> str:
    """``custom_kernel_<name>`` + ``_<arg>`` per template argument (``_t``/``_f`` for bools)."""
    kname = "custom_kernel_" + name
    for _, v in template or []:
        if isinstance(v, bool):
            kname += "_t" if v else "_f"
        elif isinstance(v, int):
            kname += f"_{int(v)}"
        elif _is_dtype(v):
            kname += "_" + metal_type(v)  # MLX uses get_type_string here too
        else:
            raise TypeError(
                "[cuda_kernel] Invalid template argument. Must be `mlx.core.Dtype`, `int` or `bool`."
            )
    return kname


def cuda_source(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str,
    inputs: Sequence[Any],
    output_dtypes: Sequence[Any],
    template: Sequence[tuple[str, Any]] | None = None,
) -> tuple[str, str]:
    """Return ``(kernel_name, full_text)`` exactly as ``mx.fast.cuda_kernel`` builds them."""
    input_names = list(input_names)
    output_names = list(output_names)
    inputs = list(inputs)
    output_dtypes = list(output_dtypes)
    template = list(template or [])
    _check_counts(input_names, inputs, output_names, output_dtypes, "[custom_kernel]")

    kname = cuda_kernel_name(name, template)
    infos = shape_infos(source, input_names)
    parts: list[str] = [
        _CUDA_DEFAULT_HEADER,
        header,
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
        f"__global__ void {kname}(\n",
    ]
    for i, (n, x) in enumerate(zip(input_names, inputs)):
        parts.append(f"    const {cuda_type(x.dtype)}* {n},\n")
        if _ndim(x) > 0:
            has_shape, has_strides, has_ndim = infos[i]
            if has_shape:
                parts.append(f"    const __grid_constant__ Shape {n}_shape,\n")
            if has_strides:
                parts.append(f"    const __grid_constant__ Strides {n}_strides,\n")
            if has_ndim:
                parts.append(f"    const __grid_constant__ int {n}_ndim,\n")
    for j, (n, d) in enumerate(zip(output_names, output_dtypes)):
        parts.append(f"    {cuda_type(d)}* {n}" + (",\n" if j < len(output_names) - 1 else ") {\n"))
    if template:
        for n, v in template:
            if isinstance(v, bool):
                parts.append(f"  constexpr bool {n} = {'true' if v else 'false'};\n")
            elif isinstance(v, int):
                parts.append(f"  constexpr int {n} = {int(v)};\n")
            else:
                parts.append(f"  using {n} = {cuda_type(v)};\n")
        parts.append("\n")
    parts.append(source)
    parts.append("\n}\n\n} // namespace mlx::core::cu\n")
    return kname, "".join(parts)

