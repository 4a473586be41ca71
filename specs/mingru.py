"""minGRU (Feng et al. 2024, "Were RNNs All We Needed?").

    z  = sigmoid(k)
    h <- (1 - z) * h + z * h~
    y  = h

k (the gate's pre-activation), h~ (the candidate), both linear in the input x_t: [B, L, D].
State [B, D]; one lane per channel.
"""

import mlx_recgen as rg
from mlx_recgen import sigmoid


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"k": "B L D", "htilde": "B L D"},
               outputs={"y": "B L D"})
def mingru(h, k, htilde):
    z = sigmoid(k)
    h = (1 - z) * h + z * htilde
    return {"y": h}
