"""Kernel schedules: how a call maps onto GPU threads, and the runtime values a kernel reads.

Mapping: one thread per (instance, lane). The lanes of one instance are padded to a multiple of
the threadgroup size and split into ``groups_per_instance`` threadgroups; grid x counts all of
them (instances are folded into x, so no grid dimension limit caps the batch). When a gradient
must be reduced over lanes (an input without the lane axis), all lanes of an instance share one
threadgroup, so the reduction runs in-kernel: ``simd_sum`` then threadgroup memory.

Compile-time constants (template parameters): the state size ``NS``, the segment ``SEG`` and the
threads per group ``TG``. Everything else — sequence length, batch sizes, lane count, strides —
is a runtime value in the ``meta`` array, so a new sequence length reuses the compiled kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import Spec

MAX_THREADS = 1024
REGISTER_HISTORY_FLOATS = 128  # per thread; beyond this the recomputed segment goes to scratch
MAX_SHARED_BYTES = 32 * 1024


COMPONENT = None  # the key of a component axis among axis names (never a str)


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
    lane_reduction: bool  # all lanes of an instance in one group
    history: str  # "registers" | "scratch"
    state_size: int  # NS (1 without a state axis)

    @property
    def simdgroups(self) -> int:
        return self.threads // 32

    def template(self):
        return [("NS", self.state_size), ("SEG", self.seg), ("TG", self.threads)]


def history_rows(spec: Spec, state_size: int) -> int:
    """Floats of state per thread and step: ``state_size`` per vector slot, 1 per scalar slot."""
    return sum(t.components * (state_size if t.has_state_axis else 1)
               for t in spec.states.values())


def needs_lane_reduction(spec: Spec) -> bool:
    return any(not t.has_lane for t in spec.inputs.values())


def make_schedule(spec: Spec, sizes: dict, seg: int, threads: int | None = None,
                  shared_floats: int = 0) -> Schedule:
    lanes = sizes[spec.lane]
    padded = -(-lanes // 32) * 32
    reduce = needs_lane_reduction(spec)
    if threads is not None:
        if not isinstance(threads, int) or threads < 32 or threads % 32 or threads > MAX_THREADS:
            raise ValueError(f"threads must be a multiple of 32 in [32, {MAX_THREADS}], got {threads!r}")
    if reduce:
        if padded > MAX_THREADS:
            raise ValueError(
                f"{spec.name}: lane axis {spec.lane} has size {lanes}; gradients of inputs without "
                f"the lane axis are reduced over lanes inside one threadgroup, which holds at most "
                f"{MAX_THREADS} threads. Split {spec.lane} across a batch axis, or use backend='mlx'.")
        if threads is not None and threads != padded:
            raise ValueError(f"{spec.name}: threads={threads} must equal the padded lane count "
                             f"{padded}: this spec reduces gradients over all lanes of an instance")
        tg = padded
    else:
        tg = threads or min(padded, 256)
    groups = -(-padded // tg)
    ns = sizes[spec.state_axis] if spec.state_axis else 1
    history = ("registers" if seg * history_rows(spec, ns) <= REGISTER_HISTORY_FLOATS
               else "scratch")
    if shared_floats * (tg // 32) * 4 > MAX_SHARED_BYTES:
        raise ValueError(f"{spec.name}: the in-kernel lane reduction needs "
                         f"{shared_floats * (tg // 32) * 4} bytes of threadgroup memory "
                         f"(> {MAX_SHARED_BYTES}); reduce the state size or the lane count")
    return Schedule(seg=seg, threads=tg, groups_per_instance=groups, lane_reduction=reduce,
                    history=history, state_size=ns)


class MetaLayout:
    """The runtime ``meta`` array: int64 entries shared by the templates and the glue.

    ``keys`` lists them in order: the generated names ``L``, ``instances``, ``lanes``,
    ``groups_per_instance``, ``segments``, then tuples for values tied to spec names:
    ``("size", axis)``, ``("stride", tensor, axis)`` (``COMPONENT`` for a component axis) and
    ``("d_stride", input, axis)`` (the lead axes of a gradient buffer). The renderer spells the
    tuples through ``render.names``."""

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
        self.grad_axes = {t.name: [b for b in spec.batch_axes if b not in t.batch_axes]
                          for t in spec.inputs.values()}
        for name, axes in self.grad_axes.items():
            self.keys += [("d_stride", name, b) for b in axes]

    def grad_shape(self, t, sizes) -> tuple:
        """Shape of the kernel's gradient buffer for input ``t`` (summed over the lead axes)."""
        lead = tuple(sizes[b] for b in self.grad_axes[t.name])
        return lead + tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)

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
        return [v[k] for k in self.keys]
