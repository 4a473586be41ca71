"""Griffin's recurrent block with the RG-LRU (De et al. 2024), on the bundled ``rglru``
recurrence."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..specs import load_spec
from .cache import RecurrentCache
from .common import ShortConv, check_call, check_options, scan


class BlockDiagonalLinear(nn.Module):
    """``y = x W + b`` with ``W`` block-diagonal: ``num_blocks`` independent ``width /
    num_blocks``-square blocks (RecurrentGemma's gates). ``weight`` ``[num_blocks, n, n]``
    uniform in ``±1/sqrt(n)``, ``bias`` ``[num_blocks, n]`` zeros."""

    def __init__(self, width: int, num_blocks: int):
        super().__init__()
        if width % num_blocks:
            raise ValueError(f"BlockDiagonalLinear: num_blocks {num_blocks} does not divide "
                             f"width {width}")
        n = width // num_blocks
        self.weight = mx.random.uniform(-1 / math.sqrt(n), 1 / math.sqrt(n), (num_blocks, n, n))
        self.bias = mx.zeros((num_blocks, n))

    def __call__(self, x):
        blocks, n = self.bias.shape
        xb = x.reshape(*x.shape[:-1], blocks, 1, n)
        y = (xb @ self.weight).squeeze(-2) + self.bias
        return y.reshape(x.shape)


def lambda_init(width: int, c: float, low: float, high: float):
    """Griffin's ``Λ``: ``a = sigmoid(Λ)`` with ``a ** c`` uniform in ``[low, high]``, i.e.
    ``log sigmoid(Λ) = log(u) / c``, ``Λ = log sigmoid(Λ) - log(1 - sigmoid(Λ))``."""
    if not 0 < low < high < 1:
        raise ValueError(f"RGLRU: a ** c must range in (0, 1), got [{low}, {high}]")
    log_a = mx.log(mx.random.uniform(low, high, (width,))) / c
    return log_a - mx.log(-mx.expm1(log_a))


class RGLRU(nn.Module):
    """Griffin's recurrent block: ``[B, L, dims] -> [B, L, dims]``.

    Two branches of ``lru_width`` channels, multiplied, then projected back (RecurrentGemma's
    ``RecurrentBlock``)::

        y   = gelu_tanh(linear_y(u))                              # the gate branch
        x   = conv1d(linear_x(u))                                 # short causal convolution
        r   = sigmoid(a_gate(x)),  i = sigmoid(input_gate(x))     # block-diagonal, per head
        log a = c * r * log sigmoid(Λ)                            # a = sigmoid(Λ) ** (c r)
        h  <- a * h + sqrt(1 - a^2) * (i * x)                     # the RG-LRU
        out = linear_out(h * y)

    The scan is the bundled ``rglru`` recurrence (``h <- a h + x``) on ``a`` and the normalised
    gated input. As in the paper's equations, every step is normalised by ``sqrt(1 - a^2)``
    (RecurrentGemma's code leaves the first token of a document unnormalised).

    Initialisation as in the paper: ``Λ`` such that ``sigmoid(Λ) ** c`` is uniform in
    ``[a_min, a_max] = [0.9, 0.999]``; the gates' blocks uniform in ``±1/sqrt(block width)``
    with zero bias; the convolution as PyTorch's depthwise ``Conv1d`` (uniform in
    ``±1/sqrt(conv_kernel)``); the linears as ``nn.Linear``, with bias.

    Args:
      dims: model width.
      lru_width: the recurrence's width (default ``dims``).
      num_heads: blocks of the gates' block-diagonal weights; must divide ``lru_width``.
      conv_kernel: the short convolution's width.
      c: the constant of ``a = sigmoid(Λ) ** (c r)`` (8).
      backend, schedule: passed to the recurrence (see ``Recurrence``); ``backend="reference"``
        runs the spec's plain per-step MLX loop instead.

    Call ``layer(x, cache=None)`` as ``Mamba2``'s.
    """

    def __init__(self, dims: int, *, lru_width: int | None = None, num_heads: int = 1,
                 conv_kernel: int = 4, c: float = 8.0, a_min: float = 0.9,
                 a_max: float = 0.999, backend: str = "auto", schedule: str = "auto"):
        super().__init__()
        check_options("RGLRU", backend, schedule)
        lru_width = lru_width or dims
        self.dims, self.lru_width, self.c = dims, lru_width, c
        self.backend, self.schedule = backend, schedule
        self.linear_y = nn.Linear(dims, lru_width)
        self.linear_x = nn.Linear(dims, lru_width)
        self.conv1d = ShortConv(lru_width, conv_kernel, bias=True)
        self.a_gate = BlockDiagonalLinear(lru_width, num_heads)
        self.input_gate = BlockDiagonalLinear(lru_width, num_heads)
        self.a_param = lambda_init(lru_width, c, a_min, a_max)
        self.linear_out = nn.Linear(lru_width, dims)
        self._recurrence = load_spec("rglru")

    def make_cache(self) -> RecurrentCache:
        """An empty cache: the conv window ``[B, conv_kernel - 1, lru_width]`` and the state
        ``[B, lru_width]`` after the first call."""
        return RecurrentCache()

    def __call__(self, x, cache: RecurrentCache | None = None):
        check_call("RGLRU", x, self.dims, cache)
        y = nn.gelu_approx(self.linear_y(x))
        xs, window = self.conv1d(self.linear_x(x), cache.conv if cache is not None else None)
        log_a = self.c * mx.sigmoid(self.a_gate(xs)) * -nn.softplus(-self.a_param)
        normalised = xs * mx.sigmoid(self.input_gate(xs)) * mx.sqrt(-mx.expm1(2 * log_a))
        h = scan(self._recurrence, (mx.exp(log_a), normalised), cache, self.backend,
                 self.schedule)
        if cache is not None:
            cache.conv, cache.offset = window, cache.offset + x.shape[1]
        return self.linear_out(h * y)
