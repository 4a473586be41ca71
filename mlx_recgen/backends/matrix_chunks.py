"""Chunks of the time axis, the pieces the matrix schedule's two forms share: its MLX ops
(``mlx_matrix.py``) and its kernels' gradients (``matrix_kernels.py``)."""

from __future__ import annotations

import mlx.core as mx

from ..layout import sum_to


class MatrixChunks:
    """Arrays ``(*batch, T, X)`` cut into chunks ``(*batch, nc, C, X)``, the time axis padded
    with ``fill`` to a whole number of chunks."""

    def __init__(self, T: int, C: int, nb: int):
        self.T, self.C, self.nb = T, C, nb
        self.nc = -(-T // C)

    def cut(self, x, fill=0.0):
        pad = self.nc * self.C - self.T
        if pad:
            widths = [(0, 0)] * x.ndim
            widths[self.nb] = (0, pad)
            x = mx.pad(x, widths, constant_values=fill)
        return x.reshape(*x.shape[:self.nb], self.nc, self.C, x.shape[-1])

    def join(self, x):
        x = x.reshape(*x.shape[:self.nb], self.nc * self.C, x.shape[-1])
        return x[(slice(None),) * self.nb + (slice(0, self.T),)]


@mx.custom_function
def _row_major_product(x, y):
    return x @ mx.contiguous(y)


@_row_major_product.vjp
def _row_major_product_vjp(primals, cotangent, _):
    x, y = primals
    dx = cotangent @ mx.contiguous(mx.swapaxes(y, -1, -2))
    dy = mx.swapaxes(x, -1, -2) @ cotangent
    return sum_to(dx, x.shape), sum_to(dy, y.shape)  # undo the operands' broadcasting


def product(x, y):
    """``x @ y`` for the chunk products. On the CPU the right operand of every product, the
    VJP's included, is passed row-major (a transposed one copied first): the BLAS of MLX's Linux
    CPU build (reference BLAS) runs a product whose right operand is transposed at half the rate
    (2.7-3.3 against 6.0-6.2 GFLOP/s at the chunks' sizes on 2 x86 cores), and MLX's own VJP of
    ``x @ y`` takes ``cotangent @ yᵀ``. The copies move ``O(n²)`` floats per ``O(n³)`` product.
    Elsewhere (cuBLAS, Metal) a transposed operand costs nothing: plain ``x @ y``."""
    if mx.default_device().type != mx.cpu:
        return x @ y
    return _row_major_product(x, y)


def causal(C: int):
    """``[C, C]``: ``t > j``."""
    i = mx.arange(C)
    return i[:, None] > i[None, :]


def causal_weights(log_d):
    """``exp(Σ_{j<s<t} log_d[s])`` for ``j < t``, else 0: ``(..., C, C, X)`` from
    ``(..., C, X)``. Each exponent is the sum of its own range (a reverse cumulative sum per
    row), not a difference of two long running sums, so it is as exact as the range allows."""
    C = log_d.shape[-2]
    mask = causal(C)[:, :, None]
    rows = mx.where(mask, log_d[..., None, :, :], 0.0)  # row t: log_d[s] for s < t
    sums = mx.cumsum(rows, axis=-2, reverse=True, inclusive=False)  # Σ_{j<s<t}
    return mx.where(mask, mx.exp(mx.where(mask, sums, -mx.inf)), 0.0)


def parity(sign, axis):
    """The running product along ``axis`` of the signs of ``sign``, a zero (a chunk's padding)
    counting as ``+1`` (exact). The sign has no derivative, and behind the stop-gradient
    forward mode never asks for ``cumprod``'s, which MLX lacks."""
    return mx.cumprod(sign_of(mx.stop_gradient(sign)), axis=axis)


def sign_of(d):
    """``±1``: the sign of ``d``, ``+1`` at zero, from ``sign(d)`` and a zero test. No operand
    is a scalar: on MLX's CUDA backend an uncompiled kernel with a scalar operand (``d < 0``,
    ``where(.., -1, 1)``) reads it from host memory, 16-20 µs a kernel over 524288 elements
    where one without takes 3.4 (benchmarks/results/bench-matrix-walk-H200-2026-11-27.md); a
    gradient's trace of the forward runs uncompiled."""
    return mx.sign(d) + mx.logical_not(d)


def carry(S0, whole, sign, U):
    """The states at every chunk's start and after the last chunk, from the initial state
    ``S0`` ``(*batch, K, V)``, each chunk's ``log |decay|`` ``whole`` ``(*batch, nc, 1 or K)``
    and sign (or None) and its end state from zero ``U`` ``(*batch, nc, K, V)``: the same
    causal weights one level up, ``S_start[c] = Σ_{c' < c} d(c'+1..c-1) U[c'] + d(0..c-1) S0``,
    as one product over chunks (no loop over them)."""
    vector = whole.shape[-1] > 1
    weights = causal_weights(whole)  # (*batch, nc, nc, 1 or K)
    before = mx.exp(mx.cumsum(whole, axis=-2, inclusive=False))  # d(0..c-1)
    after = mx.exp(mx.cumsum(whole, axis=-2, reverse=True, inclusive=False))  # d(c+1..)
    total = mx.exp(mx.sum(whole, axis=-2))
    if sign is not None:  # sign(d(c'+1..c-1)) = parity(..c-1) parity(..c')
        sign = sign[..., 0, :]
        par = parity(sign, axis=-2)
        parity_ex = par * sign
        U = U * par[..., :, :, None]
        before, after = before * parity_ex, after * par[..., -1:, :]
        total = total * par[..., -1, :]
        weights = weights * parity_ex[..., :, None, :]
    if vector:  # a product per state element: K to the batch
        mixed = mx.swapaxes(product(mx.moveaxis(weights, -1, -3), mx.moveaxis(U, -2, -3)),
                            -3, -2)
    else:
        nc, K, V = U.shape[-3:]
        mixed = product(weights[..., 0], U.reshape(*U.shape[:-2], K * V)).reshape(U.shape)
    starts = before[..., :, :, None] * S0[..., None, :, :] + mixed
    final = total[..., :, None] * S0 + mx.sum(after[..., :, :, None] * U, axis=-3)
    return starts, final


__all__ = ["MatrixChunks", "carry", "causal", "causal_weights", "parity", "product", "sign_of"]
