"""S4D (Gu et al. 2022), a diagonal complex state space model, zero-order-hold discretised.

    h[n] <- dA[n] h[n] + dB[n] u
    y     = 2 Re(sum_n C[n] h[n]) + D u

in complex numbers, per channel d and state n, with A = -exp(log_A_real) + i A_imag,
dA = exp(dt A), dB = (dA - 1) / A and dt = exp(log_dt): the recurrent view of S4D's
convolution kernel K_l = 2 Re(sum_n C[n] dB[n] dA[n]^l). u: [B, L, D], log_dt, D: [D],
log_A_real, A_imag: [D, N], C: [D, N, 2] (re, im). State [B, D, N, 2]; one lane per channel d.
"""

import mlx_recgen as rg
from mlx_recgen import Sum, cos, exp, sin


@rg.recurrence(lane="D", state={"h": "B D N 2"},
               inputs={"u": "B L D", "log_dt": "D", "log_A_real": "D N", "A_imag": "D N",
                       "C": "D N 2", "D": "D"},
               outputs={"y": "B L D"})
def s4d(h, u, log_dt, log_A_real, A_imag, C, D, n):
    dt = exp(log_dt)
    ar, ai = -exp(log_A_real[n]), A_imag[n]
    mag = exp(dt * ar)
    dar, dai = mag * cos(dt * ai), mag * sin(dt * ai)
    den = ar * ar + ai * ai  # (dA - 1) / A = (dA - 1) conj(A) / |A|^2
    dbr = ((dar - 1) * ar + dai * ai) / den
    dbi = (dai * ar - (dar - 1) * ai) / den
    re, im = h[n, 0], h[n, 1]
    h[n, 0] = dar * re - dai * im + dbr * u
    h[n, 1] = dar * im + dai * re + dbi * u
    return {"y": 2 * Sum(C[n, 0] * h[n, 0] - C[n, 1] * h[n, 1], n) + D * u}
