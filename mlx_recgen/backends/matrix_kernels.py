"""The matrix schedule on the kernel backends: the chunk form of one state in generated kernels.

For a state of the matrix form (``matrix.analyse``) with a scalar decay, one added term and one
readout, ``MatrixKernels.core`` is an MLX custom function of that state's per-step factors,
``(*batch, T, K)`` arrays ``c`` and ``a`` and ``(*batch, T, V)`` ``b`` at any strides (the
``I`` instances run over the batch axes; ``STRIDED``), ``log |d|`` (``(*batch, T)`` at any
strides or ``(I, T)``; the kernels floor it as they read it, ``matrix.LOG_FLOOR``), the sign of
``d`` (``±1``, ``(I, T)``) and the initial state ``(I, K, V)``, giving the readouts
``y[t] = c[t] · S[t-1]`` (``· d_t S[t-1]`` for a ``decayed`` readout, ``· S[t]`` for a
``diagonal`` one), the final state and the state entering every chunk. Everything else — the
factors from the inputs, the per-step outputs from the readouts — stays MLX ops, so MLX
differentiates it; the core's VJP is

* the states and chain kernels (or the walk, ``MatrixKernels.walk``) newest first: the
  gradient leaving each chunk (``G``) and ``dS0``;
* per chunk, in one kernel (``chunk_gradients``) where its group memory is given, else as
  MLX's batched matmuls between two kernels (``GRADIENTS_BY_MATMULS``): with the causal weights
  ``M[t, j] = exp(R_t - Λ_j)`` (``j < t``; ``j ≤ t`` for a ``diagonal`` readout),
  ``W = M ∘ (c @ aᵀ)``, ``dW = M ∘ (dy @ bᵀ)``:
  ``dc = exp(R) ⊙ (dy @ Sᵀ) + dW @ a``, ``da = dWᵀ @ c + exp(Λ_C - Λ) ⊙ (b @ Gᵀ)``,
  ``db = Wᵀ @ dy + exp(Λ_C - Λ) ⊙ (a @ G)``. The weights kernel forms ``W`` and ``dW`` and
  takes the cotangent of ``M`` onto ``log d``, each step's a sum over the pairs whose range
  holds it (a difference of two running sums would lose the digits of their magnitude). The
  gradients kernel adds the products up and sums the rows that carry the cotangents of
  ``exp(R)`` and ``exp(Λ_C - Λ)``, which MLX's VJP takes back onto ``log d`` through their
  sums, as that of ``exp(Λ_C)``. The one kernel forms the same sums from the scores it keeps
  in group memory (``render/matrix.py``) and takes them onto ``log d`` itself: a step's
  cotangent through ``exp(R_t)`` is a sum over the rows after it, through ``exp(Λ_C - Λ_t)``
  over the rows before, and every step has the chunk's through ``exp(Λ_C)``; no pass of MLX's
  follows it.

Its forward-mode rule differentiates the same chunk form in MLX ops (``core_in_ops``); a
second derivative and ``mx.vmap`` raise (the kernels have neither).

Kernels are rendered by ``render/matrix.py`` and built once per (shape, flags); the chunk the
kernels run is the schedule's ``seg`` rounded up to a multiple of 16 and at most 64.

A state whose decay varies over the state axis runs its chunk form in MLX ops
(``mlx_matrix.py``) but for its causal weighted scores, which ``decay_scores`` forms in a kernel
with its own VJP (docs/matrix.md, "A decay per state element").
"""

from __future__ import annotations

import math
import os
import re

import mlx.core as mx

from ..function import first_order_only, opaque, unread_zeros, zero_state
from ..matrix import LOG_FLOOR
from ..memo import LRU
from ..render.dialects import DIALECTS
from ..render.matrix import (DECAY_SCORE_KINDS, THREADS, WALK_KINDS, MatrixKernelShape,
                             MatrixRenderer, decay_score_chunk, decay_score_threads,
                             decay_score_tile, decay_scores_text, gradient_tiles, group_threads,
                             state_tiles, tiles, walk_tiles)
from ..render.names import kernel_name
from .kernels import kernel_factory
from .matrix_chunks import MatrixChunks, carry, causal, causal_weights, parity

# Whether MatrixForm runs the kernels by default, per backend: on Metal (what the simulator
# verifies is what a Mac runs) and on CUDA, where on an H100 they beat the same form on MLX's
# cuBLAS matmuls (GLA B8 H16 L4096 K=V=64 fp32 forward+backward 8.4-8.5 against 11.3-11.7 ms;
# benchmarks/results/bench-matrix-kernels-rework-H100-2026-11-25.md). The environment variable
# MLX_RECGEN_MATRIX_KERNELS=1 (or 0) turns them on (off) on every kernel backend.
DEFAULT_ON = {"metal": True, "metal-sim": True, "cuda": True}
# The kernels by kind: each chunk's state from zero and the chain through the chunks; the
# readouts; the same two for the adjoint of the states (chained newest first); the causal
# weights of the readouts, and with their cotangents those of the chunk gradients; the chunk
# gradients from their products; and the whole backward of the chunks in one
KERNELS = ("states", "chain", "outputs", "adjoint", "adjoint_chain", "weights", "weights_adjoint",
           "gradients", "chunk_gradients", *WALK_KINDS)
MAX_CHUNK = 64  # the largest chunk whose [C, C] weights fit group memory beside the tiles
# The kernels that read their per-step factors where they lie, ``(*batch, T, X)`` at any strides
# (``matrix_strided.j2``): a factor that is an input in the spec's layout (GLA's q, k, v, as
# ``(B, H, T, K)`` views of ``[B, L, H, K]``) or a broadcast is not copied first. Their other
# inputs are row-contiguous as passed. They take the steps from a factor's shape, a kernel
# argument: read from device memory (a ``dims`` array, as the other kernels do), every index
# of the kernel waited on that load (9% of the chunk-gradients kernel's warp time on an H100)
STRIDED = ("states", "adjoint", "outputs", "chunk_gradients", *WALK_KINDS)
# Where the readouts run as MLX's matmuls around the weights kernel instead of in the outputs
# kernel, per backend: none. CUDA ran them so (an H100: GLA B8 H16 L4096 forward 2.40 against
# 2.97 ms) until the outputs kernel copied its tiles past the registers, in groups of 256: on an
# H200 it then took GLA's forward from 1.30-1.39 to 1.27-1.28 ms at B8 fp32 (1.54-1.56 to 1.40
# in bf16), in less memory (benchmarks/results/bench-matrix-kernels-async-H200-2026-11-27.md)
OUTPUTS_BY_MATMULS: dict = {}
# Where the backward of the chunks runs as MLX's matmuls between the weights-adjoint and gradients
# kernels instead of in the one chunk-gradients kernel, per backend: none. The one kernel runs
# wherever its group memory is given (``MatrixKernelShape.gradient_tiles``: CUDA at every chunk,
# Metal's 32 KB up to chunks of 32), the other path elsewhere
GRADIENTS_BY_MATMULS: dict = {}
# Where the states pass through the chunks in one walk kernel (one group per instance and state
# tile, walking the chunks in order) instead of the states kernel (one group per chunk too) and
# the chain, per backend; the walk runs where its tiles give it WALK_GROUPS groups
# (``MatrixKernels.walk``), as it has one group where the states kernel has one per chunk. On an
# H200 at GLA's B8 H16 L4096 K=V=64 (128 groups of 64 x 64) it took 336 µs against 298 + 77 for
# the states and chain kernels, at B3 H12 L2048 (36 groups) 194 against 51 + 24, and in tiles
# of 32 x 32 twice as long as in 64 x 64. Metal's 32 KB of group memory leave it tiles of at
# most 32 x 16 at chunks of 64, so there (and in the simulator, which runs what a Mac runs) the
# states and chain kernels stay; the tests run the walk on every backend
WALKS = {"metal": False, "metal-sim": False, "cuda": True}
WALK_GROUPS = 128


def kernel_chunk(seg: int) -> int:
    """The chunk the kernels run for the schedule's ``seg``: a multiple of 16, at most 64."""
    return min(MAX_CHUNK, -(-seg // 16) * 16)


def _signs(sign):
    return [] if sign is None else [sign]


class MatrixKernels:
    """The matrix schedule's kernels on one kernel backend (``metal``, ``metal-sim``,
    ``cuda``). fp32 products run on the matrix units, in TF32 on CUDA (as MLX's own fp32
    matmuls) unless ``MLX_ENABLE_TF32=0``, MLX's switch, which selects exact fp32 products."""

    def __init__(self, backend: str):
        self.backend = backend
        self.dialect = DIALECTS[backend]
        self._factory = None
        self._kernels = LRU(32)
        self._cores = LRU(32)
        self._shapes = LRU(64)

    def units(self) -> bool:
        return not (self.dialect.name == "cuda" and os.environ.get("MLX_ENABLE_TF32") == "0")

    def shape(self, C, K, V, inclusive, signed=False, units=None, diagonal=False):
        """The kernels' shape for these sizes, or None where no tiling fits group memory;
        ``units``: the products on the matrix units (None: as ``units()`` says)."""
        units = self.units() if units is None else units
        d = self.dialect

        def build():  # decided once per call's sizes: a call builds its graph on each step
            t = tiles(C, K, V, d, signed)
            return None if t is None else MatrixKernelShape(
                C, K, V, *t, inclusive, units, signed, diagonal, state_tiles(C, K, V, d, signed),
                gradient_tiles(C, K, V, d, signed), walk_tiles(C, K, V, d, signed))

        # the dialect's memory in the key: tests swap in variants of it
        memory = (d.shared_bytes, d.dynamic_shared_bytes, d.matrix_pads)
        return self._shapes.get_or_build((C, K, V, inclusive, signed, units, diagonal, memory),
                                         build)

    @staticmethod
    def _text(dialect, shape, kind, halves=(), ends=(True, True)):
        """(name, input names, output names, body, header) of a kernel: ``KERNELS``.
        ``halves``: the inputs given in half precision (``_halves``); the text is the same for
        every dtype (the copies into group memory widen halves), the name is not, except where
        the kernel's tiles hold halves as given (``_tile``). ``ends``, of a walk: whether it
        reads the state it starts from and writes the one it ends at (``states``)."""
        if kind not in KERNELS:
            raise ValueError(f"the matrix schedule's kernels are {KERNELS}, got {kind!r}")
        r = MatrixRenderer(dialect, shape)
        signs = ["sign"] if shape.signed else []
        tile = _tile(dialect, shape, kind, halves)
        if kind == "outputs":
            body, outs = r.outputs(tile), ["out"]
            ins = ["c", "a", "b", "log_d", *signs, "states"]
        elif kind == "weights":
            body, outs = r.weights(adjoint=False), ["weights"]
            ins = ["scores", "log_d", *signs, "dims"]
        elif kind == "weights_adjoint":
            body, outs = r.weights(adjoint=True), ["weights", "d_weights", "d_log_d"]
            ins = ["scores", "d_scores", "log_d", *signs, "dims"]
        elif kind == "gradients":
            body = r.gradients()
            ins = ["c", "a", "dy_s", "dw_a", "dw_c", "b_g", "a_g", "w_dy", "e_row", "e_end",
                   "dims"]
            outs = ["dc", "da", "db", "row_c", "row_a"]
        elif kind == "chunk_gradients":
            body = r.chunk_gradients(tile)
            ins = GRADIENT_INPUTS[:4] + ["log_d", *signs] + GRADIENT_INPUTS[4:]
            outs = ["dc", "da", "db", "d_log_d"]
        elif kind in WALK_KINDS:
            body = r.walk(reverse=kind == "adjoint_walk", tile=tile, ends=ends)
            ins = ["x", "y", "log_d", *signs, *(["init"] if ends[0] else [])]
            outs = ["states", *(["last"] if ends[1] else [])]
        elif kind in ("chain", "adjoint_chain"):
            body = r.chain(reverse=kind == "adjoint_chain")
            ins, outs = ["local", "decay", "init", "dims"], ["states", "last"]
        else:
            body = r.states(reverse=kind == "adjoint")
            ins, outs = ["x", "y", "log_d", *signs], ["local", "decay"]
        header = r.header(kind, tile)
        return _named(kind, halves, header, body, ins, outs), ins, outs, body, header

    def _make(self, text, **launch):
        """A kernel of the backend from its ``(name, inputs, outputs, body, header)``."""
        if self._factory is None:
            self._factory = kernel_factory(self.backend)
        name, ins, outs, body, header = text
        return self._factory(name=name, input_names=ins, output_names=outs, source=body,
                             header=header, **launch)

    def _kernel(self, shape, kind, inputs=(), outputs=(), ends=(True, True)):
        """The kernel ``kind`` of ``shape`` for ``inputs`` (the factors it reads, and the states
        where it reads them) and the dtypes of its first ``outputs`` (the gradients or the
        states it writes, else fp32), any of which may be in half precision (``_halves``);
        ``ends``: a walk's (``_text``)."""
        halves = _halves([x.dtype for x in inputs]) + _halves(outputs, "o")

        def build():
            memory = MatrixRenderer(self.dialect, shape).memory(
                kind, _tile(self.dialect, shape, kind, halves))
            # group memory beyond the declared arrays' limit is sized at launch (CUDA's dynamic
            # shared memory)
            launch = {"shared_memory": memory.bytes} if memory.dynamic else {}
            return self._make(self._text(self.dialect, shape, kind, halves, ends),
                              ensure_row_contiguous=kind not in STRIDED, **launch)

        return self._kernels.get_or_build((shape, kind, halves, ends), build)

    def switches(self) -> tuple:
        """This backend's entries of the module's switches between kernels (``WALKS``,
        ``WALK_GROUPS``, ``OUTPUTS_BY_MATMULS``, ``GRADIENTS_BY_MATMULS``), which a call reads
        as it is traced: the compiled calls are kept under them."""
        b = self.backend
        return (WALKS.get(b, False), WALK_GROUPS, OUTPUTS_BY_MATMULS.get(b, False),
                GRADIENTS_BY_MATMULS.get(b, False))

    def states_dtype(self, shape, x, y) -> mx.Dtype:
        """The dtype of the states entering the chunks (the adjoint's: the gradients leaving
        them) that ``states`` returns for factors ``x``, ``y``: their half type where the walk
        multiplies them as they are (``Dialect.half_tiles``), as FLA's kernels keep their
        chunks' states in bf16 (each stored rounded; the walk carries its state in fp32); fp32
        elsewhere. The final state is fp32 either way."""
        if not self.walk(shape, math.prod(x.shape[:-2])):
            return mx.float32
        halves = _halves([x.dtype, y.dtype])
        return x.dtype if _tile(self.dialect, shape, "walk", halves) != "float" else mx.float32

    # -- launches --------------------------------------------------------------------------------
    def walk(self, shape, instances) -> bool:
        """Whether the states pass through the chunks in the walk kernel for ``instances``
        instances: where its tiles give it ``WALK_GROUPS`` groups (``WALKS``)."""
        if not WALKS.get(self.backend, False) or shape.walk_tiles is None:
            return False
        return instances * _tile_count(shape.K, shape.V, shape.walk_tiles) >= WALK_GROUPS

    def states(self, shape, x, y, log_d, sign, init, reverse=False, last=True):
        """The state entering every chunk ``(I, nc, K, V)`` and the last one (walked newest
        first: the gradient leaving every chunk, and the initial state's). ``sign``: the
        decay's ``±1`` per step, for a shape that is ``signed`` (else None); ``init`` None: the
        state starts at zero; ``last`` False: the last state is not wanted (None in its
        place). One walk through the chunks where ``walk`` says so, which then neither reads a
        zero start nor writes an unwanted end; else two launches, every chunk's state from
        zero at once, then the chain through the chunks."""
        x, y = _one_batch(x, y)
        T, K = x.shape[-2:]
        I, V = math.prod(x.shape[:-2]), y.shape[-1]
        nc = -(-T // shape.C)
        log_d = _per_step(log_d, x)
        if self.walk(shape, I):
            threads = group_threads("walk")
            states = self.states_dtype(shape, x, y)
            ends = (init is not None, last)
            kernel = self._kernel(shape, "adjoint_walk" if reverse else "walk", (x, y),
                                  (states,), ends)
            results = kernel(
                # the initial state read row-contiguous (the walk reads x and y where they lie)
                inputs=[x, y, log_d, *_signs(sign), *([mx.contiguous(init)] if ends[0] else [])],
                grid=(I * _tile_count(K, V, shape.walk_tiles) * threads, 1, 1),
                threadgroup=(threads, 1, 1),
                output_shapes=[(I, nc, K, V), *([(I, K, V)] if last else [])],
                output_dtypes=[states, *([mx.float32] if last else [])])
            return results[0], results[1] if last else None
        if init is None:
            init = zero_state((I, K, V))
        tiles = _tile_count(K, V, shape.state_tiles)
        local, decay = self._kernel(shape, "adjoint" if reverse else "states", (x, y))(
            inputs=[x, y, log_d, *_signs(sign)],
            grid=(I * nc * tiles * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(I, nc, K, V), (I, nc)], output_dtypes=[mx.float32, mx.float32])
        elements = -(-(I * K * V) // THREADS) * THREADS
        starts, end = self._kernel(shape, "adjoint_chain" if reverse else "chain")(
            inputs=[local, decay, init, mx.array([T, I], dtype=mx.int32)],
            grid=(elements, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(I, nc, K, V), (I, K, V)], output_dtypes=[mx.float32, mx.float32])
        return starts, end if last else None

    def outputs(self, shape, c, a, b, log_d, sign, starts, out=mx.float32):
        """The readouts ``(*batch, T, V)`` of the chunks (``c``'s batch axes, in the dtype
        ``out``), from the state entering each: in the outputs kernel, or
        (``OUTPUTS_BY_MATMULS``) as MLX's matmuls around the weights kernel. In the batch
        shape, not as instances: the readouts' cotangent then reaches the backward's kernels
        as the caller's layout gives it, read where it lies (a reshape to instances would copy
        a transposed cotangent first)."""
        c, a, b = _one_batch(c, a, b)
        T, V = c.shape[-2], b.shape[-1]
        readouts = (*c.shape[:-2], T, V)
        if OUTPUTS_BY_MATMULS.get(self.backend, False):
            return self._outputs_by_matmuls(shape, *_instances(c, a, b), _floored(log_d, T),
                                            sign, starts).astype(out).reshape(readouts)
        log_d = _per_step(log_d, c)
        nc = -(-T // shape.C)
        groups = math.prod(c.shape[:-2]) * nc * -(-V // shape.VT)
        # the states among the inputs named by dtype: the same text reads floats or halves
        return self._kernel(shape, "outputs", (c, a, b, starts), (out,))(
            inputs=[c, a, b, log_d, *_signs(sign), starts],
            grid=(groups * group_threads("outputs"), 1, 1),
            threadgroup=(group_threads("outputs"), 1, 1),
            output_shapes=[readouts], output_dtypes=[out])[0]

    def _outputs_by_matmuls(self, shape, c, a, b, log_d, sign, starts):
        """``(W @ b + exp(R) ⊙ (c @ S_start))`` by chunk: the products are MLX's (cuBLAS on
        CUDA), the causal weights ``W = M ∘ (c @ aᵀ)`` the weights kernel's."""
        chunks = MatrixChunks(c.shape[1], shape.C, 1)
        cc, ac, bc = (chunks.cut(x) for x in (c, a, b))
        e_row = _exponentials(chunks.cut(log_d[..., None]), shape.inclusive)[0]
        if sign is not None:
            e_row = e_row * _chunk_signs(shape, chunks, sign)[0]
        W = self.weights(shape, cc @ _tr(ac), log_d, sign)
        # the sum in the last product's epilogue, not a pass of its own over the result
        return chunks.join(mx.addmm(e_row * (cc @ starts), W, bc))

    def weights(self, shape, scores, log_d, sign, d_scores=None):
        """The causal decay weights applied to the chunks' ``(I, nc, C, C)`` scores, ``W``; with
        their cotangents ``d_scores``, ``(W, dW, dlog_d)``: also the weights applied to those and
        the cotangent of ``log d`` through the weights, ``(I, T)``."""
        I, nc = scores.shape[:2]
        T = log_d.shape[-1]
        adjoint = d_scores is not None
        outs = self._kernel(shape, "weights_adjoint" if adjoint else "weights")(
            inputs=[scores, *([d_scores] if adjoint else []), log_d, *_signs(sign),
                    mx.array([T], dtype=mx.int32)],
            grid=(I * nc * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[scores.shape, scores.shape, (I, T)][:3 if adjoint else 1],
            output_dtypes=[mx.float32] * (3 if adjoint else 1))
        return outs if adjoint else outs[0]

    def chunk_gradients(self, shape, c, a, b, dy, log_d, sign, starts, leaving, grads=None):
        """The chunks' backward in one kernel: ``(dc, da, db)`` ``(I, T, X)`` (in the dtypes
        ``grads``, fp32 by default) and the cotangent of ``log d`` ``(I, T)``, all of it:
        through the causal weights, the rows' exponentials ``exp(R)`` and ``exp(Λ_C - Λ)`` and
        each chunk's whole decay (what ``_through_exponentials`` takes in MLX ops on the other
        path); ``c``, ``a``, ``b``, ``dy`` are ``(*batch, T, X)`` at any strides."""
        c, a, b, dy = _one_batch(c, a, b, dy)
        T, K = c.shape[-2:]
        I, V = math.prod(c.shape[:-2]), b.shape[-1]
        nc = -(-T // shape.C)
        log_d = _per_step(log_d, c)
        threads = group_threads("chunk_gradients")
        grads = list(grads or _FP32_GRADS)
        return self._kernel(shape, "chunk_gradients", (c, a, b, dy, starts, leaving), grads)(
            inputs=[c, a, b, dy, log_d, *_signs(sign), starts, leaving],
            grid=(I * nc * threads, 1, 1), threadgroup=(threads, 1, 1),
            output_shapes=[(I, T, K), (I, T, K), (I, T, V), (I, T)],
            output_dtypes=grads + [mx.float32])

    def gradients(self, shape, cc, ac, dy_S, dW_a, dW_c, b_G, a_G, W_dy, e_row, e_end):
        """``(dc, da, db, Σ_k c dy_S, Σ_k a b_G)`` by chunk from the products (``(I, nc, C, X)``)
        and the exponentials with their signs (``(I, nc, C, 1)``): module docstring."""
        lead = cc.shape[:-1]
        rows = lead[0] * lead[1] * lead[2]
        return self._kernel(shape, "gradients")(
            inputs=[cc, ac, dy_S, dW_a, dW_c, b_G, a_G, W_dy, e_row, e_end,
                    mx.array([rows], dtype=mx.int32)],
            grid=(-(-rows // (THREADS // 32)) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[cc.shape, cc.shape, W_dy.shape, (*lead, 1), (*lead, 1)],
            output_dtypes=[mx.float32] * 5)

    # -- the scores under a decay per state element ---------------------------------------------
    def decay_scores_fit(self, C: int) -> bool:
        """Whether the decay-score kernels take chunks of ``C`` steps (a multiple of 8 whose
        adjoint's group memory the target gives)."""
        return C <= MAX_CHUNK and decay_score_tile(C, self.dialect) is not None

    def decay_scores(self, C: int, K: int):
        """``(c, a, row_log, col_log) -> W``, all ``(R, C, K)`` chunks of rows (fp32), ``W``
        ``(R, C, C)`` with ``W[t, j] = Σ_k c[t, k] a[j, k] exp(row_log[t, k] - col_log[j, k])``
        for ``j < t`` and 0 else, as an MLX custom function: its VJP is the adjoint kernel's
        (``dc``, ``da``, ``c ⊙ dc``, ``-a ⊙ da``), its forward-mode rule the same sum in MLX
        ops (``decay_scores_in_ops``). Products in exact fp32 on the scalar units."""
        return self._cores.get_or_build(("decay_scores", C, K),
                                        lambda: self._build_decay_scores(C, K))

    @staticmethod
    def _decay_text(dialect, kind, C, K):
        """(name, input names, output names, body, header) of a decay-score kernel."""
        header, body = decay_scores_text(dialect, kind, C, K)
        adjoint = kind == "decay_scores_adjoint"
        ins = ["c", "a", "row_log", "col_log", *(["d_scores"] if adjoint else [])]
        outs = ["dc", "da", "d_row_log", "d_col_log"] if adjoint else ["scores"]
        return kernel_name("matrix", kind, header, body, ins, outs), ins, outs, body, header

    def _decay_kernel(self, kind, C, K):
        return self._kernels.get_or_build(
            (("decay", C, K), kind),
            lambda: self._make(self._decay_text(self.dialect, kind, C, K),
                               ensure_row_contiguous=True))

    def _build_decay_scores(self, C, K):
        KB = decay_score_tile(C, self.dialect)

        def launch(kind, arrays, groups, outputs):
            threads = decay_score_threads(kind, C, KB)
            return self._decay_kernel(kind, C, K)(
                inputs=arrays, grid=(groups * threads, 1, 1), threadgroup=(threads, 1, 1),
                output_shapes=outputs, output_dtypes=[mx.float32] * len(outputs))

        @mx.custom_function
        def scores(c, a, row_log, col_log):
            arrays = opaque([c, a, row_log, col_log], self.backend)
            R = c.shape[0]
            return launch("decay_scores", arrays, R, [(R, C, C)])[0]

        def backward(c, a, row_log, col_log, d_scores):
            R = c.shape[0]
            return tuple(launch("decay_scores_adjoint", [c, a, row_log, col_log, d_scores],
                                R, [c.shape] * 4))

        backward = first_order_only(backward, self.backend)

        @scores.vjp
        def scores_vjp(primals, cotangent, _):
            return backward(*primals, cotangent)

        @scores.jvp
        def scores_jvp(primals, tangents):
            tangents = [mx.zeros_like(p) if t is None else t for p, t in zip(primals, tangents)]
            return mx.jvp(decay_scores_in_ops, list(primals), tangents)[1]

        return scores

    # -- the custom function ---------------------------------------------------------------------
    def core(self, shape, grads=None, out=mx.float32, ends=(True, True)):
        """``(c, a, b, log_d, sign, S0) -> (y, S_final, S_start)`` with its VJP (module
        docstring), ``y`` in ``c``'s batch shape (``outputs``); ``sign`` is read for a
        ``signed`` shape only (pass any array else).
        ``grads``: the dtypes of the gradients of ``c``, ``a`` and ``b`` (fp32 by default; half
        precision for a factor whose gradient is final, nothing added to it after); ``out``:
        the readouts' (half precision where they are the call's outputs as they are);
        ``ends``: whether the initial state is given (else it is zero: ``S0`` is not read and
        its gradient is zeros, never formed) and whether the final state is wanted (else the
        core gives ``(y, S_start)``: where the walk runs, no final state is written in the
        forward and no zero cotangent of it filled and read in the backward)."""
        grads = tuple(grads or _FP32_GRADS)
        return self._cores.get_or_build((shape, grads, out, ends),
                                        lambda: self._build_core(shape, grads, out, ends))

    def _build_core(self, shape, grads, out, ends):
        initial, final = ends

        # c, a, b: (*batch, T, X), read where they lie by the forward's kernels; the VJP and the
        # forward-mode rule take them as (instance, T, X)
        @mx.custom_function
        def core(c, a, b, log_d, sign, init):
            # jvp and vmap walk into a custom function's body: jvp meets the stop-gradient
            # (``function.opaque``), vmap each kernel's guard (``kernels.kernel_factory``)
            c, a, b, log_d, sign, init = opaque([c, a, b, log_d, sign, init], self.backend)
            sign = sign if shape.signed else None
            starts, last = self.states(shape, a, b, log_d, sign, init if initial else None,
                                       last=final)
            y = self.outputs(shape, c, a, b, log_d, sign, starts, out)
            return (y, last, starts) if final else (y, starts)

        def backward(c, a, b, log_d, sign, init, dy, starts, *d_last):
            signs = sign if shape.signed else None
            leaving, d_init = self.states(shape, c, dy, log_d, signs, d_last[0] if final else None,
                                          reverse=True, last=initial)
            if shape.gradient_tiles is None or GRADIENTS_BY_MATMULS.get(self.backend, False):
                T = c.shape[-2]
                dc, da, db, d_log_d = self._chunk_gradients(shape, *_instances(c, a, b, dy),
                                                            _floored(log_d, T), signs, starts,
                                                            leaving)
                dc, da, db = (g.astype(d) for g, d in zip((dc, da, db), grads))
                # none where log d was floored, as the kernel gives
                d_log_d = mx.where(log_d.reshape(-1, T) > LOG_FLOOR, d_log_d, 0.0)
            else:
                dc, da, db, d_log_d = self.chunk_gradients(shape, c, a, b, dy, log_d, signs,
                                                           starts, leaving, grads)
            # fp32 gradients unless ``grads`` says otherwise: a factor given in half precision
            # whose input has other uses gets them summed before one rounding
            # (``mlx_matrix.read_as_given``)
            # none for the sign (piecewise constant), nor for a zero initial state (a
            # constant of the call): views of a kept zero, not fills
            return (dc.reshape(c.shape), da.reshape(a.shape), db.reshape(b.shape),
                    d_log_d.reshape(log_d.shape), unread_zeros(sign.shape),
                    d_init if initial else unread_zeros(init.shape))

        # the kernels in the VJP have no derivatives: a second derivative raises
        backward = first_order_only(backward, self.backend)

        @core.vjp
        def core_vjp(primals, cotangents, outputs):
            # the final state's cotangent where the core gives it
            return backward(*primals, cotangents[0], outputs[-1], *cotangents[1:-1])

        @core.jvp
        def core_jvp(primals, tangents):
            # forward mode through the same chunk form in MLX ops (``core_in_ops``); the sign
            # is piecewise constant: no tangent
            sign = primals[4]
            moving = (0, 1, 2, 3, 5)  # every argument but the sign

            def values(c, a, b, log_d, init):
                y, last, starts = core_in_ops(shape, *_instances(c, a, b), log_d, sign,
                                              init if initial else mx.zeros_like(init))
                y = y.astype(out).reshape(*c.shape[:-1], y.shape[-1])
                starts = starts.astype(self.states_dtype(shape, a, b))
                return (y, last, starts) if final else (y, starts)

            return mx.jvp(values, [primals[i] for i in moving],
                          [mx.zeros_like(primals[i]) if tangents[i] is None else tangents[i]
                           for i in moving])[1]

        return core

    def _chunk_gradients(self, shape, c, a, b, dy, log_d, sign, starts, leaving):
        """``dc, da, db, dlog_d`` from the states entering and the gradients leaving each chunk
        (module docstring): batched products over chunks, the causal weights and their
        cotangent in the weights kernel, the sums and scalings after the products in the
        gradients kernel."""
        chunks = MatrixChunks(c.shape[1], shape.C, 1)
        cc, ac, bc, dyc = (chunks.cut(x) for x in (c, a, b, dy))
        lam = chunks.cut(log_d[..., None])  # (I, nc, C, 1)
        s_row, s_end, _ = (1.0, 1.0, 1.0) if sign is None else _chunk_signs(shape, chunks, sign)
        W, dW, d_log_d = self.weights(shape, cc @ _tr(ac), log_d, sign, d_scores=dyc @ _tr(bc))
        b_G = bc @ _tr(leaving)  # (I, nc, C, K)
        dy_S = dyc @ _tr(starts)  # (I, nc, C, K)
        e_row, e_end, _ = _exponentials(lam, shape.inclusive)
        # (a ⊙ e_end) @ G as e_end ⊙ (a @ G): a row scaling commutes with the product
        dc, da, db, row_c, row_a = self.gradients(
            shape, cc, ac, dy_S, dW @ ac, _tr(dW) @ cc, b_G, ac @ leaving, _tr(W) @ dyc,
            e_row * s_row, e_end * s_end)
        d_lam = _through_exponentials(shape, chunks, log_d, sign, row_c, row_a,
                                      mx.sum(leaving * starts, axis=(-2, -1))[..., None, None])
        return chunks.join(dc), chunks.join(da), chunks.join(db), d_lam + d_log_d


def core_in_ops(shape, c, a, b, log_d, sign, init):
    """What the kernels' core computes (``MatrixKernels.core``), in MLX ops: readouts
    ``(I, T, V)``, the final state and the state entering every chunk, from the same chunk
    products and exponents (``_exponentials``, ``matrix_chunks.causal_weights`` and
    ``carry``). The core's forward-mode rule differentiates it; its VJP is the kernels'."""
    chunks = MatrixChunks(c.shape[1], shape.C, 1)
    cc, ac, bc = (chunks.cut(x) for x in (c, a, b))
    lam = chunks.cut(_floored(log_d, c.shape[1])[..., None])  # (I, nc, C, 1)
    e_row, e_end, _ = _exponentials(lam, shape.inclusive)
    # M[t, j] = exp(R_t - Λ_j): the range (j, t), or (j, t] for a readout with its step's decay
    M = causal_weights(lam)[..., 0] * (mx.exp(lam) if shape.inclusive else 1.0)
    whole = mx.sum(lam, axis=-2)  # (I, nc, 1)
    chunk_sign = None
    if shape.signed:
        s_row, s_end, s_whole = _chunk_signs(shape, chunks, sign)
        par = parity(chunks.cut(sign[..., None]), axis=-2)
        e_row, e_end, M = e_row * s_row, e_end * s_end, M * s_row * _tr(par)
        chunk_sign = s_whole  # (I, nc, 1, 1): the sign of each chunk's whole decay
    if shape.diagonal:
        M = M + mx.eye(shape.C)
    starts, last = carry(init, whole, chunk_sign, _tr(ac) @ (e_end * bc))
    y = e_row * (cc @ starts) + ((cc @ _tr(ac)) * M) @ bc
    return chunks.join(y), last, starts


def decay_scores_in_ops(c, a, row_log, col_log):
    """What the decay-score kernels compute (``MatrixKernels.decay_scores``), in MLX ops with
    ``[C, C, K]`` exponents: their forward-mode rule differentiates it."""
    mask = causal(c.shape[-2])[..., None]
    exponent = mx.where(mask, row_log[..., :, None, :] - col_log[..., None, :, :], -mx.inf)
    return mx.sum(c[..., :, None, :] * a[..., None, :, :] * mx.exp(exponent), axis=-1)


def _tile_count(K, V, tiles):
    """How many ``(K tile, V tile)`` tiles cover a ``K x V`` state."""
    return -(-K // tiles[0]) * -(-V // tiles[1])


def _tr(x):
    return mx.swapaxes(x, -1, -2)


def _one_batch(*xs) -> list:
    """``(*batch, T, X)`` inputs of a kernel that reads them where they lie, as views of one
    batch shape (broadcast where they differ): the kernels find every input's offsets from the
    first's batch digits (``matrix_strided.j2``)."""
    batch = mx.broadcast_shapes(*(x.shape[:-2] for x in xs))
    return [x if x.shape[:-2] == batch else mx.broadcast_to(x, (*batch, *x.shape[-2:]))
            for x in xs]


def _per_step(log_d, x):
    """``log d`` (``(I, T)``, or ``(*batch, T)`` at any strides, ``x``'s batch shape or one
    that broadcasts to it) as the ``(*batch, T, 1)`` view a kernel reads where it lies
    (``matrix_strided.j2``'s ``per_step``), no copy where ``(I, T)`` is contiguous."""
    batch, T = x.shape[:-2], x.shape[-2]
    if log_d.ndim == len(batch) + 1:
        return mx.broadcast_to(log_d, (*batch, T))[..., None]
    return log_d.reshape(*batch, T)[..., None]


def _floored(log_d, T):
    """``log d`` as ``(I, T)``, floored as the kernels floor it as they read it (for the chunk
    form in MLX ops)."""
    return mx.maximum(log_d.reshape(-1, T), LOG_FLOOR)


def _instances(*xs):
    """``(*batch, T, X)`` arrays as ``(instance, T, X)`` in fp32 (a copy where the batch axes
    do not merge or a factor is in half precision: for the chunk products in MLX ops, which the
    kernels, reading factors where they lie and widening halves, do not need)."""
    return [x.reshape(-1, *x.shape[-2:]).astype(mx.float32) for x in xs]


_HALF_TAGS = {mx.bfloat16: "bf16", mx.float16: "f16"}
_FP32_GRADS = (mx.float32,) * 3


def _named(kind, halves, header, body, ins, outs) -> str:
    """A matrix kernel's name: its text's, and the factors and outputs it takes in half
    precision (``_halves``): MLX writes the signature from the arrays' dtypes."""
    return kernel_name("matrix", "_".join([kind, *halves]), header, body, ins, outs)


# The backward kernel's factors and states, which its tiles hold (``_tile``), in the order
# ``_kernel`` is given them (its inputs put ``log_d`` and the signs between them)
GRADIENT_INPUTS = ["c", "a", "b", "dy", "starts", "leaving"]


def _tile(dialect, shape, kind, halves) -> str:
    """The element type of the tiles ``kind``'s kernel multiplies, for its inputs in half
    precision ``halves`` (``_halves``): the half type where the inputs its tiles hold (a walk's
    ``x`` and ``y``; the outputs kernel's ``c``, ``a``, ``b`` and ``S_start``; the backward's
    ``GRADIENT_INPUTS``) are all halves of one kind that the dialect multiplies as they are
    (``Dialect.half_tiles``) and the kernel's group memory fits them (``MatrixRenderer.tile``);
    else floats, as wherever the products are exact (``units`` off)."""
    if not shape.units:  # exact fp32 products: on floats, the scalar units' loop
        return "float"
    given = {"chunk_gradients": len(GRADIENT_INPUTS), "outputs": 4,  # c, a, b, starts
             **{k: 2 for k in WALK_KINDS}}.get(kind)
    half = "float" if given is None else _half_tile(dialect, halves, range(given))
    if half == "float":
        return half
    # whether the tiles of halves fit: asked on every call (``states_dtype``), so kept
    key = (dialect.name, dialect.shared_bytes, dialect.dynamic_shared_bytes,
           dialect.matrix_pads, half, shape, kind)
    return _TILES.get_or_build(key, lambda: MatrixRenderer(dialect, shape).tile(kind, half))


_TILES = LRU(64)  # (the dialect's memory, half type, shape, kind) -> ``_tile``'s answer


def _half_tile(dialect, halves, positions) -> str:
    """The dialect's tile type for the inputs at ``positions`` where all are in ``halves``
    (``_halves``), halves of one kind the dialect multiplies as they are (``half_tiles``),
    else ``float``."""
    given = dict(re.fullmatch(r"(\d+)(\D\w*)", h).groups() for h in halves if h[0] != "o")
    kinds = {given.get(str(i)) for i in positions}
    if len(kinds) != 1 or None in kinds:
        return "float"
    return dialect.half_tiles.get(kinds.pop(), "float")


def _halves(dtypes, prefix="") -> tuple:
    """The positions and dtypes of a kernel's factors (its gradients: ``prefix`` ``o``) in half
    precision, as name parts (``("0bf16", "1bf16")``): the same kernel text compiles to
    another kernel for them."""
    return tuple(f"{prefix}{i}{_HALF_TAGS[d]}" for i, d in enumerate(dtypes) if d in _HALF_TAGS)


def _exponentials(lam, inclusive):
    """``exp(R)``, ``exp(Λ_C - Λ)`` and ``exp(Λ_C)`` by chunk from ``log |d|`` ``(I, nc, C, 1)``,
    each exponent a sum from the chunk's start or to its end (``R`` includes the step's own
    decay for an ``inclusive`` readout)."""
    row = mx.cumsum(lam, axis=-2, inclusive=inclusive)
    end = mx.cumsum(lam, axis=-2, reverse=True, inclusive=False)
    return mx.exp(row), mx.exp(end), mx.exp(mx.sum(lam, axis=-2, keepdims=True))


def _through_exponentials(shape, chunks, log_d, sign, row_c, row_a, whole):
    """The cotangent of ``log d`` ``(I, T)`` through ``exp(R)``, ``exp(Λ_C - Λ)`` and
    ``exp(Λ_C)`` (``_exponentials``), MLX's VJP of their sums, from the sums that carry their
    cotangents without the signs: the rows' ``(I, nc, C, 1)`` and each chunk's
    ``Σ S ∘ G`` ``(I, nc, 1, 1)``."""
    s_row, s_end, s_whole = (1.0, 1.0, 1.0) if sign is None else \
        _chunk_signs(shape, chunks, sign)
    cotangents = [s_row * row_c, s_end * row_a, s_whole * whole]
    _, (d_lam,) = mx.vjp(lambda lam: _exponentials(lam, shape.inclusive),
                         [chunks.cut(log_d[..., None])], cotangents)
    return chunks.join(d_lam)[..., 0]


def _chunk_signs(shape, chunks, sign):
    """The signs of ``exp(R)``, ``exp(Λ_C - Λ)`` and ``exp(Λ_C)`` by chunk, from the decay's
    ``±1`` per step: the sign of ``d(j+1..t)`` is ``par_t par_j`` (running products)."""
    par = parity(chunks.cut(sign[..., None]), axis=-2)
    s_row = par if shape.inclusive else par * chunks.cut(sign[..., None])
    s_whole = par[..., -1:, :]
    return s_row, s_whole * par, s_whole


def matrix_source(kind, backend, seg=64, state_size=64, lanes=64, inclusive=False,
                  signed=False, units=None, diagonal=False, factors=mx.float32) -> str:
    """The full text of a matrix kernel (``KERNELS``, or a decay-score kernel,
    ``DECAY_SCORE_KINDS``) as ``backend`` compiles it, MLX's generated signature included, for
    a state of ``state_size`` x ``lanes``; ``units``: the products on the matrix units, or exact
    on the scalar units (None: as a call would); ``factors``: the dtype of the factors the
    kernel reads where they lie (``STRIDED`` kinds; half precision is widened on its way), and
    of what a call gives or takes with them in that precision (the readouts' cotangent, the
    walk's states, gradients and readouts)."""
    from .mlx_source import cuda_source, metal_source
    from .kernels import _ArrayInfo

    if backend not in ("metal", "cuda", "metal-sim"):
        raise ValueError(f"backend must be 'metal', 'metal-sim' or 'cuda', got {backend!r}")
    build = cuda_source if backend == "cuda" else metal_source
    kernels = MatrixKernels(backend)
    if kind in DECAY_SCORE_KINDS:
        name, ins, outs, body, header = MatrixKernels._decay_text(
            kernels.dialect, kind, decay_score_chunk(seg), state_size)
        infos = [_ArrayInfo(mx.float32, 3) for _ in ins]
        return build(name, ins, outs, body, header, infos, [mx.float32] * len(outs), [])[1]
    shape = kernels.shape(kernel_chunk(seg), state_size, lanes, inclusive, signed, units,
                          diagonal)
    if shape is None:
        raise ValueError(f"no tiling of a {state_size} x {lanes} state fits group memory")
    _, ins, outs = MatrixKernels._text(kernels.dialect, shape, kind)[:3]
    # the dtypes a call gives what a kernel may read or write in half precision: the factors
    # and the readouts' cotangent, read where they lie; the states as the walk keeps them
    # (``MatrixKernels.states_dtype``); the gradients and readouts it writes (``core``'s
    # ``grads`` and ``out``)
    walked_halves = _tile(kernels.dialect, shape, "walk", _halves([factors] * 2)) != "float"
    states = factors if walked_halves else mx.float32
    given = {n: factors for n in ins if n in (*_FACTORS, "dy")} if kind in STRIDED else {}
    if given:
        given.update({n: states for n in ins if n in ("states", "starts", "leaving")})
    made = {n: factors for n in {"chunk_gradients": ["dc", "da", "db"],
                                 "outputs": ["out"]}.get(kind, [])}
    if kind in WALK_KINDS:
        made["states"] = states
    # the text and name a call gives it (a walk's tiles of halves where both factors are)
    halves = _halves([given[n] for n in ins if n in given]) + \
        _halves([made[n] for n in outs if n in made], "o")
    name, ins, outs, body, header = MatrixKernels._text(kernels.dialect, shape, kind, halves)
    ranks = {"dims": 1, "log_d": 2, "sign": 2, "decay": 2, "init": 3, "states": 4, "local": 4,
             "scores": 4, "d_scores": 4,
             **{n: 4 for n in ("dy_s", "dw_a", "dw_c", "b_g", "a_g", "w_dy", "e_row", "e_end",
                               "starts", "leaving")}}
    infos = [_ArrayInfo(mx.int32 if n == "dims" else given.get(n, mx.float32), ranks.get(n, 3))
             for n in ins]
    return build(name, ins, outs, body, header, infos,
                 [made.get(n, mx.float32) for n in outs], [])[1]


_FACTORS = ("c", "a", "b", "x", "y")  # the factors a kernel may take in half precision


def kernel_flags(form, st):
    """``(readout index, inclusive, signed, diagonal)`` where the kernels serve state ``st`` of
    the matrix form ``form`` (a scalar decay, one added term, one readout, no delta-rule read),
    else None."""
    if st.vector_decay or len(st.terms) != 1 or st.low_rank:
        return None
    reading = [i for i, ro in enumerate(form.readouts) if st.symbol in ro.coefficients]
    if len(reading) != 1:
        return None
    i, = reading
    ro = form.readouts[i]
    return i, st.symbol in ro.decayed, not st.positive, st.symbol in ro.diagonal


def spec_matrix_source(rec, kind, backend, seg=64, state_size=64, lanes=64) -> str:
    """The matrix kernel ``kind`` for the first state of ``rec`` that the kernels serve (its
    readout kind and decay sign), as ``matrix_source`` renders it."""
    form = rec.matrix
    if not form.applies:
        raise ValueError(f"{rec.name} has no matrix form: {form.reason}")
    for st in form.states:
        flags = kernel_flags(form, st)
        if flags is not None:
            return matrix_source(kind, backend, seg, state_size, lanes, flags[1], flags[2],
                                 diagonal=flags[3])
    raise ValueError(f"{rec.name}: no state of its matrix form runs on the matrix kernels (they "
                     "take a scalar decay, one added term and one readout); its products run "
                     "as MLX matmuls")


_BY_BACKEND: dict = {}


def enabled(backend: str) -> bool:
    """Whether the matrix form runs its kernels on ``backend`` (``DEFAULT_ON``, or the
    environment's ``MLX_RECGEN_MATRIX_KERNELS``), read at each call."""
    setting = os.environ.get("MLX_RECGEN_MATRIX_KERNELS", "")
    if setting not in ("", "0", "1"):
        raise ValueError(f"MLX_RECGEN_MATRIX_KERNELS must be 0 or 1, got {setting!r}")
    return DEFAULT_ON.get(backend, False) if setting == "" else setting == "1"


def matrix_kernels(backend: str) -> MatrixKernels:
    """The one ``MatrixKernels`` of a kernel backend."""
    if backend not in _BY_BACKEND:
        _BY_BACKEND[backend] = MatrixKernels(backend)
    return _BY_BACKEND[backend]


__all__ = ["DEFAULT_ON", "GRADIENTS_BY_MATMULS", "KERNELS", "MAX_CHUNK", "MatrixKernels",
           "STRIDED", "WALKS", "WALK_GROUPS", "enabled", "kernel_chunk", "kernel_flags",
           "matrix_kernels", "matrix_source", "spec_matrix_source"]
