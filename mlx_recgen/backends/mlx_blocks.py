"""The plumbing the pure-MLX forms share (``mlx_ops.SequentialForm``,
``mlx_chunked.ChunkedForm``, ``mlx_matrix.MatrixForm``; the decode path too): where each symbol
of the step programs comes from, the arrays of a run of steps, and the few array helpers that
chain a call's segments."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..layout import canonical_shape


class SymbolTable:
    """Where each symbol of the step programs comes from, and its canonical step shape."""

    def __init__(self, rec):
        spec = self.spec = rec.spec
        self.key = {}  # symbol -> (kind, (tensor, component))
        for slot, sym in spec.symbols.items():
            kind = "state" if slot.tensor in spec.states else "input"
            self.key[sym] = (kind, (slot.tensor, slot.component))
        for slot, sym in rec.adjoint.output_cotangents.items():
            self.key[sym] = ("d_output", (slot.tensor, slot.component))
        for slot, sym in rec.adjoint.state_cotangents.items():
            self.key[sym] = ("d_state", (slot.tensor, slot.component))
        self.states = [spec.symbols[s] for s in spec.state_slots()]
        self.lambdas = [rec.adjoint.state_cotangents[s] for s in spec.state_slots()]
        self.state_of = dict(zip(self.lambdas, self.states))

    def step_shape(self, sym, sizes) -> tuple:
        """The canonical shape of one step of ``sym`` (no time axis)."""
        sym = self.state_of.get(sym, sym)
        _, (tensor, _) = self.key[sym]
        return canonical_shape(self.spec, self.spec.tensors[tensor], sizes, with_time=False)

    def timed(self, sym) -> bool:
        kind, (tensor, _) = self.key[sym]
        return kind != "input" or self.spec.inputs[tensor].has_time


@dataclass
class Block:
    """The arrays of a run of ``steps`` steps, by (tensor, component): per-step values with a
    leading time axis, parameters without; ``ones`` spans the state axis."""

    values: dict
    steps: int
    ones: mx.array


def fit(x, shape) -> mx.array:
    x = x if isinstance(x, mx.array) else mx.array(x, dtype=mx.float32)
    return x if tuple(x.shape) == tuple(shape) else mx.broadcast_to(x, shape)


def concat(xs: list) -> mx.array:
    return xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=0)


def computed_after(carry: dict, results) -> dict:
    """``carry`` unchanged, but computed after ``results``. MLX evaluates a lazy graph from its
    outputs: a segment's results, used only at the very end, would wait for every later
    segment and keep every segment's working arrays alive together. A select on a false
    condition is exact whatever it reads (no ``0 * x``: x may be inf) and, unlike
    ``mx.depends``, it vmaps."""
    probes = [r.reshape(-1)[:1] for r in results if isinstance(r, mx.array)]
    if not probes:
        return carry
    probe = probes[0] if len(probes) == 1 else mx.concatenate(probes)[:1]
    never = mx.array(False)
    return {s: mx.where(never, probe.astype(v.dtype), v) for s, v in carry.items()}


def write(buffer, block, start: int, length: int):
    """``block`` written at ``start`` along the time axis of ``buffer`` (a zero buffer of
    ``length`` steps when ``buffer`` is None). Blocks are chained into one buffer rather than
    concatenated at the end, so that MLX evaluates each segment's results as soon as the
    segment is done and frees its working arrays (a final concatenation would keep every
    segment's inputs alive until all segments are computed)."""
    if buffer is None:
        if block.shape[0] == length:
            return block
        buffer = mx.zeros((length, *block.shape[1:]), dtype=block.dtype)
    return mx.slice_update(buffer, block, mx.array([start]), axes=(0,))


__all__ = ["Block", "SymbolTable", "computed_after", "concat", "fit", "write"]
