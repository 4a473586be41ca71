"""Render the forward and backward kernels of a recurrence from the Jinja templates.

Python lowers the step programs to C statements (``StepWriter``): expressions through
``CPrinter``, and every ``Store`` routed by what it is — a new state or adjoint (committed at the
end of the step, after every read of the old value), an output, or a gradient of one of four
reduction classes (written per lane, accumulated over time, reduced over lanes, or both). The
templates (``templates/*.j2``) hold the kernel skeleton: thread mapping, time and segment loops,
checkpoints and the threadgroup stage of lane reductions. Target differences come only from the
``Dialect``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import jinja2

from ..ir import Accumulate, Assign, Loop, Program, Store, free_symbols
from ..resources import templates_dir
from ..schedule import MetaLayout, Schedule
from ..spec import Slot
from .dialects import Dialect
from .expr import CPrinter

_env = None


def environment() -> jinja2.Environment:
    global _env
    if _env is None:
        _env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())),
                                  undefined=jinja2.StrictUndefined, trim_blocks=True,
                                  lstrip_blocks=True, keep_trailing_newline=True)
    return _env


@dataclass
class SharedSlot:
    """A gradient reduced over the lanes of an instance: its rows in the reduction buffer."""

    offset: str  # first row, as a C constant expression
    size: str  # "NS" or "1"
    target: str  # C lvalue: the buffer element for row ``n`` (``n`` in scope)


@dataclass
class StepWriter:
    """C statements for one step program, with loads and store routing."""

    rec: object
    dialect: Dialect
    pad: str = "    "
    shared_time: list = field(default_factory=list)
    shared_param: list = field(default_factory=list)
    accumulators: list = field(default_factory=list)  # (name, size, input tensor, component)

    def __post_init__(self):
        spec = self.rec.spec
        self.names = {}
        self.vector_inputs = {}
        self.scalar_loads = {}
        for slot, sym in spec.symbols.items():
            t = spec.tensors[slot.tensor]
            comp = f" + {slot.component} * {t.name}_stride_comp" if t.components > 1 else ""
            if t.kind == "state":
                self.names[sym] = f"{sym}_s[n]" if t.has_state_axis else f"{sym}_s"
                continue
            time = f" + t * {t.name}_stride_{spec.time}" if t.has_time else ""
            guard = "lane_ok" if t.has_lane else None
            if t.has_state_axis:
                self.names[sym] = f"{sym}_v"
                self.vector_inputs[sym] = (f"{t.name}[{t.name}_base{time}{comp} + n * "
                                           f"{t.name}_stride_{spec.state_axis}]", guard)
            else:
                self.names[sym] = f"{sym}_v"
                self.scalar_loads[sym] = (f"{t.name}[{t.name}_base{time}{comp}]", guard)
        adj = self.rec.adjoint
        for slot, sym in adj.state_cotangents.items():
            t = spec.states[slot.tensor]
            self.names[sym] = f"{sym}[n]" if t.has_state_axis else str(sym)
        for slot, sym in adj.output_cotangents.items():
            t = spec.outputs[slot.tensor]
            comp = f" + {slot.component} * {t.name}_stride_comp" if t.components > 1 else ""
            self.names[sym] = f"{sym}_v"
            self.scalar_loads[sym] = (f"d_{t.name}[{t.name}_base + t * {t.name}_stride_{spec.time}"
                                      f"{comp}]", "lane_ok")
        self.printer = CPrinter(self.names, self.dialect)

    # -- loads ---------------------------------------------------------------------------------
    def _load(self, sym, source, guard, pad):
        value = f"static_cast<float>({source})"
        if guard:
            value = f"{guard} ? {value} : 0.0f"
        return f"{pad}const float {self.names[sym]} = {value};"

    def step_loads(self, program: Program, pad: str):
        free = free_symbols(program.statements)
        return [self._load(s, *self.scalar_loads[s], pad)
                for s in sorted(free, key=str) if s in self.scalar_loads]

    # -- statements ----------------------------------------------------------------------------
    def program(self, program: Program, route, pad: str) -> list:
        """C lines of a program; ``route(store, value, in_loop, pad)`` gives the lines that use a
        stored value now and those deferred to the end of the step (or of the loop iteration):
        a new state or adjoint is committed only after every read of the old one."""
        lines, deferred = [], []
        stores = itertools.count()

        def emit(stmt, pad, in_loop, out, later):
            expr = self.printer(stmt.expr)
            if isinstance(stmt, Assign):
                out.append(f"{pad}const float {stmt.target} = {expr};")
            elif isinstance(stmt, Accumulate):
                out.append(f"{pad}{stmt.target} += {expr};")
            else:
                value = f"{stmt.kind}_{next(stores)}"
                out.append(f"{pad}const float {value} = {expr};")
                now, after = route(stmt, value, in_loop, pad)
                out += now
                later += after

        for st in program.statements:
            if not isinstance(st, Loop):
                emit(st, pad, False, lines, deferred)
                continue
            inner, loop_deferred = pad + "  ", []
            lines += [f"{pad}float {b.target} = 0.0f;" for b in st.body if isinstance(b, Accumulate)]
            lines.append(f"{pad}for (int n = 0; n < NS; ++n) {{")
            lines += [self._load(s, *self.vector_inputs[s], inner)
                      for s in sorted(free_symbols(st.body), key=str) if s in self.vector_inputs]
            for b in st.body:
                emit(b, inner, True, lines, loop_deferred)
            lines += loop_deferred
            lines.append(f"{pad}}}")
        return lines + deferred


def _commit_state(spec):
    """Route for state stores: the new value replaces the state register once the step (or the
    loop iteration) has read the old one."""
    def route(store, value, in_loop, pad):
        sym = spec.symbols[store.slot]
        return [], [f"{pad}{sym}_s{'[n]' if in_loop else ''} = {value};"]
    return route


class KernelRenderer:
    """Builds the template context of one kernel and renders (body, header)."""

    def __init__(self, rec, dialect: Dialect, schedule: Schedule):
        self.rec, self.d, self.schedule = rec, dialect, schedule
        self.spec = rec.spec
        self.meta = MetaLayout(rec.spec)

    # -- shared pieces -----------------------------------------------------------------------
    def _common(self, kind):
        spec, d = self.spec, self.d
        coords = []
        rest = "instance"
        for i, b in enumerate(reversed(spec.batch_axes)):
            if i == len(spec.batch_axes) - 1:
                coords.append(f"const {d.int64} idx_{b} = {rest};")
            else:
                coords.append(f"const {d.int64} idx_{b} = {rest} % size_{b};")
                coords.append(f"const {d.int64} rest_{b} = {rest} / size_{b};")
                rest = f"rest_{b}"
        bases = []
        for t in [*spec.inputs.values(), *spec.outputs.values(), *spec.states.values()]:
            terms = [f"idx_{b} * {t.name}_stride_{b}" for b in t.batch_axes]
            if t.has_lane:
                terms.append(f"lane * {t.name}_stride_{spec.lane}")
            bases.append(f"const {d.int64} {t.name}_base = {' + '.join(terms) or '0'};")
        states = []
        rows = []  # history rows before this slot's: NS per vector slot, 1 per scalar slot
        for t in spec.states.values():
            for c in range(t.components):
                sym = spec.symbols[Slot(t.name, c)]
                comp = f" + {c} * {t.name}_stride_comp" if t.components > 1 else ""
                n = f" + n * {t.name}_stride_{spec.state_axis}" if t.has_state_axis else ""
                # a scalar state checkpoints one row per component, a vector state NS
                ck = (f"(((s * instances + instance) * {t.components} + {c}) * NS + n) * lanes + lane"
                      if t.has_state_axis else
                      f"((s * instances + instance) * {t.components} + {c}) * lanes + lane")
                states.append(dict(sym=str(sym), vector=t.has_state_axis, tensor=t.name,
                                   offset=f"{t.name}_base{comp}{n}", ckpt=ck,
                                   row=" + ".join(rows) or "0"))
                rows.append("NS" if t.has_state_axis else "1")
        def shape_text(t):
            return " ".join(str(a) for a in t.axes)

        description = [f"inputs:  {', '.join(f'{t.name} [{shape_text(t)}]' for t in spec.inputs.values())}",
                       f"state:   {', '.join(f'{t.name} [{shape_text(t)}]' for t in spec.states.values())}",
                       f"outputs: {', '.join(f'{t.name} [{shape_text(t)}]' for t in spec.outputs.values())}",
                       f"lane axis {spec.lane}, time axis {spec.time}, state axis "
                       f"{spec.state_axis or '(none)'}, batch axes {' '.join(spec.batch_axes) or '(none)'}"]
        return dict(d=d, spec=spec.name, kind=kind, meta=list(enumerate(self.meta.names)),
                    coords=coords, bases=bases, states=states, history_rows=" + ".join(rows),
                    schedule=self.schedule,
                    description=description, i64=d.int64)

    def header(self, kind, dtypes_text):
        ctx = self._common(kind)
        ctx["dtypes"] = dtypes_text
        return environment().get_template("header.j2").render(**ctx)

    # -- forward -----------------------------------------------------------------------------
    def forward(self):
        spec = self.spec
        writer = StepWriter(self.rec, self.d)
        commit_state = _commit_state(spec)

        def route(store, value, in_loop, pad):
            if store.kind == "state":
                return commit_state(store, value, in_loop, pad)
            t = spec.outputs[store.slot.tensor]
            comp = f" + {store.slot.component} * {t.name}_stride_comp" if t.components > 1 else ""
            return [f"{pad}if (lane_ok) {{ {t.name}[{t.name}_base + t * {t.name}_stride_{spec.time}"
                    f"{comp}] = static_cast<OutT>({value}); }}"], []

        prog = self.rec.forward_program
        ctx = self._common("forward")
        ctx.update(loads=writer.step_loads(prog, "    "), step=writer.program(prog, route, "    "))
        body = environment().get_template("forward.j2").render(**ctx)
        return body

    # -- backward ----------------------------------------------------------------------------
    def backward(self):
        spec, d, sch = self.spec, self.d, self.schedule
        writer = StepWriter(self.rec, d)
        # gradients reduced over lanes, by (input tensor, component): per step, or once at the end
        time_rows, param_rows = {}, {}
        accumulators = []  # parameter gradients, summed over time in registers

        def rows(table):
            return " + ".join(r.size for r in table.values()) or "0"

        def grad_target(t, c, n_term, with_time):
            comp = f" + {c} * {t.name}_stride_comp" if t.components > 1 else ""
            time = f" + t * {t.name}_stride_{spec.time}" if with_time else ""
            return f"d_{t.name}[d_{t.name}_base{time}{comp}{n_term}]"

        def route(store, value, in_loop, pad):
            if store.kind == "lambda":
                sym = self.rec.adjoint.state_cotangents[store.slot]
                return [], [f"{pad}{sym}{'[n]' if in_loop else ''} = {value};"]
            t = spec.inputs[store.slot.tensor]
            c = store.slot.component
            n_idx = "n" if in_loop else "0"
            n_term = f" + n * {t.name}_stride_{spec.state_axis}" if in_loop else ""
            if t.has_lane and t.has_time:
                return [f"{pad}if (lane_ok) {{ {grad_target(t, c, n_term, True)} = {value}; }}"], []
            if not t.has_time:
                name = f"acc_d{spec.symbols[store.slot]}"
                masked = value if t.has_lane else f"(lane_ok ? {value} : 0.0f)"
                return [f"{pad}{name}[{n_idx}] += {masked};"], []
            # shared, time-varying: reduce over lanes this step
            slot = time_rows[(t.name, c)]
            return [f"{pad}{{",
                    f"{pad}  const float lanes_sum = {d.simd_sum}(lane_ok ? {value} : 0.0f);",
                    f"{pad}  if (simd_lane == 0) {{ red[({slot.offset} + {n_idx}) * NSG + simd_group] = lanes_sum; }}",
                    f"{pad}}}"], []

        for t in spec.inputs.values():
            for c in range(t.components):
                size = "NS" if t.has_state_axis else "1"
                n_term = f" + n * {t.name}_stride_{spec.state_axis}" if t.has_state_axis else ""
                if not t.has_time:
                    target = grad_target(t, c, n_term, False)
                    row = None
                    if not t.has_lane:
                        row = param_rows[(t.name, c)] = SharedSlot(rows(param_rows), size, target)
                    accumulators.append(dict(name=f"acc_d{spec.symbols[Slot(t.name, c)]}",
                                             size=size, shared=not t.has_lane, target=target,
                                             slot=row))
                elif not t.has_lane:
                    time_rows[(t.name, c)] = SharedSlot(rows(time_rows), size,
                                                        grad_target(t, c, n_term, True))

        recompute = _without_outputs(self.rec.forward_program)

        adj = self.rec.adjoint
        lam = []
        for slot, sym in adj.state_cotangents.items():
            t = spec.states[slot.tensor]
            comp = f" + {slot.component} * {t.name}_stride_comp" if t.components > 1 else ""
            n = f" + n * {t.name}_stride_{spec.state_axis}" if t.has_state_axis else ""
            lam.append(dict(sym=str(sym), vector=t.has_state_axis,
                            src=f"d_{t.name}_final[{t.name}_base{comp}{n}]",
                            dst=f"d_{t.name}_init[{t.name}_base{comp}{n}]"))
        grad_bases = []
        for t in spec.inputs.values():
            extra = [f" + idx_{b} * d{t.name}_stride_{b}" for b in self.meta.grad_axes[t.name]]
            grad_bases.append(f"const {d.int64} d_{t.name}_base = {t.name}_base{''.join(extra)};")
        ctx = self._common("backward")
        ctx.update(
            recompute_loads=writer.step_loads(recompute, "      "),
            recompute=writer.program(recompute, _commit_state(spec), "      "),
            loads=writer.step_loads(adj.program, "      "),
            step=writer.program(adj.program, route, "      "),
            lam=lam, grad_bases=grad_bases, accumulators=accumulators,
            time_rows=list(time_rows.values()), param_rows=list(param_rows.values()),
            time_count=rows(time_rows),
            param_count=rows(param_rows),
        )
        return environment().get_template("backward.j2").render(**ctx)


def _without_outputs(program: Program) -> Program:
    """The forward program with its output stores dropped (the backward's segment recompute)."""
    stmts = []
    for st in program.statements:
        if isinstance(st, Store) and st.kind == "output":
            continue
        if isinstance(st, Loop):
            st = Loop([b for b in st.body if not (isinstance(b, Store) and b.kind == "output")])
        stmts.append(st)
    return Program(stmts, program.vector)
