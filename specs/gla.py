"""GLA, gated linear attention with a scalar gate per head and step.

    S[i, j] <- g * S[i, j] + k[i] * v[j]
    o[j]     = sum_i q[i] * S[i, j]            (the updated state)

q, k: [B, L, H, K], v: [B, L, H, V], g: [B, L, H]. State [B, H, K, V]; one lane per value
channel j; K and V may differ.
"""

import mlx_recgen as rg
from mlx_recgen import Sum


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "g": "B L H"},
               outputs={"o": "B L H V"})
def gla(S, q, k, v, g, i):
    S[i] = g * S[i] + k[i] * v
    return {"o": Sum(q[i] * S[i], i)}
