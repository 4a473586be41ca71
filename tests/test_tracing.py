"""Tracing a spec's body while the caller has a profiler running: the spec is traced correctly
and the caller's profiler keeps working afterwards, with its settings. Tracing from several
threads at once, and beside other ``sys.monitoring`` tools on Python 3.12+ (run there by
``.ci/py312-tracing``)."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import threading

import mlx.core as mx
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


# -- tracing from several threads -----------------------------------------------------------------


def _scaled_lru(c):
    """A recurrence made by a factory: every call's body shares one code object and differs by
    the closure constant ``c`` (as cached factories of an integration make them)."""
    @rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
                   outputs={"y": "B L D"})
    def lru(h, a, x):
        h = a * h + c * x
        return {"y": h}

    return lru


def _check_scaled(rec, c):
    """The recurrence computes ``h = a h + c x``: its reference against a hand-written loop on
    random data of both signs."""
    a = mx.random.normal((2, 5, 3), key=mx.random.key(1))
    x = mx.random.normal((2, 5, 3), key=mx.random.key(2))
    h, ys = mx.zeros((2, 3)), []
    for t in range(5):
        h = a[:, t] * h + c * x[:, t]
        ys.append(h)
    assert mx.allclose(rec.reference(a, x), mx.stack(ys, axis=1), atol=1e-5), \
        f"the spec built for c={c} computes another state update: {rec.spec.state_updates}"


def _define_concurrently(constants):
    """Build ``_scaled_lru(c)`` for every constant, each on its own thread, all starting
    together; the recurrences by constant, or the first error a thread raised."""
    barrier = threading.Barrier(len(constants))
    built, errors = {}, []

    def work(c):
        try:
            barrier.wait()
            built[c] = _scaled_lru(c)
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,)) for c in constants]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return built


def _update_of(rec):
    s = rec.spec
    return s.state_updates[Slot("h")], [s.symbols[Slot(t)] for t in ("h", "a", "x")]


def test_specs_defined_on_several_threads_at_once():
    """Sixteen threads build specs from one factory at once, forty times; each spec holds its own
    closure's constant (no thread records another's locals, no tool id is claimed twice)."""
    constants = [float(k) - 7.5 for k in range(16)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often: a race shows within a few rounds
    try:
        rounds = [_define_concurrently(constants) for _ in range(40)]
    finally:
        sys.setswitchinterval(interval)
    for built in rounds:
        for c in constants:
            update, (h, a, x) = _update_of(built[c])
            assert update == a * h + c * x, f"the spec built for c={c} has h = {update}"
    for c in constants:
        _check_scaled(rounds[-1][c], c)


def test_another_thread_running_the_body_while_it_is_traced(monkeypatch):
    """Another thread calls the body function itself while it is traced, and returns after the
    traced call did: the spec is built from the traced call's locals, not the other thread's."""
    def body(h, a, x):
        h = a * h + 2.0 * x
        return {"y": h}

    if sys.version_info >= (3, 12):  # the other call returns just before the events go off
        patched, name = sys.monitoring, "set_local_events"
    else:  # the other call returns just before the profile hook goes
        patched, name = sys, "setprofile"
    original = getattr(patched, name)
    ran = []

    def off_after_another_call(*args):
        if args[-1] in (0, None) and not ran:
            other = threading.Thread(target=lambda: ran.append(body(h=1.0, a=1.0, x=1.0)))
            other.start()
            other.join()
        return original(*args)

    monkeypatch.setattr(patched, name, off_after_another_call)
    rec = rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
                        outputs={"y": "B L D"})(body)
    monkeypatch.undo()
    assert ran == [{"y": 3.0}]
    update, (h, a, x) = _update_of(rec)
    assert update == a * h + 2.0 * x


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring is new in Python 3.12")
def test_tracing_beside_other_monitoring_tools():
    """Tool ids held by another tool, also one claimed between a look and a claim, leave tracing
    working: it takes a free id, or the profile hook when none is left."""
    monitoring = sys.monitoring
    held = []
    try:
        for tool in (5, 4):
            if monitoring.get_tool(tool) is None:
                monitoring.use_tool_id(tool, "another tool")
                held.append(tool)
        _check_scaled(_scaled_lru(2.5), 2.5)
        if monitoring.get_tool(3) is None:
            monitoring.use_tool_id(3, "another tool")
            held.append(3)
        _check_scaled(_scaled_lru(-1.5), -1.5)
        _check_traced(*_define())
    finally:
        for tool in held:
            monitoring.free_tool_id(tool)
    assert all(monitoring.get_tool(i) is None for i in held)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring is new in Python 3.12")
def test_tracing_when_a_tool_id_is_claimed_after_a_look(monkeypatch):
    """Another tool claims a tool id right after it was seen free (a look, then a claim, is a
    race between threads): tracing takes another id."""
    monitoring = sys.monitoring
    look = monitoring.get_tool
    claimed = []

    def look_then_lose(tool):
        free = look(tool)
        if free is None and look(tool) is None and not claimed:
            monitoring.use_tool_id(tool, "another tool")
            claimed.append(tool)
        return free

    monkeypatch.setattr(monitoring, "get_tool", look_then_lose)
    try:
        _check_scaled(_scaled_lru(3.0), 3.0)
    finally:
        for tool in claimed:
            monitoring.free_tool_id(tool)
