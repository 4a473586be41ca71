"""Mamba-2's mixer (Dao & Gu 2024) on the bundled ``mamba2`` recurrence."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..specs import load_spec
from .cache import RecurrentCache
from .common import (GatedRMSNorm, ShortConv, a_log_init, check_call, check_options,
                     dt_bias_init, scan)


class Mamba2(nn.Module):
    """The Mamba-2 mixer: ``[B, L, dims] -> [B, L, dims]``.

    With ``d_inner = expand * dims`` channels in ``H = d_inner / head_dim`` heads and ``B`` and
    ``C`` shared by the heads of each of ``n_groups`` groups (as in the reference
    implementation, ``mamba_ssm``'s ``Mamba2``)::

        z, xBC, dt = in_proj(u)                      # xBC = (x, B, C)
        x, B, C    = silu(conv1d(xBC))               # short causal depthwise convolution
        dt         = clip(softplus(dt + dt_bias), *time_step_limit)       # [B, L, H]
        h[p, n]   <- exp(dt * A) h[p, n] + dt * B[n] * x[p],  A = -exp(A_log)
        y[p]       = sum_n C[n] h[p, n] + D * x[p]
        out        = out_proj(rms_norm(y * silu(z)) * norm.weight)   # per group of channels

    The scan is the bundled ``mamba2`` recurrence: ``B`` and ``C`` enter per group (a group
    axis of the spec), never repeated per head.

    Initialisation as in ``mamba_ssm``: ``dt_bias`` the inverse softplus of ``dt`` log-uniform
    in ``[dt_min, dt_max]`` (at least ``dt_init_floor``), ``A_log = log(A)`` with ``A`` uniform
    in ``A_init_range``, ``D`` and the norm's weight ones, the convolution as PyTorch's depthwise
    ``Conv1d`` (uniform in ``±1/sqrt(conv_kernel)``, bias likewise), the projections as
    ``nn.Linear`` (uniform in ``±1/sqrt(fan_in)``) without bias.

    Args:
      dims: model width.
      state_size: ``N``, the state per head channel.
      head_dim: ``P``, channels per head.
      expand: ``d_inner / dims``.
      n_groups: groups of heads sharing ``B`` and ``C``; must divide the number of heads.
      conv_kernel: the short convolution's width.
      time_step_limit: ``(min, max)`` for ``dt`` after its softplus.
      backend, schedule: passed to the recurrence (see ``Recurrence``); ``backend="reference"``
        runs the spec's plain per-step MLX loop instead.

    Call ``layer(x, cache=None)``: without a cache the whole sequence from a zero state; with a
    ``RecurrentCache`` (``make_cache()``) the sequence continues from the cache, which is
    updated (chunked prefill, and decoding with ``L == 1``).
    """

    def __init__(self, dims: int, *, state_size: int = 64, head_dim: int = 64,
                 expand: int = 2, n_groups: int = 1, conv_kernel: int = 4,
                 time_step_limit: tuple = (0.0, math.inf), dt_min: float = 0.001,
                 dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 A_init_range: tuple = (1.0, 16.0), norm_eps: float = 1e-5,
                 backend: str = "auto", schedule: str = "auto"):
        super().__init__()
        check_options("Mamba2", backend, schedule)
        d_inner = expand * dims
        if d_inner % head_dim:
            raise ValueError(f"Mamba2: head_dim {head_dim} does not divide expand * dims = "
                             f"{d_inner}")
        n_heads = d_inner // head_dim
        if n_heads % n_groups:
            raise ValueError(f"Mamba2: n_groups {n_groups} does not divide the {n_heads} heads")
        self.dims, self.d_inner, self.n_heads, self.head_dim = dims, d_inner, n_heads, head_dim
        self.n_groups, self.state_size = n_groups, state_size
        self.dt_low, self.dt_high = (float(v) for v in time_step_limit)
        self.backend, self.schedule = backend, schedule

        conv_channels = d_inner + 2 * n_groups * state_size
        self.in_proj = nn.Linear(dims, d_inner + conv_channels + n_heads, bias=False)
        self.conv1d = ShortConv(conv_channels, conv_kernel, bias=True)
        self.dt_bias = dt_bias_init(n_heads, dt_min, dt_max, dt_init_floor)
        self.A_log = a_log_init(n_heads, *A_init_range)
        self.D = mx.ones((n_heads,))
        self.norm = GatedRMSNorm(d_inner, eps=norm_eps, group_size=d_inner // n_groups)
        self.out_proj = nn.Linear(d_inner, dims, bias=False)
        self._recurrence = load_spec("mamba2")

    def make_cache(self) -> RecurrentCache:
        """An empty cache: the conv window ``[B, conv_kernel - 1, d_inner + 2 * n_groups *
        state_size]`` and the state ``[B, H, head_dim, state_size]`` after the first call."""
        return RecurrentCache()

    def __call__(self, x, cache: RecurrentCache | None = None):
        check_call("Mamba2", x, self.dims, cache)
        batch, L, _ = x.shape
        H, P, G, N = self.n_heads, self.head_dim, self.n_groups, self.state_size
        z, xBC, dt = mx.split(self.in_proj(x), [self.d_inner, 2 * self.d_inner + 2 * G * N],
                              axis=-1)
        xBC, window = self.conv1d(xBC, cache.conv if cache is not None else None)
        xs, Bs, Cs = mx.split(nn.silu(xBC), [self.d_inner, self.d_inner + G * N], axis=-1)
        dt = mx.clip(nn.softplus(dt + self.dt_bias), self.dt_low, self.dt_high)
        inputs = (xs.reshape(batch, L, H, P), dt, -mx.exp(self.A_log),
                  Bs.reshape(batch, L, G, N), Cs.reshape(batch, L, G, N), self.D)
        y = scan(self._recurrence, inputs, cache, self.backend, self.schedule)
        if cache is not None:
            cache.conv, cache.offset = window, cache.offset + L
        return self.out_proj(self.norm(y.reshape(batch, L, self.d_inner), z))
