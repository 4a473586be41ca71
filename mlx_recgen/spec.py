"""The spec language: declarations, axis roles and the tracing of a recurrence body.

A spec declares every tensor with its axes, named by identifiers (``"B L H P"``) or, for small
fixed-size component axes such as a (re, im) pair, by an integer literal (``"B L P 2"``). The
roles of the axes follow from the declarations:

* ``time``: the sequential axis. An input without it is a *parameter* (time-invariant).
* ``lane``: one GPU thread per lane value.
* batch-like axes: every axis an output carries besides time, lane and components. Instances
  along them are independent (grid dimensions).
* the *state axis*: the one remaining axis of the state. Each thread keeps a vector over it; the
  body addresses it through the index parameter (``n``) and reduces over it with ``Sum``.
* component axes (integer literals): indexed by constant integers in the body.
* *group* axes (``groups={"Hk": "H"}``): a coarser index of a batch-like axis. An input that
  carries ``Hk`` instead of ``H`` serves every ``H`` of its group: instance ``h`` reads it at
  ``h // (H / Hk)``.

A state without the lane axis is *shared* by the lanes of an instance: every lane computes the
same value, so its update may read only lane-invariant values (states and inputs without the
lane axis). Inputs are differentiable when they are floating point; bool and integer inputs
(masks, lengths, positions) are non-differentiable (``Tensor.differentiable``, set per call by
``Spec.without_gradients``).

The body is plain Python run once on sympy symbols; what it computes is read back as expressions.
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass, field, replace

import sympy

from .errors import SpecError
from .functions import sigmoid, softplus

# ---------------------------------------------------------------------------------------------
# Declarations
# ---------------------------------------------------------------------------------------------


def _parse_axes(spec: str, tensor: str, text) -> tuple:
    if not isinstance(text, str):
        raise SpecError(spec, f"tensor '{tensor}': axes must be a string like \"B L H P\", got {text!r}")
    axes = []
    for token in text.split():
        if token.isdecimal():
            if int(token) < 1:
                raise SpecError(spec, f"tensor '{tensor}': component axis size must be >= 1")
            axes.append(int(token))
        elif token.isidentifier():
            axes.append(token)
        else:
            raise SpecError(spec, f"tensor '{tensor}': '{token}' is not an axis name")
    names = [a for a in axes if isinstance(a, str)]
    if len(set(names)) != len(names):
        raise SpecError(spec, f"tensor '{tensor}': an axis appears twice in \"{text}\"")
    if len([a for a in axes if isinstance(a, int)]) > 1:
        raise SpecError(spec, f"tensor '{tensor}': at most one component axis is supported")
    return tuple(axes)


@dataclass(frozen=True)
class Tensor:
    """A declared tensor of the spec and the roles of its axes."""

    name: str
    kind: str  # "state" | "input" | "output"
    axes: tuple  # as declared (strings, and an int for a component axis)
    has_time: bool
    has_lane: bool
    has_state_axis: bool
    components: int  # size of the component axis, 1 if none
    batch_axes: tuple  # the batch-like axes it carries (a group axis in the place of the axis
    # it groups), in the spec's batch order
    differentiable: bool = True  # an input that gets a gradient (False: bool/integer inputs)


@dataclass(frozen=True)
class Slot:
    """One scalar-or-vector value of a tensor: the tensor and a component index (0 if none)."""

    tensor: str
    component: int = 0

    def label(self, components: int) -> str:
        return self.tensor if components == 1 else f"{self.tensor}[{self.component}]"


# ---------------------------------------------------------------------------------------------
# Tracing objects
# ---------------------------------------------------------------------------------------------


class StateIndex(sympy.Symbol):
    """The body's index over the state axis (``n`` in ``h[n]``)."""


class Reduce(sympy.Function):
    """``Sum(body, n)``: the sum of a pointwise expression over the state axis."""

    nargs = 1
    is_real = True


def Sum(expr, index):
    """Sum ``expr`` over the state axis, addressed by the body's index parameter ``index``."""
    if not isinstance(index, StateIndex):
        raise TypeError(f"Sum(expr, index): index must be the body's state index, got {index!r}")
    return Reduce(sympy.sympify(expr))


_ALLOWED_FUNCS = (sympy.exp, sympy.log, sympy.tanh, sympy.sin, sympy.cos, sympy.Abs,
                  sympy.Piecewise, sigmoid, softplus, Reduce)


def _allowed_function(f) -> bool:
    from sympy.codegen.cfunctions import log1p
    return isinstance(f, (*_ALLOWED_FUNCS, log1p))


class _Indexable:
    """A tensor with index axes, as the body sees it: ``B[n]``, ``x[0]``, ``h[n] = ...``."""

    def __init__(self, owner: "Tracer", tensor: Tensor, values: dict):
        self._owner, self._tensor, self._values = owner, tensor, values

    def _component(self, key) -> int:
        t = self._tensor
        key = key if isinstance(key, tuple) else (key,)
        want = []
        for ax in t.axes:
            if isinstance(ax, int):
                want.append("component")
            elif t.has_state_axis and ax == self._owner.state_axis:
                want.append("state index")
        if len(key) != len(want):
            raise SpecError(self._owner.spec_name,
                            f"'{t.name}' is indexed with {len(key)} indices; it takes "
                            f"{len(want)} ({', '.join(want) or 'none'})")
        comp = 0
        for k, w in zip(key, want):
            if w == "state index":
                if not isinstance(k, StateIndex):
                    raise SpecError(self._owner.spec_name,
                                    f"'{t.name}' must be indexed by the state index "
                                    f"'{self._owner.index_name}' on axis {self._owner.state_axis}, got {k!r}")
            else:
                if not isinstance(k, int) or not 0 <= k < t.components:
                    raise SpecError(self._owner.spec_name,
                                    f"'{t.name}': component index must be an integer in "
                                    f"[0, {t.components}), got {k!r}")
                comp = k
        return comp

    def __getitem__(self, key):
        return self._values[self._component(key)]

    def __setitem__(self, key, value):
        if self._tensor.kind != "state":
            raise SpecError(self._owner.spec_name, f"input '{self._tensor.name}' is read-only")
        self._values[self._component(key)] = sympy.sympify(value)

    def __repr__(self):
        return f"<{self._tensor.kind} {self._tensor.name}>"

    def _not_scalar(self, *_):
        t, axis = self._tensor, self._owner.state_axis
        hint = ""
        if t.has_state_axis:
            hint = (f" ('{t.name}' carries the state axis '{axis}', an axis that no output "
                    f"carries; if '{axis}' is a batch axis, every output must carry it)")
        raise SpecError(self._owner.spec_name,
                        f"'{t.name}' has index axes; use it as {t.name}[...] in expressions{hint}")

    __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __rsub__ = _not_scalar
    __truediv__ = __rtruediv__ = __pow__ = __neg__ = _not_scalar


class Tracer:
    """Runs a body once on symbols and captures what it computes."""

    def __init__(self, spec_name, tensors, state_axis, index_name):
        self.spec_name = spec_name
        self.tensors = tensors
        self.state_axis = state_axis
        self.index_name = index_name
        self.symbols: dict[Slot, sympy.Symbol] = {}
        self.vector_symbols: set = set()

    def symbol_for(self, tensor: Tensor, component: int) -> sympy.Symbol:
        slot = Slot(tensor.name, component)
        if slot not in self.symbols:
            name = tensor.name
            if tensor.components > 1:  # h -> h0, h1; never the name of another tensor
                name = f"{tensor.name}{component}"
                taken = set(self.tensors) | {str(x) for x in self.symbols.values()}
                while name in taken:
                    name += "_"
            s = sympy.Symbol(name, real=True)
            self.symbols[slot] = s
            if tensor.has_state_axis:
                self.vector_symbols.add(s)
        return self.symbols[slot]

    def argument_for(self, tensor: Tensor):
        values = {c: self.symbol_for(tensor, c) for c in range(tensor.components)}
        if tensor.has_state_axis or tensor.components > 1:
            return _Indexable(self, tensor, values)
        return values[0]


# Tool ids that no debugger (0), coverage tool (1) or profiler (2) claims by convention.
_TOOL_IDS = (5, 4, 3)
# One body is traced at a time: sys.monitoring's tool ids and local events are process-wide, so
# two threads tracing bodies of one code object (closures of one factory) would each see the
# other's returns. Reentrant: a body may define a spec on its own thread.
_TRACING = threading.RLock()


def _run_capturing_locals(fn, kwargs):
    """Call ``fn(**kwargs)`` and return (result, its locals at return).

    The locals are read from ``fn``'s frame when it returns, without disturbing a profiler,
    tracer or debugger the caller has running: on Python 3.12+ through a ``sys.monitoring``
    return event local to ``fn``'s code, recorded for this thread's call only; before 3.12
    through a profile hook on this thread, after which the caller's hook is reinstated (a Python
    hook with ``sys.setprofile``, cProfile's by re-enabling it, which keeps its settings).
    Another C-level hook, which cannot be reinstated, is left untouched by running ``fn`` on a
    helper thread. Safe to call from several threads: they trace one at a time."""
    with _TRACING:
        return _run_capturing_locals_locked(fn, kwargs)


def _claim_tool_id(monitoring):
    """A ``sys.monitoring`` tool id claimed for tracing, or None when another tool holds each of
    ``_TOOL_IDS``. Claimed, not looked up first: another thread may claim an id in between."""
    for tool in _TOOL_IDS:
        try:
            monitoring.use_tool_id(tool, "mlx-recgen spec tracing")
        except ValueError:  # in use
            continue
        return tool
    return None


def _run_capturing_locals_locked(fn, kwargs):
    captured = {}
    code = fn.__code__

    def keep(frame):
        if frame.f_code is code:  # the last return is the outermost call's
            captured.clear()
            captured.update(frame.f_locals)

    monitoring = getattr(sys, "monitoring", None)
    tool = None if monitoring is None else _claim_tool_id(monitoring)
    if tool is not None:
        events = monitoring.events
        tracing_thread = threading.get_ident()

        def on_return(_code, _offset, _value):
            # local events fire on every thread that runs ``code``; only this one's call counts
            if threading.get_ident() == tracing_thread:
                keep(sys._getframe(1))

        try:
            monitoring.register_callback(tool, events.PY_RETURN, on_return)
            monitoring.set_local_events(tool, code, events.PY_RETURN)
            result = fn(**kwargs)
        finally:
            monitoring.set_local_events(tool, code, 0)
            monitoring.register_callback(tool, events.PY_RETURN, None)
            monitoring.free_tool_id(tool)
        return result, captured

    def profiler(frame, event, arg):
        if event == "return":
            keep(frame)

    def run():
        sys.setprofile(profiler)
        try:
            return fn(**kwargs)
        finally:
            sys.setprofile(None)

    old = sys.getprofile()
    if old is None or callable(old):
        try:
            return run(), captured
        finally:
            sys.setprofile(old)
    import _lsprof

    if isinstance(old, _lsprof.Profiler):
        try:
            return run(), captured
        finally:
            old.enable()  # no arguments: its subcalls/builtins settings are kept

    outcome = []

    def on_thread():
        try:
            outcome.append((True, run()))
        except BaseException as exc:  # re-raised on the caller's thread
            outcome.append((False, exc))

    helper = threading.Thread(target=on_thread, name="mlx-recgen spec tracing")
    helper.start()
    helper.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value, captured


# ---------------------------------------------------------------------------------------------
# The traced spec
# ---------------------------------------------------------------------------------------------


@dataclass
class Spec:
    """A parsed, traced recurrence spec: declarations, axis roles and the step's expressions."""

    name: str
    doc: str
    time: str
    lane: str
    batch_axes: tuple
    state_axis: str | None
    index_name: str | None
    states: dict  # name -> Tensor
    inputs: dict  # name -> Tensor (ordered as the body's parameters)
    outputs: dict  # name -> Tensor
    symbols: dict  # Slot -> sympy.Symbol (old state values and inputs)
    vector_symbols: frozenset
    state_updates: dict  # Slot -> expression (new value of each state slot)
    output_exprs: dict  # Slot -> expression
    reduce_names: dict  # Reduce expression -> the body's local name for it
    source_file: str | None = None
    groups: dict = field(default_factory=dict)  # group axis -> the batch-like axis it groups

    @property
    def tensors(self) -> dict:
        return {**self.states, **self.inputs, **self.outputs}

    def grouped(self, axis):
        """The batch-like axis a group axis groups; any other axis itself."""
        return self.groups.get(axis, axis)

    def covers(self, t: Tensor, batch_axis: str) -> bool:
        """Whether tensor ``t`` carries ``batch_axis`` or a group axis of it."""
        return any(self.grouped(a) == batch_axis for a in t.batch_axes)

    def lane_varying(self) -> set:
        """Symbols that vary over the lanes of an instance: those of inputs and states with the
        lane axis."""
        return {sym for slot, sym in self.symbols.items() if self.tensors[slot.tensor].has_lane}

    @property
    def differentiable_inputs(self) -> dict:
        """The inputs that get a gradient (floating-point ones; ``without_gradients``)."""
        return {k: t for k, t in self.inputs.items() if t.differentiable}

    def without_gradients(self, names) -> "Spec":
        """The same spec with the inputs ``names`` non-differentiable: the adjoint derives no
        gradient for them and the tangent recurrence no tangent."""
        names = set(names)
        if not names:
            return self
        inputs = {k: replace(t, differentiable=False) if k in names else t
                  for k, t in self.inputs.items()}
        return replace(self, inputs=inputs)

    def state_slots(self):
        return [Slot(t.name, c) for t in self.states.values() for c in range(t.components)]

    def input_slots(self, differentiable_only: bool = False):
        return [Slot(t.name, c) for t in self.inputs.values() for c in range(t.components)
                if t.differentiable or not differentiable_only]

    def output_slots(self):
        return [Slot(t.name, c) for t in self.outputs.values() for c in range(t.components)]

    def is_vector(self, symbol) -> bool:
        return symbol in self.vector_symbols


# The keyword options of a recurrence's call (``Recurrence.__call__``; ``KERNEL_OPTIONS`` are
# those of the kernel backends only). No input may take one of these names: it could not be
# passed by keyword.
KERNEL_OPTIONS = ("threads", "split")
CALL_OPTIONS = ("initial_state", "return_state", "backend", "seg", "schedule", "group",
                *KERNEL_OPTIONS)

# A spec's name reaches generated code (kernel names, comments): letters, digits, "_", "-" and
# ".", starting with a letter or "_"; never a space, quote, newline or other control character.
_SPEC_NAME = re.compile(r"[^\W\d][\w.-]*")


def _spec_name(fn, name) -> str:
    """The spec's name, ``name`` or else the body's, checked against ``_SPEC_NAME``."""
    given = name is not None
    if not given:
        name = getattr(fn, "__name__", None)
    if isinstance(name, str) and _SPEC_NAME.fullmatch(name):
        return name
    shown = name.encode("unicode_escape").decode() if isinstance(name, str) else repr(name)
    raise SpecError(shown, "a spec name is made of letters, digits, '_', '-' and '.' and starts "
                           "with a letter or '_' (it names the generated kernels)"
                    + ("" if given else "; name the spec with name=..."))


def build_spec(fn, *, lane, time="L", state, inputs, outputs, name=None, groups=None) -> Spec:
    """The spec of the body ``fn``: its declarations checked, the axis roles inferred, the body
    traced and its state updates and outputs read back (``recurrence``'s arguments)."""
    spec_name = _spec_name(fn, name)
    _check_declarations(spec_name, lane, time, state, inputs, outputs)
    raw = {}
    for kind, group in (("state", state), ("input", inputs), ("output", outputs)):
        for tname, text in group.items():
            raw[tname] = (kind, _parse_axes(spec_name, tname, text))
    batch_axes = _batch_axes(spec_name, raw, time, lane)
    groups = _check_groups(spec_name, groups, raw, batch_axes, time, lane)
    state_axis = _state_axis(spec_name, raw, batch_axes, time, lane)
    tensors = _tensors(spec_name, raw, batch_axes, groups, time, lane, state_axis)
    declared = list(state) + list(inputs)
    index_name = _index_name(spec_name, fn, declared, state_axis)

    tracer = Tracer(spec_name, tensors, state_axis, index_name)
    kwargs = {tname: tracer.argument_for(tensors[tname]) for tname in declared}
    if index_name:
        kwargs[index_name] = StateIndex(index_name)
    try:
        result, local_vars = _run_capturing_locals(fn, kwargs)
    except SpecError:
        raise
    except Exception as exc:  # the body is user code: report it in the spec's terms
        raise SpecError(spec_name, _explain_body_error(exc)) from exc

    updates = _state_updates(spec_name, {t: kwargs[t] for t in state}, local_vars, tensors, tracer)
    output_exprs = _output_exprs(spec_name, result, outputs, tensors)
    reduce_names = {}
    for lname, value in local_vars.items():
        if isinstance(value, Reduce) and lname.isidentifier():
            reduce_names.setdefault(value, lname)

    spec = Spec(
        name=spec_name, doc=inspect.getdoc(fn) or "", time=time, lane=lane,
        batch_axes=tuple(batch_axes), state_axis=state_axis, index_name=index_name,
        states={t: tensors[t] for t in state}, inputs={t: tensors[t] for t in inputs},
        outputs={t: tensors[t] for t in outputs}, symbols=dict(tracer.symbols),
        vector_symbols=frozenset(tracer.vector_symbols), state_updates=updates,
        output_exprs=output_exprs, reduce_names=reduce_names,
        source_file=inspect.getsourcefile(fn), groups=groups,
    )
    _validate_expressions(spec)
    _warn_unread_inputs(spec)
    return spec


def _check_declarations(spec_name, lane, time, state, inputs, outputs):
    """The declarations' own form: non-empty dicts of tensors with distinct identifier names,
    none named like a call option; the lane and time axes two different axis names."""
    for arg, value in (("state", state), ("inputs", inputs), ("outputs", outputs)):
        if not isinstance(value, dict) or not value:
            raise SpecError(spec_name, f"'{arg}' must be a non-empty dict of name -> axes")
    for arg, value in (("lane", lane), ("time", time)):
        if not isinstance(value, str) or not value.isidentifier():
            raise SpecError(spec_name, f"'{arg}' must be an axis name, got {value!r}")
    if lane == time:
        raise SpecError(spec_name, f"lane and time are the same axis '{lane}'")
    seen = set()
    for group in (state, inputs, outputs):
        for tname in group:
            if not (isinstance(tname, str) and tname.isidentifier()):
                raise SpecError(spec_name, f"'{tname}' is not a valid tensor name")
            if tname in seen:
                raise SpecError(spec_name, f"tensor name '{tname}' is declared twice")
            seen.add(tname)
    clashes = [t for t in inputs if t in CALL_OPTIONS]
    if clashes:
        raise SpecError(spec_name, f"input '{clashes[0]}' is named like an option of the call; "
                                   f"the call's options {list(CALL_OPTIONS)} cannot name inputs")


def _batch_axes(spec_name, raw, time, lane) -> list:
    """The batch-like axes: what the outputs carry besides time, lane and components, in the
    order they first appear; every output carries time, lane and all of them."""
    batch_axes = []
    for tname, (kind, axes) in raw.items():
        if kind != "output":
            continue
        if time not in axes:
            raise SpecError(spec_name, f"output '{tname}' lacks the time axis '{time}'")
        if lane not in axes:
            raise SpecError(spec_name, f"output '{tname}' lacks the lane axis '{lane}'")
        for a in axes:
            if isinstance(a, str) and a not in (time, lane) and a not in batch_axes:
                batch_axes.append(a)
    for tname, (kind, axes) in raw.items():
        if kind == "output":
            lacking = [b for b in batch_axes if b not in axes]
            if lacking:
                raise SpecError(spec_name, f"output '{tname}' lacks the batch axis '{lacking[0]}' "
                                           "that other outputs carry; every output carries every "
                                           "batch-like axis")
    return batch_axes


def _state_axis(spec_name, raw, batch_axes, time, lane):
    """The state axis (None if none): what states carry besides lane, batch and components; at
    most one. States carry every batch axis and never time; a state without the lane axis is
    shared by the lanes of an instance."""
    state_axes = []
    for tname, (kind, axes) in raw.items():
        if kind != "state":
            continue
        if time in axes:
            raise SpecError(spec_name, f"state '{tname}' must not carry the time axis '{time}'")
        for b in batch_axes:
            if b not in axes:
                raise SpecError(spec_name, f"state '{tname}' lacks the batch axis '{b}' "
                                           "that the outputs carry")
        for a in axes:
            if isinstance(a, str) and a not in batch_axes and a != lane and a not in state_axes:
                state_axes.append(a)
    if len(state_axes) > 1:
        raise SpecError(spec_name, f"states carry several state axes {state_axes}; one state "
                                   "axis (besides lane, batch and a component axis) is supported. "
                                   "A state axis is one that states carry and outputs do not: a "
                                   "batch axis must be carried by every output")
    return state_axes[0] if state_axes else None


def _tensors(spec_name, raw, batch_axes, groups, time, lane, state_axis) -> dict:
    """Each declared tensor (name -> ``Tensor``) with its axis roles; an axis outside every role
    is an error."""
    known = set(batch_axes) | set(groups) | {time, lane} | ({state_axis} if state_axis else set())
    tensors = {}
    for tname, (kind, axes) in raw.items():
        for a in axes:
            if isinstance(a, str) and a not in known:
                raise SpecError(spec_name, f"tensor '{tname}': unknown axis '{a}' (not the time "
                                           "or lane axis, not carried by an output or a state, "
                                           "not a group axis; batch axes are the ones the outputs "
                                           "carry)")
        comps = [a for a in axes if isinstance(a, int)]
        carried = []
        for b in batch_axes:
            carried += [a for a in axes if a == b or groups.get(a) == b]
        tensors[tname] = Tensor(
            name=tname, kind=kind, axes=axes, has_time=time in axes, has_lane=lane in axes,
            has_state_axis=state_axis is not None and state_axis in axes,
            components=comps[0] if comps else 1, batch_axes=tuple(carried),
        )
    return tensors


def _index_name(spec_name, fn, declared, state_axis):
    """The body's parameter for the state axis (None without one): the body takes the states
    and inputs by name, then exactly one index where the spec has a state axis."""
    params = list(inspect.signature(fn).parameters)
    extra = [p for p in params if p not in declared]
    missing = [d for d in declared if d not in params]
    if missing:
        raise SpecError(spec_name, f"the body has no parameter for {missing}; every state and "
                                   "input must be a parameter")
    if state_axis is None and extra:
        raise SpecError(spec_name, f"unknown body parameters {extra}: no state/input is declared "
                                   "with these names and the spec has no state axis to index "
                                   "(an axis the outputs carry is batch-like, not a state axis; "
                                   "outputs reduce over the state axis with Sum)")
    if state_axis is not None and len(extra) != 1:
        hint = "" if extra else (
            f"; '{state_axis}' is the state axis because states carry it and no output does (if "
            f"'{state_axis}' is a batch axis, every output must carry it)")
        raise SpecError(spec_name, f"the body needs exactly one index parameter for the state "
                                   f"axis '{state_axis}' (after the tensors), got {extra}{hint}")
    return extra[0] if extra else None


def _state_updates(spec_name, state_args, local_vars, tensors, tracer) -> dict:
    """The new value of each state slot (``Slot`` -> expression) after the traced body: item
    assignment on indexables, rebinding for plain scalar states; every state updated."""
    updates = {}
    for tname, arg in state_args.items():
        t = tensors[tname]
        if isinstance(arg, _Indexable):
            rebound = local_vars.get(tname, arg)
            if rebound is not arg:
                raise SpecError(spec_name, f"state '{tname}' has index axes; update it with "
                                           f"{tname}[...] = ..., not by rebinding the name")
            for c in range(t.components):
                updates[Slot(tname, c)] = arg._values[c]
        else:
            updates[Slot(tname, 0)] = sympy.sympify(local_vars.get(tname, arg))

    old = {Slot(t, c): tracer.symbols[Slot(t, c)]
           for t in state_args for c in range(tensors[t].components)}
    for tname in state_args:
        slots = [s for s in updates if s.tensor == tname]
        if all(updates[s] == old[s] for s in slots):
            raise SpecError(spec_name, f"state '{tname}' is never updated by the body")
    return updates


def _output_exprs(spec_name, result, outputs, tensors) -> dict:
    """Each output slot's expression (``Slot`` -> expression) from the dict the body returns:
    every declared output, nothing else, one value per component."""
    if not isinstance(result, dict):
        raise SpecError(spec_name, f"the body must return a dict of outputs {list(outputs)}, "
                                   f"got {type(result).__name__}")
    unknown_out = [k for k in result if k not in outputs]
    if unknown_out:
        raise SpecError(spec_name, f"the body returns undeclared outputs {unknown_out}")
    absent_out = [k for k in outputs if k not in result]
    if absent_out:
        raise SpecError(spec_name, f"output(s) {absent_out} are declared but not returned")
    output_exprs = {}
    for oname, value in result.items():
        t = tensors[oname]
        values = value if isinstance(value, (tuple, list)) else (value,)
        if len(values) != t.components:
            raise SpecError(spec_name, f"output '{oname}' has {t.components} component(s), the "
                                       f"body returns {len(values)}")
        for c, v in enumerate(values):
            try:
                output_exprs[Slot(oname, c)] = sympy.sympify(v)
            except sympy.SympifyError as exc:
                raise SpecError(spec_name, f"output '{oname}' is not an expression: {v!r}") from exc
    return output_exprs


def _warn_unread_inputs(spec: Spec):
    """A ``UserWarning`` for each input that no state update or output depends on: it is passed
    and checked at every call for nothing (a use misspelt, or one left over)."""
    exprs = [*spec.state_updates.values(), *spec.output_exprs.values()]
    read = set().union(*(e.free_symbols for e in exprs))
    for t in spec.inputs.values():
        if not any(spec.symbols[Slot(t.name, c)] in read for c in range(t.components)):
            warnings.warn(f"spec '{spec.name}': input '{t.name}' is never read: no state update "
                          "or output depends on it", UserWarning, stacklevel=4)


_RELATIONALS = ("StrictGreaterThan", "GreaterThan", "StrictLessThan", "LessThan", "Equality",
                "Unequality", "BooleanTrue", "BooleanFalse", "And", "Or", "Not")
_BUILTIN_MAX_MIN = re.compile(r"(?<![\w.])(max|min)\s*\(")


def _user_frame(exc):
    """(source line, frame) of the innermost frame outside sympy, NumPy, MLX and mlx_recgen that
    ``exc`` passed through (the body, or a helper it called), or ``("", None)``."""
    package = os.path.dirname(__file__)
    skip = [os.path.dirname(sympy.__file__) + os.sep, package + os.sep]
    for name in ("numpy", "mlx.core"):  # their Python wrappers, e.g. numpy.clip
        module = sys.modules.get(name)
        if getattr(module, "__file__", None):
            skip.append(os.path.dirname(module.__file__) + os.sep)
    specs = os.path.join(package, "specs") + os.sep  # bundled specs, in an installed wheel
    line, frame = "", None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not filename.startswith(tuple(skip)) or filename.startswith(specs):
            line = linecache.getline(filename, tb.tb_lineno).strip()
            frame = tb.tb_frame
        tb = tb.tb_next
    return line, frame


# Libraries of array and math functions that a body may reach for (by the root of a function's
# ``__module__``); they cannot take the symbols a body is traced on.
_LIBRARIES = {"mlx": "MLX", "numpy": "NumPy", "math": "Python's math module",
              "cmath": "Python's cmath module"}
# Their names for functions the spec language has under another name.
_ALIASES = {"power": "pow", "absolute": "abs", "fabs": "abs", "fmax": "maximum", "fmin": "minimum"}
# How they fail on a sympy expression: MLX, math (via float()) and a NumPy ufunc.
_LIBRARY_FAILURES = ("received in array initialization", "Cannot convert expression to float",
                     "loop of ufunc does not support", "has no callable")
_CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*\(")


def _library_calls(line, frame) -> list:
    """``(as written, library, function name)`` of each call on ``line`` whose function,
    resolved in ``frame``, belongs to one of ``_LIBRARIES``."""
    if frame is None:
        return []
    namespaces = (frame.f_locals, frame.f_globals, frame.f_builtins)
    found = []
    for written in _CALL.findall(line):
        head, *rest = written.split(".")
        try:  # the user's objects: an attribute lookup may run their code
            obj = next((ns[head] for ns in namespaces if head in ns), None)
            for attr in rest:
                obj = getattr(obj, attr, None)
            root = (getattr(obj, "__module__", None) or "").split(".")[0]
        except Exception:
            continue
        if root in _LIBRARIES and callable(obj):
            name = getattr(obj, "__name__", written.rsplit(".", 1)[-1])
            found.append((written, _LIBRARIES[root], name))
    return found


def _library_call_hint(where, calls) -> str:
    """The message for a body that applied a library's function to traced values."""
    from . import functions

    written, library, fname = calls[0]
    fname = _ALIASES.get(fname, fname)
    use = (f"use rg.{fname}" if fname in functions.__all__ else
           f"the spec language's functions are {', '.join('rg.' + f for f in functions.__all__)}")
    return (f"{where} calls {written}, a function of {library}, on a traced value: the body "
            f"runs once on symbols, which {library} cannot take; {use}")


def _explain_body_error(exc) -> str:
    """The message of a ``SpecError`` for an exception the body raised while traced: the
    exception and, for plain Python applied to traced values, the spec language's answer."""
    line, frame = _user_frame(exc)
    where = f"`{line}`" if line else "the body"
    message = str(exc)
    calls = _library_calls(line, frame) if isinstance(exc, (TypeError, ValueError,
                                                            AttributeError)) else []
    if calls and any(f in message for f in _LIBRARY_FAILURES):
        return _library_call_hint(where, calls)
    if isinstance(exc, TypeError) and "truth value of Relational" in message:
        match = _BUILTIN_MAX_MIN.search(line)
        if match:
            name = match.group(1)
            return (f"{where} calls the builtin {name}() on traced values, which has to compare "
                    f"them while tracing; use rg.{'maximum' if name == 'max' else 'minimum'}"
                    f"(a, b)")
        if calls:  # e.g. numpy.maximum, numpy.where: they compare traced values
            return _library_call_hint(where, calls)
        return (f"{where} branches on a traced value: a Python `if`, `and`, `or`, `not`, "
                "conditional expression or chained comparison (`a < x < b`) needs a truth value "
                "that is unknown while tracing; use rg.where(cond, a, b) for a data-dependent "
                "branch")
    if isinstance(exc, TypeError) and "unsupported operand" in message and (
            any(f"'{r}'" in message for r in _RELATIONALS) or "'bool'" in message):
        return (f"{where} uses a comparison as a number: a traced comparison is a condition, and "
                "`==`/`!=` on traced values compare the expressions (a Python bool); use "
                "rg.where(cond, a, b), e.g. rg.where(x > 0, 1.0, 0.0)")
    return f"tracing the body failed: {type(exc).__name__}: {exc}"


def _check_groups(spec_name, groups, raw, batch_axes, time, lane) -> dict:
    """The ``groups`` declaration (group axis -> the batch-like axis it groups), checked: only
    inputs carry a group axis, never beside the axis it groups or another group axis of it."""
    if groups is None:
        return {}
    if not isinstance(groups, dict):
        raise SpecError(spec_name, "'groups' must be a dict of group axis -> batch-like axis, "
                                   f'like {{"Hk": "H"}}, got {groups!r}')
    for coarse, fine in groups.items():
        for value in (coarse, fine):
            if not isinstance(value, str) or not value.isidentifier():
                raise SpecError(spec_name, f"groups: {value!r} is not an axis name")
        if fine not in batch_axes:
            raise SpecError(spec_name, f"groups: '{coarse}' groups '{fine}', which is not a "
                                       f"batch-like axis (batch-like axes are those the outputs "
                                       f"carry besides time and lane: {list(batch_axes)})")
        if coarse in batch_axes or coarse in (time, lane) or coarse in groups.values():
            raise SpecError(spec_name, f"groups: group axis '{coarse}' is also the time, lane or "
                                       "a batch-like axis; a group axis needs a name of its own")
    for coarse in groups:
        users = [t for t, (kind, axes) in raw.items() if coarse in axes]
        if not users:
            raise SpecError(spec_name, f"groups: no input carries the group axis '{coarse}'")
        for tname in users:
            kind, axes = raw[tname]
            if kind != "input":
                raise SpecError(spec_name, f"{kind} '{tname}' carries the group axis '{coarse}'; "
                                           "only inputs may (states and outputs carry "
                                           f"'{groups[coarse]}')")
            twins = [a for a in axes if a == groups[coarse] or groups.get(a) == groups[coarse]]
            if len(twins) > 1:
                raise SpecError(spec_name, f"input '{tname}' carries {twins}, which all index "
                                           f"'{groups[coarse]}'; it may carry one of them")
    return dict(groups)


_NOT_REAL = {sympy.I: "the imaginary unit 'I'",
             sympy.zoo: "complex infinity 'zoo' (sympy's value of a division by zero)"}


def _validate_expressions(spec: Spec):
    """Every expression must be built from known symbols, real constants (nan and +-inf
    included) and differentiable functions, and must not use the state index where a scalar is
    required."""
    known = set(spec.symbols.values())
    lane_varying = spec.lane_varying()
    exprs = [(f"state '{s.label(spec.states[s.tensor].components)}'", e, spec.states[s.tensor])
             for s, e in spec.state_updates.items()]
    exprs += [(f"output '{s.label(spec.outputs[s.tensor].components)}'", e, None)
              for s, e in spec.output_exprs.items()]
    for what, expr, state_tensor in exprs:
        for node in sympy.preorder_traversal(expr):
            if isinstance(node, sympy.Symbol) and not isinstance(node, StateIndex) and node not in known:
                raise SpecError(spec.name, f"{what} uses the unknown symbol '{node}'")
            if isinstance(node, StateIndex):
                raise SpecError(spec.name, f"{what} uses the index '{node}' as a value")
            if node.is_Atom and node.is_number and node.is_extended_real is False:
                raise SpecError(spec.name, f"{what} = {expr} uses {_NOT_REAL.get(node, node)}, "
                                           "which is not a real number (only real constants, "
                                           "nan and +-inf, are allowed)")
            if isinstance(node, sympy.Function) and not _allowed_function(node):
                raise SpecError(spec.name, f"{what} uses '{node.func.__name__}', which is not a "
                                           "differentiable op of the spec language")
            if isinstance(node, (sympy.Integral, sympy.Derivative, sympy.Sum)):
                raise SpecError(spec.name, f"{what} uses '{type(node).__name__}'; use Sum(expr, "
                                           f"{spec.index_name}) for reductions")
        if _uses_vector_outside_reduce(spec, expr):
            if state_tensor is None or not state_tensor.has_state_axis:
                raise SpecError(spec.name, f"{what} depends on the state index outside a "
                                           f"Sum(..., {spec.index_name}); a scalar is required")
        if state_tensor is not None and not state_tensor.has_lane:
            varying = sorted(expr.free_symbols & lane_varying, key=str)
            if varying:
                slot = next(s for s, sym in spec.symbols.items() if sym == varying[0])
                t = spec.tensors[slot.tensor]
                raise SpecError(spec.name, f"{what} lacks the lane axis '{spec.lane}', so the "
                                           "lanes of an instance share it and must all compute "
                                           f"the same value; its update reads {t.kind} "
                                           f"'{slot.label(t.components)}', which varies over "
                                           f"the lanes (it carries '{spec.lane}'). Give "
                                           f"'{state_tensor.name}' the lane axis, or update it "
                                           "from lane-invariant values only")


def _uses_vector_outside_reduce(spec, expr) -> bool:
    if isinstance(expr, Reduce):
        return False
    if isinstance(expr, sympy.Symbol):
        return expr in spec.vector_symbols
    return any(_uses_vector_outside_reduce(spec, a) for a in expr.args)


__all__ = ["Spec", "Tensor", "Slot", "Sum", "Reduce", "StateIndex", "build_spec", "CALL_OPTIONS",
           "KERNEL_OPTIONS"]
