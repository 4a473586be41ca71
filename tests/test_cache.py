"""The on-disk cache of derived programs: a hit restores the same programs and kernels, a corrupt
or foreign file is ignored (and replaced), a changed spec misses, and the cache can be turned off."""

import hashlib
import pickle

import pytest

import mlx_recgen as rg
import mlx_recgen.function as function
from mlx_recgen import Sum, cache, maximum, minimum, softplus
from mlx_recgen.function import Recurrence
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


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_RECGEN_CACHE", str(tmp_path))
    return tmp_path


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
    assert derivations == ["cached"] and len(list(cache_dir.glob("*.pkl"))) == 1
    second = Recurrence(_spec())
    assert derivations == ["cached"], "the second build must come from the cache"
    assert _texts(second) == _texts(first)
    # the symbols are the spec's own: the backend finds where every step argument comes from
    for sym in second._backend("mlx").backward_step.args:
        assert sym in second._backend("mlx").origin


@pytest.mark.parametrize("damage", ["garbage", "truncated", "payload", "foreign"])
def test_corrupt_file_is_ignored_and_replaced(cache_dir, derivations, damage):
    first = Recurrence(_spec())
    (path,) = cache_dir.glob("*.pkl")
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"not a pickle")
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "payload":  # a flipped byte in the payload: the digest no longer matches
        record = pickle.loads(data)
        payload = bytearray(record["payload"])
        payload[len(payload) // 2] ^= 0xFF
        record["payload"] = bytes(payload)
        path.write_bytes(pickle.dumps(record))
    else:  # a well-formed record holding another spec's programs under this key
        other = rg.load_spec("ssd")
        record = pickle.loads(data)
        record["payload"] = pickle.dumps((other.forward_program, other.adjoint))
        record["digest"] = hashlib.sha256(record["payload"]).hexdigest()
        path.write_bytes(pickle.dumps(record))
    second = Recurrence(_spec())
    assert derivations.count("cached") == 2, "a damaged file must be derived again"
    assert _texts(second, kernels=False) == _texts(first, kernels=False)
    assert cache.load(_spec()) is not None, "the damaged file is replaced by a good one"


def test_changed_spec_misses(cache_dir, derivations):
    a = Recurrence(_spec())
    b = Recurrence(_spec(_changed))
    assert derivations == ["cached", "cached"]
    assert len(list(cache_dir.glob("*.pkl"))) == 2
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
