"""A diagonal recurrence whose step size is clamped before it feeds the decay.

    d = min(max(softplus(dt), 0.001), 0.1)
    h <- exp(-d exp(A)) h + d x,   y = h

dt, x: [B, L, D], A: [D]. State [B, D]; one lane per channel.
"""

import mlx_recgen as rg


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"dt": "B L D", "x": "B L D", "A": "D"},
               outputs={"y": "B L D"})
def clamp(h, dt, x, A):
    d = rg.minimum(rg.maximum(rg.softplus(dt), 0.001), 0.1)
    h = rg.exp(-d * rg.exp(A)) * h + d * x
    return {"y": h}
