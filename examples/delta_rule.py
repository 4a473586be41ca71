"""A delta-rule recurrence from a spec: forward, state, gradients, and the generated Metal.

    python examples/delta_rule.py [OUTPUT_DIR]

writes the forward and backward Metal kernels, whole, to ``OUTPUT_DIR`` (default: the current
directory) as ``delta_rule_forward.metal`` and ``delta_rule_backward.metal``.
"""

import sys
from pathlib import Path

import mlx.core as mx

import mlx_recgen as rg


@rg.recurrence(lane="P", state={"h": "B P N"},
               inputs={"q": "B L N", "k": "B L N", "v": "B L P", "beta": "B L"},
               outputs={"y": "B L P"})
def delta_rule(h, q, k, v, beta, n):
    r = rg.Sum(k[n] * h[n], n)
    h[n] = h[n] + rg.sigmoid(beta) * (v - r) * k[n]
    return {"y": rg.Sum(q[n] * h[n], n)}


if __name__ == "__main__":
    B, L, P, N = 2, 64, 32, 16
    q, k = (mx.random.normal((B, L, N)) / 4 for _ in range(2))
    v, beta = mx.random.normal((B, L, P)), mx.random.normal((B, L))
    y, h = delta_rule(q, k, v, beta, return_state=True)
    grads = mx.grad(lambda *a: delta_rule(*a).sum(), argnums=(0, 1, 2, 3))(q, k, v, beta)
    print("y", y.shape, "state", h.shape, "grads", [g.shape for g in grads])
    print(delta_rule.adjoint_ir())
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    for kernel in ("forward", "backward"):
        path = out_dir / f"delta_rule_{kernel}.metal"
        text = delta_rule.source(kernel, backend="metal")
        path.write_text(text)
        print(f"{kernel} kernel: {path} ({len(text.splitlines())} lines of Metal)")
