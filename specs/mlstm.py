"""mLSTM, the matrix-memory cell of xLSTM (Beck et al. 2024), in its stabilised form.

    m <- max(log f + m, i~)
    C <- f' C + i' k v^T
    n <- f' n + i' k
    h  = C^T q / max(|n^T q|, exp(-m))

with log f = log sigmoid(f~), f' = exp(log f + m_old - m) and i' = exp(i~ - m): the stabilised
twin of

    C <- f C + i k v^T,   n <- f n + i k,   h = C^T q / max(|n^T q|, 1),   i = exp(i~),
    f = sigmoid(f~)

(the same h: C and n carry a factor exp(-m)). q, k: [B, L, H, K] (k already scaled by
1/sqrt(K)), v: [B, L, H, V], i~, f~ (the gates' pre-activations): [B, L, H]. States:
C [B, H, K, V]; the normaliser n [B, H, K] and the stabiliser m [B, H] are per head, as in the
paper: states without the lane axis, shared by the head's value channels. One lane per value
channel.
"""

import mlx_recgen as rg
from mlx_recgen import Sum, abs, exp, maximum, softplus


@rg.recurrence(lane="V", state={"C": "B H K V", "n": "B H K", "m": "B H"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "igate": "B L H",
                       "fgate": "B L H"},
               outputs={"h": "B L H V"})
def mlstm(C, n, m, q, k, v, igate, fgate, j):
    log_f = -softplus(-fgate)
    m_new = maximum(log_f + m, igate)
    f = exp(log_f + m - m_new)
    i = exp(igate - m_new)
    C[j] = f * C[j] + i * k[j] * v
    n[j] = f * n[j] + i * k[j]
    m = m_new
    return {"h": Sum(q[j] * C[j], j) / maximum(abs(Sum(q[j] * n[j], j)), exp(-m))}
