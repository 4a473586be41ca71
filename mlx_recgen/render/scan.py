"""Render the kernels of the scan schedule (see ``schedule.make_scan_schedule``, docs/scan.md).

For state-affine specs without a state axis (a few floats of state per lane), two kernels that
read every input once and write every output once:

forward   one threadgroup per (instance, block of ``LB`` lanes) walks all of time in stretches
          of ``STRETCH = TG / LB * RUN`` steps, oldest first. In a stretch, thread
          ``(j, lane)`` has its run of ``RUN`` consecutive steps in registers (loaded during
          the previous stretch, in the buffers' own dtypes: ``scan_runs.j2``) and
          summarises it as an affine map ``h -> P h + s`` (the segment summary of
          ``affine.segment_summary``: ``s`` from a zero state, ``P`` the composed multiplier).
          The maps compose, with the chunked schedule's products and zero hits
          (``affine.py``), through a butterfly of shuffles over the time-threads of a
          simdgroup (an exclusive prefix and a total per thread), then one threadgroup pass:
          every thread applies the simdgroups' totals to the carried state in time order,
          which gives the state entering its simdgroup and the stretch's end state (carried to
          the next stretch). The run reruns from its start state out of its registers, writing
          outputs; the state entering each stretch is the only residual (``_ckpt``).
backward  the same walk, newest stretch first: from the stretch's checkpoint the forward
          composition gives each run's start state, the run's states are recomputed into
          registers, the run's local adjoint (``λ`` swept from zero with the adjoint's ``λ``
          statements only) and ``Pᵀ`` form the adjoint map ``λ_end -> Pᵀ λ_end + local``,
          which composes in reverse time order the same way; then the full adjoint sweep of
          each run writes the gradients, in the dtype of the gradient buffer (template types
          ``GradT<i>``: the input's dtype where nothing is summed after the kernel). Gradients
          of inputs without the time axis are summed over a run's steps in registers and
          written once per time-thread (a lead axis summed after the kernel, in fp32).

A map is stored field by field: per multiplier block ``b`` its entries ``a<b>_<i><j>``, per
state slot ``k`` its offset ``v<k>``. Threadgroup memory holds two passes' totals,
``totals[((pass * SIMDS + simdgroup) * MAPF + field) * LB + lane in block]``.
"""

from __future__ import annotations

from ..ir import free_symbols
from ..schedule import SEGMENTS, scan_map_floats
from ..spec import Slot
from .kernels import (KernelRenderer, StepWriter, _commit_state, _forward_route, _without_outputs,
                      environment, met_zero_hit)


def grad_type_name(index: int) -> str:
    """The template type of the gradient buffer of the ``index``-th differentiable input."""
    return f"GradT{index}"


def run_type_name(index: int, cotangent: bool = False) -> str:
    """The template type of the registers that load the ``index``-th input a stretch ahead
    (``cotangent``: the ``index``-th output's cotangent): its buffer's own dtype, so that the
    load writes its register without waiting for the value (a conversion would wait); the
    stretch that takes them holds them as floats."""
    return f"RunD{index}" if cotangent else f"RunT{index}"


class ScanRenderer(KernelRenderer):
    """Template contexts of the scan schedule's two kernels."""

    def __init__(self, rec, dialect, schedule, ids=None):
        super().__init__(rec, dialect, schedule, ids)
        self.form = rec.affine
        self.products = rec.segment_summary.products
        ids = self.names.ids
        for p in self.products:  # product registers are state-like: spelled as states are
            ids.add(("state", p.symbol), f"{p.symbol}_s")
        self.slots = list(self.spec.state_slots())
        for s in self.slots:
            ids.add(("hist", self.spec.symbols[s]), f"{self.spec.symbols[s]}_hist")

    # -- maps ------------------------------------------------------------------------------------
    def fields(self, hits: bool = True) -> list:
        """The fields of a map, in their order in threadgroup memory; with ``hits``, a count
        of zero hits per block last (the forward maps only, see ``_compose``)."""
        out = []
        for b, block in enumerate(self.form.blocks):
            out += [f"a{b}_{i}{k}" for i in range(block.size) for k in range(block.size)]
        out += [f"v{k}" for k in range(len(self.slots))]
        return out + ([f"z{b}" for b in range(len(self.form.blocks))] if hits else [])

    def _blocks(self):
        """(block index, size, the slots' indices in ``self.slots``) of each block."""
        return [(b, block.size, [self.slots.index(s) for s in block.slots])
                for b, block in enumerate(self.form.blocks)]

    def _compose(self, dst, x, y, hits: bool) -> list:
        """``dst = x ∘ y`` (``y`` first): ``A = A_x A_y``, ``v = A_x v_y + v_x``; ``x`` and ``y``
        map a field to a C expression, ``dst`` is a prefix of registers.

        The products are the chunked schedule's (``affine.py``): ``recgen_compose`` for
        multipliers, ``recgen_apply`` for a multiplier on an offset (a zero offset is no term,
        whatever overflowed). With ``hits``, the count of zero hits from a zero start: ``y``'s,
        and ``x``'s where ``y`` leaves a zero start at zero (its offsets all zero)."""
        lines, assign = [], []
        for b, size, idx in self._blocks():
            for i in range(size):
                for k in range(size):
                    terms = " + ".join(f"recgen_compose({x(f'a{b}_{i}{m}')}, {y(f'a{b}_{m}{k}')})"
                                       for m in range(size))
                    lines.append(f"const float c_a{b}_{i}{k} = {terms};")
                    assign.append(f"{dst}_a{b}_{i}{k} = c_a{b}_{i}{k};")
                terms = " + ".join(f"recgen_apply({x(f'a{b}_{i}{m}')}, {y(f'v{idx[m]}')})"
                                   for m in range(size))
                lines.append(f"const float c_v{idx[i]} = {terms} + {x(f'v{idx[i]}')};")
                assign.append(f"{dst}_v{idx[i]} = c_v{idx[i]};")
            if hits:
                zero = " && ".join(f"{y(f'v{k}')} == 0.0f" for k in idx)
                lines.append(f"const float c_z{b} = {y(f'z{b}')} + ({zero} ? {x(f'z{b}')} : 0.0f);")
                assign.append(f"{dst}_z{b} = c_z{b};")
        return ["{", *("  " + x for x in lines + assign), "}"]

    def _apply(self, m, src, dst, hits: bool) -> list:
        """``dst = m(src)``: ``h_i <- Σ_k A_ik h_k + v_i`` per block; ``src`` and ``dst`` list
        a C lvalue per slot (they may be the same registers). With ``hits``, a block whose
        ``src`` is all zero where the map counts zero hits is NaN: the sequential steps met
        ``inf * 0`` there."""
        lines, assign = [], []
        for b, size, idx in self._blocks():
            met = ""
            if hits:
                met = met_zero_hit([src[k] for k in idx], m(f"z{b}"))
                lines.append(f"const bool met_inf_zero_{b} = {met};")
                met = f"met_inf_zero_{b} ? {self.d.nan} : "
            for i in range(size):
                terms = " + ".join(f"recgen_apply({m(f'a{b}_{i}{k}')}, {src[idx[k]]})"
                                   for k in range(size))
                lines.append(f"const float n_{idx[i]} = {met}{terms} + {m(f'v{idx[i]}')};")
                assign.append(f"{dst[idx[i]]} = n_{idx[i]};")
        return ["{", *("  " + x for x in lines + assign), "}"]

    def _pass(self, own: dict, pass_index: int, hits: bool) -> dict:
        """Context of one composition pass (``scan_pass.j2``) over the maps ``own`` (field ->
        C expression of this thread's run map); ``hits``: the maps count zero hits (forward)."""
        fields = self.fields(hits)
        reg = lambda prefix: (lambda f: f"{prefix}_{f}")  # noqa: E731
        def shared(f, g="g"):
            return self._total(pass_index, g, fields.index(f))

        identity = self._identity(fields)
        declare = [f"float T_{f} = {own[f]};" for f in fields]
        declare += [f"float E_{f} = {identity[f]};" for f in fields]
        shuffle = [f"const float Q_{f} = {self.d.simd_shuffle_xor}(T_{f}, mask);" for f in fields]
        # a partner earlier in the pass's order: E <- E ∘ Q, T <- T ∘ Q; later: T <- Q ∘ T
        butterfly = (shuffle + ["if (earlier) {"]
                     + ["  " + x for x in self._compose("E", reg("E"), reg("Q"), hits)]
                     + ["  " + x for x in self._compose("T", reg("T"), reg("Q"), hits)]
                     + ["} else {"]
                     + ["  " + x for x in self._compose("T", reg("Q"), reg("T"), hits)] + ["}"])
        publish = [f"{shared(f, 'int(simd_group)')} = T_{f};" for f in fields]
        carry = [f"carry_{k}" for k in range(len(self.slots))]
        start = [f"start_{k}" for k in range(len(self.slots))]
        return dict(index=pass_index, declare=declare, butterfly=butterfly, publish=publish,
                    starts=start, pairs=list(zip(carry, start)), lookback=[], entered=[],
                    advance=self._apply(shared, carry, carry, hits),
                    enter=self._apply(reg("E"), start, self._registers(), hits))

    @staticmethod
    def _identity(fields) -> dict:
        """The identity map, field by field: ones on the multipliers' diagonals, zeros else."""
        return {f: ("1.0f" if f.startswith("a") and f[-1] == f[-2] else "0.0f") for f in fields}

    @staticmethod
    def _total(pass_index, simdgroup, field: int) -> str:
        """A simdgroup's total in threadgroup memory: one field of its map, for lane ``lb``."""
        return f"totals[(({pass_index} * SIMDS + {simdgroup}) * MAPF + {field}) * LB + lb]"

    @staticmethod
    def lookback_words(form, spec, stretches: int, lane_block: int) -> int:
        """64-bit words of the look-back's ``scan_words`` for ``stretches`` groups along time
        (all lane blocks): the ticket counter, then per stretch and lane its map's floats
        (``scan_map_floats``, zero hits included) and its end state's (``_lookback``)."""
        floats = scan_map_floats(form) + sum(t.components for t in spec.states.values())
        return 1 + stretches * floats * lane_block

    def _lookback(self, shared) -> dict:
        """The forward pass's look-back (``Schedule.lookback``): lines run by one thread per
        lane (``j == 0``) once the simdgroups' totals (``shared(field, q)``) are in group memory,
        and the lines after the barrier that follows them.

        Groups exchange floats through ``words`` (``scan_words``, a zero array of the call):
        each float in a 64-bit word beside a ready tag, written and read whole, so a reader that
        sees the tag sees the value (``Dialect.lookback``). Word 0 is the ticket counter; then
        every stretch's map ``G`` (the totals composed in time order), then every stretch's end
        state. The state entering stretch ``k`` is the end state of stretch ``k - WINDOW`` (the
        initial state where that is before the first) under the maps of the stretches between,
        composed oldest first while that end state may still be on its way: a fixed rule, so
        the result does not depend on which groups have finished (reruns are bit-identical)."""
        fields, states = self.fields(), self._states()
        d, i64 = self.d, self.d.int64
        identity = self._identity(fields)
        entering = [f"entering_{k}" for k in range(len(states))]

        def reg(prefix):  # a map's fields in registers named prefix_<field>
            return lambda f: f"{prefix}_{f}"

        def maps_at(tile, f):  # the word of field f of stretch tile's map, for lane lb
            return f"words + 1 + (({tile}) * MAPF + {fields.index(f)}) * LB + lb"

        def ends_at(tile, k):  # the word of slot k of stretch tile's end state, after the maps
            return (f"words + 1 + chains * segments * MAPF * LB + "
                    f"(({tile}) * {len(states)} + {k}) * LB + lb")

        # the maps of the window's stretches (the identity outside it), polled together
        window = [f"float M_{f}[WINDOW - 1];" for f in fields]
        window += ["for (bool up = false; !up;) {", "  up = true;", f"  {d.unroll}",
                   "  for (int w = 1; w < WINDOW; ++w) {", f"    const {i64} q = base + w;",
                   "    if (q >= 0 && q < k) {"]
        for f in fields:
            word = maps_at("q * chains + group", f)
            window += [f"      const unsigned long long u_{f} = recgen_peek({word});",
                       f"      up = up & recgen_ready(u_{f});",
                       f"      M_{f}[w - 1] = recgen_value(u_{f});"]
        window += ["    } else {", *(f"      M_{f}[w - 1] = {identity[f]};" for f in fields),
                   "    }", "  }", "  if (!up) {", "    recgen_pause();", "  }", "}"]
        window += [*(f"float R_{f} = {identity[f]};" for f in fields), d.unroll,
                   "for (int w = 1; w < WINDOW; ++w) {",
                   *("  " + x for x in self._compose("R", lambda f: f"M_{f}[w - 1]", reg("R"),
                                                     hits=True)), "}"]
        # the end state of stretch base, polled until all its slots are up
        awaited = ["for (bool up = false; !up;) {", "  up = true;"]
        for k, e in enumerate(entering):
            word = ends_at("base * chains + group", k)
            awaited += [f"  const unsigned long long u_{k} = recgen_peek({word});",
                        f"  up = up & recgen_ready(u_{k});", f"  {e} = recgen_value(u_{k});"]
        awaited += ["  if (!up) {", "    recgen_pause();", "  }", "}"]
        lines = [
            "if (j == 0) {  // one thread per lane: the first LB threads, in the first simdgroup",
            f"  const {i64} tile = k * chains + group;",
            "  // this stretch's map: the simdgroups' totals composed in time order",
            *(f"  float G_{f} = {shared(f, '0')};" for f in fields),
            "  for (int q = 1; q < SIMDS; ++q) {",
            *("    " + x for x in self._compose("G", lambda f: shared(f, "q"), reg("G"),
                                             hits=True)),
            "  }",
            "  if (k + 1 < segments) {  // the stretches after it apply it",
            *(f"    recgen_publish({maps_at('tile', f)}, G_{f});" for f in fields),
            "  }",
            "  // the state entering it: stretch k - WINDOW's end state (or the initial state)",
            "  // under R, the maps of the stretches between composed oldest first",
            f"  const {i64} base = k - WINDOW;",
            *("  " + x for x in window),
            *(f"  float {e} = lane_ok ? static_cast<float>({s['init']}[{s['offset']}]) : 0.0f;"
              for e, s in zip(entering, states)),
            "  if (base >= 0) {",
            *("    " + x for x in awaited),
            "  }",
            *("  " + x for x in self._apply(reg("R"), entering, entering, hits=True)),
            *(f"  entering[{k} * LB + lb] = {e};" for k, e in enumerate(entering)),
            "  if (lane_ok) {  // the checkpoint: the state entering stretch k",
            *(f"    {s['ckpt_buffer']}[{s['ckpt']}] = {e};" for e, s in zip(entering, states)),
            "  }",
            "  if (k + WINDOW < segments) {  // its end state, for stretch k + WINDOW",
            *("    " + x for x in self._apply(reg("G"), entering, entering, hits=True)),
            *(f"    recgen_publish({ends_at('tile', k)}, {e});" for k, e in enumerate(entering)),
            "  }",
            "}",
        ]
        entered = [f"carry_{k} = entering[{k} * LB + lb];" for k in range(len(states))]
        return dict(lookback=lines, entered=entered)

    def _registers(self) -> list:
        """The state register of every slot (forward: the state; backward: ``λ``)."""
        return [self.names[("state", self.spec.symbols[s])] for s in self.slots]

    # -- shared pieces ---------------------------------------------------------------------------
    def _writer(self, programs):
        """A step writer whose inputs and cotangents come from this run's registers (``[r]``),
        and the loads that fill those registers: (register, global source) each. Inputs
        without the time axis are read where a step reads them (the same address every step)."""
        nm = self.names
        writer = StepWriter(self.rec, self.d, nm)
        spec = self.spec
        timeless = {sym for slot, sym in spec.symbols.items()
                    if slot.tensor in spec.inputs and not spec.inputs[slot.tensor].has_time}
        read = set().union(*(free_symbols(p.statements) for p in programs))
        types = {sym: run_type_name(list(spec.inputs).index(slot.tensor))
                 for slot, sym in spec.symbols.items() if slot.tensor in spec.inputs}
        types.update({sym: run_type_name(list(spec.outputs).index(slot.tensor), cotangent=True)
                      for slot, sym in self.rec.adjoint.output_cotangents.items()})
        runs = []
        for sym in sorted((set(writer.scalar_loads) & read) - timeless, key=str):
            source, _ = writer.scalar_loads[sym]
            reg = nm.ids.add(("run", sym), f"{sym}_run")
            runs.append(dict(reg=reg, source=source, sym=sym, type=types[sym]))
            writer.scalar_loads[sym] = (f"{reg}[r]", None)
        return writer, runs

    def _summary(self, writer):
        """Lines of the run summary: registers from zero / the identity, and one step; for
        forms of 1 x 1 blocks also the step in IEEE products (``plain``, ``plain_loads``) and
        the test its products pass where it equals the careful step (``exact``,
        ``affine.plain_summary_program``)."""
        spec, nm = self.spec, self.names
        regs = {s: nm[("state", spec.symbols[s])] for s in self.slots}
        for p in self.products:
            regs[p.slot] = nm[("state", p.symbol)]
            writer.names[p.symbol] = regs[p.slot]

        def route(store, value, in_loop, pad):
            return [], [f"{pad}{regs[store.slot]} = {value};"]

        # states from zero (declared by the kernel), products from the identity (here)
        starts = [(regs[s], "0.0f", "") for s in self.slots] + [
            (regs[p.slot], "1.0f" if p.row == p.col else "0.0f", "float ") for p in self.products]
        init = [f"{declare}{reg} = {value};" for reg, value, declare in starts]
        reset = [f"{reg} = {value};" for reg, value, _ in starts]
        own = {}
        for p in self.products:
            own[f"z{p.block}" if p.hits else f"a{p.block}_{p.row}{p.col}"] = regs[p.slot]
        for k, s in enumerate(self.slots):
            own[f"v{k}"] = regs[s]
        # the plain step first; the careful one where a product fails the test
        summary = dict(self.summary_steps(writer, route, "        "), init=init, reset=reset,
                       exact=" && ".join(f"recgen_exact({regs[p.slot]})"
                                         for p in self.products if not p.hits))
        return summary, own

    def _states(self):
        spec, nm = self.spec, self.names
        out = []
        for k, s in enumerate(self.slots):
            t, c = spec.states[s.tensor], s.component
            sym = spec.symbols[s]
            out.append(dict(reg=nm[("state", sym)], carry=f"carry_{k}", lam_carry=f"lam_carry_{k}",
                            hist=nm[("hist", sym)],
                            init=nm[("init", t.name)], final=nm[("final", t.name)],
                            d_final=nm[("d_final", t.name)], d_init=nm[("d_init", t.name)],
                            offset=nm[("base", t.name)] + nm.terms(t, c),
                            d_init_offset=self.d_init_offset(t, c),
                            ckpt_buffer=nm[("ckpt", t.name)],
                            ckpt=self.ckpt_offset(t, c, segment="k")))
        return out

    def _context(self, kind):
        ctx = self._common(kind)
        ctx.update(map_floats=len(self.fields()), scan_states=self._states())
        return ctx

    # -- forward ---------------------------------------------------------------------------------
    def forward(self):
        spec, nm = self.spec, self.names
        prog = self.rec.forward_program
        writer, runs = self._writer([prog, self.rec.segment_summary.program])
        summary, own = self._summary(writer)
        route = _forward_route(spec, nm, _commit_state(spec, nm), "lane_ok")

        ctx = self._context("forward")
        # stretches alternate between two buffers of totals: one barrier per stretch
        forward_pass = self._pass(own, "int(k & 1)", hits=True)
        if self.schedule.lookback:
            fields = self.fields()
            forward_pass.update(self._lookback(
                lambda f, q: self._total("int(k & 1)", q, fields.index(f))))
        ctx.update(runs=runs, summary=summary, forward_pass=forward_pass,
                   lookback=bool(self.schedule.lookback),
                   loads=writer.step_loads(prog, "        "),
                   step=writer.program(prog, route, "        "))
        return environment().get_template("scan_forward.j2").render(**ctx)

    # -- backward --------------------------------------------------------------------------------
    def backward(self):
        spec, d, nm = self.spec, self.d, self.names
        adj = self.rec.adjoint
        writer, runs = self._writer([adj.program, self.rec.forward_program,
                                     self.rec.segment_summary.program])
        summary, own = self._summary(writer)
        lam_regs = {s: nm[("sym", sym)] for s, sym in adj.state_cotangents.items()}

        def grad_target(t, c, with_time):
            return (f"{nm[('d', t.name)]}[{nm[('d_base', t.name)]}"
                    f"{nm.terms(t, c, time=with_time)}]")

        accumulators = []
        differentiable = [t for t in spec.inputs.values() if t.differentiable]
        for i, t in enumerate(differentiable):
            if not t.has_time:
                for c in range(t.components):
                    accumulators.append(dict(name=nm[("acc", spec.symbols[Slot(t.name, c)])],
                                             target=grad_target(t, c, False),
                                             type=grad_type_name(i)))

        grad_type = {t.name: grad_type_name(i) for i, t in enumerate(differentiable)}

        local, counts_hits = self.rec.local_adjoint
        hit_regs = {p.slot: f"lam_hits_{p.block}" for p in self.products if p.hits}

        def route(store, value, in_loop, pad):
            if store.kind == "lambda":
                return [], [f"{pad}{lam_regs[store.slot]} = {value};"]
            if store.kind == "hits":  # adds to the block's count
                return [], [f"{pad}{hit_regs[store.slot]} += {value};"]
            t, c = spec.inputs[store.slot.tensor], store.slot.component
            if t.has_time:  # in the gradient buffer's dtype (the input's, see ScanPasses)
                target = grad_target(t, c, True)
                return [f"{pad}if (lane_ok) {{ {target} = static_cast<{grad_type[t.name]}>"
                        f"({value}); }}"], []
            return [f"{pad}{nm[('acc', spec.symbols[store.slot])]} += {value};"], []

        grad_bases = []
        for t in differentiable:
            extra = self._grad_axis_terms(t)
            if not t.has_time:  # one partial sum per time-thread
                extra.append(f" + j * {nm[('d_stride', t.name, SEGMENTS)]}")
            grad_bases.append(f"const {d.int64} {nm[('d_base', t.name)]} = "
                              f"{nm[('base', t.name)]}{''.join(extra)};")

        recompute = _without_outputs(self.rec.forward_program)
        # the adjoint map of a run: λ_end -> Pᵀ λ_end + local, with the local sweep's zero
        # hits where it counts them (``Recurrence.local_adjoint``)
        lam_own = {}
        for p in self.products:
            if p.hits:
                if counts_hits:
                    lam_own[f"z{p.block}"] = hit_regs[p.slot]
                continue
            lam_own[f"a{p.block}_{p.col}{p.row}"] = nm[("state", p.symbol)]
        for k, s in enumerate(self.slots):
            lam_own[f"v{k}"] = lam_regs[s]
        lam_pass = self._pass(lam_own, 1, hits=counts_hits)
        lam_pass["enter"] = self._apply(lambda f: f"E_{f}", lam_pass["starts"],
                                        [lam_regs[s] for s in self.slots], hits=counts_hits)
        ctx = self._context("backward")
        ctx["lookback"] = False  # the backward walks its stretches in one group
        for st, s in zip(ctx["scan_states"], self.slots):
            st["lam"] = lam_regs[s]
        ctx.update(runs=runs, summary=summary, forward_pass=self._pass(own, 0, hits=True),
                   lambda_pass=lam_pass, grad_bases=grad_bases, accumulators=accumulators,
                   history=[f"{st['hist']}[r] = {st['reg']};" for st in ctx["scan_states"]],
                   recompute_loads=writer.step_loads(recompute, "        "),
                   recompute=writer.program(recompute, _commit_state(spec, nm), "        "),
                   local_hits=sorted(hit_regs.values()) if counts_hits else [],
                   local_loads=writer.step_loads(local, "        "),
                   local=writer.program(local, route, "        "),
                   loads=writer.step_loads(adj.program, "        "),
                   step=writer.program(adj.program, route, "        "))
        return environment().get_template("scan_backward.j2").render(**ctx)

__all__ = ["ScanRenderer", "grad_type_name", "run_type_name"]
