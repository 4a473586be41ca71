"""RWKV-6 (Finch, Peng et al. 2024): the WKV recurrence with data-dependent decay and a bonus.

    o  = r^T (S + diag(u) k v^T)
    S <- diag(exp(w)) S + k v^T

o reads the state before the update. The paper's decay is exp(-exp(omega)) per key channel;
w = -exp(omega) is its log, as in flash-linear-attention. r, k, w: [B, L, H, K],
v: [B, L, H, V], u (the bonus of the current token): [H, K]. State [B, H, K, V]; one lane per
value channel.
"""

import mlx_recgen as rg
from mlx_recgen import Sum, exp


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"r": "B L H K", "k": "B L H K", "v": "B L H V", "w": "B L H K",
                       "u": "H K"},
               outputs={"o": "B L H V"})
def rwkv6(S, r, k, v, w, u, i):
    o = Sum(r[i] * (S[i] + u[i] * k[i] * v), i)
    S[i] = exp(w[i]) * S[i] + k[i] * v
    return {"o": o}
