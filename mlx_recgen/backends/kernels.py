"""The kernel backends — Metal, CUDA and the Metal simulator — behind one piece of glue.

All three take the same call (``mx.fast.metal_kernel``, ``mx.fast.cuda_kernel`` and
``mlx_recgen.sim.metal_kernel`` share it), so buffers, grids, template parameters and the
post-kernel MLX sums are identical across targets: what the simulator and the GPU test is what
a Mac runs.

Sequential schedule (one kernel per pass):

  forward:  inputs..., <state>_init..., meta  ->  outputs..., <state>_final..., <state>_ckpt...
  backward: inputs..., <state>_ckpt..., d_<output>..., d_<state>_final..., meta
            ->  d_<input>..., d_<state>_init... [, scratch]

Chunked schedule (three kernels per pass, ``render/chunked.py``):

  summary:  inputs..., meta  ->  <state>_local..., prod<b>...
  carry:    <state>_init..., <state>_local..., prod<b>..., meta  ->  <state>_final..., <state>_ckpt...
  outputs:  inputs..., <state>_ckpt..., meta  ->  outputs...
  residuals of the forward: <state>_ckpt..., prod<b>...

  local adjoints: inputs..., <state>_ckpt..., d_<output>..., meta  ->  <state>_local...
  carry:    d_<state>_final..., <state>_local..., prod<b>..., meta  ->  d_<state>_init..., <state>_lamend...
  gradients: inputs..., <state>_ckpt..., d_<output>..., <state>_lamend..., meta  ->  d_<input>...
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..layout import declared_shape
from ..render.dialects import DIALECTS
from ..render.chunked import ChunkedRenderer
from ..render.kernels import KernelRenderer
from ..schedule import MetaLayout, make_schedule


def _dtype_name(d) -> str:
    return str(d).replace("mlx.core.", "")


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
        self._factory = None
        self._kernels = {}

    # -- names -----------------------------------------------------------------------------------
    def buffers(self, kind, schedule) -> _Buffers:
        """Input and output buffer names of a kernel (see the module docstring)."""
        s = self.rec.spec
        states = list(s.states)
        local = [f"{t}_local" for t in states]
        ckpt = [f"{t}_ckpt" for t in states]
        prods = [ChunkedRenderer.product_buffer(b) for b in range(len(self.rec.affine.blocks))]
        d_outs = [f"d_{t}" for t in s.outputs]
        chunked = {
            "summary": ([*s.inputs, "meta"], [*local, *prods]),
            "carry": ([*(f"{t}_init" for t in states), *local, *prods, "meta"],
                      [*(f"{t}_final" for t in states), *ckpt]),
            "outputs": ([*s.inputs, *ckpt, "meta"], list(s.outputs)),
            "local_adjoint": ([*s.inputs, *ckpt, *d_outs, "meta"], local),
            "adjoint_carry": ([*(f"d_{t}_final" for t in states), *local, *prods, "meta"],
                              [*(f"d_{t}_init" for t in states), *(f"{t}_lamend" for t in states)]),
            "gradients": ([*s.inputs, *ckpt, *d_outs, *(f"{t}_lamend" for t in states), "meta"],
                          [f"d_{t}" for t in s.inputs]),
        }
        if kind in chunked:
            return _Buffers(*chunked[kind])
        if kind == "forward":
            return _Buffers([*s.inputs, *(f"{t}_init" for t in s.states), "meta"],
                            [*s.outputs, *(f"{t}_final" for t in s.states),
                             *(f"{t}_ckpt" for t in s.states)])
        outs = [*(f"d_{t}" for t in s.inputs), *(f"d_{t}_init" for t in s.states)]
        if schedule.history == "scratch":
            outs.append("scratch")
        return _Buffers([*s.inputs, *(f"{t}_ckpt" for t in s.states), *(f"d_{t}" for t in s.outputs),
                         *(f"d_{t}_final" for t in s.states), "meta"], outs)

    def render(self, kind, schedule, dtypes_text):
        """(body, header) of a kernel."""
        if schedule.kind == "chunked":
            r = ChunkedRenderer(self.rec, self.dialect, schedule)
            body = {"summary": r.summary, "carry": lambda: r.carry(reverse=False),
                    "outputs": r.forward, "local_adjoint": lambda: r.backward(lambda_only=True),
                    "adjoint_carry": lambda: r.carry(reverse=True),
                    "gradients": r.backward}[kind]()
        else:
            r = KernelRenderer(self.rec, self.dialect, schedule)
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
                name=f"recgen_{self.rec.spec.name}_{kind}", input_names=names.inputs,
                output_names=names.outputs, source=body, header=header)
        return self._kernels[key]

    # -- shapes ----------------------------------------------------------------------------------
    def _schedule(self, sizes, seg, threads, kind="sequential"):
        spec = self.rec.spec
        rows = sum((sizes[spec.state_axis] if t.has_state_axis else 1) * t.components
                   for t in spec.inputs.values() if not t.has_lane)
        return make_schedule(spec, sizes, seg, threads, shared_floats=rows, kind=kind)

    def _launch(self, sizes, schedule, outer=1):
        """(instances, grid, threadgroup): one thread per (instance, lane), times ``outer`` for
        the chunked schedule's kernels (one per segment, or per state element for the carry;
        outermost)."""
        instances = 1
        for b in self.rec.spec.batch_axes:
            instances *= sizes[b]
        total = instances * schedule.groups_per_instance * schedule.threads * outer
        if total >= 2**31:
            raise ValueError(f"{self.rec.spec.name}: {total} threads exceed one kernel launch "
                             "(2^31); split the batch")
        return instances, (total, 1, 1), (schedule.threads, 1, 1)

    def _meta(self, sizes, schedule):
        return mx.array(self.meta.values(sizes, schedule), dtype=mx.int64)

    def _ckpt_shape(self, t, sizes, schedule, instances):
        segments = -(-sizes[self.rec.spec.time] // schedule.seg)
        width = schedule.state_size if t.has_state_axis else 1
        return (segments, instances, t.components, width, sizes[self.rec.spec.lane])

    def _state_buffer_shapes(self, sizes, schedule, instances):
        return [self._ckpt_shape(t, sizes, schedule, instances) for t in self.rec.spec.states.values()]

    def _product_shapes(self, sizes, schedule, instances):
        segments = -(-sizes[self.rec.spec.time] // schedule.seg)
        return [(segments, instances, b.size * b.size, schedule.state_size if b.pointwise else 1,
                 sizes[self.rec.spec.lane]) for b in self.rec.affine.blocks]

    def residual_shapes(self, sizes, seg, threads=None):
        """Shapes of the chunked forward's residuals: checkpoints, then segment products."""
        sch = self._schedule(sizes, seg, threads, kind="chunked")
        instances = self._launch(sizes, sch)[0]
        return (self._state_buffer_shapes(sizes, sch, instances)
                + self._product_shapes(sizes, sch, instances))

    def _run(self, kind, sch, sizes, inputs, shapes, dtypes, dtypes_text, template=()):
        outer = sch.state_size if kind in ("carry", "adjoint_carry") else \
            -(-sizes[self.rec.spec.time] // sch.seg)
        instances, grid, group = self._launch(sizes, sch, outer=outer)
        kernel = self.kernel(kind, sch, dtypes_text)
        return kernel(inputs=[*inputs, self._meta(sizes, sch)],
                      template=[*sch.template(), *template], grid=grid, threadgroup=group,
                      output_shapes=shapes, output_dtypes=dtypes)

    # -- passes ----------------------------------------------------------------------------------
    def forward(self, inputs, states, sizes, seg, out_dtype, threads=None, schedule="sequential"):
        if schedule == "chunked":
            return self._forward_chunked(inputs, states, sizes, seg, out_dtype, threads)
        spec = self.rec.spec
        sch = self._schedule(sizes, seg, threads)
        instances, grid, group = self._launch(sizes, sch)
        dtypes = ", ".join(_dtype_name(x.dtype) for x in inputs) + f" -> {_dtype_name(out_dtype)}"
        kernel = self.kernel("forward", sch, dtypes)
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

    def backward(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg, threads=None,
                 schedule="sequential"):
        if schedule == "chunked":
            return self._backward_chunked(inputs, states, residuals, d_outputs, d_finals, sizes,
                                          seg, threads)
        spec = self.rec.spec
        sch = self._schedule(sizes, seg, threads)
        instances, grid, group = self._launch(sizes, sch)
        dtypes = ", ".join(_dtype_name(x.dtype) for x in [*inputs, *d_outputs])
        kernel = self.kernel("backward", sch, dtypes)
        shapes = [self.meta.grad_shape(t, sizes) for t in spec.inputs.values()]
        shapes += [declared_shape(t, sizes) for t in spec.states.values()]
        if sch.history == "scratch":
            slots = sum(t.components for t in spec.states.values())
            shapes.append((sch.seg * slots * sch.state_size * instances * sch.groups_per_instance
                           * sch.threads,))
        results = kernel(inputs=[*inputs, *residuals, *d_outputs,
                                 *[g.astype(mx.float32) for g in d_finals], self._meta(sizes, sch)],
                         template=sch.template(), grid=grid, threadgroup=group,
                         output_shapes=shapes, output_dtypes=[mx.float32] * len(shapes))
        n_in = len(spec.inputs)
        grads = self._finish_grads(inputs, results[:n_in])
        d_init = [g.astype(x.dtype) for g, x in zip(results[n_in:n_in + len(spec.states)], states)]
        return grads, d_init

    def _finish_grads(self, inputs, results):
        """Sum the kernel's gradient buffers over their leading axes (batch axes the input
        lacks; segments, for the chunked schedule's parameter gradients) in a fixed order."""
        grads = []
        for t, x, g in zip(self.rec.spec.inputs.values(), inputs, results):
            lead = g.ndim - len(t.axes)
            if lead:
                g = mx.sum(g, axis=tuple(range(lead)))
            grads.append(g.astype(x.dtype))
        return grads

    # -- the chunked schedule --------------------------------------------------------------------
    def _forward_chunked(self, inputs, states, sizes, seg, out_dtype, threads):
        spec = self.rec.spec
        sch = self._schedule(sizes, seg, threads, kind="chunked")
        instances = self._launch(sizes, sch)[0]
        in_dtypes = ", ".join(_dtype_name(x.dtype) for x in inputs)
        n_state = len(spec.states)
        per_state = self._state_buffer_shapes(sizes, sch, instances)
        prods = self._product_shapes(sizes, sch, instances)
        f32 = mx.float32
        summary = self._run("summary", sch, sizes, inputs, per_state + prods,
                            [f32] * (n_state + len(prods)), in_dtypes)
        local, prod = list(summary[:n_state]), list(summary[n_state:])
        state_shapes = [declared_shape(t, sizes) for t in spec.states.values()]
        carried = self._run("carry", sch, sizes, [*states, *local, *prod],
                            state_shapes + per_state, [f32] * (2 * n_state),
                            ", ".join(_dtype_name(x.dtype) for x in states))
        finals, ckpts = list(carried[:n_state]), list(carried[n_state:])
        outs = self._run("outputs", sch, sizes, [*inputs, *ckpts],
                         [declared_shape(t, sizes) for t in spec.outputs.values()],
                         [out_dtype] * len(spec.outputs),
                         in_dtypes + f" -> {_dtype_name(out_dtype)}", [("OutT", out_dtype)])
        return list(outs), finals, ckpts + prod

    def _backward_chunked(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg,
                          threads):
        spec = self.rec.spec
        sch = self._schedule(sizes, seg, threads, kind="chunked")
        instances = self._launch(sizes, sch)[0]
        n_state = len(spec.states)
        ckpts, prods = residuals[:n_state], residuals[n_state:]
        per_state = self._state_buffer_shapes(sizes, sch, instances)
        dtypes = ", ".join(_dtype_name(x.dtype) for x in [*inputs, *d_outputs])
        f32 = mx.float32
        local = self._run("local_adjoint", sch, sizes, [*inputs, *ckpts, *d_outputs], per_state,
                          [f32] * n_state, dtypes)
        carried = self._run("adjoint_carry", sch, sizes,
                            [*[g.astype(f32) for g in d_finals], *local, *prods],
                            [declared_shape(t, sizes) for t in spec.states.values()] + per_state,
                            [f32] * (2 * n_state), "float32")
        d_init, lam_end = carried[:n_state], list(carried[n_state:])
        segments = -(-sizes[spec.time] // sch.seg)
        shapes = [((segments,) if not t.has_time else ()) + self.meta.grad_shape(t, sizes)
                  for t in spec.inputs.values()]
        results = self._run("gradients", sch, sizes, [*inputs, *ckpts, *d_outputs, *lam_end],
                            shapes, [f32] * len(shapes), dtypes)
        grads = self._finish_grads(inputs, results)
        return grads, [g.astype(x.dtype) for g, x in zip(d_init, states)]


class _ArrayInfo:
    """Stands in for an input array when only its dtype, rank and size matter."""

    def __init__(self, dtype, ndim, size=1 << 20):
        self.dtype, self.ndim, self.size = dtype, ndim, size


SEQUENTIAL_KERNELS = ("forward", "backward")
CHUNKED_KERNELS = ("summary", "carry", "outputs", "local_adjoint", "adjoint_carry", "gradients")


def kernel_source(rec, kind, backend, dtype=mx.float32, seg=32, state_size=16, lanes=64,
                  threads=None, schedule="sequential"):
    """The full text of a kernel as the backend compiles it (MLX's generated signature included),
    for inputs of ``dtype`` and the schedule those sizes give. ``kind`` names a kernel of the
    schedule: ``SEQUENTIAL_KERNELS`` or ``CHUNKED_KERNELS``."""
    from .mlx_source import cuda_source, metal_source

    if backend not in ("metal", "cuda", "metal-sim"):
        raise ValueError(f"backend must be 'metal', 'cuda' or 'mlx', got {backend!r}")
    kinds = {"sequential": SEQUENTIAL_KERNELS, "chunked": CHUNKED_KERNELS}.get(schedule)
    if kinds is None:
        raise ValueError(f"schedule must be 'sequential' or 'chunked', got {schedule!r}")
    if kind not in kinds:
        raise ValueError(f"the {schedule} schedule's kernels are {kinds}, got {kind!r}")
    if schedule == "chunked" and not rec.time_parallel:
        raise ValueError(f"{rec.name} has no chunked kernels: {rec.affine.reason}")
    spec = rec.spec
    sizes = {a: 4 for a in spec.batch_axes}
    sizes.update({spec.time: 128, spec.lane: lanes})
    if spec.state_axis:
        sizes[spec.state_axis] = state_size
    impl = KernelBackend(rec, backend)
    sch = impl._schedule(sizes, seg, threads, kind=schedule)
    names = impl.buffers(kind, sch)

    def info(name):  # what MLX sees of each input buffer: dtype and rank
        if name == "meta":
            return _ArrayInfo(mx.int64, 1, len(impl.meta.names))
        if name in spec.inputs:
            return _ArrayInfo(dtype, len(spec.inputs[name].axes))
        if name.startswith("d_") and name[2:] in spec.outputs:
            return _ArrayInfo(dtype, len(spec.outputs[name[2:]].axes))
        state = next((t for t in spec.states.values()
                      if name in (f"{t.name}_init", f"d_{t.name}_final")), None)
        return _ArrayInfo(mx.float32, len(state.axes) if state else 5)

    infos = [info(n) for n in names.inputs]
    out_dtypes = [dtype if n in spec.outputs else mx.float32 for n in names.outputs]
    template = sch.template()
    if kind in ("forward", "outputs"):
        template = [*template, ("OutT", dtype)]
    dtypes_text = ", ".join(_dtype_name(i.dtype) for i in infos[:-1])
    body, header = impl.render(kind, sch, dtypes_text)
    build = cuda_source if backend == "cuda" else metal_source
    _, text = build(f"recgen_{spec.name}_{kind}", names.inputs, names.outputs, body, header,
                    infos, out_dtypes, template)
    return text
