"""Kernel schedules: how a call maps onto GPU threads, and the runtime values a kernel reads.

Mapping: one thread per (instance, lane). The lanes of one instance are padded to a multiple of
32, then split into ``groups_per_instance`` threadgroups of ``TG`` threads; grid x counts all of
them (instances are folded into x, so no grid dimension limit caps the batch).

Gradients reduced over lanes (of inputs without the lane axis) are summed in-kernel over the
lanes of each threadgroup: ``simd_sum``, then threadgroup memory across simdgroups. When all
lanes of an instance fit in one group (at most 1024), that is the whole sum; otherwise each group
writes its partial sum along a leading axis of the gradient buffer and an MLX sum over that axis
finishes it after the kernel (deterministic: no atomics). Threadgroup memory holds at most
32 KiB of rows; beyond that the rows are reduced in rounds.

Compile-time constants (template parameters): the state size ``NS``, the segment ``SEG`` and the
threads per group ``TG``. Everything else — sequence length, batch sizes, lane count, strides —
is a runtime value in the ``meta`` array, so a new sequence length reuses the compiled kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .spec import Spec

MAX_THREADS = 1024
REGISTER_HISTORY_FLOATS = 128  # per thread; beyond this the recomputed segment goes to scratch
MAX_SHARED_BYTES = 32 * 1024  # threadgroup memory for lane reductions (Metal's guaranteed size)
MAX_SHARED_FLOATS = MAX_SHARED_BYTES // 4

COMPONENT = None  # the key of a component axis among axis names (never a str)
LANE_GROUPS = 0  # the key of the partial-sum axis of a lane-reduced gradient (never a str)


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
    time_rounds: bool = False  # per-step lane reductions in rounds inside the state loop

    @property
    def simdgroups(self) -> int:
        return self.threads // 32

    @property
    def lane_partials(self) -> bool:
        """Lane-reduced gradients come out as one partial sum per group of an instance."""
        return self.lane_reduction and self.groups_per_instance > 1

    @property
    def shared_rows(self) -> int:
        """Rows of the threadgroup reduction buffer that fit in ``MAX_SHARED_BYTES``."""
        return MAX_SHARED_FLOATS // self.simdgroups

    def template(self):
        return [("NS", self.state_size), ("SEG", self.seg), ("TG", self.threads)]


def history_rows(spec: Spec, state_size: int) -> int:
    """Floats of state per thread and step: ``state_size`` per vector slot, 1 per scalar slot."""
    return sum(t.components * (state_size if t.has_state_axis else 1)
               for t in spec.states.values())


def needs_lane_reduction(spec: Spec) -> bool:
    return any(not t.has_lane for t in spec.inputs.values())


def lane_reduced_rows(spec: Spec, state_size: int) -> tuple:
    """Rows of the lane reductions: (vector slots reduced every step, scalar slots reduced every
    step, rows reduced once at the end). A vector slot has ``state_size`` rows."""
    vector = scalar = params = 0
    for t in spec.inputs.values():
        if t.has_lane:
            continue
        if not t.has_time:
            params += t.components * (state_size if t.has_state_axis else 1)
        elif t.has_state_axis:
            vector += t.components
        else:
            scalar += t.components
    return vector, scalar, params


def make_schedule(spec: Spec, sizes: dict, seg: int, threads: int | None = None) -> Schedule:
    lanes = sizes[spec.lane]
    padded = -(-lanes // 32) * 32
    reduce = needs_lane_reduction(spec)
    if threads is not None:
        if not isinstance(threads, int) or threads < 32 or threads % 32 or threads > MAX_THREADS:
            raise ValueError(f"threads must be a multiple of 32 in [32, {MAX_THREADS}], got {threads!r}")
        tg = threads
    elif reduce:
        # as few groups as possible (each adds a partial sum), balanced to limit padding
        groups = -(-padded // MAX_THREADS)
        tg = -(-padded // groups // 32) * 32
    else:
        tg = min(padded, 256)
    groups = -(-padded // tg)
    ns = sizes[spec.state_axis] if spec.state_axis else 1
    history = ("registers" if seg * history_rows(spec, ns) <= REGISTER_HISTORY_FLOATS
               else "scratch")
    sch = Schedule(seg=seg, threads=tg, groups_per_instance=groups, lane_reduction=reduce,
                   history=history, state_size=ns)
    vector, scalar, _ = lane_reduced_rows(spec, ns)
    if vector * ns + scalar > sch.shared_rows:
        # a state loop's rows in rounds of shared_rows // vector iterations; scalars after it
        if max(vector, scalar) > sch.shared_rows:
            raise ValueError(f"{spec.name}: {max(vector, scalar)} time-varying gradients reduced "
                             f"over lanes exceed the {sch.shared_rows} rows of threadgroup "
                             f"memory at {tg} threads per group; pass a smaller threads=")
        sch = replace(sch, time_rounds=True)
    return sch


class MetaLayout:
    """The runtime ``meta`` array: int64 entries shared by the templates and the glue.

    ``keys`` lists them in order: the generated names ``L``, ``instances``, ``lanes``,
    ``groups_per_instance``, ``segments``, then tuples for values tied to spec names:
    ``("size", axis)``, ``("stride", tensor, axis)`` (``COMPONENT`` for a component axis) and
    ``("d_stride", input, axis)`` (the lead axes of a gradient buffer, ``LANE_GROUPS`` for its
    partial sums). The renderer spells the tuples through ``render.names``."""

    GENERATED = ("L", "instances", "lanes", "groups_per_instance", "segments")

    def __init__(self, spec: Spec):
        self.spec = spec
        self.keys = list(self.GENERATED)
        self.keys += [("size", b) for b in spec.batch_axes]
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
        # gradient buffers carry, in front of the input's own axes, the batch axes it lacks
        # (and, in front of those, one partial sum per group when reduced over lanes)
        self.grad_axes = {t.name: [b for b in spec.batch_axes if b not in t.batch_axes]
                          for t in spec.inputs.values()}
        for t in spec.inputs.values():
            self.keys += [("d_stride", t.name, b) for b in self.grad_axes[t.name]]
            if not t.has_lane:
                self.keys.append(("d_stride", t.name, LANE_GROUPS))

    def grad_lead(self, t, sizes, schedule) -> tuple:
        """The lead axes of the kernel's gradient buffer for input ``t``, summed after it."""
        groups = (schedule.groups_per_instance,) if schedule.lane_partials and not t.has_lane else ()
        return groups + tuple(sizes[b] for b in self.grad_axes[t.name])

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
        v.update({("size", b): sizes[b] for b in spec.batch_axes})
        for t in [*spec.inputs.values(), *spec.outputs.values(), *spec.states.values()]:
            st = axis_strides(t, sizes)
            for a in self.tensor_axes[t.name]:
                v[("stride", t.name, a)] = st[a]
        for t in spec.inputs.values():
            step = 1
            for a in t.axes:
                step *= a if isinstance(a, int) else sizes[a]
            for b in reversed(self.grad_axes[t.name]):
                v[("d_stride", t.name, b)] = step
                step *= sizes[b]
            if not t.has_lane:
                v[("d_stride", t.name, LANE_GROUPS)] = step
        return [v[k] for k in self.keys]
