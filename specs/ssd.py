"""SSD, Mamba-2's head-wise selective state space scan.

    h[p, n] <- exp(delta * A[n]) * h[p, n] + delta * B[n] * u[p]
    y[p]     = sum_n C[n] * h[p, n]

u: [B, L, H, P], delta: [B, L, H], B, C: [B, L, H, N], A: [H, N] (negative for decay).
State [B, H, P, N]; one lane per head channel p.
"""

import mlx_recgen as rg
from mlx_recgen import Sum, exp


@rg.recurrence(lane="P", state={"h": "B H P N"},
               inputs={"u": "B L H P", "delta": "B L H", "B": "B L H N", "C": "B L H N",
                       "A": "H N"},
               outputs={"y": "B L H P"})
def ssd(h, u, delta, B, C, A, n):
    h[n] = exp(delta * A[n]) * h[n] + delta * B[n] * u
    return {"y": Sum(C[n] * h[n], n)}
