"""Compiled recurrences: argument checking, call plans and the ``mx.custom_function`` glue.

A call is check (``Recurrence.check``), plan (``Recurrence.plan_for``: the ``CallPlan`` decided
once per shapes, dtypes, options and device, from a bounded cache), run (``CallPlan.run``);
see ``docs/calls.md``.

The glue is the same for every backend: a backend provides ``forward`` (outputs, final states
and segment checkpoints) and ``backward`` (input and initial-state gradients from the
checkpoints), and this module wraps the pair into a custom function with a custom VJP. Its JVP
runs the tangent recurrence (``mlx_recgen.tangent``) on the same backend.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from . import cache as program_cache
from .adjoint import derive
from .errors import dtype_name
from .affine import analyse, local_adjoint_program, segment_summary
from .ir import Loop, lower, schedule_forward
from .layout import declared_shape
from .memo import LRU
from .schedule import choose as choose_schedule, chunked_misfit
from .spec import KERNEL_OPTIONS, Spec

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# bool and integer inputs (masks, lengths, positions): accepted, never differentiated
INDEX_DTYPES = (mx.bool_, mx.int8, mx.int16, mx.int32, mx.int64, mx.uint8, mx.uint16,
                mx.uint32, mx.uint64)
BACKENDS = ("auto", "mlx", "metal", "metal-sim", "cuda")
# Plans (and the custom functions behind them) kept per recurrence: a call of a new shape past
# this many evicts the least recently used (``memo.LRU``).
PLAN_CACHE_SIZE = 64
# Zero initial states of at most this many elements are filled, kept with a checked call's plan
# and passed again by the calls like it (``_kept_zeros``); larger ones are views of one zero
# (``zero_state``).
ZEROS_KEPT_MAX = 1 << 16
# The mlx backend runs calls of at most this many steps as the decode path (``CallPlan``).
DECODE_MAX_STEPS = 16
# Backends whose full path runs under mx.compile (``CallPlan.compiled``); the simulator evaluates
# its inputs through numpy and cannot be traced.
COMPILED_BACKENDS = ("metal", "cuda")


def _axes_text(t) -> str:
    return " ".join(str(a) for a in t.axes)


def positive_int(owner: str, name: str, value) -> int:
    """``value`` as a Python int if it is integer-like (``operator.index``: ``int``, NumPy and
    0-d MLX integers) and at least 1; bools, floats and anything else raise ``ValueError``
    naming ``owner`` and the argument."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")
    return number


class _AxisSizes:
    """The axes' sizes of a call, read off its arrays as they are checked: each array an
    ``mx.array`` of a float dtype (or, for an index input, bool or an integer type), of its
    declaration's rank, non-empty, its component axes of their declared sizes, and every axis
    of one size across the arrays (``where`` names the array that gave it)."""

    def __init__(self, name: str):
        self.name, self.sizes, self.where = name, {}, {}

    def check(self, arg: str, x, t, index_ok=False):
        name, sizes, where = self.name, self.sizes, self.where
        if not isinstance(x, mx.array):
            raise TypeError(f"{name}(): argument '{arg}' must be an mx.array, got "
                            f"{type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES and not (index_ok and x.dtype in INDEX_DTYPES):
            raise TypeError(f"{name}(): argument '{arg}' has dtype {dtype_name(x.dtype)}; "
                            "expected float32, float16 or bfloat16"
                            + (", or bool or an integer type (not differentiated)"
                               if index_ok else ""))
        if x.ndim != len(t.axes):
            raise ValueError(f"{name}(): argument '{arg}' has shape {tuple(x.shape)} "
                             f"({x.ndim} axes); expected {len(t.axes)} axes ({_axes_text(t)})")
        for a, n in zip(t.axes, x.shape):
            if isinstance(a, int):
                if n != a:
                    raise ValueError(f"{name}(): argument '{arg}' has shape {tuple(x.shape)}; "
                                     f"its component axis must have size {a} ({_axes_text(t)})")
            elif a in sizes and sizes[a] != n:
                raise ValueError(f"{name}(): axis {a} has size {n} in '{arg}' {tuple(x.shape)} "
                                 f"but {sizes[a]} in '{where[a]}'")
            else:
                sizes[a], where[a] = n, arg
        if x.size == 0:
            raise ValueError(f"{name}(): argument '{arg}' is empty (shape {tuple(x.shape)})")

    def check_groups(self, groups: dict):
        """Each group axis divides the axis it groups."""
        sizes = self.sizes
        for coarse, fine in groups.items():
            if coarse in sizes and sizes[fine] % sizes[coarse]:
                raise ValueError(f"{self.name}(): axis {fine} has size {sizes[fine]}, which its "
                                 f"group axis {coarse} of size {sizes[coarse]} (in "
                                 f"'{self.where[coarse]}') does not divide; each of the "
                                 f"{sizes[coarse]} groups must serve the same number of {fine}")


class Recurrence:
    """A recurrence compiled from a spec.

    Call it with the spec's inputs (positionally in declaration order, or by name)::

        y = rec(u, delta, B, C, A)
        y, h = rec(u, delta, B, C, A, initial_state=h0, return_state=True)

    Keyword-only options: ``initial_state`` (an array for a single state, else a dict by state
    name; zeros when omitted), ``return_state`` (also return the final state, fp32),
    ``backend`` (``"auto"``, ``"mlx"``, ``"metal"``, ``"metal-sim"``, ``"cuda"``), ``schedule``
    (``"auto"``, ``"sequential"``, ``"chunked"``: see ``schedule.choose``), ``seg``
    (checkpoint every ``seg`` steps, which is also the chunk length of the chunked schedule;
    chosen per call when omitted) and ``group`` (an ``mx.distributed.Group``: the inputs are
    this rank's chunk of the time axis of a sequence spread over the group's ranks in rank
    order; the outputs are this chunk's, the final state is the state after the last rank's
    chunk on every rank, and the backward is collective: see ``mlx_recgen.distributed``).
    Outputs are in the floating-point inputs' dtype (fp32 when they mix dtypes); state is kept
    in fp32. Bool and integer inputs are accepted and not differentiated: a call with some runs
    a twin of this recurrence (``_for_dtypes``) whose backward computes no gradient for them;
    their cotangents are zeros.
    """

    def __init__(self, spec: Spec):
        self.spec = spec
        self.ir = lower(spec)
        self.forward_program, self.adjoint = self._programs()
        self.affine = analyse(self.ir)
        self._backends = {}
        self._functions = LRU(PLAN_CACHE_SIZE)  # custom functions, by what decides them
        self._plans = LRU(PLAN_CACHE_SIZE)  # CallPlans, by what decides them (see plan_for)
        self._checked = LRU(PLAN_CACHE_SIZE)  # plans of calls that passed the check (_hit)
        self._variants = {}
        self.__doc__ = spec.doc or Recurrence.__doc__

    def _programs(self):
        """The forward program and the adjoint: from the program cache, else derived (and
        cached)."""
        cached = program_cache.load(self.spec)
        if cached is None:
            forward, adjoint = schedule_forward(self.ir), derive(self.ir)
            program_cache.store(self.spec, forward, adjoint)
            return forward, adjoint
        forward, adjoint = cached
        # the names a derivation hands out stay taken, as after deriving
        self.ir.namer.taken |= {str(x) for p in (forward, adjoint.program) for x in _assigned(p)}
        self.ir.namer.taken |= {str(x) for d in (adjoint.output_cotangents, adjoint.state_cotangents)
                                for x in d.values()}
        return forward, adjoint

    @property
    def name(self) -> str:
        return self.spec.name

    @functools.cached_property
    def segment_summary(self):
        """The chunked schedule's segment-summary step (``affine.segment_summary``), derived once
        for every rendering of it."""
        if not self.affine.block_diagonal:
            raise ValueError(f"{self.name} has no segment summary: {chunked_misfit(self)}")
        return segment_summary(self.ir, self.affine)

    @functools.cached_property
    def local_adjoint(self):
        """The chunked and scan backwards' local-adjoint step (``affine.LocalAdjoint``: its
        program and whether it counts zero hits), derived once for every rendering of it."""
        return local_adjoint_program(self.ir, self.affine, self.adjoint,
                                     list(self.segment_summary.products))

    @functools.cached_property
    def matrix(self):
        """Whether the recurrence has the chunkwise matrix form (``matrix.analyse``), and its
        parts: what ``schedule="matrix"`` runs."""
        from .matrix import analyse as analyse_matrix

        return analyse_matrix(self.ir, self.affine)

    @property
    def time_parallel(self) -> bool:
        """Whether the state update is affine in the state with a multiplier free of it
        (``affine.analyse``), so that time can run in parallel: block-diagonal multipliers in
        the ``chunked`` schedule, diagonal plus low rank (delta rules) in the ``matrix`` one."""
        return self.affine.time_parallel

    def __repr__(self):
        s = self.spec
        return (f"<Recurrence {s.name}: lane={s.lane} time={s.time} batch={list(s.batch_axes)} "
                f"state axis={s.state_axis} inputs={list(s.inputs)} outputs={list(s.outputs)}>")

    # -- inspection -------------------------------------------------------------------------------
    def forward_ir(self) -> str:
        """The forward step as readable statements."""
        return self.forward_program.text(self.spec.index_name or "n")

    def adjoint_ir(self) -> str:
        """The derived backward step as readable statements, with each gradient's reductions."""
        lines = [self.adjoint.program.text(self.spec.index_name or "n"), "", "gradient reductions:"]
        for name, classes in self.gradient_reductions().items():
            lines.append(f"  {name}: {', '.join(classes) or 'none (written per lane and step)'}")
        lines += ["", f"schedules: {self.schedules_text()}"]
        return "\n".join(lines)

    def schedules_text(self) -> str:
        """Which schedules apply, and why ``chunked`` does not when it does not."""
        if self.matrix.applies:
            return f"sequential, chunked and matrix; {self.matrix.describe()}"
        if self.affine.block_diagonal:
            return (f"sequential and chunked; {self.affine.describe()}; not matrix: "
                    f"{self.matrix.reason}")
        if self.time_parallel:
            return (f"sequential only; {self.affine.describe()}; not chunked: "
                    f"{chunked_misfit(self)}; not matrix: {self.matrix.reason}")
        return f"sequential only ({self.affine.reason})"

    def gradient_reductions(self) -> dict:
        """For every input (and the initial state), the reductions its gradient needs:
        ``state index`` (an in-thread loop), ``lanes`` (simd + threadgroup; for a shared
        state's initial state, a final MLX sum of its lanes' shares), ``time`` (register
        accumulator), ``group`` (a final MLX sum over the members of each group axis it
        carries), ``batch`` (a final MLX sum over batch-like axes the input lacks). A bool or
        integer input gets no gradient (``not differentiable``)."""
        s = self.spec
        out = {}
        for t in s.inputs.values():
            if not t.differentiable:
                out[t.name] = ["not differentiable"]
                continue
            classes = []
            if s.state_axis and not t.has_state_axis:
                classes.append("state index")
            if not t.has_lane:
                classes.append("lanes")
            if not t.has_time:
                classes.append("time")
            if any(a in s.groups for a in t.batch_axes):
                classes.append("group")
            if any(not s.covers(t, b) for b in s.batch_axes):
                classes.append("batch")
            out[t.name] = classes
        for t in s.states.values():
            out[f"{t.name} (initial state)"] = [] if t.has_lane else ["lanes"]
        return out

    def source(self, kernel: str = "forward", backend: str = "metal", dtype=mx.float32, **schedule):
        """The full source of a kernel as the backend compiles it.

        ``kernel`` is ``"forward"`` or ``"backward"`` (the sequential schedule's kernels), or with
        ``schedule="chunked"`` one of ``"summary"``, ``"carry"``, ``"outputs"``,
        ``"local_adjoint"``, ``"adjoint_carry"``, ``"gradients"``; ``backend`` is ``"metal"``,
        ``"cuda"`` or ``"mlx"`` (the rendered Python step function). ``dtype`` is the inputs'
        dtype, or a dict of dtypes by input name (float32 for inputs it omits): bool and
        integer inputs give the kernels that compute no gradient for them."""
        if "seg" in schedule:
            schedule["seg"] = positive_int(f"{self.name}.source()", "seg", schedule["seg"])
        names = list(self.spec.inputs)
        if isinstance(dtype, dict):
            unknown = [k for k in dtype if k not in self.spec.inputs]
            if unknown:
                raise ValueError(f"{self.name}.source(): dtype names unknown inputs {unknown}; "
                                 f"inputs are {names}")
            dtypes = [dtype.get(n, mx.float32) for n in names]
        else:
            dtypes = [dtype] * len(names)
        for n, d in zip(names, dtypes):
            if d not in FLOAT_DTYPES + INDEX_DTYPES:
                raise ValueError(f"{self.name}.source(): input '{n}' cannot have dtype {d}")
        rec = self._for_dtypes(dtypes)
        if backend == "mlx":
            if kernel not in ("forward", "backward"):
                raise ValueError(f"kernel must be 'forward' or 'backward', got {kernel!r}")
            b = rec._backend("mlx")
            return (b.forward_step if kernel == "forward" else b.backward_step).source
        from .backends.kernels import kernel_source

        return kernel_source(rec, kernel, backend, dict(zip(names, dtypes)), **schedule)

    # -- calling ----------------------------------------------------------------------------------
    def _bind(self, args, kwargs, initial_state):
        """The call's inputs and initial states in declaration order (zero states where none is
        given), checked against the spec's axes (``_AxisSizes``), with the axes' sizes and the
        outputs' dtype (the inputs' one float dtype, else float32)."""
        s = self.spec
        values = self._named_inputs(args, kwargs)
        sizes = _AxisSizes(s.name)
        for n, x in values.items():
            sizes.check(n, x, s.inputs[n], index_ok=True)
        states = self._given_states(initial_state, sizes)
        for a in (s.time, s.lane, *s.batch_axes, *([s.state_axis] if s.state_axis else [])):
            if a not in sizes.sizes:
                raise ValueError(f"{s.name}(): the size of axis {a} cannot be inferred from the "
                                 "inputs; pass initial_state")
        sizes.check_groups(s.groups)
        for k, t in s.states.items():
            if k not in states:
                states[k] = zero_state(declared_shape(t, sizes.sizes))
        floats = {x.dtype for x in values.values() if x.dtype in FLOAT_DTYPES}
        out_dtype = floats.pop() if len(floats) == 1 else mx.float32
        return list(values.values()), [states[k] for k in s.states], sizes.sizes, out_dtype

    def _named_inputs(self, args, kwargs) -> dict:
        """The inputs by name, in declaration order, from the call's positional and keyword
        arguments: each input once, none unknown, none missing."""
        s = self.spec
        names = list(s.inputs)
        if len(args) > len(names):
            raise TypeError(f"{s.name}() takes {len(names)} inputs {names}, got {len(args)}")
        values = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in s.inputs:
                raise TypeError(f"{s.name}() got an unexpected argument '{k}'; inputs are {names}")
            if k in values:
                raise TypeError(f"{s.name}() got input '{k}' twice")
            values[k] = v
        missing = [n for n in names if n not in values]
        if missing:
            raise TypeError(f"{s.name}() is missing input(s) {missing}; expects {names}")
        return {n: values[n] for n in names}

    def _given_states(self, initial_state, sizes) -> dict:
        """The initial states the call gives, by name (an array stands for the one state),
        each checked against its declaration."""
        s = self.spec
        if initial_state is None:
            return {}
        if isinstance(initial_state, mx.array):
            if len(s.states) != 1:
                raise TypeError(f"{s.name}(): initial_state must be a dict with keys "
                                f"{list(s.states)}")
            initial_state = {next(iter(s.states)): initial_state}
        if not isinstance(initial_state, dict):
            raise TypeError(f"{s.name}(): initial_state must be an mx.array or a dict, got "
                            f"{type(initial_state).__name__}")
        extra = [k for k in initial_state if k not in s.states]
        if extra:
            raise TypeError(f"{s.name}(): initial_state has unknown state(s) {extra}; states "
                            f"are {list(s.states)}")
        for k, x in initial_state.items():
            sizes.check(f"initial_state['{k}']" if len(s.states) > 1 else "initial_state", x,
                        s.states[k])
        return dict(initial_state)

    def _for_dtypes(self, dtypes) -> "Recurrence":
        """The recurrence that runs inputs of these dtypes (in declaration order): this one, or
        (when some are bool or integer) its twin with those inputs non-differentiable
        (``Spec.without_gradients``), compiled once per such set of inputs."""
        fixed = frozenset(n for n, d in zip(self.spec.inputs, dtypes) if d not in FLOAT_DTYPES)
        if not fixed:
            return self
        if fixed not in self._variants:
            self._variants[fixed] = Recurrence(self.spec.without_gradients(fixed))
        return self._variants[fixed]

    def _backend(self, backend):
        if backend == "auto":
            backend = default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend not in self._backends:
            if backend == "mlx":
                from .backends.mlx_backend import MLXBackend

                self._backends[backend] = MLXBackend(self)
            else:
                from .backends.kernels import KernelBackend

                self._backends[backend] = KernelBackend(self, backend)
        return self._backends[backend]

    def _function(self, backend, seg, sizes, out_dtype, options):
        key = (backend.name, seg, tuple(sorted(sizes.items())), out_dtype, tuple(sorted(options.items())))
        if key in self._functions:
            self._functions.move_to_end(key)
            return self._functions[key]
        n_in, n_out, n_state = len(self.spec.inputs), len(self.spec.outputs), len(self.spec.states)
        kernel = backend.name != "mlx"

        @mx.custom_function
        def fn(*arrays):
            arrays = opaque(arrays, backend.name)
            inputs, states = list(arrays[:n_in]), list(arrays[n_in:])
            outs, finals, residuals = backend.forward(inputs, states, sizes, seg, out_dtype, **options)
            return (*outs, *finals, *residuals)

        kernel_backward = _first_order_only(self.spec, backend, n_in, n_out, n_state, sizes, seg,
                                            options) if kernel else None

        if not kernel:
            def plain(*arrays):  # the body without the stop-gradient, open to MLX's transforms
                inputs, states = list(arrays[:n_in]), list(arrays[n_in:])
                outs, finals, residuals = backend.forward(inputs, states, sizes, seg, out_dtype,
                                                          **options)
                return (*outs, *finals, *residuals)

            @fn.vmap
            def fn_vmap(arrays, axes):
                # MLX vmaps a custom function by vmapping its body, where the stop-gradient would
                # cut mx.grad of the vmapped call: vmap the plain body instead
                outs = mx.vmap(plain, in_axes=tuple(axes))(*arrays)
                return outs, (0,) * len(outs)

        @fn.vjp
        def fn_vjp(primals, cotangents, outputs):
            inputs, states = list(primals[:n_in]), list(primals[n_in:])
            residuals = list(outputs[n_out + n_state:])
            d_out = list(cotangents[:n_out])
            d_fin = list(cotangents[n_out:n_out + n_state])
            if kernel_backward is None:  # checkpoint cotangents matter to a second derivative
                d_res = list(cotangents[n_out + n_state:])
                grads, d_init = backend.backward(inputs, states, residuals, d_out, d_fin, sizes,
                                                 seg, d_residuals=d_res, **options)
                return (*_with_zeros(self.spec, inputs, grads), *d_init)
            return kernel_backward(*inputs, *states, *residuals, *d_out, *d_fin)

        @fn.jvp
        def fn_jvp(primals, tangents):
            return self._jvp(backend, seg, sizes, out_dtype, options, primals, tangents)

        self._functions[key] = fn
        return fn

    # -- forward mode ---------------------------------------------------------------------------
    @functools.cached_property
    def tangent(self) -> "Recurrence":
        """The forward-mode twin of this recurrence (``mlx_recgen.tangent``): its states, inputs
        and outputs each followed by their tangent. ``mx.jvp`` runs it on the same backend."""
        from .tangent import tangent_spec

        return Recurrence(tangent_spec(self.spec).spec)

    def tangent_ir(self) -> str:
        """The forward step of the tangent recurrence (what ``mx.jvp`` runs)."""
        return self.tangent.forward_ir()

    def _jvp(self, backend, seg, sizes, out_dtype, options, primals, tangents):
        """Tangents of every result of the custom function: outputs, final states and
        checkpoints (the tangent recurrence's checkpoints of the tangent states)."""
        tangents = [mx.zeros_like(p) if t is None else t.astype(p.dtype) if t.dtype != p.dtype
                    else t for p, t in zip(primals, tangents)]
        n_in, n_out, n_state = len(self.spec.inputs), len(self.spec.outputs), len(self.spec.states)
        rec = self.tangent
        if backend.name == "mlx" and not rec.time_parallel:
            options = dict(options, schedule="sequential")
        elif options.get("schedule") == "matrix" and not rec.matrix.applies:
            # the tangent of a state reads the state itself: time-parallel, not the matrix form
            options = dict(options, schedule="chunked")
        fn = rec._function(rec._backend(backend.name), seg, sizes, out_dtype, options)
        # bool and integer inputs have no tangent in the tangent recurrence
        d_in = [d for t, d in zip(self.spec.inputs.values(), tangents) if t.differentiable]
        results = fn(*primals[:n_in], *d_in, *primals[n_in:], *tangents[n_in:])
        d_out = results[n_out:2 * n_out]
        d_fin = results[2 * n_out + n_state:2 * n_out + 2 * n_state]
        if backend.name != "mlx" and options.get("schedule", "sequential") == "chunked":
            # The chunked residuals (checkpoints, segment products) are read only by the kernel
            # backward, whose own derivatives raise: their tangents are never observed.
            d_res = [mx.zeros(shape) for shape in backend.residual_shapes(
                sizes, seg, options.get("threads"), options.get("split"))]
        else:
            checkpoints = results[2 * n_out + 2 * n_state:]
            d_res = checkpoints[len(checkpoints) // 2:]
        return (*d_out, *d_fin, *d_res)

    def __call__(self, *args, initial_state=None, return_state=False, backend="auto", seg=None,
                 schedule="auto", group=None, **kwargs):
        if group is not None:  # sequence parallelism: this rank's chunk of the time axis
            from .distributed import call_distributed

            return call_distributed(self, group, args, kwargs, initial_state=initial_state,
                                    return_state=return_state, backend=backend, seg=seg,
                                    schedule=schedule)
        key = None if kwargs else _call_key(args, initial_state, backend, seg, schedule)
        if key is not None:
            try:
                hit = self._checked.get(key)
            except TypeError:  # an unhashable option: the check below names it
                hit = key = None
            if hit is not None:
                plan, zero_states = hit
                states = [initial_state] if initial_state is not None else list(zero_states)
                return plan.package(*plan.run(list(args), states,
                                              (initial_state is not None, return_state)),
                                    return_state)
        call = self.check(*args, initial_state=initial_state, **kwargs)
        plan = self.plan_for(call, backend=backend, seg=seg, schedule=schedule)
        if key is not None:
            self._checked[key] = (plan, _kept_zeros(call.states) if initial_state is None
                                  else None)
        return plan.package(*plan.run(call.inputs, call.states,
                                      (initial_state is not None, return_state)), return_state)

    def check(self, *args, initial_state=None, **kwargs) -> "CheckedCall":
        """The arguments of a call (inputs positionally or by name, ``initial_state``, kernel
        options such as ``threads=``), checked as a call checks them (``TypeError`` or
        ``ValueError`` naming the argument): a ``CheckedCall``, with zeros for the initial
        states not given."""
        options = {k: kwargs.pop(k) for k in KERNEL_OPTIONS if k in kwargs}
        inputs, states, sizes, out_dtype = self._bind(args, kwargs, initial_state)
        return CheckedCall(inputs, states, sizes, out_dtype, options)

    def plan(self, *args, initial_state=None, backend="auto", seg=None, schedule="auto",
             **kwargs) -> "CallPlan":
        """The plan of a call with these arguments (see ``plan_for``)."""
        call = self.check(*args, initial_state=initial_state, **kwargs)
        return self.plan_for(call, backend=backend, seg=seg, schedule=schedule)

    def plan_for(self, call: "CheckedCall", backend="auto", seg=None,
                 schedule="auto") -> "CallPlan":
        """The ``CallPlan`` of a checked call: looked up by what decides it (input dtypes, sizes,
        output dtype, backend, schedule, seg, kernel options and the default device), else made
        and kept in a cache of ``PLAN_CACHE_SIZE`` plans, least recently used evicted first."""
        if seg is not None:
            seg = positive_int(f"{self.name}()", "seg", seg)
        key = (tuple(x.dtype for x in call.inputs), tuple(call.sizes.items()), call.out_dtype,
               backend, schedule, seg, tuple(call.options.items()), device_key())
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable option: planning it raises the error that names it
            return self._make_plan(call, backend, seg, schedule)
        if plan is None:
            plan = self._plans[key] = self._make_plan(call, backend, seg, schedule)
        else:
            self._plans.move_to_end(key)
        return plan

    def _make_plan(self, call, backend, seg, schedule) -> "CallPlan":
        """Everything decided once for calls like ``call``: the recurrence that runs it (this
        one, or its twin without gradients for bool and integer inputs), backend, schedule,
        seg and the function that runs it."""
        options, sizes = dict(call.options), call.sizes
        rec = self._for_dtypes([x.dtype for x in call.inputs])
        impl = rec._backend(backend)
        if options and impl.name == "mlx":
            raise ValueError(f"{self.name}(): {'= and '.join(options)}= applies to the kernel "
                             "backends, not 'mlx'")
        kind, seg = choose_schedule(rec, sizes, schedule, seg, impl.name)
        if kind == "matrix":
            # MLX ops (its matmuls) on whatever device the backend names: no kernel of ours
            if options:
                raise ValueError(f"{self.name}(): {'= and '.join(options)}= applies to the "
                                 "kernel schedules, not schedule='matrix'")
            if impl.name != "mlx":  # its chunk products in that backend's kernels
                options["kernels"] = impl.name
            impl = rec._backend("mlx")
        options["schedule"] = kind
        decode = direct = None
        if impl.name == "mlx" and kind != "matrix" and sizes[self.spec.time] <= DECODE_MAX_STEPS:
            decode = impl.decoder(sizes, call.out_dtype)
        if kind == "matrix":
            direct = impl.matrix_on(options.get("kernels")).direct(sizes, seg, call.out_dtype)
        compiled = impl.name in COMPILED_BACKENDS
        return CallPlan(rec, impl, kind, seg, tuple(sorted(sizes.items())), call.out_dtype,
                        tuple(sorted(options.items())), decode, direct, compiled)

    def reference(self, *args, initial_state=None, return_state=False, **kwargs):
        """The spec's traced expressions evaluated step by step on MLX arrays, independent of
        the compiler's lowering, adjoint and renderers (no custom VJP: MLX autodiff
        differentiates it and stores every state). Same arguments and results as calling the
        recurrence."""
        from .backends.reference import run_reference

        inputs, states, sizes, out_dtype = self._bind(args, kwargs, initial_state)
        outs, finals = run_reference(self, inputs, states, sizes, out_dtype)
        out = outs[0] if len(outs) == 1 else tuple(outs)
        if not return_state:
            return out
        return out, (finals[0] if len(finals) == 1 else dict(zip(self.spec.states, finals)))


def _call_key(args, initial_state, backend, seg, schedule):
    """What decides a call's check and plan where its inputs are passed positionally and its
    initial state (if any) as one array: the arrays' shapes and dtypes, the options and the
    default device; ``None`` for any other call (it takes the full check). A call whose check
    passed once passes again with the same key, so ``Recurrence.__call__`` keeps its plan under
    it and skips the check."""
    if initial_state is not None:
        if type(initial_state) is not mx.array:
            return None
        args = (*args, initial_state)
    shapes = []
    for x in args:
        if type(x) is not mx.array:
            return None
        shapes.append((x.shape, x.dtype))
    return (tuple(shapes), initial_state is not None, backend, seg, schedule, device_key())


# the default device last seen and its text (``device_key``)
_last_device = (mx.default_device(), str(mx.default_device()))


def device_key() -> str:
    """The default device as a key: its text (a Device hashes by identity, its text by value),
    formatted again only when the device changes; comparing devices costs a fraction of
    formatting one, and a decode step keys a call by its device once per layer and token."""
    global _last_device
    device = mx.default_device()
    last, text = _last_device
    if device == last:
        return text
    text = str(device)
    _last_device = (device, text)
    return text


# (device key, trailing shape) -> an evaluated fp32 zero (``zero_state``), the most recent kept
_ZERO = LRU(16)
# The fewest elements of a kept zero: MLX's CUDA backend serves arrays of at most 8 bytes from a
# pool of managed memory, which the host's small writes share, so a kernel that reads a 0-d
# zero may wait on the page coming back to the device
ZERO_KEPT_MIN = 4


def zero_state(shape) -> mx.array:
    """A zero initial state of ``shape`` (fp32): filled where it has at most
    ``ZEROS_KEPT_MAX`` elements, else a broadcast view of a zero of its fewest trailing axes that
    hold ``ZERO_KEPT_MIN`` elements (device memory, not the small arrays' pool; a 0-d zero where
    those are more than ``ZEROS_KEPT_MAX``), evaluated once per device and kept. A kernel that
    reads it makes it contiguous by a copy, which on MLX's CUDA backend takes less than a fill:
    GLA's 2 MB of states at B8 H16 64 x 64 on an H200, 3.5-3.9 µs from a kept ``(64,)`` zero,
    11.6-16.1 from a 0-d one, 17.7 filled
    (benchmarks/results/bench-matrix-floor-in-kernels-H200-2026-11-28.md)."""
    if math.prod(shape) <= ZEROS_KEPT_MAX:
        return mx.zeros(shape, dtype=mx.float32)
    tail = len(shape) - 1
    while tail > 0 and math.prod(shape[tail:]) < ZERO_KEPT_MIN:
        tail -= 1
    trailing = tuple(shape[tail:]) if math.prod(shape[tail:]) <= ZEROS_KEPT_MAX else ()
    zero = _ZERO.get_or_build((device_key(), trailing), lambda: _evaluated_zeros(trailing))
    return mx.broadcast_to(zero, shape)


def unread_zeros(shape) -> mx.array:
    """Zeros of ``shape`` as a view of a kept, evaluated 0-d zero: no kernel runs for them. For
    what a custom function's VJP must return but nothing reads (the cotangent of a constant it
    was given): MLX evaluates every result of a VJP together, and a fill of zeros there took
    11 µs for a 2 MB state and as long for one float on MLX's CUDA backend."""
    zero = _ZERO.get_or_build((device_key(), ()), lambda: _evaluated_zeros(()))
    return mx.broadcast_to(zero, shape)


def _evaluated_zeros(shape) -> mx.array:
    zero = mx.zeros(shape, dtype=mx.float32)
    mx.eval(zero)
    return zero


def _kept_zeros(states) -> tuple:
    """What a call without ``initial_state`` keeps of its zero states (``zero_state``) for the
    calls like it, which pass them again: each small one evaluated (no fill to build or run
    each call; MLX never writes an array another holds), a larger one the view it is."""
    for x in states:
        if x.size <= ZEROS_KEPT_MAX:
            mx.eval(x)
    return tuple(states)


class CheckedCall(NamedTuple):
    """A call's checked arguments (``Recurrence.check``): inputs in declaration order, initial
    states in state order (zeros where not given), axis sizes, the outputs' dtype and the kernel
    options (``threads``, ``split``)."""

    inputs: list
    states: list
    sizes: dict
    out_dtype: mx.Dtype
    options: dict


@dataclass(frozen=True, eq=False)
class CallPlan:
    """What one kind of call runs, decided once (``Recurrence.plan_for``): the recurrence that
    runs it (the called one, or its twin without gradients for bool and integer inputs), the
    backend implementation, the schedule, the segment length, the sizes (sorted items), the
    outputs' dtype and the kernel options (the schedule among them).

    ``function`` is the custom function of the full path (outputs, final states, checkpoints;
    its VJP the backend's backward). ``decode``, on the mlx backend for calls of at most
    ``DECODE_MAX_STEPS`` steps, is the decode path: the steps as plain MLX ops
    (``mx.compile``d where the states are small), initial states in and final states out, no
    checkpoints, which MLX's own transforms differentiate, vmap and compile. ``direct``, for the
    matrix schedule, is its form as plain MLX ops around the kernels' core where kernels run
    (``MatrixForm.direct``): MLX's transforms take it as they take the decode path (the core
    has a VJP, a forward-mode rule and a clear refusal of vmap), and a VJP reuses the forward's
    graph where the full path's traces and computes the forward again. ``compiled``, on Metal
    and CUDA: the full path runs under ``mx.compile``, which replays the call's graph without
    running the glue's Python again (a decode step's or a small scan's time on the host is
    mostly that glue: 19 -> 8 µs a gated DeltaNet decode call, 14 -> 4 µs an RG-LRU scan
    call, on a 2-core x86 CPU). ``run`` takes the decode or the direct path
    where there is one, else the full path."""

    recurrence: "Recurrence"
    backend: object
    schedule: str
    seg: int
    sizes: tuple
    out_dtype: mx.Dtype
    options: tuple
    decode: object = None
    direct: object = None
    compiled: bool = False

    @functools.cached_property
    def function(self):
        """The full path's custom function (built on first use)."""
        return self.recurrence._function(self.backend, self.seg, dict(self.sizes),
                                         self.out_dtype, dict(self.options))

    @functools.cached_property
    def _path(self):
        """What ``run`` calls: the decode path (the function its ``Decoder`` runs), the direct
        path, or the full path (compiled where ``compiled``)."""
        if self.decode is not None:
            return self.decode.run
        return (self.direct
                or (mx.compile(self.function) if self.compiled else self.function))

    @functools.cached_property
    def _counts(self):
        """(outputs, states) of the recurrence: how ``run`` splits the path's results."""
        spec = self.recurrence.spec
        return len(spec.outputs), len(spec.states)

    def run(self, inputs, states, ends=(True, True)) -> tuple:
        """(outputs, final states) of the call on these checked arrays. ``ends``: whether the
        initial states were given (else they are zeros) and whether the final states are
        wanted; the direct path then neither reads zeros nor forms unwanted final states
        (``MatrixForm.direct``), and gives none of them."""
        n_out, n_state = self._counts
        path = self._path
        results = path(*inputs, *states, ends=ends) if path is self.direct \
            else path(*inputs, *states)
        return list(results[:n_out]), list(results[n_out:n_out + n_state])

    def package(self, outs, finals, return_state):
        """The call's results: the output (a tuple for several), then the final state (a dict
        by name for several) when ``return_state``."""
        out = outs[0] if len(outs) == 1 else tuple(outs)
        if not return_state:
            return out
        return out, (finals[0] if len(finals) == 1
                     else dict(zip(self.recurrence.spec.states, finals)))


_NO_SECOND_ORDER = (
    "second-order derivatives (mx.grad of a gradient, mx.jvp of a gradient) are not supported "
    "by the kernel backends (backend={backend!r}): the backward kernel has no derivative of its "
    "own. Use backend='mlx' for second-order derivatives (with schedule='matrix', "
    "MLX_RECGEN_MATRIX_KERNELS=0 keeps its chunk products in MLX ops, which have them)")
_NO_VMAP = (
    "mx.vmap is not supported by the kernel backends (backend={backend!r}): custom kernels have "
    "no batching rule. Fold the mapped axis into a batch axis of the spec, or use backend='mlx'")


def _refuse(message):
    def refuse(*_):
        raise NotImplementedError(message)

    return refuse


def opaque(arrays, backend):
    """The arguments as the body of a custom function should see them. MLX's jvp walks into a
    custom function's body (its outputs are computed there): the stop-gradient keeps jvp on the
    custom rule (a kernel or a compiled step has no jvp). vmap walks in too, and meets each
    kernel's own guard first (``vmap_guard``). The simulator is left alone: it evaluates its
    inputs through numpy (so they must stay on the graph: an evaluated intermediate is cut from
    it), its results are constants to MLX, and it reports compile/vmap itself."""
    if backend == "metal-sim":
        return list(arrays)
    return [mx.stop_gradient(a) for a in arrays]


def vmap_guard(backend):
    """A custom function of any arrays that returns the last one and whose vmap rule raises
    the kernel backends' refusal: a kernel launch passes its inputs through it
    (``backends.kernels.kernel_factory``)."""
    @mx.custom_function
    def guard(*arrays):
        return arrays[-1]

    guard.vmap(_refuse(_NO_VMAP.format(backend=backend)))
    return guard


def _with_zeros(spec, inputs, grads) -> list:
    """The gradients of the differentiable inputs, with zeros of each bool or integer input's
    shape and dtype in its place (MLX's cotangent for such an input)."""
    grads = iter(grads)
    return [next(grads) if t.differentiable else mx.zeros_like(x)
            for t, x in zip(spec.inputs.values(), inputs)]


def first_order_only(backward, backend: str):
    """``backward``, a VJP that runs kernels, as a custom function whose own derivatives raise:
    a kernel is opaque to MLX, so a second derivative through it would otherwise be silently 0
    (or wrong, or an internal error on a GPU)."""
    fn = mx.custom_function(backward)
    fn.vjp(_refuse(_NO_SECOND_ORDER.format(backend=backend)))
    fn.jvp(_refuse(_NO_SECOND_ORDER.format(backend=backend)))
    return fn


def _first_order_only(spec, backend, n_in, n_out, n_state, sizes, seg, schedule):
    """A kernel backend's backward as a custom function whose own derivatives raise."""
    def backward(*arrays):
        arrays = opaque(arrays, backend.name)
        inputs, states = list(arrays[:n_in]), list(arrays[n_in:n_in + n_state])
        d_out, d_fin = list(arrays[-n_out - n_state:-n_state]), list(arrays[-n_state:])
        residuals = list(arrays[n_in + n_state:-n_out - n_state])
        grads, d_init = backend.backward(inputs, states, residuals, d_out, d_fin, sizes, seg,
                                         **schedule)
        return (*_with_zeros(spec, inputs, grads), *d_init)

    return first_order_only(backward, backend.name)


def _assigned(program) -> set:
    return {b.target for s in program.statements for b in (s.body if isinstance(s, Loop) else [s])
            if hasattr(b, "target")}


def require_backend(backend: str) -> None:
    """Raise now, before anything is computed, where ``backend`` cannot run here: ``metal`` or
    ``cuda`` without that device in this MLX, ``metal-sim`` without a C++ compiler."""
    if backend in ("metal", "cuda"):
        from .backends.kernels import kernel_factory

        kernel_factory(backend)  # raises without the device
    elif backend == "metal-sim":
        from .sim import find_compiler

        find_compiler()  # raises without a C++ compiler


def default_backend() -> str:
    """``metal`` where MLX has Metal, else ``cuda`` where it has CUDA, else ``mlx``; ``mlx``
    too where MLX's default device is the CPU (``mx.set_default_device(mx.cpu)``), whose
    stream cannot run GPU kernels."""
    if mx.default_device().type != mx.gpu:
        return "mlx"
    try:
        if mx.metal.is_available():
            return "metal"
    except AttributeError:
        pass
    try:
        if mx.cuda.is_available():
            return "cuda"
    except AttributeError:
        pass
    return "mlx"
