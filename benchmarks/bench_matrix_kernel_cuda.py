"""The matrix schedule's states and outputs kernels alone, without MLX: their CUDA text as the
renderer emits it for a spec's flags, and the causal weights kernels (forward and adjoint) of the
matrix products' path, wrapped in a standalone program that times each with CUDA events and
checks a sample of chunks against loops on the host.

    python benchmarks/bench_matrix_kernel_cuda.py --out /tmp/matrix-kernel        # gla, B8 sizes
    cd /tmp/matrix-kernel && nvcc -O3 -std=c++17 -arch=sm_90 -Xptxas -v matrix_kernels.cu \\
        -o matrix_kernels && ./matrix_kernels                                   # on the GPU

``--instances`` is batch times heads (GLA B8 H16: 128), ``--T`` the steps, ``--K``/``--V`` the
state. The states kernel takes ``x = a``, ``y = b``; the outputs kernel reads the states kernel's
local states as the states entering each chunk (any values serve to time and check it). The
states and outputs kernels read their factors as row-contiguous ``(I, T, X)`` arrays given with
their shapes and strides, as MLX passes them. Inputs
are uniform in [-1, 1], ``log d`` in [-0.5, 0]. Bytes are those each kernel must move at least
(its inputs read once, its outputs written once).
"""

from __future__ import annotations

import argparse
import pathlib

import mlx_recgen as rg
from mlx_recgen.backends.matrix_kernels import (MatrixKernels, MatrixRenderer, kernel_chunk,
                                                kernel_flags, matrix_source)
from mlx_recgen.render.matrix import THREADS, group_threads
from bench_scan_kernel import filled, standalone  # this script's folder is first on sys.path

KINDS = ("states", "outputs", "weights", "weights_adjoint")

HARNESS = r'''
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <vector>
__global__ void fill(float* p, int64_t n, float lo, float hi, unsigned seed) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) {
    unsigned h = unsigned(i * 2654435761u) ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = lo + (hi - lo) * ((h & 0xffffff) / 16777216.0f);
  }
}
template <typename F> float timed(F launch) {
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int w = 0; w < 3; ++w) launch();
  float best = 1e9f, ms = 0.0f;
  for (int rep = 0; rep < 7; ++rep) {
    cudaEventRecord(e0);
    for (int w = 0; w < 10; ++w) launch();
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    cudaEventElapsedTime(&ms, e0, e1);
    best = ms / 10 < best ? ms / 10 : best;
  }
  return best * 1e3f;  // µs
}
// a row-contiguous (I, T, X) array as the strided kernels take it: shape, strides, rank
struct Rows { Shape shape; Strides strides; int ndim; };
Rows rows(int64_t I, int64_t T, int64_t X) {
  Rows r{};
  r.shape[0] = int(I); r.shape[1] = int(T); r.shape[2] = int(X);
  r.strides[0] = T * X; r.strides[1] = X; r.strides[2] = 1;
  r.ndim = 3;
  return r;
}
std::vector<float> host(const float* d, int64_t n) {
  std::vector<float> h(n);
  cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost);
  return h;
}
int main() {
  const int64_t I = @I@, T = @T@, K = @K@, V = @V@, C = @C@, nc = (T + C - 1) / C;
  const bool inclusive = @INCLUSIVE@, diagonal = @DIAGONAL@;
  float *c, *a, *b, *log_d, *sign, *local, *decay, *out, *scores, *d_scores, *w, *dw, *dl;
  int* dims;
  cudaMalloc(&c, I * T * K * 4); cudaMalloc(&a, I * T * K * 4); cudaMalloc(&b, I * T * V * 4);
  cudaMalloc(&log_d, I * T * 4); cudaMalloc(&sign, I * T * 4); cudaMalloc(&out, I * T * V * 4);
  cudaMalloc(&local, I * nc * K * V * 4); cudaMalloc(&decay, I * nc * 4);
  cudaMalloc(&dims, 4);
  const int64_t n_scores = I * nc * C * C;
  cudaMalloc(&scores, n_scores * 4); cudaMalloc(&d_scores, n_scores * 4);
  cudaMalloc(&w, n_scores * 4); cudaMalloc(&dw, n_scores * 4); cudaMalloc(&dl, I * T * 4);
  fill<<<(n_scores + 255) / 256, 256>>>(scores, n_scores, -1.0f, 1.0f, 6);
  fill<<<(n_scores + 255) / 256, 256>>>(d_scores, n_scores, -1.0f, 1.0f, 7);
  const int host_dims[1] = {int(T)};
  cudaMemcpy(dims, host_dims, 4, cudaMemcpyHostToDevice);
  fill<<<(I * T * K + 255) / 256, 256>>>(c, I * T * K, -1.0f, 1.0f, 1);
  fill<<<(I * T * K + 255) / 256, 256>>>(a, I * T * K, -1.0f, 1.0f, 2);
  fill<<<(I * T * V + 255) / 256, 256>>>(b, I * T * V, -1.0f, 1.0f, 3);
  fill<<<(I * T + 255) / 256, 256>>>(log_d, I * T, -0.5f, 0.0f, 4);
  fill<<<(I * T + 255) / 256, 256>>>(sign, I * T, 1.0f, 1.0f, 5);
  const int states_smem = @STATES_SMEM@, outputs_smem = @OUTPUTS_SMEM@;
  if (states_smem > 48000)
    cudaFuncSetAttribute(states_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, states_smem);
  if (outputs_smem > 48000)
    cudaFuncSetAttribute(outputs_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, outputs_smem);
  const Rows rk = rows(I, T, K), rv = rows(I, T, V);
  const float states_us = timed([&] {
    states_kernel<<<@STATES_GROUPS@, @THREADS@, states_smem>>>(
        a, rk.shape, rk.strides, rk.ndim, b, rv.shape, rv.strides, rv.ndim, log_d, @SIGN@local, decay);
  });
  const float outputs_us = timed([&] {
    outputs_kernel<<<@OUTPUTS_GROUPS@, @OUTPUT_THREADS@, outputs_smem>>>(
        c, rk.shape, rk.strides, rk.ndim, a, rk.shape, rk.strides, rk.ndim, b, rv.shape, rv.strides,
        rv.ndim, log_d, @SIGN@local, out);
  });
  const float weights_us = timed([&] {
    weights_kernel<<<I * nc, @THREADS@>>>(scores, log_d, @SIGN@dims, w);
  });
  const float adjoint_us = timed([&] {
    weights_adjoint_kernel<<<I * nc, @THREADS@>>>(scores, d_scores, log_d, @SIGN@dims, w, dw, dl);
  });
  const cudaError_t status = cudaGetLastError();
  auto hc = host(c, I * T * K), ha = host(a, I * T * K), hb = host(b, I * T * V);
  auto hl = host(log_d, I * T), hU = host(local, I * nc * K * V), hy = host(out, I * T * V);
  auto hs = host(scores, n_scores), hds = host(d_scores, n_scores), hw = host(w, n_scores);
  auto hdw = host(dw, n_scores);
  double err_states = 0, err_outputs = 0, err_weights = 0;  // a sample of chunks against loops
  for (int64_t i = 0; i < I; i += 37) for (int64_t q = 0; q < nc; q += 13) {
    const int64_t t0 = q * C, n = T - t0 < C ? T - t0 : C;
    std::vector<double> lam(n);  // Λ, inclusive running sums within the chunk
    double s = 0;
    for (int64_t j = 0; j < n; ++j) { s += hl[i * T + t0 + j]; lam[j] = s; }
    const float* S = &hU[(i * nc + q) * K * V];
    for (int64_t t = 0; t < n; ++t) for (int64_t j = 0; j < C; ++j) {  // weights, and dW
      const double R = inclusive ? lam[t] : lam[t] - hl[i * T + t0 + t];
      const double m = j < n && (diagonal ? j <= t : j < t) ? exp(R - lam[j]) : 0.0;
      const int64_t e = ((i * nc + q) * C + t) * C + j;
      err_weights = fmax(err_weights, fabs(hw[e] - hs[e] * m) + fabs(hdw[e] - hds[e] * m));
    }
    for (int64_t k = 0; k < K; ++k) for (int64_t v = 0; v < V; ++v) {
      double u = 0, scale = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double x = ha[(i * T + t0 + j) * K + k] * exp(lam[n - 1] - lam[j]);
        u += x * hb[(i * T + t0 + j) * V + v];
        scale += fabs(x * hb[(i * T + t0 + j) * V + v]);
      }
      err_states = fmax(err_states, fabs(S[k * V + v] - u) / (scale + 1e-6));
    }
    for (int64_t t = 0; t < n; ++t) for (int64_t v = 0; v < V; ++v) {
      const double R = inclusive ? lam[t] : lam[t] - hl[i * T + t0 + t];
      double y = 0, scale = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double term = exp(R) * hc[(i * T + t0 + t) * K + k] * S[k * V + v];
        y += term; scale += fabs(term);
      }
      for (int64_t j = 0; j < (diagonal ? t + 1 : t); ++j) {
        double ca = 0;
        for (int64_t k = 0; k < K; ++k) ca += hc[(i * T + t0 + t) * K + k] * ha[(i * T + t0 + j) * K + k];
        const double term = exp(R - lam[j]) * ca * hb[(i * T + t0 + j) * V + v];
        y += term; scale += fabs(term);
      }
      err_outputs = fmax(err_outputs, fabs(hy[(i * T + t0 + t) * V + v] - y) / (scale + 1e-6));
    }
  }
  const double states_bytes = 4.0 * (I * T * (K + V + 1) + I * nc * (K * V + 1));
  const double outputs_bytes = 4.0 * (I * T * (2 * K + 2 * V + 1) + I * nc * K * V);
  printf("@NAME@ (%s)\n", cudaGetErrorString(status));
  printf("  states:  %7.1f us, %5.2f TB/s of its %4.0f MB, worst error %.1e\n", states_us,
         states_bytes / (states_us * 1e-6) / 1e12, states_bytes / 1e6, err_states);
  printf("  outputs: %7.1f us, %5.2f TB/s of its %4.0f MB, worst error %.1e\n", outputs_us,
         outputs_bytes / (outputs_us * 1e-6) / 1e12, outputs_bytes / 1e6, err_outputs);
  const double weights_bytes = 4.0 * (2 * n_scores + I * T), adjoint_bytes = 4.0 * (4 * n_scores + 2 * I * T);
  printf("  weights: %7.1f us, %5.2f TB/s of its %4.0f MB; adjoint %7.1f us, %5.2f TB/s of its %4.0f MB; "
         "worst error of both (the adjoint's W and dW) %.1e\n", weights_us,
         weights_bytes / (weights_us * 1e-6) / 1e12, weights_bytes / 1e6, adjoint_us,
         adjoint_bytes / (adjoint_us * 1e-6) / 1e12, adjoint_bytes / 1e6, err_weights);
}
'''


def program(spec: str, I: int, T: int, K: int, V: int, seg: int = 64) -> str:
    rec = rg.load_spec(spec)
    flags = next(f for f in (kernel_flags(rec.matrix, st) for st in rec.matrix.states) if f)
    _, inclusive, signed, diagonal = flags
    kernels = MatrixKernels("cuda")
    shape = kernels.shape(kernel_chunk(seg), K, V, inclusive, signed, diagonal=diagonal)
    renderer = MatrixRenderer(kernels.dialect, shape)
    texts = {kind: matrix_source(kind, "cuda", seg, K, V, inclusive, signed, diagonal=diagonal)
             for kind in KINDS}
    memory = {kind: renderer.memory(kind) for kind in ("states", "outputs")}
    nc = -(-T // shape.C)
    SK, SV = shape.state_tiles
    # the header (helpers) once: the other kernels' texts without it (the weights kernels'
    # headers are the states kernel's less the products' helpers)
    kernels = ""
    for kind in KINDS:
        text = standalone(texts[kind], f"{kind}_kernel")
        kernels += text if kind == "states" else text[text.index(f"__global__ void {kind}_kernel"):]
    harness = filled(
        HARNESS, I=I, T=T, K=K, V=V, C=shape.C, INCLUSIVE=str(inclusive).lower(),
        DIAGONAL=str(diagonal).lower(),
        STATES_SMEM=memory["states"].bytes if memory["states"].dynamic else 0,
        OUTPUTS_SMEM=memory["outputs"].bytes if memory["outputs"].dynamic else 0,
        STATES_GROUPS=I * nc * -(-K // SK) * -(-V // SV), OUTPUTS_GROUPS=I * nc * -(-V // shape.VT),
        THREADS=THREADS, OUTPUT_THREADS=group_threads("outputs"), SIGN="sign, " if signed else "",
        NAME=f"{spec} matrix kernels, I={I} T={T} K={K} V={V} C={shape.C}, "
             f"tiles {shape.KT}x{shape.VT}, states {SK}x{SV}")
    return kernels + harness


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for matrix_kernels.cu")
    p.add_argument("--spec", default="gla", help="a bundled spec the matrix kernels serve")
    p.add_argument("--instances", type=int, default=128)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--V", type=int, default=64)
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "matrix_kernels.cu"
    path.write_text(program(args.spec, args.instances, args.T, args.K, args.V))
    print(path)


if __name__ == "__main__":
    main()
