"""The rotational LRU: a damped 2-D rotation per channel.

    (u, w) <- a * (cos * u - sin * w) + x0,  a * (sin * u + cos * w) + x1
    y       = (u, w)

a, cos, sin: [B, L, P], x: [B, L, P, 2] (pairs). State [B, P, 2]; one lane per pair.
"""

import mlx_recgen as rg


@rg.recurrence(lane="P", state={"h": "B P 2"},
               inputs={"a": "B L P", "cos": "B L P", "sin": "B L P", "x": "B L P 2"},
               outputs={"y": "B L P 2"})
def rotlru(h, a, cos, sin, x):
    u, w = h[0], h[1]
    h[0] = a * (cos * u - sin * w) + x[0]
    h[1] = a * (sin * u + cos * w) + x[1]
    return {"y": (h[0], h[1])}
