"""The stabilised mLSTM cell (Beck et al. 2024, xLSTM), one lane per value channel.

    m' = max(log f + m, log i)          (log f = -softplus(-f~): a log-sigmoid forget gate)
    i' = exp(log i - m'),  f' = exp(log f + m - m')
    C' = f' C + i' v k^T,  n' = f' n + i' k
    h  = C' q / max(|n'^T q|, exp(-m'))

q, k: [B, L, H, K], v: [B, L, H, V], ipre (log i), fpre (f~): [B, L, H]. States: C [B, H, K, V];
the normaliser n and the stabiliser m are the same for every value channel and kept per lane
(n as [B, H, K, V], m as [B, H, V]).
"""

import mlx_recgen as rg
from mlx_recgen import Sum


@rg.recurrence(lane="V", state={"C": "B H K V", "nrm": "B H K V", "m": "B H V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "ipre": "B L H",
                       "fpre": "B L H"},
               outputs={"h": "B L H V"})
def mlstm(C, nrm, m, q, k, v, ipre, fpre, i):
    logf = -rg.softplus(-fpre)
    m_new = rg.maximum(logf + m, ipre)
    ig = rg.exp(ipre - m_new)
    fg = rg.exp(logf + m - m_new)
    C[i] = fg * C[i] + ig * v * k[i]
    nrm[i] = fg * nrm[i] + ig * k[i]
    m = m_new
    den = rg.maximum(rg.abs(Sum(nrm[i] * q[i], i)), rg.exp(-m))
    return {"h": Sum(C[i] * q[i], i) / den}
