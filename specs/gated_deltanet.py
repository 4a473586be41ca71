"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024): the delta rule with a decay per head.

    S <- exp(g) (I - beta k k^T) S + beta k v^T
    o  = S^T q

with the decay alpha = exp(g); o reads the updated state. Per value channel j:

    S[i, j] <- alpha S[i, j] + beta (v[j] - alpha sum_i' k[i'] S[i', j]) k[i]

q, k: [B, L, H, K], v: [B, L, H, V], g (log of the decay), beta: [B, L, H]. State
[B, H, K, V]; one lane per value channel j.
"""

import mlx_recgen as rg
from mlx_recgen import Sum, exp


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "g": "B L H",
                       "beta": "B L H"},
               outputs={"o": "B L H V"})
def gated_deltanet(S, q, k, v, g, beta, i):
    alpha = exp(g)
    r = Sum(k[i] * S[i], i)  # k^T S, read before the write
    S[i] = alpha * S[i] + beta * (v - alpha * r) * k[i]
    return {"o": Sum(q[i] * S[i], i)}
