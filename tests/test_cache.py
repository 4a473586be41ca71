"""The on-disk cache of derived programs: a hit restores the same programs and kernels, a corrupt
or foreign file is ignored (and replaced), a changed spec misses, and the cache can be turned off.
Reading the cache runs no code, a record that disagrees with the spec is not used, and a directory
that another user controls is not used at all."""

import hashlib
import json
import os
import pickle
import shlex
import stat
import warnings

import mlx.core as mx
import pytest
from references import rglru_ref

import mlx_recgen as rg
import mlx_recgen.function as function
from mlx_recgen import Sum, cache, cachedirs, maximum, minimum, softplus
from mlx_recgen.function import Recurrence
from mlx_recgen.ir import Loop, Program, Store
from mlx_recgen.spec import build_spec

DECL = dict(lane="P", state={"h": "B P N", "m": "B P"},
            inputs={"q": "B L N", "k": "B L N", "v": "B L P", "dt": "B L P"},
            outputs={"y": "B L P"})


def _body(h, m, q, k, v, dt, n):
    d = minimum(maximum(softplus(dt), 0.01), 2.0)  # kinks: Piecewise in every derivative
    m = m * 0.5 + d
    h[n] = h[n] * (1 - d) + d * (v - Sum(k[n] * h[n], n)) * k[n]
    return {"y": Sum(q[n] * h[n], n) * m}


def _changed(h, m, q, k, v, dt, n):
    d = minimum(maximum(softplus(dt), 0.01), 3.0)  # another constant
    m = m * 0.5 + d
    h[n] = h[n] * (1 - d) + d * (v - Sum(k[n] * h[n], n)) * k[n]
    return {"y": Sum(q[n] * h[n], n) * m}


def _spec(body=_body):
    return build_spec(body, name="cached", **DECL)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(cachedirs, "_warned", set())


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "programs"
    monkeypatch.setenv("MLX_RECGEN_CACHE", str(directory))
    return directory


@pytest.fixture
def derivations(monkeypatch):
    """Counts the derivations of an adjoint (a cache miss derives, a hit does not)."""
    calls = []
    real = function.derive

    def counting(ir):
        calls.append(ir.spec.name)
        return real(ir)

    monkeypatch.setattr(function, "derive", counting)
    return calls


def _texts(rec, kernels=True):
    texts = [rec.forward_ir(), rec.adjoint_ir(), rec.source("forward", backend="mlx"),
             rec.source("backward", backend="mlx")]
    if kernels:
        texts += [rec.source("forward", backend="metal"), rec.source("backward", backend="metal"),
                  rec.source("backward", backend="cuda")]
    return texts


def test_hit_restores_identical_programs_and_kernels(cache_dir, derivations):
    first = Recurrence(_spec())
    assert derivations == ["cached"] and len(list(cache_dir.glob("*.json"))) == 1
    second = Recurrence(_spec())
    assert derivations == ["cached"], "the second build must come from the cache"
    assert _texts(second) == _texts(first)
    # the symbols are the spec's own: the backend finds where every step argument comes from
    for sym in second._backend("mlx").backward_step.args:
        assert sym in second._backend("mlx").origin


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not-utf8", "unknown-node",
                                    "foreign", "bad-index", "deep"])
def test_corrupt_file_is_ignored_and_replaced(cache_dir, derivations, damage):
    first = Recurrence(_spec())
    (path,) = cache_dir.glob("*.json")
    data = path.read_bytes()
    record = json.loads(data)
    if damage == "garbage":
        path.write_bytes(b"not json {")
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "not-utf8":
        path.write_bytes(b"\xff\xfe" + data)
    elif damage == "unknown-node":  # a class outside the whitelist, by name
        text = json.dumps(record).replace('["Add",', '["Function",', 1)
        path.write_text(text)
    elif damage == "foreign":  # a well-formed record holding another spec's programs
        other = rg.load_spec("ssd")
        path.write_text(json.dumps({"format": cache.FORMAT, "key": record["key"],
                                    **cache._encode_record(other.forward_program, other.adjoint)}))
    elif damage == "bad-index":
        record["forward"]["vector"] = [len(record["symbols"]) + 5]
        path.write_text(json.dumps(record))
    else:  # nested beyond the recursion limit: an error, not a crash
        path.write_text('{"format": "x", "key": ' + "[" * 100_000 + "]" * 100_000 + "}")
    second = Recurrence(_spec())
    assert derivations.count("cached") == 2, "a damaged file must be derived again"
    assert _texts(second, kernels=False) == _texts(first, kernels=False)
    assert cache.load(_spec()) is not None, "the damaged file is replaced by a good one"


def test_reading_a_record_runs_no_code(cache_dir, tmp_path, derivations):
    """A pickle whose ``__reduce__`` calls ``os.system``, planted where a pickle-reading cache
    looks for the record of this spec (and under the record's own name), never runs."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {shlex.quote(str(marker))}",)

    spec = _spec()
    key = cache.spec_key(spec)
    payload = pickle.dumps((Payload(), Payload()))
    record = pickle.dumps({"format": cache.FORMAT, "key": key, "payload": payload,
                           "digest": hashlib.sha256(payload).hexdigest()})
    cache_dir.mkdir(mode=0o700)
    own = cache._path(cache_dir, spec, key)
    for path in {own, own.with_suffix(".pkl"), own.with_suffix(".json")}:
        path.write_bytes(record)
    rec = Recurrence(spec)
    assert not marker.exists(), "a cache record executed code"
    assert derivations == ["cached"] and "lambda h" in rec.adjoint_ir()


def _lru(h, a, x):
    h = a * h + x
    return {"y": h}


def _lru_spec():
    return build_spec(_lru, name="cached_lru", lane="D", state={"h": "B D"},
                      inputs={"a": "B L D", "x": "B L D"}, outputs={"y": "B L D"})


def _doubled(program: Program) -> Program:
    """The program with every state store doubled (``h <- 2 * (a h + x)``)."""
    def double(st):
        if isinstance(st, Store) and st.kind == "state":
            return Store(st.kind, st.slot, 2 * st.expr)
        return Loop([double(b) for b in st.body]) if isinstance(st, Loop) else st

    return Program([double(s) for s in program.statements], program.vector)


def test_record_with_another_forward_program_is_not_used(cache_dir, derivations):
    """A well-formed record whose forward program stores ``2*h``: it passes the structural checks,
    so only deriving the forward program again and comparing catches it."""
    spec = _lru_spec()
    good = Recurrence(spec)
    assert cache.store(spec, _doubled(good.forward_program), good.adjoint)
    rec = Recurrence(_lru_spec())
    assert derivations == ["cached_lru", "cached_lru"], "the altered record must be a miss"
    a = mx.random.uniform(-0.9, 0.9, (2, 7, 3))
    x = mx.random.normal((2, 7, 3))
    y, h = rec(a, x, backend="mlx", return_state=True)
    y_ref, h_ref = rglru_ref(a, x)
    assert mx.allclose(y, y_ref, atol=1e-5) and mx.allclose(h, h_ref, atol=1e-5)


def _files(directory):
    return sorted(p.name for p in directory.iterdir())


def _refused(directory, derivations, match):
    """Two builds with an unsafe cache: one warning naming the directory, both derive, and no
    file in it is read or written."""
    before = _files(directory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Recurrence(_spec())
        Recurrence(_spec())
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning)
            and "program cache" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert str(directory) in str(ours[0].message) and match in str(ours[0].message)
    assert derivations.count("cached") == 3, "an unsafe cache must not be read"
    assert _files(directory) == before, "an unsafe cache must not be written"


def test_directory_writable_by_others_is_not_used(cache_dir, derivations):
    Recurrence(_spec())  # a good record, written while the directory was private
    os.chmod(cache_dir, 0o777)
    _refused(cache_dir, derivations, "other users can write")


def test_directory_of_another_user_is_not_used(cache_dir, derivations, monkeypatch):
    Recurrence(_spec())
    uid = os.getuid()
    monkeypatch.setattr(cachedirs.os, "getuid", lambda: uid + 1)
    _refused(cache_dir, derivations, f"owned by uid {uid}")


def test_new_directories_and_records_are_private(tmp_path, monkeypatch, derivations):
    old = os.umask(0o022)
    try:
        directory = tmp_path / "a" / "b"
        monkeypatch.setenv("MLX_RECGEN_CACHE", str(directory))
        Recurrence(_spec())
    finally:
        os.umask(old)
    for d in (directory, directory.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (record,) = directory.iterdir()
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    Recurrence(_spec())
    assert derivations == ["cached"], "the second build must come from the cache"


def test_changed_spec_misses(cache_dir, derivations):
    a = Recurrence(_spec())
    b = Recurrence(_spec(_changed))
    assert derivations == ["cached", "cached"]
    assert len(list(cache_dir.glob("*.json"))) == 2
    assert a.adjoint_ir() != b.adjoint_ir()
    assert cache.spec_key(_spec()) != cache.spec_key(_spec(_changed))


def test_cache_can_be_disabled(tmp_path, monkeypatch, derivations):
    monkeypatch.setenv("MLX_RECGEN_CACHE", "off")
    assert cache.cache_dir() is None
    Recurrence(_spec())
    Recurrence(_spec())
    assert derivations == ["cached", "cached"]


def test_default_location_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_RECGEN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "mlx-recgen" / "programs"


def test_unwritable_cache_still_builds(tmp_path, monkeypatch, derivations):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MLX_RECGEN_CACHE", str(blocker / "sub"))  # a path under a file
    rec = Recurrence(_spec())
    assert derivations == ["cached"] and "lambda h" in rec.adjoint_ir()


def test_spec_without_gradients_misses(cache_dir, derivations):
    """The twin a call with bool or integer inputs runs derives no gradient for them: a cached
    adjoint of the full spec must not serve it."""
    spec = _spec()
    name = next(iter(spec.inputs))
    twin = spec.without_gradients([name])
    assert cache.spec_key(twin) != cache.spec_key(spec)
    full, without = Recurrence(spec), Recurrence(twin)
    assert derivations == ["cached", "cached"]
    assert any(s.slot.tensor == name for s in full.adjoint.program.stores("grad"))
    assert not any(s.slot.tensor == name for s in without.adjoint.program.stores("grad"))
