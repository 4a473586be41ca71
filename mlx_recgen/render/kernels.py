"""Render the forward and backward kernels of a recurrence from the Jinja templates.

Python lowers the step programs to C statements (``StepWriter``): expressions through
``CPrinter``, and every ``Store`` routed by what it is — a new state or adjoint (committed at the
end of the step, after every read of the old value), an output, or a gradient of one of four
reduction classes (written per lane, accumulated over time, reduced over lanes, or both;
``GradientRoutes``). The
templates (``templates/*.j2``) hold the kernel skeleton: thread mapping, time and segment loops,
checkpoints and the threadgroup stage of lane reductions, and the lines of the reductions the
step program writes inline (``backward_reductions.j2``: a gradient's lane sums a step, a chunk's
sums, a round's reductions inside the state loop). Target differences come only from the
``Dialect``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import jinja2

from ..ir import Accumulate, Assign, Loop, Program, Store, free_symbols, prune
from ..resources import templates_dir
from ..schedule import COMPONENT, LANE_GROUPS, LANES, SEGMENTS, MetaLayout, Schedule, members
from ..spec import Slot
from .dialects import Dialect
from .expr import CPrinter
from .names import PREFIX, kernel_identifiers, program_symbols

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
    """A gradient reduced over the lanes of a threadgroup: its rows in the reduction buffer."""

    offset: str  # first row, as a C constant expression
    size: str  # "NS" or "1"
    target: str  # C lvalue: the buffer element for row ``n`` (``n`` in scope)


class Names:
    """The spelling of every spec-derived identifier of one recurrence's kernels, with the
    composite expressions (tensor offsets) built from them."""

    def __init__(self, rec, meta: MetaLayout, ids=None):
        self.spec, self.meta = rec.spec, meta
        self.ids = ids if ids is not None else kernel_identifiers(rec, meta)

    def __getitem__(self, key) -> str:
        return self.ids[key]

    def meta_entry(self, key) -> str:
        return key if isinstance(key, str) else self.ids[key]

    def stride(self, t, axis) -> str:
        return self.ids[("stride", t.name, axis)]

    def terms(self, t, component=0, time=False, n=False) -> str:
        """`` + c * <comp stride>``, `` + t * <time stride>``, `` + n * <state stride>`` as
        asked for (the component term only where the tensor has components)."""
        out = f" + t * {self.stride(t, self.spec.time)}" if time else ""
        if t.components > 1:
            out += f" + {component} * {self.stride(t, COMPONENT)}"
        if n:
            out += f" + n * {self.stride(t, self.spec.state_axis)}"
        return out


class StepWriter:
    """C statements for one step program, with loads and store routing."""

    def __init__(self, rec, dialect: Dialect, names: Names, stage: bool = False,
                 split: bool = False):
        spec = rec.spec
        self.rec, self.dialect, self.ids = rec, dialect, names
        # (``split``) a thread holds the state elements n = part + PARTS * m: registers are
        # indexed by m, and a sum over n is this thread's part of it until ``recgen_part_sum``
        self.split = split
        self.idx = "m" if split else "n"
        self.names = {}  # symbol -> the C expression of its value
        self.vector_inputs = {}
        self.scalar_loads = {}
        # (``stage``) symbols read from the threadgroup stage: symbol -> (buffer, width)
        self.staged = {}
        for slot, sym in spec.symbols.items():
            t = spec.tensors[slot.tensor]
            if t.kind == "state":
                reg = names[("state", sym)]
                self.names[sym] = f"{reg}[{self.idx}]" if t.has_state_axis else reg
                continue
            self.names[sym] = names[("value", sym)]
            buf, base = names[("buffer", t.name)], names[("base", t.name)]
            offset = names.terms(t, slot.component, time=t.has_time, n=t.has_state_axis)
            guard = "lane_ok" if t.has_lane else None
            loads = self.vector_inputs if t.has_state_axis else self.scalar_loads
            loads[sym] = (f"{buf}[{base}{offset}]", guard)
            if stage and t.has_time and not t.has_lane:
                self.staged[sym] = (names[("stage", sym)], "NS" if t.has_state_axis else "1")
        adj = rec.adjoint
        for slot, sym in adj.state_cotangents.items():
            t = spec.states[slot.tensor]
            self.names[sym] = names[("sym", sym)] + (f"[{self.idx}]" if t.has_state_axis else "")
        for slot, sym in adj.output_cotangents.items():
            t = spec.outputs[slot.tensor]
            self.names[sym] = names[("value", sym)]
            offset = names.terms(t, slot.component, time=True)
            self.scalar_loads[sym] = (f"{names[('d', t.name)]}[{names[('base', t.name)]}{offset}]",
                                      "lane_ok")
        for sym in program_symbols(rec.forward_program) | program_symbols(adj.program):
            if sym not in self.names:  # temporaries, reductions, accumulators
                self.names[sym] = names[("sym", sym)]
        self.printer = CPrinter(self.names, self.dialect)

    # -- loads ---------------------------------------------------------------------------------
    def stage_loads(self, programs) -> list:
        """The staged symbols the programs read: (buffer, width, global source) each, for the
        template's tile load (``t`` and ``n`` in scope there)."""
        free = set().union(*(free_symbols(p.statements) for p in programs))
        return [dict(buffer=self.staged[s][0], width=self.staged[s][1],
                     source=(self.vector_inputs.get(s) or self.scalar_loads[s])[0])
                for s in sorted(free, key=str) if s in self.staged]

    def _load(self, sym, source, guard, pad):
        if sym in self.staged:  # step jt of the tile; element n
            buffer, width = self.staged[sym]
            return f"{pad}const float {self.names[sym]} = {buffer}[jt * {width} + n];" \
                if width != "1" else f"{pad}const float {self.names[sym]} = {buffer}[jt];"
        value = f"static_cast<float>({source})"
        if guard:
            value = f"{guard} ? {value} : 0.0f"
        return f"{pad}const float {self.names[sym]} = {value};"

    def step_loads(self, program: Program, pad: str):
        free = free_symbols(program.statements)
        return [self._load(s, *self.scalar_loads[s], pad)
                for s in sorted(free, key=str) if s in self.scalar_loads]

    # -- statements ----------------------------------------------------------------------------
    def program(self, program: Program, route, pad: str, loop_end=None) -> list:
        """C lines of a program; ``route(store, value, in_loop, pad)`` gives the lines that use a
        stored value now and those deferred to the end of the step (or of the loop iteration):
        a new state or adjoint is committed only after every read of the old one.
        ``loop_end(loop, pad)`` gives lines that close each loop iteration; a loop with such
        lines is unrolled (they index thread arrays by the loop's counter)."""
        lines, deferred = [], []
        stores = itertools.count()

        def emit(stmt, pad, in_loop, out, later):
            expr = self.printer(stmt.expr)
            if isinstance(stmt, Assign):
                out.append(f"{pad}const float {self.names[stmt.target]} = {expr};")
            elif isinstance(stmt, Accumulate):
                out.append(f"{pad}{self.names[stmt.target]} += {expr};")
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
            lines += [f"{pad}float {self.names[b.target]} = 0.0f;"
                      for b in st.body if isinstance(b, Accumulate)]
            closing = loop_end(st, inner) if loop_end else []
            if closing:
                lines.append(f"{pad}{self.dialect.unroll}")
            if self.split:
                lines += [f"{pad}for (int m = 0; m < NSP; ++m) {{",
                          f"{pad}  const int n = part + PARTS * m;"]
            else:
                lines.append(f"{pad}for (int n = 0; n < NS; ++n) {{")
            lines += [self._load(s, *self.vector_inputs[s], inner)
                      for s in sorted(free_symbols(st.body), key=str) if s in self.vector_inputs]
            for b in st.body:
                emit(b, inner, True, lines, loop_deferred)
            lines += loop_deferred + closing
            lines.append(f"{pad}}}")
            if self.split:  # every part holds the whole sum: the sum over the lane's parts
                lines += [f"{pad}{self.names[b.target]} = recgen_part_sum("
                          f"{self.names[b.target]}, PARTS);"
                          for b in st.body if isinstance(b, Accumulate)]
        return lines + deferred


def met_zero_hit(states, hits: str) -> str:
    """The C condition under which a composed map gives NaN (``affine.zero_hit``): the block's
    ``states`` (C expressions) all zero where the map counted zero ``hits``, as the sequential
    steps met ``inf * 0`` there."""
    return " && ".join([*(f"{s} == 0.0f" for s in states), f"{hits} != 0.0f"])


def _commit_state(spec, names, idx="n"):
    """Route for state stores: the new value replaces the state register once the step (or the
    loop iteration) has read the old one."""
    def route(store, value, in_loop, pad):
        reg = names[("state", spec.symbols[store.slot])]
        return [], [f"{pad}{reg}{f'[{idx}]' if in_loop else ''} = {value};"]
    return route


def _forward_route(spec, names, commit_state, guard):
    """Route for a forward step's stores: states through ``commit_state``, outputs written to
    their buffers where ``guard`` (the thread writes its lane's outputs) holds."""
    def route(store, value, in_loop, pad):
        if store.kind == "state":
            return commit_state(store, value, in_loop, pad)
        t = spec.outputs[store.slot.tensor]
        target = (f"{names[('buffer', t.name)]}[{names[('base', t.name)]}"
                  f"{names.terms(t, store.slot.component, time=True)}]")
        return [f"{pad}if ({guard}) {{ {target} = static_cast<OutT>({value}); }}"], []
    return route


class KernelRenderer:
    """Builds the template context of one kernel and renders (body, header)."""

    def __init__(self, rec, dialect: Dialect, schedule: Schedule, ids=None):
        self.rec, self.d, self.schedule = rec, dialect, schedule
        self.spec = rec.spec
        self.meta = MetaLayout(rec.spec)
        self.names = Names(rec, self.meta, ids)

    # -- shared pieces -----------------------------------------------------------------------
    def _grad_axis_terms(self, t) -> list:
        """The offset terms of input ``t``'s gradient buffer along the batch axes it carries and
        the members of its group axes (the partial-sum axes summed after the kernel)."""
        nm = self.names
        return ([f" + {nm[('idx', b)]} * {nm[('d_stride', t.name, b)]}"
                 for b in self.meta.grad_axes[t.name]]
                + [f" + {nm[('member', g)]} * {nm[('d_stride', t.name, members(g))]}"
                   for g in self.meta.grad_members[t.name]])

    def summary_steps(self, writer, route, pad: str) -> dict:
        """The segment summary's step, ``loads`` and ``step`` lines, and where the form's blocks
        are 1 x 1 the same step in IEEE products, ``plain_loads`` and ``plain`` (else ``plain``
        is None; ``affine.plain_summary_program``), their temporaries named in ``writer``. The
        chunked schedule's summary kernel and the scan's kernels run the plain one first."""
        summary = self.rec.segment_summary
        programs = [p for p in (summary.program, summary.plain) if p is not None]
        for sym in set().union(*(program_symbols(p) for p in programs)):
            if sym not in writer.names:
                writer.names[sym] = self.names.ids.add(("sym", sym), str(sym))
        out = dict(loads=writer.step_loads(summary.program, pad),
                   step=writer.program(summary.program, route, pad), plain=None)
        if summary.plain is not None:
            out.update(plain_loads=writer.step_loads(summary.plain, pad),
                       plain=writer.program(summary.plain, route, pad))
        return out

    def _common(self, kind):
        spec, d, nm = self.spec, self.d, self.names
        coords = []
        rest = "instance"
        for i, b in enumerate(reversed(spec.batch_axes)):
            idx = nm[("idx", b)]
            if i == len(spec.batch_axes) - 1:
                coords.append(f"const {d.int64} {idx} = {rest};")
            else:
                coords.append(f"const {d.int64} {idx} = {rest} % {nm[('size', b)]};")
                coords.append(f"const {d.int64} {nm[('rest', b)]} = {rest} / {nm[('size', b)]};")
                rest = nm[("rest", b)]
        for g, b in spec.groups.items():  # h -> its group h // (H / Hk) and member h % (H / Hk)
            ratio = f"({nm[('size', b)]} / {nm[('size', g)]})"
            coords.append(f"const {d.int64} {nm[('idx', g)]} = {nm[('idx', b)]} / {ratio};")
            coords.append(f"const {d.int64} {nm[('member', g)]} = {nm[('idx', b)]} % {ratio};")
        bases = []
        for t in [*spec.inputs.values(), *spec.outputs.values(), *spec.states.values()]:
            terms = [f"{nm[('idx', b)]} * {nm.stride(t, b)}" for b in t.batch_axes]
            if t.has_lane:
                terms.append(f"lane * {nm.stride(t, spec.lane)}")
            bases.append(f"const {d.int64} {nm[('base', t.name)]} = {' + '.join(terms) or '0'};")
        split = self.schedule.parts > 1
        ns_arr = "NSP" if split else "NS"  # state elements per thread
        states = []
        rows = []  # history rows before this slot's: NS(P) per vector slot, 1 per scalar slot
        for t in spec.states.values():
            for c in range(t.components):
                sym = spec.symbols[Slot(t.name, c)]
                ck = self.ckpt_offset(t, c)
                # a shared state is stored once per instance, by lane 0 (every lane holds it);
                # a scalar state once per lane, by part 0 (every part holds it)
                writer = "lane_ok" if t.has_lane else "lane == 0"
                if not t.has_state_axis:
                    writer = "lane_once" if t.has_lane else "lane == 0 && part == 0"
                states.append(dict(reg=nm[("state", sym)], vector=t.has_state_axis,
                                   init=nm[("init", t.name)], final=nm[("final", t.name)],
                                   ckpt_buffer=nm[("ckpt", t.name)],
                                   offset=nm[("base", t.name)] + nm.terms(t, c, n=t.has_state_axis),
                                   ckpt=ck, row=" + ".join(rows) or "0",
                                   writer=writer))
                rows.append(ns_arr if t.has_state_axis else "1")

        def shape_text(t):
            return " ".join(str(a) for a in t.axes)

        description = [f"inputs:  {', '.join(f'{t.name} [{shape_text(t)}]' for t in spec.inputs.values())}",
                       f"state:   {', '.join(f'{t.name} [{shape_text(t)}]' for t in spec.states.values())}",
                       f"outputs: {', '.join(f'{t.name} [{shape_text(t)}]' for t in spec.outputs.values())}",
                       f"lane axis {spec.lane}, time axis {spec.time}, state axis "
                       f"{spec.state_axis or '(none)'}, batch axes {' '.join(spec.batch_axes) or '(none)'}",
                       f"spec names are spelled with the prefix {PREFIX} (q -> {PREFIX}q)"]
        meta = [(i, nm.meta_entry(k)) for i, k in enumerate(self.meta.keys)]
        # a loop over this thread's state elements: n (global), indexing registers by idx
        ns_loop = ("for (int m = 0; m < NSP; ++m) { const int n = part + PARTS * m;" if split
                   else "for (int n = 0; n < NS; ++n) {")
        return dict(d=d, spec=spec.name, kind=kind, meta=meta, ns_arr=ns_arr, ns_loop=ns_loop,
                    idx="m" if split else "n",
                    coords=coords, bases=bases, states=states, history_rows=" + ".join(rows),
                    schedule=self.schedule,
                    description=description, i64=d.int64, segment_in_grid=False, outer=None)

    @staticmethod
    def ckpt_offset(t, component, segment="s", shares=False) -> str:
        """Element offset in a buffer of one state per segment (checkpoints), laid out
        ``[segment, instance, component, NS or 1, lane]``: NS rows for a vector state, one for a
        scalar state; lanes fastest, so a simdgroup's reads and writes are contiguous. A shared
        state's values have one lane (``lane`` 0); its adjoint (``shares``) one share per lane."""
        lane, lanes = ("lane", "lanes") if t.has_lane or shares else ("0", "1")
        if t.has_state_axis:
            return (f"((({segment} * instances + instance) * {t.components} + {component}) * NS "
                    f"+ n) * {lanes} + {lane}")
        return (f"(({segment} * instances + instance) * {t.components} + {component}) * {lanes} "
                f"+ {lane}")

    def d_init_offset(self, t, component) -> str:
        """Offset of element ``n`` of the initial-state gradient: one share per lane in front of
        the declared layout for a shared state."""
        nm = self.names
        offset = nm[("base", t.name)] + nm.terms(t, component, n=t.has_state_axis)
        return offset if t.has_lane else f"{offset} + lane * {nm[('d_stride', t.name, LANES)]}"

    def header(self, kind, dtypes_text):
        ctx = self._common(kind)
        ctx["dtypes"] = dtypes_text
        return environment().get_template("header.j2").render(**ctx)

    # -- forward -----------------------------------------------------------------------------
    def forward(self):
        return self._render_forward(segment_in_grid=False)

    def _render_forward(self, segment_in_grid):
        """The forward sweep: over all steps from the initial state, writing checkpoints and
        the final state, or (``segment_in_grid``) over one segment from its checkpoint."""
        spec, nm = self.spec, self.names
        writer = StepWriter(self.rec, self.d, nm, stage=self.schedule.stage_steps > 0,
                            split=self.schedule.parts > 1)
        route = _forward_route(spec, nm, _commit_state(spec, nm, writer.idx), "lane_once")

        prog = self.rec.forward_program
        ctx = self._common("forward")
        ctx.update(loads=writer.step_loads(prog, "    "), step=writer.program(prog, route, "    "),
                   stage=writer.stage_loads([prog]),
                   segment_in_grid=segment_in_grid, outer="segment" if segment_in_grid else None)
        body = environment().get_template("forward.j2").render(**ctx)
        return body

    # -- backward ----------------------------------------------------------------------------
    def backward(self):
        return self._render_backward(self.rec.adjoint.program)

    def _render_backward(self, program, segment_in_grid=False, lambda_only=False, hits=()):
        """The adjoint sweep: over all segments newest first, from the final state's cotangent,
        writing gradients and the initial state's gradient; or (``segment_in_grid``) over one
        segment from its end adjoint, with parameter gradients summed per segment; or
        (``lambda_only``, a program with only ``λ`` stores) from a zero adjoint, writing the
        segment's local adjoint, and with ``hits`` (per block: ``reg``, ``vector``, ``buffer``,
        ``offset``) its counts of zero hits (``affine.local_adjoint_program``)."""
        spec = self.spec
        writer = StepWriter(self.rec, self.d, self.names, stage=self.schedule.stage_steps > 0,
                            split=self.schedule.parts > 1)
        differentiable = [] if lambda_only else list(spec.differentiable_inputs.values())
        grads = GradientRoutes(self, writer, differentiable, hits)
        recompute = _without_outputs(self.rec.forward_program)
        state_symbols = {spec.symbols[s] for s in spec.state_slots()}
        reads_state = bool(free_symbols(program.statements) & state_symbols)
        ctx = self._common("backward")
        ctx.update(
            stage=writer.stage_loads([recompute, program] if reads_state else [program]),
            recompute_loads=writer.step_loads(recompute, "      "),
            recompute=writer.program(recompute, _commit_state(spec, self.names, writer.idx),
                                     "      "),
            loads=writer.step_loads(program, "      "),
            step=writer.program(program, grads.route, "      ", loop_end=grads.loop_end),
            segment_in_grid=segment_in_grid, lambda_only=lambda_only,
            outer="segment" if segment_in_grid else None,
            # an adjoint that never reads the state (a state-affine update with outputs linear
            # in the state, swept for λ only) needs no recomputed segment
            reads_state=reads_state,
            lam=self._adjoint_starts(segment_in_grid, lambda_only), hits=list(hits),
            grad_bases=self._gradient_bases(differentiable, segment_in_grid),
            accumulators=grads.accumulators,
            time_rows=list(grads.time_rows.values()), param_rows=list(grads.param_rows.values()),
            time_count=_rows(grads.time_rows), chunk_arrays=list(grads.chunk_arrays.values()),
            param_count=_rows(grads.param_rows), loop_count=len(grads.loop_rows),
            max_shared_floats=self.schedule.reduction_floats,
        )
        return environment().get_template("backward.j2").render(**ctx)

    def _adjoint_starts(self, segment_in_grid, lambda_only) -> list:
        """Each state's ``λ`` (its symbol, whether it is a vector) and the value it starts the
        sweep from: zero (``lambda_only``), the segment's end adjoint (``segment_in_grid``) or
        the final state's cotangent, of which a shared state's lane 0 holds the lanes' share;
        with where the initial state's gradient and the local adjoint are written."""
        nm, lam = self.names, []
        for slot, sym in self.rec.adjoint.state_cotangents.items():
            t = self.spec.states[slot.tensor]
            c = slot.component
            offset = nm[("base", t.name)] + nm.terms(t, c, n=t.has_state_axis)
            seeded = "lane_ok" if t.has_lane else "lane == 0"
            if lambda_only:
                init = "0.0f"
            elif segment_in_grid:
                at = self.ckpt_offset(t, c, "segment", shares=True)
                init = f"lane_ok ? {nm[('lamend', t.name)]}[{at}] : 0.0f"
            else:
                init = f"{seeded} ? static_cast<float>({nm[('d_final', t.name)]}[{offset}]) : 0.0f"
            lam.append(dict(sym=nm[("sym", sym)], vector=t.has_state_axis, init=init,
                            dst=f"{nm[('d_init', t.name)]}[{self.d_init_offset(t, c)}]",
                            local=f"{nm[('local', t.name)]}"
                                  f"[{self.ckpt_offset(t, c, shares=True)}]"))
        return lam

    def _gradient_bases(self, differentiable, segment_in_grid) -> list:
        """The declarations of each gradient buffer's base offset: the input's, with the
        partial sums' axes (lane groups; segments for a parameter summed per segment)."""
        nm, bases = self.names, []
        for t in differentiable:
            extra = self._grad_axis_terms(t)
            if self.schedule.lane_partials and not t.has_lane:
                extra.append(f" + lane_group * {nm[('d_stride', t.name, LANE_GROUPS)]}")
            if segment_in_grid and not t.has_time:  # one partial sum per segment
                extra.append(f" + segment * {nm[('d_stride', t.name, SEGMENTS)]}")
            bases.append(f"const {self.d.int64} {nm[('d_base', t.name)]} = "
                         f"{nm[('base', t.name)]}{''.join(extra)};")
        return bases


def _rows(table) -> str:
    """The rows a table of ``SharedSlot`` takes in the reduction buffer, as a C expression."""
    return " + ".join(r.size for r in table.values()) or "0"


class GradientRoutes:
    """Where the backward step's stores go (``route``, for ``StepWriter.program``): a ``λ`` or a
    count of zero hits to its register; a gradient by its reduction class, as its input's axes
    say: written per lane (lane and time axes), summed over time in registers (no time axis:
    ``accumulators``), or reduced over the lanes of the threadgroup, one step at a time
    (``time_rows``), per round of the state loop (``loop_rows``, ``time_rounds``), or ``LC``
    values at a time (``chunk_arrays``); and the reductions at the end of a state loop's
    iteration (``loop_end``)."""

    def __init__(self, renderer: KernelRenderer, writer: StepWriter, differentiable, hits):
        self.spec, self.nm, self.idx = renderer.spec, renderer.names, writer.idx
        self.split, self.barrier = writer.split, renderer.d.barrier
        self.lambdas = renderer.rec.adjoint.state_cotangents
        self.reductions = environment().get_template("backward_reductions.j2").module
        self.hit_regs = {h["slot"]: h["reg"] for h in hits}
        # by (input tensor, component): the rows of the gradients reduced over lanes per step,
        # and once at the end (parameters); with time_rounds, the vector gradients reduced
        # every step take rows (n % ROUND) * len(loop_rows) + k, reduced inside the state loop
        # every ROUND iterations; otherwise they are summed over lanes LC values at a time,
        # from the thread's array of the current chunk
        self.time_rows, self.param_rows, self.loop_rows, self.chunk_arrays = {}, {}, {}, {}
        self.accumulators = []  # parameter gradients, summed over time in registers
        for t in differentiable:
            for c in range(t.components):
                self._add(t, c, renderer.schedule.time_rounds)

    def _add(self, t, c, time_rounds):
        size = "NS" if t.has_state_axis else "1"
        if not t.has_time:
            target = self.target(t, c, t.has_state_axis, False)
            row = None
            if not t.has_lane:
                row = self.param_rows[(t.name, c)] = SharedSlot(_rows(self.param_rows), size,
                                                                target)
            self.accumulators.append(dict(name=self.nm[("acc", self.spec.symbols[Slot(t.name, c)])],
                                          vector=t.has_state_axis, shared=not t.has_lane,
                                          target=target, slot=row))
        elif not t.has_lane:
            target = self.target(t, c, t.has_state_axis, True)
            if time_rounds and t.has_state_axis:
                self.loop_rows[(t.name, c)] = target
            else:
                self.time_rows[(t.name, c)] = SharedSlot(_rows(self.time_rows), size, target)
                if t.has_state_axis:
                    self.chunk_arrays[(t.name, c)] = f"lane_chunk_{len(self.chunk_arrays)}"

    def target(self, t, c, in_loop, with_time) -> str:
        """The gradient buffer's element of input ``t``'s component ``c``."""
        offset = self.nm.terms(t, c, time=with_time, n=in_loop)
        return f"{self.nm[('d', t.name)]}[{self.nm[('d_base', t.name)]}{offset}]"

    def route(self, store, value, in_loop, pad):
        idx, key = self.idx, None
        if store.kind == "hits":  # adds to the block's count
            return [], [f"{pad}{self.hit_regs[store.slot]}[{idx if in_loop else 0}] += {value};"]
        if store.kind == "lambda":
            lam = self.nm[("sym", self.lambdas[store.slot])]
            return [], [f"{pad}{lam}{f'[{idx}]' if in_loop else ''} = {value};"]
        t = self.spec.inputs[store.slot.tensor]  # differentiable: the adjoint has no others
        key = (t.name, store.slot.component)
        # a value outside the state loop is the same in every part of a lane: counted once
        ok = "lane_ok" if in_loop else "lane_once"
        if t.has_lane and t.has_time:
            return [f"{pad}if ({ok}) {{ {self.target(t, key[1], in_loop, True)} = {value}; }}"], []
        if not t.has_time:
            name = self.nm[("acc", self.spec.symbols[store.slot])]
            masked = value if t.has_lane and in_loop else f"({ok} ? {value} : 0.0f)"
            return [f"{pad}{name}[{idx if in_loop else 0}] += {masked};"], []
        # shared, time-varying: reduce over lanes this step
        if in_loop and key in self.chunk_arrays:  # with the chunk's other values
            return [f"{pad}{self.chunk_arrays[key]}[{idx} % LC] = {ok} ? {value} : 0.0f;"], []
        if key in self.loop_rows:
            row, at = f"(n % ROUND) * {len(self.loop_rows)} + {list(self.loop_rows).index(key)}", ""
        else:
            row, at = f"{self.time_rows[key].offset} + {'n' if in_loop else '0'}", "red_step + "
        # one value: whole lanes (part 0 holds a value outside the state loop)
        writes = "writes" if in_loop else "writes && part == 0"
        return self.reductions.lane_sum(pad, ok, value, writes, at, row).splitlines(), []

    def _writes(self, loop, keys) -> bool:
        """Whether the state loop ``loop`` stores a gradient of one of ``keys``."""
        return any(isinstance(b, Store) and b.kind == "grad"
                   and (b.slot.tensor, b.slot.component) in keys for b in loop.body)

    def loop_end(self, loop, pad) -> list:
        """The lane reductions of one round of the state loop (``time_rounds`` only), and the
        lane sums of the last ``LC`` values of the gradients reduced in chunks."""
        lines = []
        if self._writes(loop, self.loop_rows):
            lines += self.reductions.round_end(pad, list(self.loop_rows.values()),
                                               self.barrier).splitlines()
        arrays = [(self.chunk_arrays[key], self.time_rows[key].offset) for key in self.chunk_arrays
                  if self._writes(loop, {key})]
        if arrays:
            element = "part + PARTS * e" if self.split else "e"
            lines += self.reductions.chunk_end(pad, self.idx, element, arrays).splitlines()
        return lines


def _without_outputs(program: Program) -> Program:
    """The forward program with its output stores, and what only they read, dropped (the
    backward's segment recompute)."""
    return prune(program, lambda store: store.kind != "output")
