"""The Gated Linear Attention layer (Yang, Wang, Shen, Panda & Kim 2024)."""

from __future__ import annotations

import mlx.nn as nn

from .cache import RecurrentCache
from .common import GatedRMSNorm, check_call, check_options, scan
from .recurrences import gated_linear_attention


class GLA(nn.Module):
    """Gated linear attention: ``[B, L, dims] -> [B, L, dims]``.

    ``num_heads`` heads of ``K = expand_k * dims / num_heads`` key and ``V = expand_v * dims /
    num_heads`` value channels, with a data-dependent gate per key channel from a low-rank
    projection (the paper's ``alpha = sigmoid(u W1 W2 + b) ** (1 / tau)``, kept in log space)::

        q, k, v = q_proj(u) * K ** -0.5, k_proj(u), v_proj(u)
        gk      = log_sigmoid(gk_proj(u)) / gate_logit_normalizer      # [B, L, H, K]
        S[i, j] <- exp(gk[i]) S[i, j] + k[i] v[j];  o[j] = sum_i q[i] S[i, j]
        out     = o_proj(rms_norm(o) * norm.weight * silu(g_proj(u)))  # norm per head

    ``gk_proj`` is ``Linear(dims, gate_low_rank_dim, bias=False)`` then ``Linear(
    gate_low_rank_dim, H * K)`` with bias. The output normalisation is an RMS norm per head (the
    paper's LayerNorm, as in FLA's ``GatedLinearAttention``). No short convolution: the cache
    carries only the state. The recurrence is ``recurrences.gated_linear_attention``.

    Initialisation: the projections as ``nn.Linear`` (uniform in ``±1/sqrt(fan_in)``), the
    norm's weight ones.

    Args:
      dims: model width.
      num_heads: heads.
      expand_k, expand_v: key and value width over ``dims`` (the paper: 0.5 and 1).
      gate_low_rank_dim: the rank of the gate projection (16).
      gate_logit_normalizer: ``tau`` (16).
      backend, schedule: passed to the recurrence (see ``Recurrence``); ``backend="reference"``
        runs the spec's plain per-step MLX loop instead.

    Call ``layer(x, cache=None)`` as ``Mamba2``'s.
    """

    def __init__(self, dims: int, *, num_heads: int = 4, expand_k: float = 0.5,
                 expand_v: float = 1.0, gate_low_rank_dim: int = 16,
                 gate_logit_normalizer: float = 16.0, norm_eps: float = 1e-5,
                 backend: str = "auto", schedule: str = "auto"):
        super().__init__()
        check_options("GLA", backend, schedule)
        key_dim, value_dim = int(dims * expand_k), int(dims * expand_v)
        if key_dim % num_heads or value_dim % num_heads or not key_dim or not value_dim:
            raise ValueError(f"GLA: num_heads {num_heads} must divide the key width {key_dim} "
                             f"and the value width {value_dim}")
        self.dims, self.num_heads = dims, num_heads
        self.key_head_dim, self.value_head_dim = key_dim // num_heads, value_dim // num_heads
        self.gate_logit_normalizer = gate_logit_normalizer
        self.backend, self.schedule = backend, schedule
        self.q_proj = nn.Linear(dims, key_dim, bias=False)
        self.k_proj = nn.Linear(dims, key_dim, bias=False)
        self.v_proj = nn.Linear(dims, value_dim, bias=False)
        self.g_proj = nn.Linear(dims, value_dim, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(dims, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, key_dim, bias=True))
        self.norm = GatedRMSNorm(value_dim, eps=norm_eps, group_size=self.value_head_dim,
                                 norm_before_gate=True)
        self.o_proj = nn.Linear(value_dim, dims, bias=False)

    def make_cache(self) -> RecurrentCache:
        """An empty cache: the state ``[B, num_heads, K, V]`` after the first call."""
        return RecurrentCache()

    def __call__(self, x, cache: RecurrentCache | None = None):
        check_call("GLA", x, self.dims, cache)
        batch, L, _ = x.shape
        H, K, V = self.num_heads, self.key_head_dim, self.value_head_dim
        q = self.q_proj(x).reshape(batch, L, H, K) * K ** -0.5
        k = self.k_proj(x).reshape(batch, L, H, K)
        v = self.v_proj(x).reshape(batch, L, H, V)
        gk = nn.log_sigmoid(self.gk_proj(x)).reshape(batch, L, H, K) / self.gate_logit_normalizer
        o = scan(gated_linear_attention, (q, k, v, gk), cache, self.backend, self.schedule)
        if cache is not None:
            cache.offset += L
        return self.o_proj(self.norm(o.reshape(batch, L, H * V), self.g_proj(x)))
