"""Tracing a spec's body while the caller has a profiler running: the spec is traced correctly
and the caller's profiler keeps working afterwards, with its settings."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import pytest

import mlx_recgen as rg
from mlx_recgen.spec import Reduce, Slot


def _define():
    """A scalar-state spec (its update is a rebinding, read from the body's locals) and a
    vector-state spec (its reduction's local name is read back too)."""
    @rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
                   outputs={"y": "B L D"})
    def lru(h, a, x):
        h = a * h + x
        return {"y": h}

    @rg.recurrence(lane="P", state={"h": "B P N"}, inputs={"a": "B L P", "C": "B L N"},
                   outputs={"y": "B L P"})
    def vec(h, a, C, n):
        h[n] = a * h[n] + C[n]
        readout = rg.Sum(C[n] * h[n], n)
        return {"y": readout}

    return lru, vec


def _check_traced(lru, vec):
    s = lru.spec
    h, a, x = (s.symbols[Slot(t)] for t in ("h", "a", "x"))
    assert s.state_updates[Slot("h")] == a * h + x
    assert list(vec.spec.reduce_names.values()) == ["readout"]
    assert isinstance(next(iter(vec.spec.reduce_names)), Reduce)


def _marker():
    return len("after the spec")  # a Python call and a builtin call


def _stats(profile) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).print_stats()
    return out.getvalue()


@pytest.mark.parametrize("builtins", [True, False])
def test_spec_defined_under_cprofile(builtins):
    profile = cProfile.Profile(builtins=builtins)
    profile.enable()
    try:
        specs = _define()
        if sys.version_info < (3, 12):
            assert sys.getprofile() is profile  # the C-level profiler is back
        _marker()
    finally:
        profile.disable()
    assert sys.getprofile() is None
    _check_traced(*specs)
    text = _stats(profile)
    assert "_marker" in text, "the profiler stopped recording after the spec was defined"
    assert ("built-in method builtins.len" in text) == builtins, "profiler settings changed"


def test_spec_defined_under_python_profile_hook():
    events = []

    def hook(frame, event, arg):
        events.append((event, frame.f_code.co_name))

    sys.setprofile(hook)
    try:
        specs = _define()
        after = sys.getprofile()
        _marker()
    finally:
        sys.setprofile(None)
    assert after is hook
    _check_traced(*specs)
    assert ("call", "_marker") in events


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12+ traces with sys.monitoring")
def test_unrecognised_c_level_hook_is_left_alone(monkeypatch):
    """A C-level profile hook that cannot be reinstated (here cProfile's, disguised) is never
    replaced: the body is traced on a helper thread."""
    import _lsprof

    monkeypatch.setattr(_lsprof, "Profiler", type("Other", (), {}))
    profile = cProfile.Profile()
    profile.enable()
    try:
        specs = _define()
        still = sys.getprofile()
        _marker()
        with pytest.raises(rg.SpecError, match=r"spec 'boom': tracing the body failed: "
                                               r"ZeroDivisionError"):
            @rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D"},
                           outputs={"y": "B L D"})
            def boom(h, x):
                h = h + x + 1 / 0
                return {"y": h}
    finally:
        profile.disable()
    assert still is profile
    _check_traced(*specs)
    assert "_marker" in _stats(profile)
