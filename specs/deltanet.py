"""DeltaNet, linear attention with the delta rule (Schlag et al. 2021; Yang et al. 2024).

    S <- (I - beta k k^T) S + beta k v^T
    o  = S^T q

that is S <- S - beta k (k^T S - v^T); o reads the updated state. Per value channel j:

    S[i, j] <- S[i, j] + beta (v[j] - sum_i' k[i'] S[i', j]) k[i]

q, k: [B, L, H, K], v: [B, L, H, V], beta: [B, L, H]. State [B, H, K, V] (K by V, as in
flash-linear-attention); one lane per value channel j.
"""

import mlx_recgen as rg
from mlx_recgen import Sum


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "beta": "B L H"},
               outputs={"o": "B L H V"})
def deltanet(S, q, k, v, beta, i):
    r = Sum(k[i] * S[i], i)  # k^T S, read before the write
    S[i] = S[i] + beta * (v - r) * k[i]
    return {"o": Sum(q[i] * S[i], i)}
