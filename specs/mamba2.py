"""Mamba-2's SSD layer (Dao & Gu 2024): a scalar decay per head, with the D skip.

    h[p, n] <- exp(dt * A) * h[p, n] + dt * B[n] * x[p]
    y[p]     = sum_n C[n] * h[p, n] + D * x[p]

x: [B, L, H, P], dt: [B, L, H] (the step after its softplus), A: [H] (negative for decay),
B, C: [B, L, G, N] shared by the H / G heads of each group (Mamba-2's n_groups; G = H gives a
B and C per head), D: [H]. State [B, H, P, N]; one lane per head channel p.
"""

import mlx_recgen as rg
from mlx_recgen import Sum, exp


@rg.recurrence(lane="P", state={"h": "B H P N"},
               inputs={"x": "B L H P", "dt": "B L H", "A": "H", "B": "B L G N",
                       "C": "B L G N", "D": "H"},
               outputs={"y": "B L H P"}, groups={"G": "H"})
def mamba2(h, x, dt, A, B, C, D, n):
    h[n] = exp(dt * A) * h[n] + dt * B[n] * x
    return {"y": Sum(C[n] * h[n], n) + D * x}
