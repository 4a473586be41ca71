"""The Gated DeltaNet layer (Yang, Kautz & Hatamizadeh 2024), as in FLA and Qwen3-Next."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .cache import RecurrentCache
from .common import (GatedRMSNorm, ShortConv, a_log_init, check_call, check_options,
                     dt_bias_init, l2_normalize, scan)
from .recurrences import grouped_gated_delta_rule


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet: ``[B, L, dims] -> [B, L, dims]``.

    ``num_heads`` value heads of ``value_head_dim`` channels read ``num_key_heads`` query/key
    heads of ``key_head_dim`` channels, each shared by ``num_heads / num_key_heads`` consecutive
    value heads (FLA's ``num_v_heads``, Qwen3-Next's grouped heads)::

        q, k, v = silu(conv1d(q_proj(u), k_proj(u), v_proj(u)))    # short causal convolution
        q, k    = l2_normalize(q) * key_head_dim ** -0.5, l2_normalize(k)
        beta    = sigmoid(b_proj(u))                                # [B, L, H]
        g       = -exp(A_log) * softplus(a_proj(u) + dt_bias)      # log of the decay
        S      <- exp(g) (I - beta k k^T) S + beta k v^T;  o = S^T q
        out     = o_proj(rms_norm(o) * norm.weight * silu(g_proj(u)))    # norm per head

    The recurrence is ``recurrences.grouped_gated_delta_rule``: the key heads enter through a
    group axis of the spec, never repeated per value head.

    Initialisation as in FLA's ``GatedDeltaNet`` (the paper's code): ``A_log = log(A)`` with
    ``A`` uniform in ``A_init_range`` (``(0, 16]``), ``dt_bias`` as Mamba-2's (the inverse
    softplus of ``dt`` log-uniform in ``[dt_min, dt_max]``, at least ``dt_init_floor``), the
    norm's weight ones, the convolution as PyTorch's depthwise ``Conv1d`` without bias, the
    projections as ``nn.Linear`` without bias.

    Args:
      dims: model width.
      num_heads: value heads (the recurrence's heads).
      key_head_dim, value_head_dim: channels per query/key head and per value head.
      num_key_heads: query/key heads (default ``num_heads``); must divide ``num_heads``.
      conv_kernel: the short convolution's width.
      backend, schedule: passed to the recurrence (see ``Recurrence``); ``backend="reference"``
        runs the spec's plain per-step MLX loop instead.

    Call ``layer(x, cache=None)`` as ``Mamba2``'s.
    """

    def __init__(self, dims: int, *, num_heads: int = 4, key_head_dim: int = 64,
                 value_head_dim: int = 128, num_key_heads: int | None = None,
                 conv_kernel: int = 4, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, A_init_range: tuple = (0.0, 16.0),
                 norm_eps: float = 1e-5, backend: str = "auto", schedule: str = "auto"):
        super().__init__()
        check_options("GatedDeltaNet", backend, schedule)
        num_key_heads = num_key_heads or num_heads
        if num_heads % num_key_heads:
            raise ValueError(f"GatedDeltaNet: num_key_heads {num_key_heads} does not divide "
                             f"num_heads {num_heads}")
        self.dims, self.num_heads, self.num_key_heads = dims, num_heads, num_key_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.backend, self.schedule = backend, schedule
        key_dim, value_dim = num_key_heads * key_head_dim, num_heads * value_head_dim
        self.q_proj = nn.Linear(dims, key_dim, bias=False)
        self.k_proj = nn.Linear(dims, key_dim, bias=False)
        self.v_proj = nn.Linear(dims, value_dim, bias=False)
        self.a_proj = nn.Linear(dims, num_heads, bias=False)
        self.b_proj = nn.Linear(dims, num_heads, bias=False)
        self.g_proj = nn.Linear(dims, value_dim, bias=False)
        self.conv1d = ShortConv(2 * key_dim + value_dim, conv_kernel, bias=False)
        self.A_log = a_log_init(num_heads, *A_init_range)
        self.dt_bias = dt_bias_init(num_heads, dt_min, dt_max, dt_init_floor)
        self.norm = GatedRMSNorm(value_dim, eps=norm_eps, group_size=value_head_dim,
                                 norm_before_gate=True)
        self.o_proj = nn.Linear(value_dim, dims, bias=False)

    def make_cache(self) -> RecurrentCache:
        """An empty cache: the conv window ``[B, conv_kernel - 1, 2 * num_key_heads *
        key_head_dim + num_heads * value_head_dim]`` and the state ``[B, num_heads,
        key_head_dim, value_head_dim]`` after the first call."""
        return RecurrentCache()

    def __call__(self, x, cache: RecurrentCache | None = None):
        check_call("GatedDeltaNet", x, self.dims, cache)
        batch, L, _ = x.shape
        Hk, K, H, V = self.num_key_heads, self.key_head_dim, self.num_heads, self.value_head_dim
        qkv = mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        qkv, window = self.conv1d(qkv, cache.conv if cache is not None else None)
        q, k, v = mx.split(nn.silu(qkv), [Hk * K, 2 * Hk * K], axis=-1)
        q = l2_normalize(q.reshape(batch, L, Hk, K)) * K ** -0.5
        k = l2_normalize(k.reshape(batch, L, Hk, K))
        beta = mx.sigmoid(self.b_proj(x))
        g = -mx.exp(self.A_log) * nn.softplus(self.a_proj(x) + self.dt_bias)
        inputs = (q, k, v.reshape(batch, L, H, V), g, beta)
        o = scan(grouped_gated_delta_rule, inputs, cache, self.backend, self.schedule)
        if cache is not None:
            cache.conv, cache.offset = window, cache.offset + L
        o = self.norm(o.reshape(batch, L, H * V), self.g_proj(x))
        return self.o_proj(o)
