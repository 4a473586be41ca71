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
walk     the two above in one kernel (``adjoint_walk``: the adjoint's): one threadgroup per
         (instance, K tile, V tile; ``walk_tiles``) walks the chunks in order with its tile
         of the state in group memory, ``S <- exp(Λ_C) S + Xᵀ Y``, storing the state entering
         each chunk; each chunk's rows are copied while the chunks before are multiplied
         (``WALK_STAGES``: one chunk ahead on float tiles, three on tiles of halves). It
         moves no ``U`` through device memory, but its groups are as many as the instances
         times the tiles, not times the chunks: it pays where those fill the GPU.
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
chunk_gradients  one threadgroup per (instance, chunk): all of the above for the backward in
         one kernel, the scores, their weights and every product in group memory
         (``gradient_tiles``; where that memory is not given, the three kernels above and MLX's
         matmuls between them).
decay_scores  for a decay per state element, which cannot leave the sum over the state axis
         (``decay_scores_text``): one threadgroup per chunk forms its causal weighted scores
         ``W[t, j] = Σ_k c[t, k] a[j, k] exp(row_log[t, k] - col_log[j, k])``, a thread per
         4 x 4 block; ``decay_scores_adjoint`` takes ``dW`` back onto ``c``, ``a`` and the two
         running sums. The chunk products around them stay MLX's.

``Λ`` is the running sum of ``log d`` within the chunk and ``R_t`` the exponent of readout
``t``: ``Λ_t - log d_t`` (the readout of the state before step ``t``), or ``Λ_t`` for a readout
marked ``decayed`` (``matrix.Readout.decayed``: ``d_t`` multiplies the whole readout). A readout
marked ``diagonal`` (``matrix.Readout.diagonal``: the state after the update, the step's own
added term included) has the causal weights' diagonal too, ``M[t, t] = 1``. A decay
whose sign is not known symbolically brings its sign as a ``±1`` per step, and each weight is
multiplied by the product of the signs over its range (running products within the chunk). Every
product is ``recgen_mm`` on two tiles in group memory: the target's matrix units
(``Dialect.matrix_prelude``: ``simdgroup_matrix`` on Metal, ``mma.sync`` in TF32 on CUDA) or,
for exact fp32, a loop over the scalar units written once for both. Where a kernel's factors
and states are halves the dialect multiplies as they are (``Dialect.half_tiles``), the walks',
outputs' and backward's tiles hold them as given and their products run on them
(``HALF_ARRAYS``; ``mma.sync`` m16n8k16 on CUDA), the weighted scores rounded to the halves.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..matrix import LOG_FLOOR
from .kernels import environment

THREADS = 128  # four simdgroups / warps per threadgroup
# The outputs kernel's groups: eight simdgroups, so each thread forms and copies half as many of
# a chunk's elements (GLA B8 H16 L4096 K=V=64 on an H200, the kernel alone: 641 -> 486 µs)
OUTPUT_THREADS = 256
WALK_KINDS = ("walk", "adjoint_walk")  # the walk through the chunks, and its adjoint's
# The kernels of eight simdgroups a group: the outputs kernel, the backward's and the walks (a
# 64 x 64 state tile is eight strips of the product, one a simdgroup). Walks of sixteen (512
# threads, strips of 16 x 16, registers bounded to 128 a thread) took longer on an H200 at GLA
# B8 H16 L4096 K=V=64: the walk 212 -> 223 µs, its adjoint 202 -> 212
# (benchmarks/results/bench-matrix-tile-passes-H200-2026-11-28.md)
WIDE_KERNELS = ("outputs", "chunk_gradients", *WALK_KINDS)
# How many times the loops over a tile's elements are unrolled: unrolled fully, every address
# of a 64 x 64 tile's copies, or every step's range sums of the causal weights, waits in
# registers (255 a thread on CUDA, and spills)
UNROLL = 8
# The backward's copies unrolled by 4, and its groups bounded to the registers that leave two a
# core (two is what its group memory allows at chunks of 64 on CUDA): its copies unrolled by 8
# and unbounded, it took 255 registers a thread and spilled (one group a core)
GRADIENT_UNROLL, GRADIENT_GROUPS = 4, 2
# The kernels whose copies of a chunk's rows take four floats at a time where the factor's rows
# lie side by side and 16-byte aligned (``matrix_copies.j2``; else a float at a time): a
# quarter of the copies' instructions, where the walk issues an instruction every 4.7 cycles
# with two warps a scheduler. On an H200, GLA B8 H16 L4096 K=V=64 fp32: the forward 1.03-1.06 ->
# 0.92 ms, forward+backward 3.19-3.29 -> 3.10 with the walks, outputs and backward kernels so
# (benchmarks/results/bench-matrix-copies-by-fours-H200-2026-11-27.json)
VECTOR_COPIES = frozenset({"states", "adjoint", *WALK_KINDS, "outputs", "chunk_gradients"})
# Rows of the causal weights a simdgroup loads before it uses any (the weights kernels)
WEIGHT_ROWS = 4
TILE_SIZES = (64, 32, 16)  # K and V tiles, largest first; multiples of the MMA tiles (16 x 8)
# The states kernel's K and V tiles, largest first: each threadgroup repeats its chunk's loads
# of log d and running sums, and a 32 x 32 tile keeps two of four warps busy in the product
# (M = 32 is two strips of 16 rows); 64 x 64 fits CUDA's dynamic shared memory, 64 x 32 its
# 48 KB of static arrays at chunks of 64, not Metal's 32 KB
STATE_TILES = ((64, 64), (64, 32), (32, 32))
# The walks' K and V tiles, largest first (``walk_tiles``): each group repeats its chunks' sums of
# log d and copies the chunks' rows of its K and V tiles, so smaller tiles cost more in all (GLA
# B8 H16 L4096 K=V=64 on an H200, the walk alone: 336 µs in tiles of 64 x 64, 527 in 64 x 32,
# 744 in 32 x 32, though these give 2 and 4 times the groups)
WALK_TILES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16))
# The walks form a chunk's sums of log d in registers, every simdgroup for itself by shuffles
# (``matrix_walk_scan.j2``), where they took three barriers and loops over group memory
# (``matrix_cumulate.j2``, which the kernels with one chunk a group keep): on H200s at GLA B8
# H16 L4096 K=V=64 bf16 the walk 219 -> 178 µs, its adjoint 202 -> 182
# (benchmarks/results/bench-matrix-walk-scan-H200-2026-11-28.md)


# the per-chunk sums each kernel reads beyond log d's running sums (``matrix_cumulate.j2``):
# the exponentials exp(Λ_C - Λ_j) ("tail", scaling the states kernel's a), exp(R_t) ("row":
# the adjoint's c, the readouts' c @ S_start) and Λ_C ("whole": both states kernels store
# exp(Λ_C)); and the sums of whole groups of 8 steps between any two groups ("spans", for the
# kernels that sum a range per weight)
_CHUNK_SUMS = {"states": ("tail", "whole"), "adjoint": ("row", "whole"),
               "outputs": ("row", "spans"), "weights": ("spans",), "weights_adjoint": ("spans",),
               "chunk_gradients": ("row", "tail", "spans")}


def chunk_sums(kind: str, half: bool = False) -> tuple:
    """The per-chunk sums ``kind``'s kernel reads (``_CHUNK_SUMS``). Where its products take
    tiles of halves (``half``), the causal weights' exponents are differences of two running
    sums, ``R_t - Λ_j`` (\"running\": the arrays ``row_cum`` and ``cum``), as FLA's kernels form
    them, in place of a sum over each exponent's own range (\"spans\"): the difference is off
    by a few units in the last place of ``Λ`` (5e-4 at -6400, log d's floor over a chunk of 64,
    where every weight but the diagonal's is 0 anyway), at most the size of the weight's own
    rounding to a half, and two loads and a subtraction where the range sum took a branch and
    four loads."""
    sums = _CHUNK_SUMS.get(kind, ())
    return tuple("running" if key == "spans" else key for key in sums) if half else sums
# The backward's tiles of K and V (``gradient_tiles``), largest first: its group memory holds
# two [C, C] arrays beside two tiles of the chunk's rows, two of its states and two products
GRADIENT_TILES = ((64, 64), (64, 32), (32, 64), (32, 32), (32, 16), (16, 32), (16, 16))
# The pad of a row of a tile of halves (``Dialect.half_tiles``), in halves: the products load
# such tiles eight rows at a time (ldmatrix), each row's 16 bytes from its own address, which
# must be 16-byte aligned; rows an odd number of 16-byte words apart fall in distinct banks
HALF_PAD = 8


def group_threads(kind: str) -> int:
    """Threads of a group of ``kind``'s kernel."""
    return OUTPUT_THREADS if kind in WIDE_KERNELS else THREADS


def _weight_rows(rows: int) -> int:
    """Rows of the causal weights a simdgroup loads at a time, of the ``rows`` it takes: the
    most, up to ``WEIGHT_ROWS``, that divide them (a chunk of 48 in 8 simdgroups: 6 rows, 3)."""
    return max(n for n in range(1, WEIGHT_ROWS + 1) if rows % n == 0)


def _padded(n: int) -> int:
    return -(-n // 16) * 16


@dataclass(frozen=True)
class GroupMemory:
    """A kernel's group memory: ``arrays`` in order, ``(name, size as the kernel spells it,
    floats)``. ``dynamic``: one buffer sized at launch (``Dialect.dynamic_shared``), each array a
    pointer into it, where the arrays exceed what the target lets a kernel declare; else
    declared arrays. The templates declare what this lists (``matrix_memory.j2``), so the
    tilings are chosen on the memory the kernels take."""

    arrays: tuple
    dynamic: bool = False
    halves: tuple = ()  # the arrays whose elements are the kernel's tile type, not floats

    @property
    def bytes(self) -> int:
        return 4 * sum(_aligned(floats) for *_, floats in self.arrays)

    def placed(self) -> list:
        """``(name, size, offset in floats)`` of each array, each 16-byte aligned (the passes
        over tiles read and write four floats at a time, ``recgen_load4``)."""
        out, offset = [], 0
        for name, size, floats in self.arrays:
            out.append((name, size, offset))
            offset += _aligned(floats)
        return out


def _aligned(floats: int) -> int:
    """``floats`` rounded up to whole 16-byte words."""
    return -(-floats // 4) * 4


def _step_arrays(kind: str, C: int, signed: bool, half: bool = False) -> list:
    """The per-step values of ``matrix_cumulate.j2``: log d and its sums within groups of 8
    steps, the sums the kernel reads (``chunk_sums``), and the signs' running
    products for a decay of unknown sign."""
    sums = chunk_sums(kind, half)
    names = ["step_log", "part", "part_before"]
    names += ["cum"] if {"whole", "running"} & set(sums) else []
    names += ["row_cum"] if "running" in sums else []
    names += [name for key, name in (("row", "row_exp"), ("tail", "tail_exp"))
              if key in sums]
    if signed:
        names += ["step_sign", "sign_part", "sign_part_before", "par", "row_par"]
    spans = [("group_spans", "(C / 8) * (C / 8)", (C // 8) ** 2)] if "spans" in sums else []
    return [(n, "C", C) for n in names] + spans


def _floats(n: int, half: bool) -> int:
    """The floats of group memory that ``n`` elements take: floats, or halves (``half``)."""
    return -(-n // 2) if half else n


# The arrays that hold halves where a kernel multiplies them as they are (``group_arrays``'s
# ``half``; the outputs kernel's tiles of rows are halves in its float array ``tiles``)
HALF_ARRAYS = {"chunk_gradients": ("Wh", "dWh", "Xs", "Ys", "Ss", "Gs"), "outputs": ("Ss", "Wh"),
               **{kind: ("X", "Y") for kind in WALK_KINDS}}
# The chunks of rows a walk keeps in group memory, by its tiles' elements: the one it multiplies
# and those whose copies are in flight meanwhile. A walk is one group a core, waiting on its
# next chunk's rows (a chunk of GLA B8's walk took about 2 µs on an H200 with one in flight);
# tiles of halves take half the bytes, so twice the chunks fit the same memory
WALK_STAGES = {"float": 2, "half": 4}


def walk_stages(half: bool) -> int:
    """The chunks of rows a walk holds at a time (``WALK_STAGES``), with tiles of halves or not."""
    return WALK_STAGES["half" if half else "float"]


def gradient_arrays(C: int, KT: int, VT: int, pads=(0, 0), half=False) -> list:
    """The backward kernel's own arrays: the scores and their weights, two tiles of the chunk's
    rows (``c`` and ``a``, or ``dy`` and ``b``), two of its states (``S`` and ``G``) and two
    products. With ``half`` (its factors and states halves of a kind the dialect multiplies as
    they are) the tiles of rows and states hold halves, and so do copies of the weighted
    scores (``Wh``, ``dWh``), the operands of the products after them, rounded as FLA's
    kernels round theirs; the scores are summed in floats. Each array's rows are padded:
    ``pads[0]`` floats, ``HALF_PAD`` halves (``gradient_pads``)."""
    wide, warps = max(KT, VT), group_threads("chunk_gradients") // 32
    ldw, ldt, lds, ldp = gradient_pads(C, KT, VT, pads, half)
    tiles = [("Xs", "C * LDT", C * ldt), ("Ys", "C * LDT", C * ldt),
             ("Ss", "KT * LDS", KT * lds), ("Gs", "KT * LDS", KT * lds)]
    if half:
        tiles = [("Wh", "C * LDWH", C * (C + HALF_PAD)), ("dWh", "C * LDWH", C * (C + HALF_PAD))] \
            + tiles
        tiles = [(name, size, _floats(n, half)) for name, size, n in tiles]
    return [("W", "C * LDW", C * ldw), ("dW", "C * LDW", C * ldw), *tiles,
            ("Pa", "C * LDP", C * ldp), ("Pb", "C * LDP", C * ldp),
            ("sums", "WARPS * C", warps * C), ("warp_sums", "WARPS", warps)]


def gradient_pads(C: int, KT: int, VT: int, pads=(0, 0), half=False) -> tuple:
    """The backward kernel's row lengths ``(LDW, LDT, LDS, LDP)``: its scores', rows', states'
    and products' (``pads`` as ``gradient_arrays``; every array a product's operand read
    row-wise: the row pad). Tiles of halves pad by ``HALF_PAD``."""
    rows, wide = pads[0], max(KT, VT)
    pad = HALF_PAD if half else rows
    return C + rows, wide + pad, VT + pad, wide + rows


def group_arrays(kind: str, C: int, KT: int, VT: int, pads=(0, 0), signed=False,
                 K: int = None, half=False) -> list:
    """The arrays ``kind``'s kernel keeps in group memory (``GroupMemory.arrays``), for tiles of
    ``KT x VT`` (the states kernels': their own ``state_tiles``) of a state of ``K`` rows (None:
    more than one tile); ``pads``: ``Dialect.matrix_pads``; ``half``: the tiles of halves of the
    kernels that take them (``HALF_ARRAYS``)."""
    rows, cols = pads
    if kind in ("states", "adjoint"):
        own = [("X", "C * LDX", C * (KT + cols)), ("Y", "C * LDY", C * (VT + cols)),
               ("S", "KT * VT", KT * VT)]
    elif kind in WALK_KINDS:
        # buffers of the chunks' rows and log d (signs) by turns (``walk_stages``), and the
        # state's tile
        stages = walk_stages(half)
        own = [("X", "STAGES * C * LDX", _floats(stages * C * (KT + cols), half)),
               ("Y", "STAGES * C * LDY", _floats(stages * C * (VT + cols), half)),
               ("S", "KT * VT", KT * VT), ("logs", "STAGES * C", stages * C)]
        own += [("signs", "STAGES * C", stages * C)] if signed else []
        return own  # the sums of log d in registers (matrix_walk_scan.j2)
    elif kind == "outputs":
        # c and a side by side, later b in the same memory; with one tile of K, the readouts
        # too, past c's and b's rows (``_outputs_in_tiles``). With ``half``: c, a, b and S_start
        # as halves, and the weights rounded to them (``Wh``)
        ldc, ldb, lds = output_pads(KT, VT, pads, half)
        tiles = _floats(max(2 * C * ldc, C * ldb), half)
        at = _outputs_in_tiles(C, K, KT, VT, pads, half)
        own = [("tiles", "TILES", max(tiles, at + C * VT) if at is not None else tiles),
               ("W", "C * LDW", C * (C + rows)), ("Ss", "KT * LDS", _floats(KT * lds, half))]
        own += [("Wh", "C * LDWH", _floats(C * (C + HALF_PAD), half))] if half else []
        own += [("Yt", "C * VT", C * VT)] if at is None else []
    elif kind == "chunk_gradients":
        own = gradient_arrays(C, KT, VT, pads, half)
    elif kind == "weights_adjoint":
        own = [("sums", "WARPS * C", (THREADS // 32) * C)]
    elif kind == "weights":
        own = []
    else:  # the chains and the gradients kernel keep nothing in group memory
        return []
    return own + _step_arrays(kind, C, signed, half)


def output_pads(KT: int, VT: int, pads=(0, 0), half=False) -> tuple:
    """The outputs kernel's row lengths ``(LDC, LDB, LDS)``, of its tiles of ``c`` and ``a``, of
    ``b`` and of ``S_start``: ``c`` and ``a`` read row-wise (the row pad), ``b`` and the state by
    columns (the column pad); tiles of halves pad by ``HALF_PAD``."""
    rows, cols = (HALF_PAD, HALF_PAD) if half else pads
    return KT + rows, VT + cols, VT + cols


def _outputs_in_tiles(C: int, K, KT: int, VT: int, pads, half=False):
    """Where the outputs kernel's readouts ``[C, VT]`` lie in its ``tiles`` (floats from its
    start), or None where they take their own array. With one tile of K, ``a``'s rows are done
    with once ``c aᵀ`` is formed, before the first readout is written, so the readouts take
    their place past ``c``'s rows (read by ``c S_start``) and ``b``'s (read by ``W b``): a
    group's memory is then a fifth less (GLA's chunks of 64 on CUDA: 89.6 -> 73.2 KB, three
    groups a core where two were)."""
    if K is None or KT < K:  # a's rows come again for the next tile of K
        return None
    ldc, ldb, _ = output_pads(KT, VT, pads, half)
    return _aligned(_floats(max(C * ldc, C * ldb), half))


def group_memory(kind: str, C: int, KT: int, VT: int, dialect, signed=False, K: int = None,
                 half=False):
    """``kind``'s ``GroupMemory`` on ``dialect`` (a state of ``K`` rows, as ``group_arrays``;
    ``half``: its tiles of halves), or None where it fits neither the arrays the
    target lets a kernel declare nor its dynamic group memory."""
    arrays = tuple(group_arrays(kind, C, KT, VT, dialect.matrix_pads, signed, K, half))
    halves = HALF_ARRAYS.get(kind, ()) if half else ()
    memory = GroupMemory(arrays, halves=halves)
    if memory.bytes <= dialect.shared_bytes:
        return memory
    if memory.bytes <= dialect.dynamic_shared_bytes:
        return GroupMemory(arrays, dynamic=True, halves=halves)
    return None


def tiles(C: int, K: int, V: int, dialect, signed=False) -> tuple:
    """``(KT, VT)``: the outputs kernel's largest tiles (V first: a wider V tile repeats less of
    ``c @ aᵀ``) whose group memory ``dialect`` gives (``group_memory``), or None."""
    for VT in (v for v in TILE_SIZES if v <= _padded(V)):
        for KT in (k for k in TILE_SIZES if k <= _padded(K)):
            if group_memory("outputs", C, KT, VT, dialect, signed, K) is not None:
                return KT, VT
    return None


def state_tiles(C: int, K: int, V: int, dialect, signed=False) -> tuple:
    """The states kernel's ``(K tile, V tile)``: the first of ``STATE_TILES`` no larger than the
    state (rounded up to 16) whose group memory ``dialect`` gives, else the last (the smallest,
    which every dialect's group memory holds)."""
    for SK, SV in STATE_TILES[:-1]:
        if SK <= _padded(K) and SV <= _padded(V) and \
                group_memory("states", C, SK, SV, dialect, signed) is not None:
            return SK, SV
    return STATE_TILES[-1]


def walk_tiles(C: int, K: int, V: int, dialect, signed=False):
    """The walks' ``(K tile, V tile)``: the first of ``WALK_TILES`` no larger than the state
    (rounded up to 16) whose group memory ``dialect`` gives, or None where none fits."""
    for KT, VT in WALK_TILES:
        if KT <= _padded(K) and VT <= _padded(V) and \
                group_memory("walk", C, KT, VT, dialect, signed) is not None:
            return KT, VT
    return None


def gradient_tiles(C: int, K: int, V: int, dialect, signed=False):
    """The backward kernel's ``(K tile, V tile)``: the first of ``GRADIENT_TILES`` no larger than
    the state (rounded up to 16) whose group memory ``dialect`` gives, or None where none fits
    (the backward then runs as three kernels around MLX's matmuls)."""
    for KT, VT in GRADIENT_TILES:
        if KT <= _padded(K) and VT <= _padded(V) and \
                group_memory("chunk_gradients", C, KT, VT, dialect, signed) is not None:
            return KT, VT
    return None


# The scores of a chunk under a decay per state element and their adjoint (``decay_scores``):
# ``W[t, j] = Σ_k c[t, k] a[j, k] exp(row_log[t, k] - col_log[j, k])``, the readouts' and a
# delta rule's causal weights where the decay varies over the state axis, and so cannot leave
# the sum over it as a scalar decay's weights do
DECAY_SCORE_KINDS = ("decay_scores", "decay_scores_adjoint")
# Their tiles of the state axis, largest first: the adjoint keeps a chunk's [C, C] cotangent in
# group memory beside four tiles of [C, KB]
DECAY_SCORE_TILES = (16, 8)


def decay_score_chunk(C: int) -> int:
    """The chunk the decay-score kernels run for ``C`` steps: the next multiple of 8 (a thread
    takes two quads of steps); the steps past ``C`` add nothing to the weights before them."""
    return -(-C // 8) * 8


def decay_score_tile(C: int, dialect):
    """The state elements the decay-score kernels take at a time: the first of
    ``DECAY_SCORE_TILES`` whose adjoint's group memory ``dialect`` declares, or None (they need
    a chunk that is a multiple of 8: a thread takes two quads of steps)."""
    if C % 8 or C <= 0:
        return None
    for KB in DECAY_SCORE_TILES:
        if 4 * decay_score_floats("decay_scores_adjoint", C, KB) <= dialect.shared_bytes:
            return KB
    return None


def decay_score_floats(kind: str, C: int, KB: int) -> int:
    """Floats of group memory of a decay-score kernel: six tiles of the chunk's rows (``c``,
    ``a``, the two running sums, ``x`` and ``y``), padded a float a row against bank conflicts;
    the adjoint's beside the chunk's cotangent ``[C, C + 1]``."""
    if kind == "decay_scores":
        return 6 * KB * (C + 1)
    return C * (C + 1) + 6 * C * (KB + 1)


def decay_score_threads(kind: str, C: int, KB: int) -> int:
    """Threads of a group of a decay-score kernel: the forward's one per 4 x 4 block of the
    causal triangle (whole simdgroups), the adjoint's one per state element and pair of quads
    of steps, in each of its two roles."""
    if kind == "decay_scores":
        quads = C // 4
        return -(-quads * (quads + 1) // 2 // 32) * 32
    return C * KB // 4


def decay_scores_text(dialect, kind: str, C: int, K: int) -> tuple:
    """``(header, body)`` of a decay-score kernel (``DECAY_SCORE_KINDS``) for chunks of ``C``
    steps and ``K`` state elements."""
    KB = decay_score_tile(C, dialect)
    if kind not in DECAY_SCORE_KINDS or KB is None:
        raise ValueError(f"no {kind!r} kernel for chunks of {C} steps on {dialect.name}")
    ctx = dict(d=dialect, kind=kind, C=C, K=K, KB=KB, NT=decay_score_threads(kind, C, KB),
               i64=dialect.int64, products=False, bounds="", adjoint=kind.endswith("adjoint"),
               log_floor=None)  # its exponents come floored (mlx_matrix.py)
    env = environment()
    return (env.get_template("matrix_header.j2").render(**ctx),
            env.get_template("matrix_decay_scores.j2").render(**ctx))


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
    gradient_tiles: tuple = None  # the backward kernel's, None where its memory is not given
    walk_tiles: tuple = None  # the walks', None where their memory is not given


class MatrixRenderer:
    """Header and bodies of the matrix schedule's kernels for one dialect and shape."""

    def __init__(self, dialect, shape: MatrixKernelShape):
        self.d, self.shape = dialect, shape

    def _tiles(self, kind: str) -> tuple:
        """The ``(K tile, V tile)`` of ``kind``'s kernel: the states kernels' own."""
        s = self.shape
        if kind == "chunk_gradients":
            return s.gradient_tiles
        if kind in WALK_KINDS:
            return s.walk_tiles
        return s.state_tiles if kind in ("states", "adjoint", "chain", "adjoint_chain") \
            else (s.KT, s.VT)

    def _context(self, kind: str, tile: str = "float") -> dict:
        s, (rows, cols) = self.shape, self.d.matrix_pads
        memory = self.memory(kind, tile)
        KT, VT = self._tiles(kind)
        warps = group_threads(kind) // 32
        half = tile != "float"
        LDW, LDT, LDS, LDP = gradient_pads(s.C, KT, VT, self.d.matrix_pads, half)
        LDC, LDB, LDS_OUT = output_pads(KT, VT, self.d.matrix_pads, half)
        return dict(d=self.d, kind=kind, C=s.C,
                    vector_copies=kind in VECTOR_COPIES,
                    products=kind in ("states", "adjoint", "outputs", "chunk_gradients",
                                      *WALK_KINDS),
                    sums=chunk_sums(kind, half), K=s.K, V=s.V, KT=KT, VT=VT,
                    log_floor=f"{LOG_FLOOR!r}f" if kind in (*_CHUNK_SUMS, *WALK_KINDS) else None,
                    NT=group_threads(kind),
                    units=s.units, i64=self.d.int64, signed=s.signed, inclusive=s.inclusive,
                    diagonal=s.diagonal,  # the causal weights' columns j of row t, and the others
                    causal="j <= t" if s.diagonal else "j < t",
                    masked="j > t" if s.diagonal else "j >= t",
                    # a run of 32 columns from 32 h on, all of them masked
                    masked_run="32 * h > t" if s.diagonal else "32 * h >= t",
                    LDX=KT + cols, LDY=VT + cols,  # the states kernel's Xᵀ and Y
                    LDC=LDC, LDW=LDW, LDB=LDB, LDWH=s.C + HALF_PAD, tile=tile, half=half,
                    # the outputs kernel's S_start (read by columns); the backward's S and G
                    LDS=LDS if kind == "chunk_gradients" else LDS_OUT,
                    # the outputs kernel's c and a tiles (later b's): their floats, and where
                    # its readouts lie in them (None: in their own array)
                    tiles={name: n for name, _, n in memory.arrays}.get("tiles"),
                    outputs_at=_outputs_in_tiles(s.C, s.K, KT, VT, self.d.matrix_pads, half),
                    row_exponent="s" if s.inclusive else "before",
                    row_doc="Λ_t" if s.inclusive else "Λ_t - log d_t",
                    memory=memory, ROWS=_weight_rows(s.C // warps), stages=walk_stages(half),
                    UNROLL=GRADIENT_UNROLL if kind == "chunk_gradients" else UNROLL,
                    bounds=self.d.launch_bounds.format(threads=group_threads(kind),
                                                       groups=GRADIENT_GROUPS)
                    if kind == "chunk_gradients" else "",
                    # the backward's tiles of rows and products
                    LDT=LDT, LDP=LDP)

    def memory(self, kind: str, tile: str = "float") -> GroupMemory:
        """The group memory of ``kind``'s kernel with tiles of ``tile`` (a shape is only made
        where it fits with floats; ``tile`` is a half type only where that fits too)."""
        s = self.shape
        if self._tiles(kind) is None:
            raise ValueError(f"the matrix {kind} kernel's group memory for C={s.C}, K={s.K}, "
                             f"V={s.V} exceeds what {self.d.name} gives a kernel")
        KT, VT = self._tiles(kind)
        memory = group_memory(kind, s.C, KT, VT, self.d, s.signed, s.K, tile != "float")
        if memory is None:
            raise ValueError(f"the matrix {kind} kernel's group memory for C={s.C}, tiles of "
                             f"{KT} x {VT} exceeds what {self.d.name} gives a kernel")
        return memory

    def header(self, kind: str, tile: str = "float") -> str:
        return environment().get_template("matrix_header.j2").render(
            **self._context(kind, tile))

    def states(self, reverse: bool) -> str:
        ctx = self._context("adjoint" if reverse else "states")
        ctx.update(reverse=reverse, **self._scaled_rows(reverse))
        return environment().get_template("matrix_states.j2").render(**ctx)

    def walk(self, reverse: bool, tile: str = "float", ends=(True, True)) -> str:
        """The walk (``reverse``: its adjoint's); ``tile``: the type of its tiles of ``x`` and
        ``y``, ``float`` or (``Dialect.half_tiles``) the factors' half type, which the product
        then takes as it is; ``ends``: whether it reads the state it starts from (``init``;
        else zero) and writes the one it ends at (``last``)."""
        kind = "adjoint_walk" if reverse else "walk"
        ctx = self._context(kind, tile)
        ctx.update(reverse=reverse, reads_init=ends[0], writes_last=ends[1],
                   **self._scaled_rows(reverse))
        return environment().get_template("matrix_walk.j2").render(**ctx)

    def _scaled_rows(self, reverse: bool) -> dict:
        """The states' and walks' ``Xᵀ Y``: what ``X`` and ``Y`` are, and the scale of ``X``'s
        rows (``x_scale``, of row ``j``, in the states kernels' sums; the walks form their own,
        ``matrix_walk_scan.j2``)."""
        if reverse:
            return dict(x_doc="c[j] exp(R_j)", y_doc="dy[j]",
                        x_scale=("row_par[j] * " if self.shape.signed else "") + "row_exp[j]")
        return dict(x_doc="a[j] exp(Λ_C - Λ_j)", y_doc="b[j]",
                    x_scale=("whole_sign * par[j] * " if self.shape.signed else "")
                    + "tail_exp[j]")

    def chain(self, reverse: bool) -> str:
        ctx = self._context("adjoint_chain" if reverse else "chain")
        return environment().get_template("matrix_chain.j2").render(reverse=reverse, **ctx)

    def weights(self, adjoint: bool) -> str:
        ctx = self._context("weights_adjoint" if adjoint else "weights")
        return environment().get_template("matrix_weights.j2").render(adjoint=adjoint, **ctx)

    def outputs(self, tile: str = "float") -> str:
        """The readouts; ``tile``: the type of the tiles of ``c``, ``a``, ``b`` and ``S_start``,
        ``float`` or ``tile``'s half type, which the products then take as it is (and the
        weights rounded to it)."""
        return environment().get_template("matrix_outputs.j2").render(
            **self._context("outputs", tile))

    def gradients(self) -> str:
        return environment().get_template("matrix_gradients.j2").render(
            **self._context("gradients"))

    def tile(self, kind: str, half: str) -> str:
        """The element type of the tiles of ``kind``'s kernel (the walks', the outputs' or the
        backward's, ``HALF_ARRAYS``) for factors and states that are all halves of the
        dialect's type ``half`` (``Dialect.half_tiles``; None: they are not): that type where
        the kernel's group memory with tiles of halves fits its tiles, else ``float``."""
        s = self.shape
        if half is None or kind not in HALF_ARRAYS or self._tiles(kind) is None or \
                group_memory(kind, s.C, *self._tiles(kind), self.d, s.signed, s.K,
                             half=True) is None:
            return "float"
        return half

    def chunk_gradients(self, tile: str = "float") -> str:
        """The backward of the chunks in one kernel; ``tile``: the type of its tiles of rows and
        states, ``float`` or ``tile``'s half type, which the products then take as it
        is (and the weighted scores rounded to it)."""
        return environment().get_template("matrix_chunk_gradients.j2").render(
            **self._context("chunk_gradients", tile))


__all__ = ["DECAY_SCORE_KINDS", "DECAY_SCORE_TILES", "GRADIENT_TILES", "HALF_ARRAYS",
           "GroupMemory", "HALF_PAD", "MatrixKernelShape", "MatrixRenderer", "OUTPUT_THREADS",
           "STATE_TILES", "THREADS", "VECTOR_COPIES", "WALK_KINDS", "WALK_STAGES", "WALK_TILES",
           "WIDE_KERNELS", "decay_score_chunk", "decay_score_floats", "decay_score_threads",
           "decay_score_tile", "decay_scores_text", "gradient_arrays", "gradient_pads",
           "gradient_tiles", "group_arrays", "group_memory", "group_threads", "output_pads",
           "state_tiles", "tiles", "walk_stages", "walk_tiles"]
