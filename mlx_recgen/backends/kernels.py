"""The kernel backends — Metal, CUDA and the Metal simulator — behind one piece of glue.

All three take the same call (``mx.fast.metal_kernel``, ``mx.fast.cuda_kernel`` and
``mlx_recgen.sim.metal_kernel`` share it), so buffers, grids, template parameters and the
post-kernel MLX sums are identical across targets: what the simulator and the GPU test is what
a Mac runs.

Forward kernel:  inputs..., <state>_init..., meta  ->  outputs..., <state>_final..., <state>_ckpt...
Backward kernel: inputs..., <state>_ckpt..., d_<output>..., d_<state>_final..., meta
                 ->  d_<input>..., d_<state>_init... [, scratch]
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..layout import declared_shape
from ..render.dialects import DIALECTS
from ..render.kernels import KernelRenderer
from ..render.names import kernel_identifiers, kernel_name
from ..schedule import MetaLayout, history_rows, make_schedule


def _dtype_name(d) -> str:
    return str(d).replace("mlx.core.", "")


def _as_buffer(x):
    """MLX passes a 0-d input as a reference (``const constant T&``), which the kernels cannot
    index; pass it as shape (1,) instead (same element, same address space)."""
    return mx.reshape(x, (1,)) if x.ndim == 0 else x


def kernel_factory(backend: str):
    """The kernel constructor of a backend (same signature for all three)."""
    if backend == "metal":
        if not mx.metal.is_available():
            raise RuntimeError("backend='metal' needs MLX with Metal (Apple silicon); use "
                               "backend='metal-sim' to run the Metal kernels on the CPU")
        return mx.fast.metal_kernel
    if backend == "cuda":
        if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
            raise RuntimeError("backend='cuda' needs MLX's CUDA build on an NVIDIA GPU "
                               "(pip install 'mlx[cuda13]')")
        return mx.fast.cuda_kernel
    if backend == "metal-sim":
        from ..sim import metal_kernel

        return metal_kernel
    raise ValueError(f"not a kernel backend: {backend!r}")


@dataclass(frozen=True)
class _Buffers:
    inputs: list
    outputs: list


class KernelBackend:
    """Runs a recurrence with generated kernels on one of the kernel backends."""

    def __init__(self, rec, backend: str):
        self.rec, self.name = rec, backend
        self.dialect = DIALECTS[backend]
        self.meta = MetaLayout(rec.spec)
        self.ids = kernel_identifiers(rec, self.meta)
        self._factory = None
        self._kernels = {}

    # -- names -----------------------------------------------------------------------------------
    def buffers(self, kind, schedule) -> _Buffers:
        s, ids = self.rec.spec, self.ids
        if kind == "forward":
            return _Buffers([*(ids["buffer", t] for t in s.inputs),
                             *(ids["init", t] for t in s.states), "meta"],
                            [*(ids["buffer", t] for t in s.outputs),
                             *(ids["final", t] for t in s.states),
                             *(ids["ckpt", t] for t in s.states)])
        outs = [*(ids["d", t] for t in s.inputs), *(ids["d_init", t] for t in s.states)]
        if schedule.history == "scratch":
            outs.append("scratch")
        return _Buffers([*(ids["buffer", t] for t in s.inputs), *(ids["ckpt", t] for t in s.states),
                         *(ids["d", t] for t in s.outputs), *(ids["d_final", t] for t in s.states),
                         "meta"], outs)

    def render(self, kind, schedule, dtypes_text):
        """(body, header) of a kernel."""
        r = KernelRenderer(self.rec, self.dialect, schedule, self.ids)
        body = r.forward() if kind == "forward" else r.backward()
        return body, r.header(kind, dtypes_text)

    def kernel(self, kind, schedule, dtypes_text):
        key = (kind, schedule, dtypes_text)
        if key not in self._kernels:
            if self._factory is None:
                self._factory = kernel_factory(self.name)
            body, header = self.render(kind, schedule, dtypes_text)
            names = self.buffers(kind, schedule)
            self._kernels[key] = self._factory(
                name=kernel_name(self.rec.spec.name, kind), input_names=names.inputs,
                output_names=names.outputs, source=body, header=header)
        return self._kernels[key]

    # -- shapes ----------------------------------------------------------------------------------
    def _schedule(self, sizes, seg, threads):
        return make_schedule(self.rec.spec, sizes, seg, threads)

    def _launch(self, sizes, schedule):
        instances = 1
        for b in self.rec.spec.batch_axes:
            instances *= sizes[b]
        total = instances * schedule.groups_per_instance * schedule.threads
        if total >= 2**31:
            raise ValueError(f"{self.rec.spec.name}: {total} threads exceed one kernel launch "
                             "(2^31); split the batch")
        return instances, (total, 1, 1), (schedule.threads, 1, 1)

    def _meta(self, sizes, schedule):
        return mx.array(self.meta.values(sizes, schedule), dtype=mx.int64)

    def _ckpt_shape(self, t, sizes, schedule, instances):
        """(segments, instances, components, rows, lanes): NS rows for a vector state, one for a
        scalar state."""
        segments = -(-sizes[self.rec.spec.time] // schedule.seg)
        rows = schedule.state_size if t.has_state_axis else 1
        return (segments, instances, t.components, rows, sizes[self.rec.spec.lane])

    # -- passes ----------------------------------------------------------------------------------
    def forward(self, inputs, states, sizes, seg, out_dtype, threads=None):
        spec = self.rec.spec
        sch = self._schedule(sizes, seg, threads)
        instances, grid, group = self._launch(sizes, sch)
        dtypes = ", ".join(_dtype_name(x.dtype) for x in inputs) + f" -> {_dtype_name(out_dtype)}"
        kernel = self.kernel("forward", sch, dtypes)
        inputs = [_as_buffer(x) for x in inputs]
        shapes = [declared_shape(t, sizes) for t in spec.outputs.values()]
        shapes += [declared_shape(t, sizes) for t in spec.states.values()]
        shapes += [self._ckpt_shape(t, sizes, sch, instances) for t in spec.states.values()]
        n_out, n_state = len(spec.outputs), len(spec.states)
        dtypes_out = [out_dtype] * n_out + [mx.float32] * (2 * n_state)
        results = kernel(inputs=[*inputs, *states, self._meta(sizes, sch)],
                         template=[*sch.template(), ("OutT", out_dtype)], grid=grid,
                         threadgroup=group, output_shapes=shapes, output_dtypes=dtypes_out)
        return (list(results[:n_out]), list(results[n_out:n_out + n_state]),
                list(results[n_out + n_state:]))

    def backward(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg, threads=None):
        spec = self.rec.spec
        sch = self._schedule(sizes, seg, threads)
        instances, grid, group = self._launch(sizes, sch)
        dtypes = ", ".join(_dtype_name(x.dtype) for x in [*inputs, *d_outputs])
        kernel = self.kernel("backward", sch, dtypes)
        shapes = [self.meta.grad_shape(t, sizes, sch) for t in spec.inputs.values()]
        shapes += [declared_shape(t, sizes) for t in spec.states.values()]
        if sch.history == "scratch":
            shapes.append((sch.seg * history_rows(spec, sch.state_size) * instances
                           * sch.groups_per_instance * sch.threads,))
        results = kernel(inputs=[*map(_as_buffer, inputs), *residuals, *d_outputs,
                                 *[g.astype(mx.float32) for g in d_finals], self._meta(sizes, sch)],
                         template=sch.template(), grid=grid, threadgroup=group,
                         output_shapes=shapes, output_dtypes=[mx.float32] * len(shapes))
        grads = []
        for t, x, g in zip(spec.inputs.values(), inputs, results):
            # partial sums over lane groups, batch axes the input lacks: a deterministic MLX sum
            lead = len(self.meta.grad_lead(t, sizes, sch))
            if lead:
                g = mx.sum(g, axis=tuple(range(lead)))
            grads.append(g.astype(x.dtype))
        n_in = len(spec.inputs)
        d_init = [g.astype(x.dtype) for g, x in zip(results[n_in:n_in + len(spec.states)], states)]
        return grads, d_init


class _ArrayInfo:
    """Stands in for an input array when only its dtype, rank and size matter."""

    def __init__(self, dtype, ndim, size=1 << 20):
        self.dtype, self.ndim, self.size = dtype, ndim, size


def _input_info(dtype, t):
    """An input as the kernel receives it (a 0-d input as shape (1,), see ``_as_buffer``)."""
    return _ArrayInfo(dtype, len(t.axes)) if t.axes else _ArrayInfo(dtype, 1, 1)


def kernel_source(rec, kind, backend, dtype=mx.float32, seg=32, state_size=16, lanes=64,
                  threads=None):
    """The full text of a kernel as the backend compiles it (MLX's generated signature included),
    for inputs of ``dtype`` and the schedule those sizes give."""
    from .mlx_source import cuda_source, metal_source

    if backend not in ("metal", "cuda", "metal-sim"):
        raise ValueError(f"backend must be 'metal', 'cuda' or 'mlx', got {backend!r}")
    spec = rec.spec
    sizes = {a: 4 for a in spec.batch_axes}
    sizes.update({spec.time: 128, spec.lane: lanes})
    if spec.state_axis:
        sizes[spec.state_axis] = state_size
    impl = KernelBackend(rec, backend)
    sch = impl._schedule(sizes, seg, threads)
    names = impl.buffers(kind, sch)
    n_in = len(spec.inputs)
    if kind == "forward":
        dtypes_text = ", ".join([_dtype_name(dtype)] * n_in) + f" -> {_dtype_name(dtype)}"
        infos = [_input_info(dtype, t) for t in spec.inputs.values()]
        infos += [_ArrayInfo(mx.float32, len(t.axes)) for t in spec.states.values()]
        out_dtypes = [dtype] * len(spec.outputs) + [mx.float32] * (2 * len(spec.states))
        template = [*sch.template(), ("OutT", dtype)]
    else:
        dtypes_text = ", ".join([_dtype_name(dtype)] * (n_in + len(spec.outputs)))
        infos = [_input_info(dtype, t) for t in spec.inputs.values()]
        infos += [_ArrayInfo(mx.float32, 5) for _ in spec.states]
        infos += [_ArrayInfo(dtype, len(t.axes)) for t in spec.outputs.values()]
        infos += [_ArrayInfo(mx.float32, len(t.axes)) for t in spec.states.values()]
        out_dtypes = [mx.float32] * len(names.outputs)
        template = sch.template()
    infos.append(_ArrayInfo(mx.int64, 1, len(impl.meta.keys)))
    body, header = impl.render(kind, sch, dtypes_text)
    build = cuda_source if backend == "cuda" else metal_source
    _, text = build(kernel_name(spec.name, kind), names.inputs, names.outputs, body, header,
                    infos, out_dtypes, template)
    return text
