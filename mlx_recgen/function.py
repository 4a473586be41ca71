"""Compiled recurrences: argument checking, backend choice and the ``mx.custom_function`` glue.

The glue is the same for every backend: a backend provides ``forward`` (outputs, final states
and segment checkpoints) and ``backward`` (input and initial-state gradients from the
checkpoints), and this module wraps the pair into a custom function with a custom VJP.
"""

from __future__ import annotations

import mlx.core as mx

from . import cache as program_cache
from .adjoint import derive
from .ir import Loop, lower, schedule_forward
from .layout import declared_shape
from .spec import Spec

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
BACKENDS = ("auto", "mlx", "metal", "metal-sim", "cuda")


def _axes_text(t) -> str:
    return " ".join(str(a) for a in t.axes)


def _dtype_name(d) -> str:
    return str(d).replace("mlx.core.", "")


class Recurrence:
    """A recurrence compiled from a spec.

    Call it with the spec's inputs (positionally in declaration order, or by name)::

        y = rec(u, delta, B, C, A)
        y, h = rec(u, delta, B, C, A, initial_state=h0, return_state=True)

    Keyword-only options: ``initial_state`` (an array for a single state, else a dict by state
    name; zeros when omitted), ``return_state`` (also return the final state, fp32),
    ``backend`` (``"auto"``, ``"mlx"``, ``"metal"``, ``"metal-sim"``, ``"cuda"``) and ``seg``
    (checkpoint every ``seg`` steps). Outputs are in the inputs' dtype; state is kept in fp32.
    """

    def __init__(self, spec: Spec):
        self.spec = spec
        self.ir = lower(spec)
        self.forward_program, self.adjoint = self._programs()
        self._backends = {}
        self._functions = {}
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
        return "\n".join(lines)

    def gradient_reductions(self) -> dict:
        """For every input (and the initial state), the reductions its gradient needs:
        ``state index`` (an in-thread loop), ``lanes`` (simd + threadgroup), ``time`` (register
        accumulator), ``batch`` (a final MLX sum over batch-like axes the input lacks)."""
        s = self.spec
        out = {}
        for t in s.inputs.values():
            classes = []
            if s.state_axis and not t.has_state_axis:
                classes.append("state index")
            if not t.has_lane:
                classes.append("lanes")
            if not t.has_time:
                classes.append("time")
            if len(t.batch_axes) < len(s.batch_axes):
                classes.append("batch")
            out[t.name] = classes
        for t in s.states.values():
            out[f"{t.name} (initial state)"] = []
        return out

    def source(self, kernel: str = "forward", backend: str = "metal", dtype=mx.float32, **schedule):
        """The full source of a kernel as the backend compiles it.

        ``kernel`` is ``"forward"`` or ``"backward"``; ``backend`` is ``"metal"``, ``"cuda"`` or
        ``"mlx"`` (the rendered Python step function)."""
        if kernel not in ("forward", "backward"):
            raise ValueError(f"kernel must be 'forward' or 'backward', got {kernel!r}")
        if backend == "mlx":
            b = self._backend("mlx")
            return (b.forward_step if kernel == "forward" else b.backward_step).source
        from .backends.kernels import kernel_source

        return kernel_source(self, kernel, backend, dtype, **schedule)

    # -- calling ----------------------------------------------------------------------------------
    def _bind(self, args, kwargs, initial_state):
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

        sizes, where = {}, {}

        def check(arg, x, t):
            if not isinstance(x, mx.array):
                raise TypeError(f"{s.name}(): argument '{arg}' must be an mx.array, got {type(x).__name__}")
            if x.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{s.name}(): argument '{arg}' has dtype {_dtype_name(x.dtype)}; "
                                "expected float32, float16 or bfloat16")
            if x.ndim != len(t.axes):
                raise ValueError(f"{s.name}(): argument '{arg}' has shape {tuple(x.shape)} "
                                 f"({x.ndim} axes); expected {len(t.axes)} axes ({_axes_text(t)})")
            for a, n in zip(t.axes, x.shape):
                if isinstance(a, int):
                    if n != a:
                        raise ValueError(f"{s.name}(): argument '{arg}' has shape {tuple(x.shape)}; "
                                         f"its component axis must have size {a} ({_axes_text(t)})")
                elif a in sizes and sizes[a] != n:
                    raise ValueError(f"{s.name}(): axis {a} has size {n} in '{arg}' {tuple(x.shape)} "
                                     f"but {sizes[a]} in '{where[a]}'")
                else:
                    sizes[a], where[a] = n, arg
            if x.size == 0:
                raise ValueError(f"{s.name}(): argument '{arg}' is empty (shape {tuple(x.shape)})")

        for n in names:
            check(n, values[n], s.inputs[n])

        states = {}
        if initial_state is not None:
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
                check(f"initial_state['{k}']" if len(s.states) > 1 else "initial_state", x, s.states[k])
                states[k] = x
        for a in (s.time, s.lane, *s.batch_axes, *([s.state_axis] if s.state_axis else [])):
            if a not in sizes:
                raise ValueError(f"{s.name}(): the size of axis {a} cannot be inferred from the "
                                 "inputs; pass initial_state")
        for k, t in s.states.items():
            if k not in states:
                states[k] = mx.zeros(declared_shape(t, sizes), dtype=mx.float32)
        floats = {values[n].dtype for n in names}
        out_dtype = floats.pop() if len(floats) == 1 else mx.float32
        return [values[n] for n in names], [states[k] for k in s.states], sizes, out_dtype

    def _backend(self, backend):
        if backend == "auto":
            backend = default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend not in self._backends:
            if backend == "mlx":
                from .backends.mlx_ops import MLXBackend

                self._backends[backend] = MLXBackend(self)
            else:
                from .backends.kernels import KernelBackend

                self._backends[backend] = KernelBackend(self, backend)
        return self._backends[backend]

    def _function(self, backend, seg, sizes, out_dtype, schedule):
        key = (backend.name, seg, tuple(sorted(sizes.items())), out_dtype, tuple(sorted(schedule.items())))
        if key in self._functions:
            return self._functions[key]
        n_in, n_out, n_state = len(self.spec.inputs), len(self.spec.outputs), len(self.spec.states)

        @mx.custom_function
        def fn(*arrays):
            inputs, states = list(arrays[:n_in]), list(arrays[n_in:])
            outs, finals, residuals = backend.forward(inputs, states, sizes, seg, out_dtype, **schedule)
            return (*outs, *finals, *residuals)

        @fn.vjp
        def fn_vjp(primals, cotangents, outputs):
            inputs, states = list(primals[:n_in]), list(primals[n_in:])
            residuals = list(outputs[n_out + n_state:])
            d_out = list(cotangents[:n_out])
            d_fin = list(cotangents[n_out:n_out + n_state])
            grads, d_init = backend.backward(inputs, states, residuals, d_out, d_fin, sizes, seg, **schedule)
            return (*grads, *d_init)

        self._functions[key] = fn
        return fn

    def __call__(self, *args, initial_state=None, return_state=False, backend="auto", seg=32,
                 **kwargs):
        schedule = {k: kwargs.pop(k) for k in ("threads",) if k in kwargs}
        inputs, states, sizes, out_dtype = self._bind(args, kwargs, initial_state)
        if not isinstance(seg, int) or isinstance(seg, bool) or seg < 1:
            raise ValueError(f"{self.name}(): seg must be a positive integer, got {seg!r}")
        seg = min(seg, sizes[self.spec.time])
        impl = self._backend(backend)
        if schedule and impl.name == "mlx":
            raise ValueError(f"{self.name}(): threads= applies to the kernel backends, not 'mlx'")
        fn = self._function(impl, seg, sizes, out_dtype, schedule)
        results = fn(*inputs, *states)
        n_out, n_state = len(self.spec.outputs), len(self.spec.states)
        outs = results[:n_out]
        out = outs[0] if n_out == 1 else tuple(outs)
        if not return_state:
            return out
        finals = results[n_out:n_out + n_state]
        final = finals[0] if n_state == 1 else dict(zip(self.spec.states, finals))
        return out, final

    def reference(self, *args, initial_state=None, return_state=False, **kwargs):
        """The plain per-step MLX loop (no custom VJP: MLX autodiff differentiates it and stores
        every state). Same arguments and results as calling the recurrence."""
        from .backends.reference import run_reference

        inputs, states, sizes, out_dtype = self._bind(args, kwargs, initial_state)
        outs, finals = run_reference(self, inputs, states, sizes, out_dtype)
        out = outs[0] if len(outs) == 1 else tuple(outs)
        if not return_state:
            return out
        return out, (finals[0] if len(finals) == 1 else dict(zip(self.spec.states, finals)))


def _assigned(program) -> set:
    return {b.target for s in program.statements for b in (s.body if isinstance(s, Loop) else [s])
            if hasattr(b, "target")}


def default_backend() -> str:
    """``metal`` where MLX has Metal, else ``cuda`` where it has CUDA, else ``mlx``."""
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
