"""The scan schedule's forward kernel alone, without MLX: RG-LRU's CUDA text as the renderer
emits it for one shape, wrapped in a standalone program that times it with CUDA events, checks
lanes against a loop on the host and measures the device's copy bandwidth beside it.

    python benchmarks/bench_scan_kernel.py --out /tmp/scan-kernel      # writes .cu files
    cd /tmp/scan-kernel && for f in *.cu; do nvcc -O3 -std=c++17 -arch=sm_90 $f -o ${f%.cu}; done
    ./rglru_forward_float32 && ./rglru_forward_bfloat16                 # on the GPU machine

``nvcc -Xptxas -v`` gives the registers a thread; ``ncu --clock-control none --kernel-name
scan_forward`` the issue rate and memory throughput. The schedule's constants (stretch, group,
lane block, run) are those ``schedule.make_scan_schedule`` picks for the shape.
"""

from __future__ import annotations

import argparse
import pathlib
import re

import mlx.core as mx

import mlx_recgen as rg
from mlx_recgen.backends.kernels import kernel_source
from mlx_recgen.backends.mlx_source import without_mlx_header
from mlx_recgen.schedule import make_scan_schedule, scan_run

C_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}

HARNESS = r'''
#include <cstdio>
#include <cmath>
#include <cstdlib>
template <typename T> __global__ void fill(T* p, int64_t n, float lo, float hi, unsigned seed) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) {
    unsigned h = unsigned(i * 2654435761u) ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = T(lo + (hi - lo) * ((h & 0xffffff) / 16777216.0f));
  }
}
int main() {
  using T = @CTYPE@;
  const int64_t B = @B@, L = @L@, D = @D@, LB = @LB@, TG = @TG@, STRETCH = @STRETCH@;
  const int64_t n = B * L * D, gpi = (D + LB - 1) / LB, segments = (L + STRETCH - 1) / STRETCH;
  T *a, *x, *y; float *h0, *hf, *ck; int64_t* meta;
  cudaMalloc(&a, n * sizeof(T)); cudaMalloc(&x, n * sizeof(T)); cudaMalloc(&y, n * sizeof(T));
  cudaMalloc(&h0, B * D * 4); cudaMalloc(&hf, B * D * 4); cudaMalloc(&ck, segments * B * D * 4);
  // L, instances, lanes, groups per instance, segments, B; strides of a, x, y (B, L, D); of h (B, D)
  const int64_t host_meta[17] = {L, B, D, gpi, segments, B, L * D, D, 1, L * D, D, 1,
                                 L * D, D, 1, D, 1};
  cudaMalloc(&meta, sizeof(host_meta));
  cudaMemcpy(meta, host_meta, sizeof(host_meta), cudaMemcpyHostToDevice);
  fill<<<(n + 255) / 256, 256>>>(a, n, -0.99f, 0.99f, 1);
  fill<<<(n + 255) / 256, 256>>>(x, n, -1.0f, 1.0f, 2);
  fill<<<(B * D + 255) / 256, 256>>>(h0, B * D, -1.0f, 1.0f, 3);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int w = 0; w < 5; ++w) scan_forward<<<B * gpi, TG>>>(a, x, h0, meta, y, hf, ck);
  float best = 1e9f, ms = 0.0f;
  for (int rep = 0; rep < 7; ++rep) {
    cudaEventRecord(e0);
    for (int w = 0; w < 20; ++w) scan_forward<<<B * gpi, TG>>>(a, x, h0, meta, y, hf, ck);
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    cudaEventElapsedTime(&ms, e0, e1);
    best = ms / 20 < best ? ms / 20 : best;
  }
  T* ha = (T*)malloc(n * sizeof(T)); T* hx = (T*)malloc(n * sizeof(T)); T* hy = (T*)malloc(n * sizeof(T));
  float* hh = (float*)malloc(B * D * 4);
  cudaMemcpy(ha, a, n * sizeof(T), cudaMemcpyDeviceToHost);
  cudaMemcpy(hx, x, n * sizeof(T), cudaMemcpyDeviceToHost);
  cudaMemcpy(hy, y, n * sizeof(T), cudaMemcpyDeviceToHost);
  cudaMemcpy(hh, h0, B * D * 4, cudaMemcpyDeviceToHost);
  double err = 0;  // a sample of lanes against h <- a h + x in fp32
  for (int64_t b = 0; b < B; b += 3) for (int64_t d = 0; d < D; d += 37) {
    float h = hh[b * D + d];
    for (int64_t t = 0; t < L; ++t) {
      const int64_t i = (b * L + t) * D + d;
      h = float(ha[i]) * h + float(hx[i]);
      const double e = fabs(double(float(hy[i])) - h) / (1 + fabs(h));
      err = e > err ? e : err;
    }
  }
  const double bytes = 3.0 * n * sizeof(T);  // a and x read, y written
  printf("@NAME@: %.1f us, %.2f TB/s, max relative error %.2e (%s)\n", best * 1e3,
         bytes / (best * 1e-3) / 1e12, err, cudaGetErrorString(cudaGetLastError()));
  cudaEventRecord(e0);
  for (int w = 0; w < 20; ++w) cudaMemcpyAsync(y, a, n * sizeof(T), cudaMemcpyDeviceToDevice);
  cudaEventRecord(e1); cudaEventSynchronize(e1); cudaEventElapsedTime(&ms, e0, e1);
  printf("  copy of %.0f MB: %.1f us, %.2f TB/s\n", n * sizeof(T) / 1e6, ms / 20 * 1e3,
         2.0 * n * sizeof(T) / (ms / 20 * 1e-3) / 1e12);
}
'''


def standalone(text: str, name: str) -> str:
    """A kernel's full CUDA text as MLX compiles it, as a plain CUDA kernel called ``name``
    (a stand-in for MLX's header, out of MLX's namespace)."""
    text = without_mlx_header(text)
    text = text.replace("namespace mlx::core::cu {", "").replace("} // namespace mlx::core::cu", "")
    return re.sub(r"__global__ void \w+\(", f"__global__ void {name}(", text)


def filled(harness: str, **values) -> str:
    """``harness`` with each ``@KEY@`` replaced by ``values[KEY]``."""
    for key, value in values.items():
        harness = harness.replace(f"@{key}@", str(value))
    return harness


def program(dtype: str, B: int, L: int, D: int) -> str:
    rec = rg.load_spec("rglru")
    sch = make_scan_schedule(rec.spec, {"B": B, "L": L, "D": D}, scan_run(rec.spec))
    text = kernel_source(rec, "forward", "cuda", getattr(mx, dtype), lanes=D, schedule="scan")
    for name, value in (("STRETCH", sch.seg), ("TG", sch.threads), ("LB", sch.lane_block),
                        ("RUN", sch.run)):
        text = re.sub(rf"constexpr int {name} = \d+;", f"constexpr int {name} = {value};", text)
    text = standalone(text, "scan_forward")
    return text + filled(HARNESS, CTYPE=C_TYPES[dtype], B=B, L=L, D=D, LB=sch.lane_block,
                         TG=sch.threads, STRETCH=sch.seg, NAME=f"rglru forward B{B} L{L} D{D} {dtype}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the .cu files")
    p.add_argument("--shape", default="8,4096,1024", help="B,L,D")
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    B, L, D = (int(v) for v in args.shape.split(","))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes.split(","):
        path = out / f"rglru_forward_{dtype}.cu"
        path.write_text(program(dtype, B, L, D))
        print(path)


if __name__ == "__main__":
    main()
