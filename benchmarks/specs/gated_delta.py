"""Gated DeltaNet, the gated delta rule (Yang et al. 2024).

    S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,    o_t = S_t q_t

With S [V, K] and one lane per row j (a value channel), row j updates as
    S[j, :] <- alpha S[j, :] + beta (v[j] - alpha <S[j, :], k>) k
q, k: [B, L, H, K], v: [B, L, H, V], alpha, beta: [B, L, H]. State [B, H, K, V].
"""

import mlx_recgen as rg
from mlx_recgen import Sum


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "alpha": "B L H",
                       "beta": "B L H"},
               outputs={"o": "B L H V"})
def gated_delta(S, q, k, v, alpha, beta, i):
    r = Sum(k[i] * S[i], i)  # <S[j, :], k> of the old state
    S[i] = alpha * S[i] + beta * (v - alpha * r) * k[i]
    return {"o": Sum(q[i] * S[i], i)}
