"""RG-LRU's diagonal linear recurrence (the scan of Griffin's real-gated LRU).

    h <- a * h + x
    y  = h

a, x: [B, L, D]; any real a. State [B, D]; one lane per channel.
"""

import mlx_recgen as rg


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
               outputs={"y": "B L D"})
def rglru(h, a, x):
    h = a * h + x
    return {"y": h}
