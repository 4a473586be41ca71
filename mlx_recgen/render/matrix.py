"""Render the kernels of the matrix schedule (``backends/matrix_kernels.py``, docs/matrix.md).

The matrix schedule's per-step factors (``c``, ``a``, ``b``, ``log d``) come from the spec
through ``matrix.analyse`` and are evaluated in MLX ops; what the kernels compute is the chunk
form itself, the same for every spec, so they are rendered from the chunk length, the state's
sizes and two flags, not from a spec:

states   one threadgroup per (instance, chunk, K tile, V tile; ``state_tiles``) takes
         its chunk's state from zero, ``U = Xᵀ Y`` with ``X[j] = a[j] exp(Λ_C - Λ_j)``,
         ``Y = b``, and the chunk's decay ``exp(Λ_C)``; with ``X[j] = c[j] exp(R_j)``,
         ``Y = dy`` (``adjoint``) the same for the adjoint of the states.
chain    one thread per element of the state walks the chunks in order (``adjoint_chain``:
         newest first), ``S <- exp(Λ_C) S + U``, and stores the state entering each chunk (the
         gradient leaving each). Only this pass is sequential, and it moves one float in and
         one out per element and chunk, so its threads never wait on a product.
outputs  one threadgroup per (instance, chunk, V tile): ``y = exp(R) ⊙ (c @ S_start) +
         (M ∘ (c @ aᵀ)) @ b`` with the causal decay weights ``M[t, j] = exp(R_t - Λ_j)``,
         ``j < t`` (``j ≤ t`` for a ``diagonal`` readout).

weights  one threadgroup per (instance, chunk): from the chunk's scores ``CA = c @ aᵀ`` (MLX's
         matmuls) the weighted ``W = CA ∘ M``; with their cotangent ``DB = dy @ bᵀ``
         (``weights_adjoint``) also ``dW = DB ∘ M`` and the cotangent of ``log d`` through
         ``M``, ``Σ CA DB M`` over the pairs ``(t, j)`` whose range holds the step, as prefix
         sums along each row.
gradients  one simdgroup per step: the chunk gradients ``dc``, ``da``, ``db`` from the chunks'
         products (MLX's matmuls) and the exponentials, and the row sums that carry the
         exponentials' cotangents, in one pass.

``Λ`` is the running sum of ``log d`` within the chunk and ``R_t`` the exponent of readout
``t``: ``Λ_t - log d_t`` (the readout of the state before step ``t``), or ``Λ_t`` for a readout
marked ``decayed`` (``matrix.Readout.decayed``: ``d_t`` multiplies the whole readout). A readout
marked ``diagonal`` (``matrix.Readout.diagonal``: the state after the update, the step's own
added term included) has the causal weights' diagonal too, ``M[t, t] = 1``. A decay
whose sign is not known symbolically brings its sign as a ``±1`` per step, and each weight is
multiplied by the product of the signs over its range (running products within the chunk). Every
product is ``recgen_mm`` on two tiles in group memory: the target's matrix units
(``Dialect.matrix_prelude``: ``simdgroup_matrix`` on Metal, ``mma.sync`` in TF32 on CUDA) or,
for exact fp32, a loop over the scalar units written once for both.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernels import environment

THREADS = 128  # four simdgroups / warps per threadgroup
TILE_SIZES = (64, 32, 16)  # K and V tiles, largest first; multiples of the MMA tiles (16 x 8)
# The states kernel's K and V tiles, largest first: each threadgroup repeats its chunk's loads
# of log d and running sums, and a 32 x 32 tile keeps two of four warps busy in the product
# (M = 32 is two strips of 16 rows); 64 x 32 fits CUDA's 48 KB of group memory, not Metal's 32
STATE_TILES = ((64, 32), (32, 32))


# the per-step exponentials each kernel reads: exp(Λ_C - Λ_j) scales the states kernel's a,
# exp(R_t) the adjoint's c and the readouts' c @ S_start; both states kernels store exp(Λ_C)
_EXPONENTIALS = {"states": ("tail", "whole"), "adjoint": ("row", "whole"), "outputs": ("row",)}


def _padded(n: int) -> int:
    return -(-n // 16) * 16


# floats of group memory a kernel keeps per step: log d, two partial sums, Λ, R, Λ_C - Λ, and
# (signed) those of the signs
PER_STEP_FLOATS = 11


def _states_floats(C: int, SK: int, SV: int, pads=(0, 0)) -> int:
    """Floats of group memory the states kernel declares for tiles of ``SK x SV``."""
    cols = pads[1]
    return C * (SK + cols) + C * (SV + cols) + SK * SV + PER_STEP_FLOATS * C


def shared_floats(C: int, KT: int, VT: int, pads=(0, 0), state_tiles=STATE_TILES[-1]) -> dict:
    """Floats of group memory each kernel declares (the states kernel with its own tiles,
    ``state_tiles``); ``pads``: ``Dialect.matrix_pads``."""
    rows, cols = pads
    per_step = PER_STEP_FLOATS * C
    return {"states": _states_floats(C, *state_tiles, pads),
            "outputs": max(2 * C * (KT + rows), C * (VT + cols)) + C * (C + rows)
            + KT * (VT + cols) + C * VT + per_step}


def tiles(C: int, K: int, V: int, shared_bytes: int, pads=(0, 0)) -> tuple:
    """``(KT, VT)``: the outputs kernel's largest tiles (V first: a wider V tile repeats less of
    ``c @ aᵀ``) whose kernels fit ``shared_bytes`` of group memory, or None."""
    for VT in (v for v in TILE_SIZES if v <= _padded(V)):
        for KT in (k for k in TILE_SIZES if k <= _padded(K)):
            if max(shared_floats(C, KT, VT, pads).values()) * 4 <= shared_bytes:
                return KT, VT
    return None


def state_tiles(C: int, K: int, V: int, shared_bytes: int, pads=(0, 0)) -> tuple:
    """The states kernel's ``(K tile, V tile)``: the first of ``STATE_TILES`` no larger than the
    state (rounded up to 16) whose kernel fits ``shared_bytes`` of group memory, else the last
    (the smallest, which every dialect's group memory holds)."""
    for SK, SV in STATE_TILES[:-1]:
        if SK <= _padded(K) and SV <= _padded(V) and \
                _states_floats(C, SK, SV, pads) * 4 <= shared_bytes:
            return SK, SV
    return STATE_TILES[-1]


@dataclass(frozen=True)
class MatrixKernelShape:
    """What a matrix kernel's text depends on: chunk ``C`` (a multiple of 16), state sizes
    ``K``, ``V``, tiles, whether readouts include their own step's decay (``inclusive``) and
    its added term (``diagonal``: ``M[t, t] = 1``), and whether the products run on the matrix
    units (else exact fp32 on the scalar units)."""

    C: int
    K: int
    V: int
    KT: int
    VT: int
    inclusive: bool
    units: bool
    signed: bool = False  # the decay's sign is not known: a ±1 per step, ``sign``
    diagonal: bool = False  # readouts take their own step's added term: M[t, t] = 1
    state_tiles: tuple = STATE_TILES[-1]  # the states kernel's (K tile, V tile)


class MatrixRenderer:
    """Header and bodies of the matrix schedule's kernels for one dialect and shape."""

    def __init__(self, dialect, shape: MatrixKernelShape):
        self.d, self.shape = dialect, shape

    def _context(self, kind: str) -> dict:
        s, (rows, cols) = self.shape, self.d.matrix_pads
        states = kind in ("states", "adjoint", "chain", "adjoint_chain")
        KT, VT = s.state_tiles if states else (s.KT, s.VT)
        return dict(d=self.d, kind=kind, products=kind in ("states", "adjoint", "outputs"), C=s.C,
                    exponentials=_EXPONENTIALS.get(kind, ()), K=s.K, V=s.V, KT=KT, VT=VT, NT=THREADS,
                    units=s.units, i64=self.d.int64, signed=s.signed, inclusive=s.inclusive,
                    diagonal=s.diagonal,  # the causal weights' columns j of row t, and the others
                    causal="j <= t" if s.diagonal else "j < t",
                    masked="j > t" if s.diagonal else "j >= t",
                    LDX=KT + cols, LDY=VT + cols,  # the states kernel's Xᵀ and Y
                    LDC=KT + rows, LDW=s.C + rows, LDS=VT + cols, LDB=VT + cols,
                    tiles=max(2 * s.C * (KT + rows), s.C * (VT + cols)),
                    row_exponent="s" if s.inclusive else "before",
                    row_doc="Λ_t" if s.inclusive else "Λ_t - log d_t")

    def header(self, kind: str) -> str:
        return environment().get_template("matrix_header.j2").render(**self._context(kind))

    def states(self, reverse: bool) -> str:
        ctx = self._context("adjoint" if reverse else "states")
        s = self.shape
        if reverse:
            ctx.update(reverse=True, x_doc="c[j] exp(R_j)", y_doc="dy[j]",
                       x_scale=("row_par[j] * " if s.signed else "") + "row_exp[j]")
        else:
            ctx.update(reverse=False, x_doc="a[j] exp(Λ_C - Λ_j)", y_doc="b[j]",
                       x_scale=("whole_sign * par[j] * " if s.signed else "")
                       + "tail_exp[j]")
        return environment().get_template("matrix_states.j2").render(**ctx)

    def chain(self, reverse: bool) -> str:
        ctx = self._context("adjoint_chain" if reverse else "chain")
        return environment().get_template("matrix_chain.j2").render(reverse=reverse, **ctx)

    def weights(self, adjoint: bool) -> str:
        ctx = self._context("weights_adjoint" if adjoint else "weights")
        return environment().get_template("matrix_weights.j2").render(adjoint=adjoint, **ctx)

    def outputs(self) -> str:
        return environment().get_template("matrix_outputs.j2").render(**self._context("outputs"))

    def gradients(self) -> str:
        return environment().get_template("matrix_gradients.j2").render(
            **self._context("gradients"))


__all__ = ["MatrixKernelShape", "MatrixRenderer", "STATE_TILES", "THREADS", "shared_floats",
           "state_tiles", "tiles"]
