"""HGRN2 (Qin et al. 2024): a gated linear RNN with outer-product state expansion.

    S <- diag(f) S + (1 - f) i^T
    o  = S^T q

o reads the updated state; f is the forget gate (in (0, 1) in the paper), 1 - f the input key,
i the input and q the output gate. q, f: [B, L, H, K], i: [B, L, H, V]. State [B, H, K, V];
one lane per value channel.
"""

import mlx_recgen as rg
from mlx_recgen import Sum


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "f": "B L H K", "i": "B L H V"},
               outputs={"o": "B L H V"})
def hgrn2(S, q, f, i, n):
    S[n] = f[n] * S[n] + (1 - f[n]) * i
    return {"o": Sum(q[n] * S[n], n)}
