"""Mamba-1's selective scan (S6, Gu & Dao 2023), with the D skip.

    h[d, n] <- exp(delta[d] * A[d, n]) * h[d, n] + delta[d] * B[n] * u[d]
    y[d]     = sum_n C[n] * h[d, n] + D[d] * u[d]

The paper's discretisation: zero-order hold for A (A_bar = exp(delta A)) and the simplified
delta * B for B. u, delta: [B, L, D] (delta is the step after its softplus), A: [D, N] (negative
for decay), B, C: [B, L, N] shared by all channels, D: [D]. State [B, D, N]; one lane per
channel d. The gate y * silu(z) of a Mamba block is outside the scan.
"""

import mlx_recgen as rg
from mlx_recgen import Sum, exp


@rg.recurrence(lane="D", state={"h": "B D N"},
               inputs={"u": "B L D", "delta": "B L D", "A": "D N", "B": "B L N", "C": "B L N",
                       "D": "D"},
               outputs={"y": "B L D"})
def mamba1(h, u, delta, A, B, C, D, n):
    h[n] = exp(delta * A[n]) * h[n] + delta * B[n] * u
    return {"y": Sum(C[n] * h[n], n) + D * u}
