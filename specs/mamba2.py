"""Mamba-2's SSD layer (Dao & Gu 2024): a scalar decay per head, with the D skip.

    h[p, n] <- exp(dt * A) * h[p, n] + dt * B[n] * x[p]
    y[p]     = sum_n C[n] * h[p, n] + D * x[p]

x: [B, L, H, P], dt: [B, L, H] (the step after its softplus), A: [H] (negative for decay),
B, C: [B, L, H, N], D: [H]. State [B, H, P, N]; one lane per head channel p. Mamba-2 shares B
and C across a group of heads; here they are given per head (repeat a group's B and C over its
heads: their gradients then come back per head, to be summed over the group).
"""

import mlx_recgen as rg
from mlx_recgen import Sum, exp


@rg.recurrence(lane="P", state={"h": "B H P N"},
               inputs={"x": "B L H P", "dt": "B L H", "A": "H", "B": "B L H N",
                       "C": "B L H N", "D": "H"},
               outputs={"y": "B L H P"})
def mamba2(h, x, dt, A, B, C, D, n):
    h[n] = exp(dt * A) * h[n] + dt * B[n] * x
    return {"y": Sum(C[n] * h[n], n) + D * x}
