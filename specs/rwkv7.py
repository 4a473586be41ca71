"""RWKV-7 (Goose, Peng et al. 2025): a diagonal-plus-rank-one transition with decay.

    S <- (diag(exp(w)) + b a^T) S + k v^T
    o  = S^T r

o reads the updated state. The paper's transition, in its transposed layout, is
diag(w_t) - kappa^T (a_t * kappa): here a = -kappa and b = kappa * a_t
(flash-linear-attention's form), and w is the log of the decay. Per value channel j:

    S[i, j] <- exp(w[i]) S[i, j] + b[i] sum_i' a[i'] S[i', j] + k[i] v[j]

r, w, k, a, b: [B, L, H, K], v: [B, L, H, V]. State [B, H, K, V]; one lane per value channel.
"""

import mlx_recgen as rg
from mlx_recgen import Sum, exp


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"r": "B L H K", "w": "B L H K", "k": "B L H K", "v": "B L H V",
                       "a": "B L H K", "b": "B L H K"},
               outputs={"o": "B L H V"})
def rwkv7(S, r, w, k, v, a, b, i):
    sa = Sum(a[i] * S[i], i)  # a^T S, read before the write
    S[i] = exp(w[i]) * S[i] + b[i] * sa + k[i] * v
    return {"o": Sum(r[i] * S[i], i)}
