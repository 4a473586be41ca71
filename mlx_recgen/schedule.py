"""Kernel schedules: how a call maps onto GPU threads, and the runtime values a kernel reads.

Three kernel schedules, chosen in one place (``choose``; ``matrix`` runs MLX ops and, on the
kernel backends, the chunk kernels of ``backends/matrix_kernels.py``):

* ``sequential``: one thread per (instance, lane) walks all ``L`` steps, writing a checkpoint
  every ``seg`` steps; the backward walks segments newest first. Any recurrence.
* ``chunked``: for state-affine recurrences (``affine.analyse``) time runs in parallel. One
  thread per (segment, instance, lane) summarises its segment (local end state from zero,
  composed multiplier), one thread per (state element, instance, lane) carries the summaries
  over segments into the checkpoints, then every segment reruns its steps from its checkpoint
  and writes the outputs. The backward mirrors it: local adjoints per segment, a carry of ``λ``
  with the transposed multipliers, then every segment sweeps its adjoint and writes the
  gradients (``render/chunked.py``).
* ``scan``: for state-affine recurrences without a state axis (``scan_misfit``), one kernel per
  pass that reads every input once: a threadgroup per (instance, block of lanes) walks time in
  stretches, each thread a run of ``seg`` steps held in registers, the runs' affine maps
  composed through shuffles and one threadgroup pass, the state carried from stretch to
  stretch (``render/scan.py``, docs/scan.md).

Mapping: one thread per (instance, lane). The lanes of one instance are padded to a multiple of
32, then split into ``groups_per_instance`` threadgroups of ``TG`` threads; grid x counts all of
them (instances are folded into x, so no grid dimension limit caps the batch).

Gradients reduced over lanes (of inputs without the lane axis) are summed in-kernel over the
lanes of each threadgroup: shuffles within a simdgroup (``LC`` values of a thread at once, see
``Schedule.lane_chunk``), then threadgroup memory across simdgroups. When all
lanes of an instance fit in one group (at most 1024 threads; 256 on CUDA, see
``Dialect.max_threads``), that is the whole sum; otherwise each group writes its partial sum along a leading axis of the gradient buffer and an MLX sum over that axis
finishes it after the kernel (deterministic: no atomics). Threadgroup memory holds at most
32 KiB of rows; beyond that the rows are reduced in rounds.

Compile-time constants (template parameters): the state size ``NS``, the segment ``SEG`` and the
threads per group ``TG``. Everything else — sequence length, batch sizes, lane count, strides —
is a runtime value in the ``meta`` array, so a new sequence length reuses the compiled kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import mlx.core as mx

from .spec import Spec

MAX_THREADS = 1024
REGISTER_HISTORY_FLOATS = 128  # per thread; beyond this the recomputed segment goes to scratch
MAX_SHARED_BYTES = 32 * 1024  # threadgroup memory of a kernel (Metal's guaranteed size)
MAX_SHARED_FLOATS = MAX_SHARED_BYTES // 4
# Inputs every lane reads (no lane axis, one value per step, or a vector over the state axis)
# are staged in threadgroup memory a tile of steps at a time: loaded once per group, coalesced,
# all of a tile's loads in flight at once, instead of once per lane and step. Their share of
# threadgroup memory, and the longest tile:
STAGE_MAX_BYTES = 16 * 1024
STAGE_MAX_STEPS = 32

COMPONENT = None  # the key of a component axis among axis names (never a str)
LANE_GROUPS = 0  # the key of the partial-sum axis of a lane-reduced gradient (never a str)
SEGMENTS = 1  # the key of the per-segment partial-sum axis of a parameter gradient (chunked)
LANES = 2  # the key of the per-lane axis of a shared state's initial-state gradient


def members(group_axis: str) -> tuple:
    """The key of the partial-sum axis of a gradient over the members of a group axis (one
    partial sum per ``h % (H / Hk)``)."""
    return ("members", group_axis)


SCHEDULES = ("auto", "sequential", "chunked", "matrix", "scan")
SEQUENTIAL_SEG = 32
# The chunked schedule wants enough (segment, instance, lane) threads to fill a large GPU, and
# segments short enough that a thread's recomputed segment stays in thread-private memory.
CHUNKED_TARGET_THREADS = 1 << 17
# The sequential schedule splits a lane's state over up to SPLIT_MAX threads while instances x
# lanes give fewer than SPLIT_TARGET_THREADS threads, keeping at least SPLIT_MIN_STATE state
# elements per thread. (H200, gated DeltaNet K=V=64: at 36 instances x 64 lanes a split of 4
# beat 8 forward (0.43 vs 0.77 ms) and forward+backward (1.99 vs 2.81 ms); at 128 instances
# no split beat 4, 11.5 vs 12.2 ms.)
SPLIT_TARGET_THREADS = 1 << 13
# The sequential backward of a spec with lane-reduced gradients picks groups of at most this
# many threads (see make_schedule).
BACKWARD_MAX_THREADS = 128
SPLIT_MAX = 8
LANE_CHUNK_MAX = 8
SPLIT_MIN_STATE = 4
CHUNKED_HISTORY_FLOATS = 1024
CHUNKED_MIN_SEG = 8
# Where one sequential step already has this much state to update (instances x padded lanes x
# state floats per lane), the sequential kernel fills the GPU and chunking only adds traffic:
# on an H100, GLA and SSD with 128 instances x 64 lanes x 64 state floats ran as fast or faster
# sequentially, with half the memory; with 2,304 lanes x 16-64 floats chunked ran 1.3-2x faster.
CHUNKED_MAX_SEQUENTIAL_WORK = 1 << 19
# The pure-MLX chunked form: every scan round is a few MLX ops over a whole segment, so long
# segments mean few ops; the segment's arrays (states, multipliers) bound it.
MLX_MAX_CHUNK = 64
# The matrix schedule's chunk: [C, C] decay matrices and [C, K] x [K, V] products per chunk.
MATRIX_CHUNK = 64
# Its chunk in MLX ops on the CPU where every decay is a scalar (``matrix_chunk``): there the
# products run on the CPU's BLAS, whose rate does not grow with their size, and a chunk of 32
# has half the [C, C] work per step of one of 64 (2-core x86, mlx 0.32.4, gradients of
# every input, chunks of 16 / 32 / 64: GLA B2 H4 L1024 K=V=32 72 / 55 / 65 ms, B2 H8 L512
# K=V=64 204 / 134 / 153 ms; gated DeltaNet B2 H4 L512 K=V=64 203 / 191 / 232 ms; Mamba-2
# B2 L256 H8 P64 N128 98 against 103 ms at 64). HGRN2's vector decay, whose weights take
# sub-chunks, ran 106 / 102 / 98 ms: vector decays keep MATRIX_CHUNK.
MATRIX_CHUNK_CPU = 32
# Where ``auto`` runs the matrix schedule (``matrix_pays``): on CUDA (Metal's matrix kernels are
# unmeasured on an Apple GPU; the pure-MLX backend keeps its forms), for a recurrence whose every
# decay is a scalar per step and which is no delta rule, over at least two chunks and
# MATRIX_AUTO_MIN_WORK instance-steps (B x H x L). Measured on an H200, GLA K=V=64 fp32, ms
# forward / forward+backward: B3 H12 L2048 (73728 instance-steps) matrix 0.26-0.34 / 1.33-1.79
# against sequential 1.60 / 5.54 pipelined and 0.49 / 1.80 queued; B8 H16 L4096 matrix
# 0.90 / 3.14 against sequential 1.07 / 9.91 (benchmarks/results/bench-peers-b3-pipelined-*,
# bench-matrix-glue-*, bench-matrix-final-H200-2026-11-27.md). Not taken: a decay per state
# element (SSD N16 at B3: the older kernels 1.29 ms forward+backward on an H100, the matrix
# form 2.01 on an H200), a delta rule (gated DeltaNet B3: forward 1.98 ms against sequential
# 1.51).
MATRIX_AUTO_BACKENDS = ("cuda",)
MATRIX_AUTO_MIN_WORK = 1 << 16
MLX_CHUNK_FLOATS = 1 << 22


def axis_strides(t, sizes) -> dict:
    """Row-contiguous strides of a tensor's declared axes, by axis name (``COMPONENT`` for a
    component axis)."""
    strides, step = {}, 1
    for a in reversed(t.axes):
        strides[COMPONENT if isinstance(a, int) else a] = step
        step *= a if isinstance(a, int) else sizes[a]
    return strides


@dataclass(frozen=True)
class Schedule:
    seg: int
    threads: int  # threads per group (TG)
    groups_per_instance: int
    lane_reduction: bool  # some gradient is reduced over lanes
    history: str  # "registers" | "scratch"
    state_size: int  # NS (1 without a state axis)
    kind: str = "sequential"  # | "chunked" | "scan"
    time_rounds: bool = False  # per-step lane reductions in rounds inside the state loop
    stage_steps: int = 0  # TILE: steps of the lane-shared inputs staged at once (0: none)
    stage_floats: int = 0  # floats of lane-shared inputs per step
    lane_chunk: int = 1  # LC: values of a thread summed over lanes at once (see lane_chunk)
    parts: int = 1  # PARTS: threads per lane, each holding NS / PARTS of the state (split)
    lane_block: int = 32  # LB: lanes of a threadgroup (scan; ``seg`` is then its stretch)
    run: int = 1  # RUN: consecutive steps of one thread (scan)
    # WINDOW (scan, forward): a group per stretch, the state entering it from the groups of
    # the stretches before it (the look-back over WINDOW stretches); 0: a group walks all
    lookback: int = 0

    @property
    def time_threads(self) -> int:
        """Threads along time of one lane (the scan schedule; 1 otherwise)."""
        return self.threads // self.lane_block if self.kind == "scan" else 1

    @property
    def simdgroups(self) -> int:
        return self.threads // 32

    @property
    def lane_partials(self) -> bool:
        """Lane-reduced gradients come out as one partial sum per group of an instance."""
        return self.lane_reduction and self.groups_per_instance > 1

    @property
    def reduction_floats(self) -> int:
        """Threadgroup memory left for lane reductions once the staged inputs have theirs."""
        return MAX_SHARED_FLOATS - self.stage_steps * self.stage_floats

    @property
    def shared_rows(self) -> int:
        """Rows of the threadgroup reduction buffer (``reduction_floats``): a column per
        simdgroup, plus one of padding."""
        return self.reduction_floats // (self.simdgroups + 1)

    def template(self):
        if self.kind == "scan":
            return [("STRETCH", self.seg), ("TG", self.threads), ("LB", self.lane_block),
                    ("RUN", self.run), *([("WINDOW", self.lookback)] if self.lookback else [])]
        return [("NS", self.state_size), ("SEG", self.seg), ("TG", self.threads),
                ("TILE", self.stage_steps), ("LC", self.lane_chunk), ("PARTS", self.parts)]


def history_rows(spec: Spec, state_size: int) -> int:
    """Floats of state per thread and step: ``state_size`` per vector slot, 1 per scalar slot."""
    return sum(t.components * (state_size if t.has_state_axis else 1)
               for t in spec.states.values())


def staged_floats(spec: Spec, state_size: int) -> int:
    """Floats per step of the inputs staged in threadgroup memory: those with the time axis and
    without the lane axis (``state_size`` per component with the state axis, else 1)."""
    return sum(t.components * (state_size if t.has_state_axis else 1)
               for t in spec.inputs.values() if t.has_time and not t.has_lane)


def lane_chunk(state_per_thread: int) -> int:
    """``LC``: how many of a thread's per-element values a lane reduction sums at once, the
    largest power of two up to ``LANE_CHUNK_MAX`` dividing ``state_per_thread``. Summed one at a
    time, a value takes a shuffle per level of the simdgroup (5 levels without a split); summed
    ``LC`` at once, the lanes exchange halves of the chunk (``recgen_lane_scatter``): for
    ``LC = 8`` and 5 levels, 9 shuffles per 8 values instead of 40, and ``LC`` more registers."""
    chunk = 1
    while chunk < LANE_CHUNK_MAX and state_per_thread % (chunk * 2) == 0:
        chunk *= 2
    return chunk


def stage_steps(seg: int, floats: int) -> int:
    """The tile: the longest power of two of steps, at most ``seg`` and ``STAGE_MAX_STEPS``,
    whose staged inputs fit in ``STAGE_MAX_BYTES`` (0: nothing to stage, or not one step)."""
    if floats == 0 or floats * 4 > STAGE_MAX_BYTES:
        return 0
    tile = 1
    while tile * 2 <= min(seg, STAGE_MAX_STEPS) and tile * 2 * floats * 4 <= STAGE_MAX_BYTES:
        tile *= 2
    return tile


def needs_lane_reduction(spec: Spec) -> bool:
    """Some gradient is summed over lanes in the kernel: that of a differentiable input
    without the lane axis."""
    return any(not t.has_lane and t.differentiable for t in spec.inputs.values())


def lane_reduced_rows(spec: Spec, state_size: int) -> tuple:
    """Rows of the lane reductions: (vector slots reduced every step, scalar slots reduced every
    step, rows reduced once at the end). A vector slot has ``state_size`` rows."""
    vector = scalar = params = 0
    for t in spec.inputs.values():
        if t.has_lane or not t.differentiable:
            continue
        if not t.has_time:
            params += t.components * (state_size if t.has_state_axis else 1)
        elif t.has_state_axis:
            vector += t.components
        else:
            scalar += t.components
    return vector, scalar, params


def choose(rec, sizes: dict, requested: str, seg, backend: str) -> tuple:
    """The schedule and segment length of one call: ``(kind, seg)``.

    ``auto`` runs ``chunked`` when the recurrence is state-affine with a block-diagonal
    multiplier (``AffineForm.block_diagonal``), the sequence holds at least
    two chunks and, on a kernel backend, one sequential step would not already fill the GPU
    (``CHUNKED_MAX_SEQUENTIAL_WORK``), on the ``mlx`` backend the device is a GPU
    (``mlx_time_parallel_pays``); else ``sequential``.
    ``auto`` picks ``matrix`` on CUDA where ``matrix_pays`` (every decay a scalar, no delta rule,
    enough work: measured faster there, ``MATRIX_AUTO_BACKENDS``), with what that form brings:
    fp32 products in TF32 unless ``MLX_ENABLE_TF32=0`` (as MLX's own matmuls), and a non-finite
    value in a chunk making that chunk's outputs before it NaN, where the sequential schedule
    keeps them (docs/matrix.md). Elsewhere it is asked for by name (on the CPU it is the
    fastest pure-MLX form: a Mamba-2 model's training step 1.02 s against 1.98 s sequential,
    ``benchmarks/bench_models.py``; the mlx-lm integration asks for it for the SSD).
    ``matrix`` on a call of one step runs what ``auto`` picks.
    ``chunked`` on a delta rule (state-affine, its multiplier diagonal plus low rank: no
    segment summaries) runs ``matrix`` where the matrix form applies. ``chunked`` on a
    recurrence that is not state-affine, and ``matrix`` on one without the matrix form
    (``matrix.analyse``), raise ``ValueError`` saying why. ``seg`` (the checkpoint
    interval, which is also the chunk length) is chosen when not given (the matrix schedule's
    by ``matrix_chunk``); it may exceed ``L``.

    ``scan`` needs ``scan_misfit`` to find nothing; its ``seg`` is the run of steps of one
    thread (``scan_run``). ``auto`` picks it instead of ``chunked`` on the backends of
    ``SCAN_AUTO_BACKENDS`` (CUDA, where it is measured faster) when no ``seg`` is given. On the
    ``mlx`` backend it runs the chunked form."""
    spec = rec.spec
    if requested not in SCHEDULES:
        raise ValueError(f"{spec.name}(): schedule must be one of {SCHEDULES}, got {requested!r}")
    L = sizes[spec.time]
    form = rec.affine
    kernels = backend != "mlx"
    if requested == "chunked":
        if not form.time_parallel:
            raise ValueError(f"{spec.name}(): schedule='chunked' needs a state-affine recurrence, "
                             f"and {form.reason}; use schedule='sequential'")
        if not form.block_diagonal:  # a delta rule: its chunks are the matrix form's
            if not rec.matrix.applies:
                raise ValueError(f"{spec.name}(): schedule='chunked' has no form for it: "
                                 f"{chunked_misfit(rec)}, and {rec.matrix.reason}; use "
                                 "schedule='sequential'")
            requested = "matrix"
    if requested == "scan":
        misfit = scan_misfit(rec)
        if misfit:
            raise ValueError(f"{spec.name}(): schedule='scan' needs a state-affine recurrence "
                             f"with a few floats of state per lane, and {misfit}; use "
                             "schedule='chunked' or 'sequential'")
        if not kernels:  # the pure-MLX backend runs its chunked form (docs/scan.md)
            return "chunked", min(seg or mlx_chunk_length(spec, sizes), L)
        return "scan", min(seg or scan_run(spec), L)
    if requested == "matrix":
        if not rec.matrix.applies:
            raise ValueError(f"{spec.name}(): schedule='matrix' needs the matrix form, and "
                             f"{rec.matrix.reason}; use schedule='chunked' or 'sequential'")
        if L > 1:
            return "matrix", min(seg or matrix_chunk(rec, backend), L)
        # one step has no product for a matrix unit: a decode step under
        # patch(schedule="matrix") takes what auto picks, the decode path or the sequential
        # kernel (a Mamba-2 model on an H100: 23.5 ms a token as a chunk of one, 8.0 ms)
        requested = "auto"
    kind = requested
    if requested == "auto":
        chunk = seg or (chunk_length(spec, sizes) if kernels else mlx_chunk_length(spec, sizes))
        busy = (kernels and _lane_width(spec, sizes) * _state_floats(spec, sizes)
                >= CHUNKED_MAX_SEQUENTIAL_WORK)
        parallel = kernels or mlx_time_parallel_pays()
        kind = ("chunked" if form.block_diagonal and parallel and L >= 2 * chunk and not busy
                else "sequential")
        if kind == "chunked" and seg is None and backend in SCAN_AUTO_BACKENDS \
                and not scan_misfit(rec):
            return "scan", scan_run(spec)
        if seg is None and backend in MATRIX_AUTO_BACKENDS and matrix_pays(rec, sizes):
            return "matrix", matrix_chunk(rec, backend)
    if seg is None:
        seg = (MATRIX_CHUNK if kind == "matrix" else SEQUENTIAL_SEG if kind != "chunked"
               else chunk_length(spec, sizes) if kernels else mlx_chunk_length(spec, sizes))
    # Not clipped to L: a call shorter than its segment runs one segment with the kernels of
    # that segment length (they take SEG as a template constant and stop at the runtime L in
    # ``meta``), so short calls of any length share one set of kernels instead of compiling a
    # kernel per length.
    return kind, seg


# The scan schedule (docs/scan.md): a threadgroup owns LB lanes of one instance and walks all
# of time in stretches of TG / LB threads x RUN steps. Lane blocks narrow from 32 to
# SCAN_MIN_LANE_BLOCK lanes while instances x blocks give fewer than SCAN_TARGET_GROUPS groups
# (a block of 8 fp32 lanes is one 32-byte sector per step). Groups of SCAN_THREADS threads
# halve (to SCAN_MIN_THREADS) where that brings the call within SCAN_TARGET_THREADS threads,
# about what an H100 holds at once at the kernels' ~120 registers a thread (two groups of 256
# per SM), so the groups run in one wave instead of a second, mostly empty one (RG-LRU B3 D768
# L2048: 288 groups; forward 43 -> 36 us, backward 90 -> 56 us in groups of 128).
SCAN_THREADS = 256
SCAN_MIN_THREADS = 128
# Where ``auto`` runs the scan instead of the chunked schedule (for the specs it serves, when
# no seg is given): measured on an H100 (RG-LRU, one process, forward+backward: B8 D1024
# L4096 fp32 0.93 against 1.17 ms, bf16 0.99 against 1.44 ms; B3 D768 L2048 0.47 against
# 0.59 ms, bf16 0.35 against 0.62 ms; benchmarks/results/bench-scan-rglru-H100-2026-11-24-*).
# Metal is not measured on hardware yet, so it keeps the chunked schedule.
SCAN_AUTO_BACKENDS = ("cuda",)
SCAN_TARGET_THREADS = 1 << 16
SCAN_TARGET_GROUPS = 256
SCAN_MIN_LANE_BLOCK = 8
# A thread keeps its run's inputs (twice: the next stretch's are loaded ahead), cotangents and
# recomputed states in registers: RUN x the floats per step up to this many; RUN at most
# SCAN_MAX_RUN (runs of 16 took ~160 registers, one group of 256 per H100 SM, and were
# slower than runs of 8: RG-LRU B8 D1024 L4096 fp32 forward 221 against 152 us).
SCAN_RUN_FLOATS = 64
SCAN_MAX_RUN = 8
# The look-back (forward; targets where a group may wait on another, ``Dialect.lookback``): a
# group per stretch where the lane blocks alone give fewer than SCAN_LOOKBACK_THREADS threads,
# the GPU then mostly idle. A stretch starts from the end state of the stretch SCAN_WINDOW
# before it, published by its group, under the maps of the stretches between. Measured on an
# H200 (RG-LRU forward, µs a pipelined call, one group / look-back with windows of 4 / of 8):
# B1 D256 L32768 (32 groups of 256) 171-190 / 78-83 / 98-107, B1 D512 L16384 (64 of 256)
# 92-101 / 77-82 / 101-104; B3 D768 L2048 (288 of 128) the kernel 23.6 / 29.7 / 41.0
# (benchmarks/results/bench-scan-lookback-H200-2026-11-27.md).
SCAN_LOOKBACK_THREADS = 1 << 15
SCAN_WINDOW = 4
SCAN_MAX_BLOCK = 4  # the largest multiplier block (K x K) the scan composes


def chunked_misfit(rec) -> str:
    """Why the chunked schedule's segment summaries cannot serve the recurrence ("" when
    they can): they compose block-diagonal multipliers (``AffineForm.block_diagonal``)."""
    form = rec.affine
    if not form.time_parallel:
        return form.reason
    if form.low_rank:
        return ("its multiplier is diagonal plus low rank over the state axis (a delta rule), "
                "whose chunks compose K x K products: schedule='matrix' runs them")
    return ""


def scan_misfit(rec) -> str:
    """Why ``schedule="scan"`` cannot run the recurrence ("" when it can): it needs a
    state-affine update (``affine.analyse``) with no state axis, blocks of at most
    ``SCAN_MAX_BLOCK`` slots, and every input and state along the lane axis (no gradient is
    reduced over lanes)."""
    spec, form = rec.spec, rec.affine
    if not form.block_diagonal:
        return chunked_misfit(rec)
    if spec.state_axis is not None:
        return f"it has the state axis '{spec.state_axis}' (per lane a state of NS floats)"
    big = [b for b in form.blocks if b.size > SCAN_MAX_BLOCK]
    if big:
        return f"a multiplier block has {big[0].size} slots (at most {SCAN_MAX_BLOCK})"
    shared = [t.name for t in [*spec.inputs.values(), *spec.states.values()] if not t.has_lane]
    if shared:
        return f"'{shared[0]}' has no lane axis '{spec.lane}' (a gradient reduced over lanes)"
    return ""


def scan_step_floats(spec: Spec) -> int:
    """Floats per step a backward thread keeps in registers: inputs with the time axis,
    output cotangents and the recomputed states."""
    return (sum(t.components for t in spec.inputs.values() if t.has_time)
            + sum(t.components for t in spec.outputs.values())
            + sum(t.components for t in spec.states.values()))


def scan_run(spec: Spec) -> int:
    """``RUN``: the largest power of two up to ``SCAN_MAX_RUN`` whose steps keep at most
    ``SCAN_RUN_FLOATS`` floats in a thread's registers (``scan_step_floats``)."""
    run = 1
    while run * 2 <= SCAN_MAX_RUN and run * 2 * scan_step_floats(spec) <= SCAN_RUN_FLOATS:
        run *= 2
    return run


def scan_map_floats(form) -> int:
    """Floats of one affine map of a lane (the scan composes them): per block of ``K`` slots
    ``K x K`` multiplier entries, ``K`` offsets and a count of zero hits (``affine.zero_hit``)."""
    return sum(b.size * b.size + b.size + 1 for b in form.blocks)


def make_scan_schedule(spec: Spec, sizes: dict, run: int, threads=None,
                       max_threads: int = MAX_THREADS, map_floats: int = 2,
                       lookback: bool = False) -> Schedule:
    """The scan schedule of a call: ``run`` steps per thread, ``threads`` per group (chosen:
    ``SCAN_THREADS``, at most ``max_threads``, halved (to ``SCAN_MIN_THREADS``) where that
    brings the call's threads within ``SCAN_TARGET_THREADS``, and until the two buffers of
    simdgroup totals, ``2 x TG / 32 x map_floats x LB`` floats, fit in threadgroup memory),
    lane blocks narrowed as ``SCAN_TARGET_GROUPS`` asks; ``seg`` is the stretch
    ``threads / LB * run``. Where the target has the look-back (``lookback``), the forward
    takes a group per stretch when the lane blocks' threads are fewer than
    ``SCAN_LOOKBACK_THREADS`` and there are several stretches (``Schedule.lookback``)."""
    if threads is None:
        tg = min(SCAN_THREADS, max_threads)
    elif not isinstance(threads, int) or threads < 32 or threads % 32 or threads > MAX_THREADS:
        raise ValueError(f"threads must be a multiple of 32 in [32, {MAX_THREADS}], got {threads!r}")
    else:
        tg = threads
    instances = 1
    for b in spec.batch_axes:
        instances *= sizes[b]
    block = 32
    while block > SCAN_MIN_LANE_BLOCK and instances * -(-sizes[spec.lane] // block) \
            < SCAN_TARGET_GROUPS:
        block //= 2
    groups, fit = instances * -(-sizes[spec.lane] // block), tg
    while fit > SCAN_MIN_THREADS and groups * fit > SCAN_TARGET_THREADS:
        fit //= 2
    if threads is None and groups * fit <= SCAN_TARGET_THREADS:  # else several waves anyway
        tg = fit
    while 2 * (tg // 32) * map_floats * block > MAX_SHARED_FLOATS:
        if threads is not None:
            raise ValueError(f"{spec.name}: threads={threads} needs more than {MAX_SHARED_BYTES} "
                             f"bytes of threadgroup memory for the scan's totals ({map_floats} "
                             "floats per map); pass a smaller threads=")
        tg //= 2
    stretch = tg // block * run
    several = sizes[spec.time] > stretch
    window = max(SCAN_WINDOW, 2) if lookback and several and groups * tg < SCAN_LOOKBACK_THREADS \
        else 0  # at least 2: the stretches between are WINDOW - 1 registers of maps
    return Schedule(seg=stretch, threads=tg,
                    groups_per_instance=-(-sizes[spec.lane] // block), lane_reduction=False,
                    history="registers", state_size=1, kind="scan", lane_block=block, run=run,
                    lookback=window)


def _lane_width(spec: Spec, sizes: dict) -> int:
    """Threads of one sequential step: instances x lanes padded to 32."""
    width = -(-sizes[spec.lane] // 32) * 32
    for b in spec.batch_axes:
        width *= sizes[b]
    return width


def _state_floats(spec: Spec, sizes: dict) -> int:
    """State floats per lane."""
    return (sizes[spec.state_axis] if spec.state_axis else 1) * \
        sum(t.components for t in spec.states.values())


def chunk_length(spec: Spec, sizes: dict) -> int:
    """A power-of-two chunk length for the chunked schedule: short enough to give about
    ``CHUNKED_TARGET_THREADS`` threads, and for the recomputed chunk to fit in
    ``CHUNKED_HISTORY_FLOATS`` per thread; at least ``CHUNKED_MIN_SEG`` steps when the history
    allows."""
    L, width = sizes[spec.time], _lane_width(spec, sizes)
    limit = min(L, max(1, L * width // CHUNKED_TARGET_THREADS))
    seg = 1
    while seg * 2 <= limit:
        seg *= 2
    seg = max(seg, CHUNKED_MIN_SEG)
    while seg > 1 and seg * _state_floats(spec, sizes) > CHUNKED_HISTORY_FLOATS:
        seg //= 2
    return seg


def matrix_pays(rec, sizes: dict) -> bool:
    """Whether ``auto`` runs the matrix schedule on a backend of ``MATRIX_AUTO_BACKENDS``: the
    matrix form applies, every decay is a scalar per step, no delta rule, and the call has two
    chunks and ``MATRIX_AUTO_MIN_WORK`` instance-steps (measured where it wins; see there)."""
    form = rec.matrix
    if not form.applies or not rec.affine.block_diagonal \
            or any(st.vector_decay for st in form.states):
        return False
    L = sizes[rec.spec.time]
    instances = math.prod(sizes[b] for b in rec.spec.batch_axes)
    return L >= 2 * MATRIX_CHUNK and instances * L >= MATRIX_AUTO_MIN_WORK


def matrix_chunk(rec, backend: str) -> int:
    """The matrix schedule's chunk when none is given: ``MATRIX_CHUNK_CPU`` in MLX ops on the
    CPU where every state's decay is a scalar, else ``MATRIX_CHUNK``."""
    if backend == "mlx" and mx.default_device().type == mx.cpu \
            and not any(st.vector_decay for st in rec.matrix.states):
        return MATRIX_CHUNK_CPU
    return MATRIX_CHUNK


def mlx_time_parallel_pays() -> bool:
    """Whether ``auto`` runs the pure-MLX backend's chunked form: on a GPU, where a step's few
    small ops cost a launch each. Not on the CPU: there the scan's ``log2(seg)`` passes over a
    segment cost more than the per-step loop of the sequential form, whose ops per step are
    already few (2-core x86, mlx 0.32.4, L=1024: chunked forward+backward 1.19x the sequential
    form's speed for rglru, 0.86x for ssd, 0.48x for gla; ``benchmarks/bench_mlx_backend.py``)."""
    return mx.default_device().type == mx.gpu


def mlx_chunk_length(spec: Spec, sizes: dict) -> int:
    """The chunk length of the pure-MLX chunked form: a power of two, as long as the segment's
    working arrays allow (``MLX_CHUNK_FLOATS`` of state over all instances and lanes), at most
    ``MLX_MAX_CHUNK`` steps."""
    floats = _state_floats(spec, sizes) * sizes[spec.lane]
    for b in spec.batch_axes:
        floats *= sizes[b]
    seg = MLX_MAX_CHUNK
    while seg > 1 and seg * floats > MLX_CHUNK_FLOATS:
        seg //= 2
    return seg


def state_split(spec: Spec, sizes: dict, kind: str, split=None) -> int:
    """Threads per lane (``PARTS``) of the sequential schedule: each holds ``NS / PARTS`` of
    the lane's state, and a sum over the state axis becomes a partial sum per thread plus
    ``log2(PARTS)`` shuffles. Chosen (``split=None``) where instances x lanes are too few to
    fill the GPU (``SPLIT_TARGET_THREADS``): the smallest power of two that reaches it, at most
    ``SPLIT_MAX`` and dividing ``NS``. ``split=`` forces it (1: no split)."""
    ns = sizes[spec.state_axis] if spec.state_axis else 1
    if split is not None:
        if kind != "sequential" and split != 1:
            raise ValueError("split= applies to the sequential schedule's kernels")
        if not isinstance(split, int) or split < 1 or split > 32 or split & (split - 1) \
                or ns % split:
            raise ValueError(f"split must be a power of two up to 32 dividing the state size "
                             f"{ns}, got {split!r}")
        return split
    if kind != "sequential" or ns == 1:
        return 1
    threads = _lane_width(spec, sizes)
    parts = 1
    while (threads * parts < SPLIT_TARGET_THREADS and parts < SPLIT_MAX
           and ns % (parts * 2) == 0 and ns // (parts * 2) >= SPLIT_MIN_STATE):
        parts *= 2
    return parts


class _SplitMisfit(Exception):
    """A split state whose lane reductions do not fit in threadgroup memory."""


def make_schedule(spec: Spec, sizes: dict, seg: int, threads: int | None = None,
                  kind: str = "sequential", max_threads: int = MAX_THREADS,
                  split: int | None = None, sweep: str = "forward") -> Schedule:
    """The schedule of a call. ``max_threads`` caps the threads per group chosen when
    ``threads`` is not given (the target's own limit, ``Dialect.max_threads``); ``split``
    overrides ``state_split``, whose choice is otherwise halved until the lane reductions fit
    in threadgroup memory. ``sweep="backward"``: the sequential backward's own choice of
    threads per group (its checkpoints do not depend on it)."""
    if sweep == "backward" and kind == "sequential" and threads is None \
            and needs_lane_reduction(spec):
        # The backward reduces gradients over lanes at every step, and one group per instance
        # leaves most of a large GPU idle when instances are few: smaller groups spread an
        # instance over more SMs, each group adding a partial sum (H200, gated DeltaNet and
        # GLA at 36 and 128 instances x 64 lanes: 9-20% less forward+backward time with
        # 128-thread groups, while the forward ran slower with them).
        max_threads = min(max_threads, BACKWARD_MAX_THREADS)
    parts = state_split(spec, sizes, kind, split)
    while True:
        try:
            return _make_schedule(spec, sizes, seg, threads, kind, max_threads, parts)
        except _SplitMisfit as misfit:
            if split is not None:
                raise ValueError(f"{spec.name}: split={split} {misfit}; pass a smaller "
                                 "split=") from None
            parts //= 2


def _make_schedule(spec, sizes, seg, threads, kind, max_threads, parts) -> Schedule:
    lanes = sizes[spec.lane]
    padded = -(-lanes // 32) * 32 * parts  # threads of an instance's lanes
    reduce = needs_lane_reduction(spec)
    if threads is not None:
        if not isinstance(threads, int) or threads < 32 or threads % 32 or threads > MAX_THREADS:
            raise ValueError(f"threads must be a multiple of 32 in [32, {MAX_THREADS}], got {threads!r}")
        tg = threads
    elif reduce:
        # as few groups as possible (each adds a partial sum), balanced to limit padding
        groups = -(-padded // max_threads)
        tg = -(-padded // groups // 32) * 32
    else:
        tg = min(padded, 256, max_threads)
    groups = -(-padded // tg)
    ns = sizes[spec.state_axis] if spec.state_axis else 1
    # The chunked schedule launches a thread per segment, so a scratch buffer of one segment per
    # thread would hold the whole history: its recomputed segment stays in thread memory.
    history = ("registers" if kind == "chunked"
               or seg * history_rows(spec, ns // parts) <= REGISTER_HISTORY_FLOATS else "scratch")
    floats = staged_floats(spec, ns)
    sch = Schedule(seg=seg, threads=tg, groups_per_instance=groups, lane_reduction=reduce,
                   history=history, state_size=ns, kind=kind,
                   stage_steps=stage_steps(seg, floats), stage_floats=floats, parts=parts)
    vector, scalar, _ = lane_reduced_rows(spec, ns)
    if vector * ns + scalar > sch.shared_rows:
        # a state loop's rows in rounds of shared_rows // vector iterations; scalars after it
        if max(vector, scalar) > sch.shared_rows:
            raise ValueError(f"{spec.name}: {max(vector, scalar)} time-varying gradients reduced "
                             f"over lanes exceed the {sch.shared_rows} rows of threadgroup "
                             f"memory at {tg} threads per group; pass a smaller threads=")
        if parts > 1:
            raise _SplitMisfit("needs every per-step lane reduction in threadgroup memory at once")
        return replace(sch, time_rounds=True)
    return replace(sch, lane_chunk=lane_chunk(ns // parts))


class MetaLayout:
    """The runtime ``meta`` array: int64 entries shared by the templates and the glue.

    ``keys`` lists them in order: the generated names ``L``, ``instances``, ``lanes``,
    ``groups_per_instance``, ``segments``, then tuples for values tied to spec names:
    ``("size", axis)`` (batch-like and group axes), ``("stride", tensor, axis)``
    (``COMPONENT`` for a component axis) and ``("d_stride", tensor, axis)`` (the lead axes of a
    gradient buffer: missing batch axes, ``members(group axis)``, ``LANE_GROUPS``, ``SEGMENTS``,
    and ``LANES`` for a shared state's initial-state gradient). The renderer spells the tuples
    through ``render.names``.

    Gradient buffers exist for differentiable inputs only; each is the input's layout behind
    lead axes that an MLX sum removes after the kernel (``grad_lead``)."""

    GENERATED = ("L", "instances", "lanes", "groups_per_instance", "segments")

    def __init__(self, spec: Spec):
        self.spec = spec
        self.keys = list(self.GENERATED)
        self.keys += [("size", b) for b in spec.batch_axes]
        self.keys += [("size", g) for g in spec.groups]
        self.tensor_axes = {}
        for t in [*spec.inputs.values(), *spec.outputs.values(), *spec.states.values()]:
            axes = list(t.batch_axes)
            for a, present in ((spec.time, t.has_time), (spec.lane, t.has_lane),
                               (spec.state_axis, t.has_state_axis),
                               (COMPONENT, t.components > 1)):
                if present:
                    axes.append(a)
            self.tensor_axes[t.name] = axes
            self.keys += [("stride", t.name, a) for a in axes]
        # gradient buffers carry, in front of the input's own axes, the batch axes it lacks, in
        # front of those one partial sum per member of each group axis it carries, and in front
        # of those one partial sum per group of lanes when reduced over lanes
        differentiable = [t for t in spec.inputs.values() if t.differentiable]
        self.grad_axes = {t.name: [b for b in spec.batch_axes if not spec.covers(t, b)]
                          for t in differentiable}
        self.grad_members = {t.name: [a for a in t.batch_axes if a in spec.groups]
                             for t in differentiable}
        for t in differentiable:
            self.keys += [("d_stride", t.name, b) for b in self.grad_axes[t.name]]
            self.keys += [("d_stride", t.name, members(g)) for g in self.grad_members[t.name]]
            if not t.has_lane:
                self.keys.append(("d_stride", t.name, LANE_GROUPS))
            if not t.has_time:  # the chunked backward's one partial sum per segment
                self.keys.append(("d_stride", t.name, SEGMENTS))
        # a shared state's initial-state gradient: one share per lane, summed after the kernel
        self.keys += [("d_stride", t.name, LANES) for t in spec.states.values() if not t.has_lane]

    def grad_lead(self, t, sizes, schedule) -> tuple:
        """The lead axes of the kernel's gradient buffer for input ``t``, summed after it:
        segments (the chunked schedule's parameter gradients), lane groups, group members,
        missing batch axes."""
        segments = ((-(-sizes[self.spec.time] // schedule.seg),)
                    if schedule.kind == "chunked" and not t.has_time else ())
        if schedule.kind == "scan" and not t.has_time:  # one partial sum per time-thread
            segments = (schedule.time_threads,)
        groups = (schedule.groups_per_instance,) if schedule.lane_partials and not t.has_lane else ()
        group_members = tuple(sizes[self.spec.groups[g]] // sizes[g]
                              for g in self.grad_members[t.name])
        return segments + groups + group_members + tuple(sizes[b] for b in self.grad_axes[t.name])

    def d_init_shape(self, t, sizes) -> tuple:
        """Shape of the kernel's initial-state gradient of state ``t``: its declared shape, behind
        one share per lane for a shared state (summed after the kernel)."""
        shape = tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)
        return shape if t.has_lane else (sizes[self.spec.lane],) + shape

    def grad_shape(self, t, sizes, schedule) -> tuple:
        """Shape of the kernel's gradient buffer for input ``t``."""
        return (self.grad_lead(t, sizes, schedule)
                + tuple(a if isinstance(a, int) else sizes[a] for a in t.axes))

    def values(self, sizes: dict, schedule: Schedule) -> list:
        spec = self.spec
        instances = 1
        for b in spec.batch_axes:
            instances *= sizes[b]
        v = {"L": sizes[spec.time], "instances": instances, "lanes": sizes[spec.lane],
             "groups_per_instance": schedule.groups_per_instance,
             "segments": -(-sizes[spec.time] // schedule.seg)}
        v.update({("size", b): sizes[b] for b in [*spec.batch_axes, *spec.groups]})
        for t in [*spec.inputs.values(), *spec.outputs.values(), *spec.states.values()]:
            st = axis_strides(t, sizes)
            for a in self.tensor_axes[t.name]:
                v[("stride", t.name, a)] = st[a]
        for t in spec.inputs.values():
            if not t.differentiable:
                continue
            step = 1
            for a in t.axes:
                step *= a if isinstance(a, int) else sizes[a]
            for b in reversed(self.grad_axes[t.name]):
                v[("d_stride", t.name, b)] = step
                step *= sizes[b]
            for g in reversed(self.grad_members[t.name]):
                v[("d_stride", t.name, members(g))] = step
                step *= sizes[spec.groups[g]] // sizes[g]
            if not t.has_lane:
                v[("d_stride", t.name, LANE_GROUPS)] = step
                if schedule.lane_partials:
                    step *= schedule.groups_per_instance
            if not t.has_time:
                v[("d_stride", t.name, SEGMENTS)] = step
        for t in spec.states.values():
            if not t.has_lane:
                step = 1
                for a in t.axes:
                    step *= a if isinstance(a, int) else sizes[a]
                v[("d_stride", t.name, LANES)] = step
        return [v[k] for k in self.keys]
