"""The LRU, a complex diagonal linear recurrence (Orvieto et al. 2023).

    h <- lambda * h + gamma * bx
    y  = h

in complex numbers, exponentially parametrised and normalised:
lambda = exp(-exp(nu_log) + i exp(theta_log)), gamma = sqrt(1 - |lambda|^2). bx (B x_t, the
complex input projection, as (re, im) pairs): [B, L, D, 2]; nu_log, theta_log: [D]. State
[B, D, 2] (re, im); one lane per channel. The readout Re(C h) + D x is outside.
"""

import mlx_recgen as rg
from mlx_recgen import cos, exp, sin, sqrt


@rg.recurrence(lane="D", state={"h": "B D 2"},
               inputs={"bx": "B L D 2", "nu_log": "D", "theta_log": "D"},
               outputs={"y": "B L D 2"})
def complex_lru(h, bx, nu_log, theta_log):
    mag = exp(-exp(nu_log))
    theta = exp(theta_log)
    lr, li = mag * cos(theta), mag * sin(theta)
    gamma = sqrt(1 - mag * mag)
    re, im = h[0], h[1]
    h[0] = lr * re - li * im + gamma * bx[0]
    h[1] = lr * im + li * re + gamma * bx[1]
    return {"y": (h[0], h[1])}
