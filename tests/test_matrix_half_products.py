"""The CUDA dialect's product of half-precision tiles (``recgen_mm`` on bf16 or fp16 operands:
``ldmatrix`` fragments, ``mma.sync`` m16n8k16) against a loop on the host, every transposition,
with and without accumulation, at sizes of one to several strips a warp: a standalone program
built with ``nvcc`` from the dialect's text and run on an NVIDIA GPU (marker ``gpu``)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import cuda_available
from mlx_recgen.render.dialects import CUDA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not cuda_available() or shutil.which("nvcc") is None,
    reason="needs an NVIDIA GPU with MLX's CUDA backend, and nvcc")]

HARNESS = r'''
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
%(prelude)s
// D = [D +] op(A) op(B) on one group of NT threads, A and B copied into shared memory with
// rows padded by 8 halves (ldmatrix wants 16-byte rows)
template <int M, int N, int K, bool TA, bool TB, bool ACC, typename Half>
__global__ void product(const Half* A, const Half* B, float* D) {
  constexpr int AR = TA ? K : M, AC = TA ? M : K, BR = TB ? N : K, BC = TB ? K : N;
  constexpr int LDA = AC + 8, LDB = BC + 8, LDD = N + 4;
  __shared__ __align__(16) Half As[AR * LDA];
  __shared__ __align__(16) Half Bs[BR * LDB];
  __shared__ __align__(16) float Ds[M * LDD];
  for (int e = threadIdx.x; e < AR * AC; e += blockDim.x) As[(e / AC) * LDA + e %% AC] = A[e];
  for (int e = threadIdx.x; e < BR * BC; e += blockDim.x) Bs[(e / BC) * LDB + e %% BC] = B[e];
  for (int e = threadIdx.x; e < M * N; e += blockDim.x) Ds[(e / N) * LDD + e %% N] = D[e];
  __syncthreads();
  recgen_mm<M, N, K, TA, TB, ACC, 8>(Ds, LDD, As, LDA, Bs, LDB, threadIdx.x, blockDim.x);
  __syncthreads();
  for (int e = threadIdx.x; e < M * N; e += blockDim.x) D[e] = Ds[(e / N) * LDD + e %% N];
}
float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
float to_float(__half x) { return __half2float(x); }
void from(float x, __nv_bfloat16* y) { *y = __float2bfloat16(x); }
void from(float x, __half* y) { *y = __float2half(x); }
template <int M, int N, int K, bool TA, bool TB, bool ACC, typename Half>
int check(const char* name) {
  std::vector<Half> A(M * K), B(K * N);
  std::vector<float> D(M * N), want(M * N);
  unsigned s = 12345u + M * 7 + N * 13 + K * 17 + TA * 2 + TB;
  auto draw = [&]() { s = s * 1664525u + 1013904223u; return ((s >> 8) & 0xffff) / 32768.0f - 1.0f; };
  for (auto& x : A) from(draw(), &x);
  for (auto& x : B) from(draw(), &x);
  for (auto& x : D) x = draw();
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double acc = ACC ? D[i * N + j] : 0.0;
      for (int k = 0; k < K; ++k) {
        const double a = to_float(TA ? A[k * M + i] : A[i * K + k]);
        const double b = to_float(TB ? B[j * K + k] : B[k * N + j]);
        acc += a * b;
      }
      want[i * N + j] = float(acc);
    }
  Half *dA, *dB; float* dD;
  cudaMalloc(&dA, A.size() * sizeof(Half)); cudaMalloc(&dB, B.size() * sizeof(Half));
  cudaMalloc(&dD, D.size() * sizeof(float));
  cudaMemcpy(dA, A.data(), A.size() * sizeof(Half), cudaMemcpyHostToDevice);
  cudaMemcpy(dB, B.data(), B.size() * sizeof(Half), cudaMemcpyHostToDevice);
  cudaMemcpy(dD, D.data(), D.size() * sizeof(float), cudaMemcpyHostToDevice);
  product<M, N, K, TA, TB, ACC, Half><<<1, 256>>>(dA, dB, dD);
  cudaError_t err = cudaDeviceSynchronize();
  cudaMemcpy(D.data(), dD, D.size() * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(dA); cudaFree(dB); cudaFree(dD);
  double worst = 0.0;
  for (int e = 0; e < M * N; ++e) worst = fmax(worst, fabs(D[e] - want[e]) / (1.0 + fabs(want[e])));
  const bool ok = err == cudaSuccess && worst < 1e-5;
  printf("%%s M=%%d N=%%d K=%%d TA=%%d TB=%%d ACC=%%d: %%s, worst %%.3g\n", name, M, N, K, TA, TB, ACC,
         ok ? "ok" : (err != cudaSuccess ? cudaGetErrorString(err) : "WRONG"), worst);
  return ok ? 0 : 1;
}
template <int M, int N, int K, typename Half>
int all(const char* name) {
  return check<M, N, K, false, false, true, Half>(name) + check<M, N, K, true, false, true, Half>(name) +
         check<M, N, K, false, true, false, Half>(name) + check<M, N, K, true, true, true, Half>(name);
}
int main() {
  int bad = all<64, 64, 64, __nv_bfloat16>("bf16") + all<16, 8, 16, __nv_bfloat16>("bf16") +
            all<32, 64, 48, __nv_bfloat16>("bf16") + all<64, 32, 16, __half>("fp16") +
            all<48, 16, 32, __half>("fp16");
  printf("%%s\n", bad ? "FAILED" : "all ok");
  return bad != 0;
}
'''


def test_half_tiles_multiply_as_the_host_loop(tmp_path):
    src = tmp_path / "half_products.cu"
    src.write_text(HARNESS % {"prelude": CUDA.matrix_prelude})
    exe = tmp_path / "half_products"
    built = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-O2", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "all ok" in ran.stdout, ran.stdout + ran.stderr
