"""The recurrences of the layers that no bundled spec states as the layer needs it.

The bundled ``gated_deltanet`` has a key head per value head and the bundled ``gla`` a scalar
gate per head; Gated DeltaNet layers share key heads among value heads (Qwen3-Next, FLA's
``num_v_heads``), and the GLA paper gates every key channel. ``Mamba2`` and ``RGLRU`` run the
bundled ``mamba2`` and ``rglru``.
"""

from __future__ import annotations

from .. import recurrence
from ..functions import exp
from ..spec import Sum


@recurrence(lane="V", state={"S": "B H K V"},
            inputs={"q": "B L Hk K", "k": "B L Hk K", "v": "B L H V", "g": "B L H",
                    "beta": "B L H"},
            outputs={"o": "B L H V"}, groups={"Hk": "H"})
def grouped_gated_delta_rule(S, q, k, v, g, beta, i):
    """Gated DeltaNet's delta rule (Yang, Kautz & Hatamizadeh 2024) with grouped key heads:

        S <- exp(g) (I - beta k k^T) S + beta k v^T;   o = S^T q   (the updated state)

    q, k: [B, L, Hk, K], one key head for each H / Hk consecutive value heads; v: [B, L, H, V];
    g (the log of the decay), beta: [B, L, H]. State [B, H, K, V]; one lane per value channel.
    """
    alpha = exp(g)
    r = Sum(k[i] * S[i], i)  # k^T S, read before the write
    S[i] = alpha * S[i] + beta * (v - alpha * r) * k[i]
    return {"o": Sum(q[i] * S[i], i)}


@recurrence(lane="V", state={"S": "B H K V"},
            inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "gk": "B L H K"},
            outputs={"o": "B L H V"})
def gated_linear_attention(S, q, k, v, gk, i):
    """GLA (Yang et al. 2024) with a gate per key channel, in log space:

        S[i, j] <- exp(gk[i]) S[i, j] + k[i] v[j];   o[j] = sum_i q[i] S[i, j]

    q, k, gk: [B, L, H, K], v: [B, L, H, V]. State [B, H, K, V]; one lane per value channel.
    """
    S[i] = exp(gk[i]) * S[i] + k[i] * v
    return {"o": Sum(q[i] * S[i], i)}
