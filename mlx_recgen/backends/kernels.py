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

  summary:  inputs..., meta  ->  <state>_local..., prod<b>..., hits<b>...
  carry:    <state>_init..., <state>_local..., prod<b>..., hits<b>..., meta
            ->  <state>_final..., <state>_ckpt...
  outputs:  inputs..., <state>_ckpt..., meta  ->  outputs...
  (the forward's residuals: <state>_ckpt..., prod<b>...)
  local adjoints: inputs..., <state>_ckpt..., d_<output>..., meta
            ->  <state>_local... [, hits<b>...]
  carry:    d_<state>_final..., <state>_local..., prod<b>... [, hits<b>...], meta
            ->  d_<state>_init..., <state>_lamend...
  (the backward's hits<b>: where its local adjoint counts zero hits, ``Recurrence.local_adjoint``)
  gradients: inputs..., <state>_ckpt..., d_<output>..., <state>_lamend..., meta  ->  d_<input>...

Scan schedule (one kernel per pass, ``render/scan.py``; the buffers of the sequential schedule,
with one checkpoint per stretch and no scratch):

  forward:  inputs..., <state>_init..., meta  ->  outputs..., <state>_final..., <state>_ckpt...
  backward: inputs..., <state>_ckpt..., d_<output>..., d_<state>_final..., meta
            ->  d_<input>..., d_<state>_init...

Buffer names are spelled through ``render.names`` (``u_`` + the spec's name). ``d_<input>``
exists for differentiable inputs only (bool and integer inputs get none). A shared state (without
the lane axis) has one lane in the buffers of its values (``_ckpt``, the forward's ``_local``) and
all lanes in those of its adjoint's shares (the backward's ``_local``, ``_lamend``, and
``d_<state>_init``, whose lane shares an MLX sum adds up after the kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ..errors import dtype_name
from ..function import vmap_guard
from ..layout import declared_shape
from ..memo import LRU
from ..render.chunked import ChunkedRenderer
from ..render.dialects import DIALECTS
from ..render.kernels import KernelRenderer
from ..render.names import kernel_identifiers, kernel_name
from ..render.scan import ScanRenderer, grad_type_name, run_type_name
from ..schedule import (MetaLayout, chunked_misfit, history_rows, make_scan_schedule,
                        make_schedule, scan_map_floats, scan_misfit, scan_run)


# Sizes of the memos: kernels by (kind, schedule, dtypes) — a schedule holds the bucketed
# segment, so short calls of any length share a few —, and schedules and meta arrays by shape.
KERNELS_KEPT = 64
SHAPES_KEPT = 128


def as_buffer(x):
    """MLX passes a 0-d input as a reference (``const constant T&``), which the kernels cannot
    index; pass it as shape (1,) instead (same element, same address space)."""
    return mx.reshape(x, (1,)) if x.ndim == 0 else x


def kernel_factory(backend: str):
    """The kernel constructor of a backend (same signature for all three). On Metal and CUDA
    each kernel it makes meets ``mx.vmap`` with a clear error (``_refusing_vmap``); the
    simulator reports vmap itself."""
    if backend == "metal":
        if not mx.metal.is_available():
            raise RuntimeError("backend='metal' needs MLX with Metal (Apple silicon); use "
                               "backend='metal-sim' to run the Metal kernels on the CPU")
        _require_gpu_device(backend)
        return _refusing_vmap(mx.fast.metal_kernel, backend)
    if backend == "cuda":
        if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
            raise RuntimeError("backend='cuda' needs MLX's CUDA build on an NVIDIA GPU "
                               "(pip install 'mlx[cuda13]')")
        _require_gpu_device(backend)
        return _refusing_vmap(mx.fast.cuda_kernel, backend)
    if backend == "metal-sim":
        from ..sim import metal_kernel

        return metal_kernel
    raise ValueError(f"not a kernel backend: {backend!r}")


def _require_gpu_device(backend: str) -> None:
    """Metal's and CUDA's kernels run on the GPU's stream; MLX fails on the CPU's."""
    if mx.default_device().type != mx.gpu:
        raise ValueError(f"backend={backend!r} runs its kernels on the GPU, but MLX's default "
                         "device is the CPU; pass backend='mlx' (or 'auto'), or "
                         "mx.set_default_device(mx.gpu)")


def _refusing_vmap(make_kernel, backend: str):
    """``make_kernel`` whose kernels take their last input (the runtime values) through
    ``function.vmap_guard``, a custom function of all the inputs whose vmap rule raises. A
    custom kernel has no batching rule, and MLX's vmap walks into the custom functions around
    it: the guard is met first, by any kernel, on any mapped input. One output, not one per
    input, because a custom function with a rule costs about a microsecond per output."""
    guard = vmap_guard(backend)

    def make(**definition):
        kernel = make_kernel(**definition)

        def launch(inputs, **call):
            return kernel(inputs=[*inputs[:-1], guard(*inputs)], **call)

        return launch

    return make


@dataclass(frozen=True)
class _Buffers:
    inputs: list
    outputs: list


@dataclass(frozen=True)
class _Launch:
    """A kernel call's arguments that the call's shape decides (schedule, kernel, grid, output
    shapes and dtypes, template, runtime values): worked out once per call shape
    (``KernelBackend.launch``), so a call passes only its arrays."""

    kernel: object
    meta: mx.array
    template: list
    grid: tuple
    group: tuple
    shapes: list
    dtypes: list

    def __call__(self, buffers):
        return self.kernel(inputs=[*buffers, self.meta], template=self.template, grid=self.grid,
                           threadgroup=self.group, output_shapes=self.shapes,
                           output_dtypes=self.dtypes)


class KernelBackend:
    """Runs a recurrence with generated kernels on one of the kernel backends."""

    def __init__(self, rec, backend: str):
        self.rec, self.name = rec, backend
        self.dialect = DIALECTS[backend]
        self.meta = MetaLayout(rec.spec)
        self.ids = kernel_identifiers(rec, self.meta)
        self._factory = None
        # bounded memos (memo.LRU): calls of ever new shapes do not grow them
        self._kernels = LRU(KERNELS_KEPT)  # (kind, schedule, dtypes) -> compiled kernel
        self._schedules = LRU(SHAPES_KEPT)  # (sizes, seg, threads, kind, split, sweep) -> Schedule
        self._metas = LRU(SHAPES_KEPT)  # (sizes, schedule) -> the runtime-values array
        self._launches = LRU(SHAPES_KEPT)  # (pass, sizes, options, dtypes) -> _Launch
        self.scan = ScanPasses(self)

    # -- names -----------------------------------------------------------------------------------
    def buffers(self, kind, schedule) -> _Buffers:
        """Input and output buffer names of a kernel (see the module docstring)."""
        s, ids = self.rec.spec, self.ids
        if schedule.kind == "chunked":
            return self._chunked_buffers(kind)
        if kind == "forward":
            lookback = schedule.kind == "scan" and schedule.lookback > 0  # ScanPasses.forward
            return _Buffers([*(ids["buffer", t] for t in s.inputs),
                             *(ids["init", t] for t in s.states),
                             *(["scan_words"] if lookback else []), "meta"],
                            [*(ids["buffer", t] for t in s.outputs),
                             *(ids["final", t] for t in s.states),
                             *(ids["ckpt", t] for t in s.states)])
        outs = [*(ids["d", t] for t in s.differentiable_inputs),
                *(ids["d_init", t] for t in s.states)]
        if schedule.history == "scratch":
            outs.append("scratch")
        return _Buffers([*(ids["buffer", t] for t in s.inputs), *(ids["ckpt", t] for t in s.states),
                         *(ids["d", t] for t in s.outputs), *(ids["d_final", t] for t in s.states),
                         "meta"], outs)

    def _chunked_buffers(self, kind) -> _Buffers:
        s, ids = self.rec.spec, self.ids
        inputs = [ids["buffer", t] for t in s.inputs]
        local = [ids["local", t] for t in s.states]
        ckpt = [ids["ckpt", t] for t in s.states]
        prods = [ChunkedRenderer.product_buffer(b) for b in range(len(self.rec.affine.blocks))]
        hits = [ChunkedRenderer.hits_buffer(b) for b in range(len(self.rec.affine.blocks))]
        backward_hits = hits if kind in ("local_adjoint", "adjoint_carry") and \
            self.rec.local_adjoint.counts_hits else []
        d_outs = [ids["d", t] for t in s.outputs]
        lamend = [ids["lamend", t] for t in s.states]
        table = {
            "summary": ([*inputs, "meta"], [*local, *prods, *hits]),
            "carry": ([*(ids["init", t] for t in s.states), *local, *prods, *hits, "meta"],
                      [*(ids["final", t] for t in s.states), *ckpt]),
            "outputs": ([*inputs, *ckpt, "meta"], [ids["buffer", t] for t in s.outputs]),
            "local_adjoint": ([*inputs, *ckpt, *d_outs, "meta"], [*local, *backward_hits]),
            "adjoint_carry": ([*(ids["d_final", t] for t in s.states), *local, *prods,
                               *backward_hits, "meta"],
                              [*(ids["d_init", t] for t in s.states), *lamend]),
            "gradients": ([*inputs, *ckpt, *d_outs, *lamend, "meta"],
                          [ids["d", t] for t in s.differentiable_inputs]),
        }
        if kind not in table:
            raise ValueError(f"the chunked schedule's kernels are {CHUNKED_KERNELS}, got {kind!r}")
        return _Buffers(*table[kind])

    def render(self, kind, schedule, dtypes_text):
        """(body, header) of a kernel."""
        if schedule.kind == "scan":
            r = ScanRenderer(self.rec, self.dialect, schedule, self.ids)
            body = r.forward() if kind == "forward" else r.backward()
        elif schedule.kind == "chunked":
            r = ChunkedRenderer(self.rec, self.dialect, schedule, self.ids)
            body = {"summary": r.summary, "carry": lambda: r.carry(reverse=False),
                    "outputs": r.forward, "local_adjoint": lambda: r.backward(lambda_only=True),
                    "adjoint_carry": lambda: r.carry(reverse=True),
                    "gradients": r.backward}[kind]()
        else:
            r = KernelRenderer(self.rec, self.dialect, schedule, self.ids)
            body = r.forward() if kind == "forward" else r.backward()
        return body, r.header(kind, dtypes_text)

    def kernel(self, kind, schedule, dtypes_text):
        def build():
            if self._factory is None:
                self._factory = kernel_factory(self.name)
            body, header = self.render(kind, schedule, dtypes_text)
            names = self.buffers(kind, schedule)
            return self._factory(
                name=kernel_name(self.rec.spec.name, kind, header, body, names.inputs,
                                 names.outputs),
                input_names=names.inputs, output_names=names.outputs, source=body, header=header)

        return self._kernels.get_or_build((kind, schedule, dtypes_text), build)

    # -- shapes ----------------------------------------------------------------------------------
    def _schedule(self, sizes, seg, threads, kind="sequential", split=None, sweep="forward"):
        # memoised: a decode step (L = 1) is dominated by such fixed costs per call
        key = (tuple(sorted(sizes.items())), seg, threads, kind, split, sweep)
        def build():
            if kind == "scan":  # seg: the run of one thread
                return make_scan_schedule(self.rec.spec, sizes, seg, threads,
                                          max_threads=self.dialect.max_threads,
                                          map_floats=scan_map_floats(self.rec.affine),
                                          lookback=bool(self.dialect.lookback))
            return make_schedule(self.rec.spec, sizes, seg, threads, kind=kind,
                                 max_threads=self.dialect.max_threads, split=split, sweep=sweep)

        return self._schedules.get_or_build(key, build)

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

    def forget_shapes(self):
        """Drop what was worked out per call shape (schedules, runtime values, launches): after
        a change of the schedule's constants, the next calls choose again."""
        for memo in (self._schedules, self._metas, self._launches):
            memo.clear()

    def launch(self, key: tuple, sizes: dict, build) -> _Launch:
        """The memoised ``_Launch`` of a pass: ``key`` names the pass and everything besides
        ``sizes`` that decides it (options, dtypes); ``build()`` makes it."""
        return self._launches.get_or_build((*key, *sorted(sizes.items())), build)

    def _meta(self, sizes, schedule):
        key = (tuple(sorted(sizes.items())), schedule)
        return self._metas.get_or_build(key, lambda: mx.array(self.meta.values(sizes, schedule),
                                                               dtype=mx.int64))

    def _forward_outputs(self, sizes, schedule, instances, out_dtype):
        """Shapes and dtypes of a one-kernel forward's outputs: the outputs, the final states
        and the checkpoints."""
        spec = self.rec.spec
        shapes = [declared_shape(t, sizes) for t in spec.outputs.values()]
        shapes += [declared_shape(t, sizes) for t in spec.states.values()]
        shapes += [self._ckpt_shape(t, sizes, schedule, instances) for t in spec.states.values()]
        return shapes, [out_dtype] * len(spec.outputs) + [mx.float32] * (2 * len(spec.states))

    def _ckpt_shape(self, t, sizes, schedule, instances, shares=False):
        """(segments, instances, components, rows, lanes): NS rows for a vector state, one for a
        scalar state; one lane for a shared state's values, all lanes for its adjoint's shares
        (``shares``)."""
        segments = -(-sizes[self.rec.spec.time] // schedule.seg)
        rows = schedule.state_size if t.has_state_axis else 1
        lanes = sizes[self.rec.spec.lane] if t.has_lane or shares else 1
        return (segments, instances, t.components, rows, lanes)

    def _state_buffer_shapes(self, sizes, schedule, instances, shares=False):
        return [self._ckpt_shape(t, sizes, schedule, instances, shares)
                for t in self.rec.spec.states.values()]

    def _d_init_shapes(self, sizes):
        return [self.meta.d_init_shape(t, sizes) for t in self.rec.spec.states.values()]

    def _finish_d_init(self, results, states):
        """The initial states' gradients: a shared state's lane shares summed (a deterministic
        MLX sum after the kernel), each in its initial state's dtype."""
        return [(g if t.has_lane else mx.sum(g, axis=0)).astype(x.dtype)
                for t, g, x in zip(self.rec.spec.states.values(), results, states)]

    def _product_shapes(self, sizes, schedule, instances):
        segments = -(-sizes[self.rec.spec.time] // schedule.seg)
        return [(segments, instances, b.size * b.size, schedule.state_size if b.pointwise else 1,
                 sizes[self.rec.spec.lane]) for b in self.rec.affine.blocks]

    def _hits_shapes(self, sizes, schedule, instances):
        """Per block, the summaries' counts of zero hits (``affine.zero_hit``): per state element
        in a block with the state axis."""
        segments = -(-sizes[self.rec.spec.time] // schedule.seg)
        return [(segments, instances, 1, schedule.state_size if b.vector else 1,
                 sizes[self.rec.spec.lane]) for b in self.rec.affine.blocks]

    def residual_shapes(self, sizes, seg, threads=None, split=None):
        """Shapes of the chunked forward's residuals: checkpoints, then segment products."""
        passes = self.chunked(sizes, seg, threads, split)
        return passes.values + passes.products

    def _run(self, kind, sch, sizes, meta, inputs, shapes, dtypes, dtypes_text, template=()):
        """Launch one kernel of the chunked schedule (``meta``: the pass's runtime values)."""
        outer = sch.state_size if kind in ("carry", "adjoint_carry") else \
            -(-sizes[self.rec.spec.time] // sch.seg)
        _, grid, group = self._launch(sizes, sch, outer=outer)
        kernel = self.kernel(kind, sch, dtypes_text)
        return kernel(inputs=[*inputs, meta],
                      template=[*sch.template(), *template], grid=grid, threadgroup=group,
                      output_shapes=shapes, output_dtypes=dtypes)

    # -- passes ----------------------------------------------------------------------------------
    def forward(self, inputs, states, sizes, seg, out_dtype, threads=None, split=None,
                schedule="sequential"):
        if schedule == "scan":
            return self.scan.forward(inputs, states, sizes, seg, out_dtype, threads)
        if schedule == "chunked":
            return self._forward_chunked(inputs, states, sizes, seg, out_dtype, threads, split)
        spec = self.rec.spec

        def build():
            sch = self._schedule(sizes, seg, threads, split=split)
            instances, grid, group = self._launch(sizes, sch)
            dtypes = f"{_dtypes_text(inputs)} -> {dtype_name(out_dtype)}"
            shapes, out_dtypes = self._forward_outputs(sizes, sch, instances, out_dtype)
            return _Launch(self.kernel("forward", sch, dtypes), self._meta(sizes, sch),
                           [*sch.template(), ("OutT", out_dtype)], grid, group, shapes, out_dtypes)

        key = ("forward", seg, threads, split, out_dtype, *(x.dtype for x in inputs))
        results = self.launch(key, sizes, build)([*map(as_buffer, inputs), *states])
        n_out, n_state = len(spec.outputs), len(spec.states)
        return (list(results[:n_out]), list(results[n_out:n_out + n_state]),
                list(results[n_out + n_state:n_out + 2 * n_state]))

    def backward(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg, threads=None,
                 split=None, schedule="sequential"):
        if schedule == "scan":
            return self.scan.backward(inputs, states, residuals, d_outputs, d_finals, sizes, seg,
                                      threads)
        if schedule == "chunked":
            return self._backward_chunked(inputs, states, residuals, d_outputs, d_finals, sizes,
                                          seg, threads, split)
        spec = self.rec.spec
        sch = self._schedule(sizes, seg, threads, split=split, sweep="backward")

        def build():
            instances, grid, group = self._launch(sizes, sch)
            dtypes = _dtypes_text([*inputs, *d_outputs])
            shapes = [self.meta.grad_shape(t, sizes, sch)
                      for t in spec.differentiable_inputs.values()]
            shapes += self._d_init_shapes(sizes)
            if sch.history == "scratch":
                shapes.append((sch.seg * history_rows(spec, sch.state_size // sch.parts)
                               * instances * sch.groups_per_instance * sch.threads,))
            return _Launch(self.kernel("backward", sch, dtypes), self._meta(sizes, sch),
                           sch.template(), grid, group, shapes, [mx.float32] * len(shapes))

        key = ("backward", seg, threads, split, *(x.dtype for x in [*inputs, *d_outputs]))
        results = self.launch(key, sizes, build)(
            [*map(as_buffer, inputs), *residuals, *d_outputs,
             *[g.astype(mx.float32) for g in d_finals]])
        n_in = len(spec.differentiable_inputs)
        grads = self._finish_grads(inputs, results[:n_in], sizes, sch)
        return grads, self._finish_d_init(results[n_in:n_in + len(spec.states)], states)

    def _finish_grads(self, inputs, results, sizes, sch):
        """The gradients of the differentiable inputs: the gradient buffers' lead axes —
        per-segment partial sums (chunked), lane groups, group members, batch axes the input
        lacks — summed with a deterministic MLX sum."""
        grads = []
        results = iter(results)
        for t, x in zip(self.rec.spec.inputs.values(), inputs):
            if not t.differentiable:
                continue
            g = next(results)
            lead = len(self.meta.grad_lead(t, sizes, sch))
            if lead:
                g = mx.sum(g, axis=tuple(range(lead)))
            grads.append(g.astype(x.dtype))
        return grads

    # -- the chunked schedule --------------------------------------------------------------------
    def chunked(self, sizes, seg, threads=None, split=None) -> "ChunkedPasses":
        """The chunked schedule's passes for a call of these sizes (``ChunkedPasses``)."""
        return ChunkedPasses(self, sizes, seg, threads, split)

    def _forward_chunked(self, inputs, states, sizes, seg, out_dtype, threads, split=None):
        passes = self.chunked(sizes, seg, threads, split)
        local, products, hits = passes.summary(inputs)
        finals, ckpts = passes.carry(states, local, products, hits)
        return passes.outputs(inputs, ckpts, out_dtype), finals, ckpts + products

    def _backward_chunked(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg,
                          threads, split=None):
        passes = self.chunked(sizes, seg, threads, split)
        n_state = len(self.rec.spec.states)
        ckpts, products = residuals[:n_state], residuals[n_state:]
        local, hits = passes.local_adjoint(inputs, ckpts, d_outputs)
        d_init, lam_end = passes.adjoint_carry(d_finals, local, products, hits)
        return (passes.gradients(inputs, ckpts, d_outputs, lam_end),
                passes.initial_gradients(d_init, states))


class ChunkedPasses:
    """The chunked schedule's passes on a kernel backend for one call's sizes
    (``render/chunked.py``), each one kernel whose wrapper makes its outputs and returns them
    by name: the forward is ``summary``, ``carry``, ``outputs``; the backward
    ``local_adjoint``, ``adjoint_carry``, ``gradients``; sequence parallelism composes the
    same passes with its own carry between ranks (``distributed._Segments``).

    Buffers (shapes in ``values``, ``shares``, ``products``, ``hits``): every state per segment,
    ``[segment, instance, component, NS or 1, lane]`` (an adjoint's lane shares of a state
    without the lane axis: all lanes); block ``b``'s products ``[segment, instance, row * K +
    col, NS or 1, lane]``; its counts of zero hits ``[segment, instance, 1, NS or 1, lane]``.
    Instances enumerate the batch axes, row-major."""

    def __init__(self, backend: KernelBackend, sizes, seg, threads=None, split=None):
        self.backend, self.sizes = backend, sizes
        self.spec = backend.rec.spec
        b = backend
        self.schedule = sch = b._schedule(sizes, seg, threads, kind="chunked", split=split)
        instances = b._launch(sizes, sch)[0]
        self.meta = b._meta(sizes, sch)  # the passes' runtime values
        self.values = b._state_buffer_shapes(sizes, sch, instances)
        self.shares = b._state_buffer_shapes(sizes, sch, instances, shares=True)
        self.products = b._product_shapes(sizes, sch, instances)
        self.hits = b._hits_shapes(sizes, sch, instances)

    def _run(self, kind, inputs, shapes, dtypes_text, dtypes=None, template=()):
        """One pass's kernel on ``inputs``, its outputs of ``shapes`` (fp32 unless ``dtypes``)."""
        dtypes = dtypes or [mx.float32] * len(shapes)
        return list(self.backend._run(kind, self.schedule, self.sizes, self.meta, inputs, shapes,
                                      dtypes, dtypes_text, template))

    def summary(self, inputs) -> tuple:
        """``(local, products, hits)``: every segment's state from zero, its block products and
        counts of zero hits."""
        n, m = len(self.values), len(self.values) + len(self.products)
        out = self._run("summary", _buffers(inputs), self.values + self.products + self.hits,
                        _dtypes_text(inputs))
        return out[:n], out[n:m], out[m:]

    def carry(self, states, local, products, hits) -> tuple:
        """``(final states, checkpoints)``: the states from ``states`` through the segments'
        summaries, the state entering every segment."""
        n = len(states)
        out = self._run("carry", [*states, *local, *products, *hits],
                        [declared_shape(t, self.sizes) for t in self.spec.states.values()]
                        + self.values, _dtypes_text(states))
        return out[:n], out[n:]

    def outputs(self, inputs, ckpts, out_dtype) -> list:
        """The outputs, in ``out_dtype``, every segment from its checkpoint."""
        outs = self.spec.outputs.values()
        return self._run("outputs", [*_buffers(inputs), *ckpts],
                         [declared_shape(t, self.sizes) for t in outs],
                         f"{_dtypes_text(inputs)} -> {dtype_name(out_dtype)}",
                         [out_dtype] * len(outs), [("OutT", out_dtype)])

    def local_adjoint(self, inputs, ckpts, d_outputs) -> tuple:
        """``(local, hits)``: every segment's adjoint state from zero (lane shares) and, where
        the adjoint counts them, its zero hits (else none)."""
        n = len(self.shares)
        hits = self.hits if self.backend.rec.local_adjoint.counts_hits else []
        out = self._run("local_adjoint", [*_buffers(inputs), *ckpts, *d_outputs],
                        self.shares + hits, _dtypes_text([*inputs, *d_outputs]))
        return out[:n], out[n:]

    def adjoint_carry(self, d_finals, local, products, hits) -> tuple:
        """``(d_init, lam_end)``: the adjoint from the final states' cotangents through the
        segments, newest first: the initial states' gradient buffers (``initial_gradients``
        finishes them) and the adjoint leaving every segment."""
        n = len(d_finals)
        out = self._run("adjoint_carry",
                        [*[g.astype(mx.float32) for g in d_finals], *local, *products, *hits],
                        self.backend._d_init_shapes(self.sizes) + self.shares, "float32")
        return out[:n], out[n:]

    def gradients(self, inputs, ckpts, d_outputs, lam_end) -> list:
        """The gradients of the differentiable inputs, each in its input's dtype."""
        b = self.backend
        shapes = [b.meta.grad_shape(t, self.sizes, self.schedule)
                  for t in self.spec.differentiable_inputs.values()]
        results = self._run("gradients", [*_buffers(inputs), *ckpts, *d_outputs, *lam_end],
                            shapes, _dtypes_text([*inputs, *d_outputs]))
        return b._finish_grads(inputs, results, self.sizes, self.schedule)

    def initial_gradients(self, d_init, states) -> list:
        """The initial states' gradients from ``adjoint_carry``'s buffers, in their dtypes."""
        return self.backend._finish_d_init(d_init, states)


def _buffers(inputs) -> list:
    return [as_buffer(x) for x in inputs]


def _dtypes_text(arrays) -> str:
    return ", ".join(dtype_name(x.dtype) for x in arrays)


class ScanPasses:
    """The scan schedule's passes on a kernel backend: one kernel each (``render/scan.py``).
    ``run`` (the call's ``seg``) is the steps of one thread; the residuals are the states
    entering every stretch."""

    def __init__(self, backend: KernelBackend):
        self.backend = backend

    def schedule(self, sizes, run, threads=None):
        return self.backend._schedule(sizes, run, threads, kind="scan")

    def forward(self, inputs, states, sizes, run, out_dtype, threads=None):
        """(outputs, final states, checkpoints).

        With the look-back (``Schedule.lookback``) a group takes one stretch (the grid is
        ``segments`` times the lane blocks) and the kernel also takes ``scan_words``, a zero
        array of the call through which the groups publish (``ScanRenderer._lookback``): a
        ticket counter, then per stretch and lane its map's floats and its end state's."""
        b, spec = self.backend, self.backend.rec.spec
        sch = self.schedule(sizes, run, threads)
        segments = -(-sizes[spec.time] // sch.seg)

        def build():
            instances, grid, group = b._launch(sizes, sch, outer=segments if sch.lookback else 1)
            dtypes = f"{_dtypes_text(inputs)} -> {dtype_name(out_dtype)}"
            shapes, out_dtypes = b._forward_outputs(sizes, sch, instances, out_dtype)
            template = [*sch.template(), ("OutT", out_dtype),
                        *self.run_template([x.dtype for x in inputs])]
            return _Launch(b.kernel("forward", sch, dtypes), b._meta(sizes, sch), template,
                           grid, group, shapes, out_dtypes)

        key = ("scan forward", run, threads, out_dtype, *(x.dtype for x in inputs))
        words = []
        if sch.lookback:
            tiles = segments * sch.groups_per_instance * math.prod(
                sizes[a] for a in spec.batch_axes)
            n = ScanRenderer.lookback_words(b.rec.affine, spec, tiles, sch.lane_block)
            # 64-bit words as pairs of 32-bit zeros: MLX's fill of 64-bit ones took 15-20 µs for
            # 1.2 MB on an H200
            words = [mx.zeros((2 * n,), dtype=mx.uint32)]
        results = b.launch(key, sizes, build)([*map(as_buffer, inputs), *states, *words])
        n_out, n_state = len(spec.outputs), len(spec.states)
        return (list(results[:n_out]), list(results[n_out:n_out + n_state]),
                list(results[n_out + n_state:n_out + 2 * n_state]))

    def backward(self, inputs, states, ckpts, d_outputs, d_finals, sizes, run, threads=None):
        """(gradients of the differentiable inputs, gradients of the initial states)."""
        b, spec = self.backend, self.backend.rec.spec
        sch = self.schedule(sizes, run, threads)

        def build():
            _, grid, group = b._launch(sizes, sch)
            dtypes = _dtypes_text([*inputs, *d_outputs])
            shapes = [b.meta.grad_shape(t, sizes, sch) for t in spec.differentiable_inputs.values()]
            shapes += b._d_init_shapes(sizes)
            grad_dtypes = self.grad_dtypes({n: x.dtype for n, x in zip(spec.inputs, inputs)},
                                           sizes, sch)
            template = [*sch.template(), *self.grad_template(grad_dtypes),
                        *self.run_template([x.dtype for x in inputs],
                                           [d.dtype for d in d_outputs])]
            out_dtypes = grad_dtypes + [mx.float32] * (len(shapes) - len(grad_dtypes))
            return _Launch(b.kernel("backward", sch, dtypes), b._meta(sizes, sch), template,
                           grid, group, shapes, out_dtypes)

        key = ("scan backward", run, threads, *(x.dtype for x in [*inputs, *d_outputs]))
        results = b.launch(key, sizes, build)(
            [*map(as_buffer, inputs), *ckpts, *d_outputs,
             *[g.astype(mx.float32) for g in d_finals]])
        n_in = len(spec.differentiable_inputs)
        grads = b._finish_grads(inputs, results[:n_in], sizes, sch)
        return grads, b._finish_d_init(results[n_in:], states)

    def grad_dtypes(self, dtypes: dict, sizes, sch) -> list:
        """The dtype of each differentiable input's gradient buffer: the input's own where the
        kernel writes the whole gradient (no lead axis to sum after it: no cast pass over it),
        else float32."""
        meta = self.backend.meta
        return [dtypes[t.name] if not meta.grad_lead(t, sizes, sch) else mx.float32
                for t in self.backend.rec.spec.differentiable_inputs.values()]

    @staticmethod
    def grad_template(grad_dtypes) -> list:
        return [(grad_type_name(i), d) for i, d in enumerate(grad_dtypes)]

    def run_template(self, input_dtypes, cotangent_dtypes=()) -> list:
        """The run registers' types (``run_type_name``): the dtype of each input with the time
        axis, and of each output's cotangent."""
        inputs = self.backend.rec.spec.inputs.values()
        return ([(run_type_name(i), d) for i, (t, d) in enumerate(zip(inputs, input_dtypes))
                 if t.has_time]
                + [(run_type_name(j, cotangent=True), d) for j, d in enumerate(cotangent_dtypes)])


class _ArrayInfo:
    """Stands in for an input array when only its dtype, rank and size matter."""

    def __init__(self, dtype, ndim, size=1 << 20):
        self.dtype, self.ndim, self.size = dtype, ndim, size


def _input_info(dtype, t):
    """An input as the kernel receives it (a 0-d input as shape (1,), see ``as_buffer``)."""
    return _ArrayInfo(dtype, len(t.axes)) if t.axes else _ArrayInfo(dtype, 1, 1)


SEQUENTIAL_KERNELS = ("forward", "backward")
CHUNKED_KERNELS = ("summary", "carry", "outputs", "local_adjoint", "adjoint_carry", "gradients")
SCAN_KERNELS = ("forward", "backward")


def kernel_source(rec, kind, backend, dtype=mx.float32, seg=None, state_size=16, lanes=64,
                  threads=None, schedule="sequential", split=None, length=128):
    """The full text of a kernel as the backend compiles it (MLX's generated signature included),
    for inputs of ``dtype`` (one dtype, or a dict by input name) and the schedule those sizes
    give. ``kind`` names a kernel of the schedule: ``SEQUENTIAL_KERNELS``, ``CHUNKED_KERNELS`` or
    ``SCAN_KERNELS``; ``seg`` defaults to 32 (the scan: ``scan_run``, its steps per thread).
    Group axes get size 2 and the axes they group 4; the time axis ``length`` (the scan's
    forward on CUDA takes the look-back where that gives several stretches)."""
    from .mlx_source import cuda_source, metal_source

    if backend not in ("metal", "cuda", "metal-sim"):
        raise ValueError(f"backend must be 'metal', 'cuda' or 'mlx', got {backend!r}")
    kinds = {"sequential": SEQUENTIAL_KERNELS, "chunked": CHUNKED_KERNELS,
             "scan": SCAN_KERNELS}.get(schedule)
    if kinds is None:
        raise ValueError(f"schedule must be 'sequential', 'chunked' or 'scan', got {schedule!r}")
    if kind not in kinds:
        raise ValueError(f"the {schedule} schedule's kernels are {kinds}, got {kind!r}")
    if schedule == "chunked" and not rec.affine.block_diagonal:
        raise ValueError(f"{rec.name} has no chunked kernels: {chunked_misfit(rec)}")
    if schedule == "scan" and scan_misfit(rec):
        raise ValueError(f"{rec.name} has no scan kernels: {scan_misfit(rec)}")
    if seg is None:
        seg = scan_run(rec.spec) if schedule == "scan" else 32
    spec = rec.spec
    dtypes = dtype if isinstance(dtype, dict) else {n: dtype for n in spec.inputs}
    floats = [d for d in dtypes.values() if d in (mx.float32, mx.float16, mx.bfloat16)]
    dtype = floats[0] if len(set(floats)) == 1 else mx.float32  # of outputs and cotangents
    sizes = {a: 4 for a in spec.batch_axes}
    sizes.update({g: 2 for g in spec.groups})
    sizes.update({spec.time: length, spec.lane: lanes})
    if spec.state_axis:
        sizes[spec.state_axis] = state_size
    impl = KernelBackend(rec, backend)
    sch = impl._schedule(sizes, seg, threads, kind=schedule, split=split,
                         sweep="backward" if kind == "backward" else "forward")
    names = impl.buffers(kind, sch)
    ids = impl.ids
    by_name = {ids["buffer", t.name]: t for t in spec.inputs.values()}
    d_outputs = {ids["d", t.name]: t for t in spec.outputs.values()}
    whole_states = {ids[role, t.name]: t for t in spec.states.values()
                    for role in ("init", "d_final")}

    def info(name):  # what MLX sees of each input buffer: dtype and rank
        if name == "meta":
            return _ArrayInfo(mx.int64, 1, len(impl.meta.keys))
        if name == "scan_words":
            return _ArrayInfo(mx.uint32, 1)
        if name in by_name:
            return _input_info(dtypes[by_name[name].name], by_name[name])
        if name in d_outputs:
            return _ArrayInfo(dtype, len(d_outputs[name].axes))
        if name in whole_states:
            return _ArrayInfo(mx.float32, len(whole_states[name].axes))
        return _ArrayInfo(mx.float32, 5)  # one state per segment, or segment products

    infos = [info(n) for n in names.inputs]
    outputs = {ids["buffer", t] for t in spec.outputs}
    out_dtypes = [dtype if n in outputs else mx.float32 for n in names.outputs]
    template = sch.template()
    if schedule == "scan":
        cotangents = [dtype] * len(spec.outputs) if kind == "backward" else []
        template = [*template, *impl.scan.run_template(list(dtypes.values()), cotangents)]
    if schedule == "scan" and kind == "backward":
        grad_dtypes = impl.scan.grad_dtypes(dtypes, sizes, sch)
        out_dtypes[:len(grad_dtypes)] = grad_dtypes
        template = [*template, *impl.scan.grad_template(grad_dtypes)]
    if kind in ("forward", "outputs"):
        template = [*template, ("OutT", dtype)]
    # the dtypes a kernel's header names, as the passes above name them at a call (the kernel's
    # name derives from its header): inputs, then the outputs' dtype or the cotangents'
    in_text = ", ".join(dtype_name(dtypes[n]) for n in spec.inputs)
    to_outputs = f"{in_text} -> {dtype_name(dtype)}"
    with_cotangents = ", ".join([in_text] + [dtype_name(dtype)] * len(spec.outputs))
    dtypes_text = {"forward": to_outputs, "outputs": to_outputs, "summary": in_text,
                   "carry": ", ".join(["float32"] * len(spec.states)),
                   "adjoint_carry": "float32"}.get(kind, with_cotangents)
    body, header = impl.render(kind, sch, dtypes_text)
    build = cuda_source if backend == "cuda" else metal_source
    name = kernel_name(spec.name, kind, header, body, names.inputs, names.outputs)
    _, text = build(name, names.inputs, names.outputs, body, header,
                    infos, out_dtypes, template)
    return text
