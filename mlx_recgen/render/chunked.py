"""Render the kernels of the chunked schedule (see ``schedule.py``).

Six kernels, three per pass, all from the IR's affine analysis (``affine.py``):

forward   summary   one thread per (segment, instance, lane): the segment's local end state
                    from a zero state and its composed multiplier ``P`` (``chunked_summary.j2``)
          carry     one thread per (state element, instance, lane): ``h <- P h + local`` over
                    segments, writing the checkpoints and the final state (``chunked_carry.j2``)
          outputs   one thread per (segment, instance, lane): the forward step from the
                    segment's checkpoint, writing outputs (``forward.j2``, segment mode)
backward  summary   per segment: sweep ``λ`` from zero with the adjoint's ``λ`` statements only
                    (``Recurrence.local_adjoint``: with its count of zero hits where it keeps
                    one), recomputing the segment only if they read the state (``backward.j2``,
                    segment and λ-only mode)
          carry     ``λ <- Pᵀ λ + local`` over segments, newest first (NaN where the local
                    adjoint counted zero hits and the incoming ``λ`` is zero), writing the adjoint
                    at every segment's end and the initial state's gradient (``chunked_carry.j2``)
          gradients per segment: the full adjoint sweep from the segment's end adjoint, writing
                    gradients; parameter gradients go to one partial sum per segment, summed
                    afterwards in a fixed order (``backward.j2``, segment mode)

Buffers that hold one state per segment (checkpoints, local states, local and end adjoints)
share the checkpoint layout ``[segment, instance, component, NS or 1, lane]``; the composed
multiplier of block ``b`` is ``prod<b>`` with layout ``[segment, instance, entry, NS or 1, lane]``,
and its count of zero hits (``affine.zero_hit``, read by the forward carry) is ``hits<b>`` with
layout ``[segment, instance, 1, NS or 1, lane]`` (NS rows for a block with the state axis).
"""

from __future__ import annotations

from .kernels import KernelRenderer, StepWriter, environment, met_zero_hit


class ChunkedRenderer(KernelRenderer):
    """Template contexts of the chunked schedule's kernels."""

    def __init__(self, rec, dialect, schedule, ids=None):
        super().__init__(rec, dialect, schedule, ids)
        self.form = rec.affine
        self.products = rec.segment_summary.products
        for p in self.products:  # product registers are state-like: spelled as states are
            self.names.ids.add(("state", p.symbol), f"{p.symbol}_s")

    def _common(self, kind):
        ctx = super()._common(kind)
        ctx["segment_in_grid"] = kind != "carry"
        # the carry is independent per state element: one thread per element, not per segment
        ctx["outer"] = "element" if kind == "carry" else "segment"
        nm = self.names
        tensors = [t for t in self.spec.states.values() for _ in range(t.components)]
        for st, t in zip(ctx["states"], tensors):
            st.update(local=nm[("local", t.name)], lamend=nm[("lamend", t.name)],
                      d_init=nm[("d_init", t.name)], d_final=nm[("d_final", t.name)])
        return ctx

    # -- the composed multipliers ----------------------------------------------------------------
    @staticmethod
    def product_buffer(block: int) -> str:
        return f"prod{block}"

    @staticmethod
    def hits_buffer(block: int) -> str:
        return f"hits{block}"

    def _product_offset(self, p) -> str:
        block = self.form.blocks[p.block]
        if p.hits:  # its own buffer: [segment, instance, 1, NS or 1, lane]
            n, width = ("n", "NS") if block.vector else ("0", "1")
            return f"((s * instances + instance) * {width} + {n}) * lanes + lane"
        n, width = ("n", "NS") if p.pointwise else ("0", "1")
        entries = block.size * block.size
        e = p.row * block.size + p.col
        return (f"(((s * instances + instance) * {entries} + {e}) * {width} + {n}) "
                f"* lanes + lane")

    def _products_ctx(self):
        return [dict(reg=self.names[("state", p.symbol)], pointwise=p.pointwise, hits=p.hits,
                     identity="1.0f" if p.row == p.col else "0.0f",
                     buffer=self.hits_buffer(p.block) if p.hits else
                     self.product_buffer(p.block),
                     offset=self._product_offset(p))
                for p in self.products]

    # -- forward -------------------------------------------------------------------------------
    def summary(self):
        """Forward phase 1: local end state and composed multiplier of every segment. Where
        the form's blocks are 1 x 1, the segment runs the summary in IEEE products first and
        the careful step only where a product fails ``recgen_exact``
        (``affine.plain_summary_program``)."""
        spec, nm = self.spec, self.names
        writer = StepWriter(self.rec, self.d, nm)
        regs = {s: nm[("state", sym)] for s, sym in spec.symbols.items() if s.tensor in spec.states}
        for p in self.products:
            regs[p.slot] = nm[("state", p.symbol)]
            writer.names[p.symbol] = regs[p.slot] + ("[n]" if p.pointwise else "")

        def route(store, value, in_loop, pad):
            return [], [f"{pad}{regs[store.slot]}{'[n]' if in_loop else ''} = {value};"]

        ctx = self._common("summary")
        ctx.update(self.summary_steps(writer, route, "    "), products=self._products_ctx())
        return environment().get_template("chunked_summary.j2").render(**ctx)

    def carry(self, reverse: bool):
        """Phase 2 of either pass: the carry over segments. Forward: ``h <- P h + local``,
        oldest segment first; backward (``reverse``): ``λ <- Pᵀ λ + local``, newest first.

        A shared state (without the lane axis) is carried by every lane; forward, lane 0 stores
        it (checkpoints, final state); backward, every lane carries its share of the adjoint
        (lane 0 seeded with the final state's cotangent) and stores it per lane."""
        spec, nm = self.spec, self.names
        updates = []
        # the forward summary counts zero hits; the local adjoint where it has the form for it
        counts_hits = self.rec.local_adjoint.counts_hits if reverse else True
        for b, block in enumerate(self.form.blocks):
            regs = [nm[("state", spec.symbols[s])] for s in block.slots]
            tensors = [spec.states[s.tensor] for s in block.slots]  # a block may span tensors
            lines = [f"const float old_{i} = {regs[i]};" for i in range(block.size)]
            for p in self.products:
                if p.block == b and (counts_hits or not p.hits):
                    name = "hits" if p.hits else f"p_{p.row}{p.col}"
                    buffer = self.hits_buffer(b) if p.hits else self.product_buffer(b)
                    lines.append(f"const float {name} = {buffer}[{self._product_offset(p)}];")
            if counts_hits:  # from a zero start the sequential steps met inf * 0 in the segment
                met = met_zero_hit([f"old_{i}" for i in range(block.size)], "hits")
                lines.append(f"const bool met_inf_zero = {met};")
            for i in range(block.size):
                terms = [f"recgen_apply(p_{j}{i}, old_{j})" if reverse else
                         f"recgen_apply(p_{i}{j}, old_{j})" for j in range(block.size)]
                t, c = tensors[i], block.slots[i].component
                local = f"{nm[('local', t.name)]}[{self.ckpt_offset(t, c, shares=reverse)}]"
                value = f"{' + '.join(terms)} + {local}"
                if counts_hits:
                    value = f"met_inf_zero ? {self.d.nan} : {value}"
                lines.append(f"{regs[i]} = {value};")
            guard = "vector_ok" if block.vector else "scalar_ok"
            updates += [f"    if ({guard}) {{", *("      " + x for x in lines), "    }"]
        ctx = self._common("carry")
        tensors = [(t, c) for t in spec.states.values() for c in range(t.components)]
        for st, (t, c) in zip(ctx["states"], tensors):
            ok = "vector_ok" if t.has_state_axis else "scalar_ok"
            lane0 = ok if t.has_lane else f"{ok} && lane == 0"
            if reverse:
                st.update(first=st["d_final"], boundary=st["lamend"], last=st["d_init"],
                          seeded=lane0, stored=ok, last_offset=self.d_init_offset(t, c),
                          ckpt=self.ckpt_offset(t, c, shares=True))
            else:
                st.update(first=st["init"], boundary=st["ckpt_buffer"], last=st["final"],
                          seeded=ok, stored=lane0, last_offset=st["offset"])
        ctx.update(updates=updates, reverse=reverse)
        return environment().get_template("chunked_carry.j2").render(**ctx)

    def forward(self):
        """Forward phase 3: every segment from its checkpoint, writing the outputs."""
        return self._render_forward(segment_in_grid=True)

    # -- backward ------------------------------------------------------------------------------
    def backward(self, lambda_only: bool = False):
        """Backward phase 1 (``lambda_only``: the local adjoint of every segment) or phase 3
        (every segment's adjoint sweep from its end adjoint, writing gradients)."""
        if not lambda_only:
            return self._render_backward(self.rec.adjoint.program, segment_in_grid=True)
        program, counts_hits = self.rec.local_adjoint
        hits = [dict(slot=p.slot, reg=f"zero_hits_{p.block}",
                     vector=self.form.blocks[p.block].vector,
                     buffer=self.hits_buffer(p.block), offset=self._product_offset(p))
                for p in self.products if p.hits and counts_hits]
        return self._render_backward(program, segment_in_grid=True, lambda_only=True, hits=hits)


__all__ = ["ChunkedRenderer"]
