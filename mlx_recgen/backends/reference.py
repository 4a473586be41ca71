"""The reference: the spec's forward step in a plain MLX loop, differentiated by MLX autodiff."""

from __future__ import annotations


def run_reference(rec, inputs, states, sizes, out_dtype):
    backend = rec._backend("mlx")
    L = sizes[rec.spec.time]
    outs, finals, _ = backend.forward(inputs, states, sizes, L, out_dtype, compiled=False)
    return outs, finals
