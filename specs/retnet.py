"""RetNet's retention, recurrent form (Sun et al. 2023): a fixed decay per head.

    S <- gamma S + k v^T
    o  = S^T q

o reads the updated state. q, k: [B, L, H, K], v: [B, L, H, V], gamma: [H] (the paper uses
1 - 2^(-5 - h)). State [B, H, K, V]; one lane per value channel.
"""

import mlx_recgen as rg
from mlx_recgen import Sum


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "gamma": "H"},
               outputs={"o": "B L H V"})
def retnet(S, q, k, v, gamma, i):
    S[i] = gamma * S[i] + k[i] * v
    return {"o": Sum(q[i] * S[i], i)}
