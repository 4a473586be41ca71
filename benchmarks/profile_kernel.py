"""One forward+backward of gated DeltaNet on the ``cuda`` backend (sequential schedule), to run
under Nsight Compute:

    ncu --kernel-name regex:backward --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python benchmarks/profile_kernel.py

(the first launch compiles and warms up; the second is profiled).
"""

import mlx.core as mx
import numpy as np

from bench_peers import gated_delta, make_inputs

shape = dict(B=3, L=2048, H=12, K=64, V=64)
xs = [mx.array(x) for x in make_inputs("gated_delta", shape, np.random.default_rng(0))]
w = mx.random.normal((3, 2048, 12, 64))
grad = mx.grad(lambda *a: mx.sum(gated_delta(*a, backend="cuda", schedule="sequential") * w),
               argnums=tuple(range(5)))
for _ in range(2):
    mx.eval(grad(*xs))
    mx.synchronize()
