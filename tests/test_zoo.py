"""The zoo of bundled specs against loops written from each paper's formula
(``references.ZOO_REFERENCES``), on the pure-MLX backend, the Metal simulator (marker ``sim``)
and CUDA (marker ``gpu``; skipped where MLX has no CUDA backend): every output, every final
state and the gradient of every input and initial state, through ``mx.grad`` of a random
weighting of them. Time-parallel specs also run the chunked schedule on the kernel backends.

All cases share one size (two batch and head instances, K = N = 3 state elements, 5 lanes,
11 steps in segments of 4), so the simulator compiles one kernel set per spec.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

import mlx_recgen as rg
from conftest import KERNEL_BACKENDS, rel_err
from references import ZOO_REFERENCES, mlstm_unstabilised_ref

TOL = 1e-5
b, L, H, K, V, SEG = 2, 11, 2, 3, 5, 4




def _n(*shape, scale=1.0):
    return scale * mx.random.normal(shape)


def _u(lo, hi, *shape):
    return mx.random.uniform(lo, hi, shape)


# Inputs (in the spec's order) and the reference's initial states, of both signs wherever the
# recurrence stays bounded over 11 steps; step sizes (delta, dt) are positive by definition.
def _draw(name):
    qk = lambda: _n(b, L, H, K, scale=0.5)  # noqa: E731
    vv = lambda: _n(b, L, H, V)  # noqa: E731
    S0 = lambda: _n(b, H, K, V, scale=0.5)  # noqa: E731
    D = V  # channels of the diagonal specs
    if name == "mamba1":
        return [_n(b, L, D), _u(0.05, 0.6, b, L, D), _n(D, K, scale=0.5), _n(b, L, K, scale=0.5),
                _n(b, L, K, scale=0.5), _n(D)], [_n(b, D, K, scale=0.5)]
    if name == "mamba2":
        return [_n(b, L, H, V), _u(0.05, 0.6, b, L, H), _n(H, scale=0.5),  # B, C: one group
                _n(b, L, 1, K, scale=0.5), _n(b, L, 1, K, scale=0.5), _n(H)], \
               [_n(b, H, V, K, scale=0.5)]
    if name == "deltanet":
        return [qk(), qk(), vv(), _n(b, L, H, scale=0.5)], [S0()]
    if name == "gated_deltanet":
        return [qk(), qk(), vv(), _n(b, L, H, scale=0.3), _n(b, L, H, scale=0.5)], [S0()]
    if name == "rwkv6":
        return [qk(), qk(), vv(), _n(b, L, H, K, scale=0.3), _n(H, K, scale=0.5)], [S0()]
    if name == "rwkv7":
        return [qk(), _n(b, L, H, K, scale=0.3), qk(), vv(), _n(b, L, H, K, scale=0.4),
                _n(b, L, H, K, scale=0.4)], [S0()]
    if name == "hgrn2":
        return [_n(b, L, H, K), _u(-0.95, 0.95, b, L, H, K), vv()], [S0()]
    if name == "retnet":
        return [qk(), qk(), vv(), _u(-0.99, 0.99, H)], [S0()]
    if name == "mlstm":
        return [qk(), qk(), vv(), _n(b, L, H), _n(b, L, H, scale=2.0)], \
               [S0(), _n(b, H, K, scale=0.5), _n(b, H, scale=0.5)]
    if name == "mingru":
        return [_n(b, L, D, scale=2.0), _n(b, L, D)], [_n(b, D)]
    if name == "complex_lru":
        return [_n(b, L, D, 2), _n(D, scale=0.5), _n(D, scale=0.5)], [_n(b, D, 2)]
    if name == "s4d":
        return [_n(b, L, D), _n(D, scale=0.5), _n(D, K, scale=0.5), _n(D, K, scale=2.0),
                _n(D, K, 2), _n(D)], [_n(b, D, K, 2)]
    raise KeyError(name)


def _to_spec(name, states):
    """The reference's initial states as the spec's dict."""
    return dict(zip(rg.load_spec(name).spec.states, states))


def _from_spec(name, finals):
    """The spec's final states in the reference's order."""
    finals = finals if isinstance(finals, dict) else {next(iter(rg.load_spec(name).spec.states)): finals}
    return list(finals.values())


def _reference(name, inputs, states):
    y, finals = ZOO_REFERENCES[name](*inputs, *states)
    return [y], list(finals) if isinstance(finals, tuple) else [finals]


def _compiled(name, backend, schedule, **call):
    rec = rg.load_spec(name)

    def run(inputs, states):
        y, finals = rec(*inputs, initial_state=_to_spec(name, states), return_state=True,
                        backend=backend, seg=SEG,
                        **({} if backend == "mlx" else {"schedule": schedule}), **call)
        return [y], _from_spec(name, finals)

    return run


def _values_and_grads(fn, inputs, states, weights=None):
    """Outputs + final states, the loss weights, and the gradient of sum(weights * values) with
    respect to every input and initial state."""
    n_in = len(inputs)
    outs, fins = fn(inputs, states)
    values = outs + fins
    if weights is None:
        weights = [mx.random.normal(v.shape, key=mx.random.key(7 + i)) for i, v in enumerate(values)]

    def loss(*args):
        o, f = fn(list(args[:n_in]), list(args[n_in:]))
        return sum(mx.sum(v * w) for v, w in zip(o + f, weights))

    grads = mx.grad(loss, argnums=tuple(range(n_in + len(states))))(*inputs, *states)
    mx.eval(values, grads)
    return values, weights, list(grads)


def compare(name, backend, schedule="sequential", **call):
    """Relative errors of the backend against the paper's loop: ``{quantity: error}``."""
    mx.random.seed(sum(map(ord, name)))
    inputs, states = _draw(name)
    rec = rg.load_spec(name)
    ref_values, weights, ref_grads = _values_and_grads(
        lambda i, s: _reference(name, i, s), inputs, states)
    values, _, grads = _values_and_grads(_compiled(name, backend, schedule, **call), inputs, states,
                                         weights)
    state_names = list(rec.spec.states)
    errors = {f"output {o}": rel_err(v, r) for o, v, r in zip(rec.spec.outputs, values, ref_values)}
    errors.update({f"final {s}": rel_err(v, r)
                   for s, v, r in zip(state_names, values[1:], ref_values[1:])})
    labels = [*rec.spec.inputs, *(f"initial {s}" for s in state_names)]
    for label, g, r in zip(labels, grads, ref_grads):
        assert g.shape == r.shape, label
        errors[f"grad {label}"] = rel_err(g, r)
    return errors


ZOO = ["mamba1", "mamba2", "deltanet", "gated_deltanet", "rwkv6", "rwkv7", "hgrn2", "retnet",
       "mlstm", "mingru", "complex_lru", "s4d"]
TIME_PARALLEL = ["mamba1", "mamba2", "rwkv6", "hgrn2", "retnet", "mingru", "complex_lru", "s4d",
                 "deltanet", "gated_deltanet", "rwkv7"]
LOW_RANK = ["deltanet", "gated_deltanet", "rwkv7"]  # diagonal plus rank one: the matrix form


def test_every_bundled_spec_is_in_the_zoo_or_the_original_four():
    assert sorted(rg.list_specs()) == sorted(ZOO + ["ssd", "gla", "rglru", "rotlru"])


@pytest.mark.parametrize("name", ZOO)
def test_time_parallel_flag(name):
    """Affine in the state with a diagonal (or 2x2-block) multiplier, or a diagonal plus rank
    one (a delta rule reads the state through a reduction and adds it back): time-parallel. The
    stabilised mLSTM's multiplier depends on its running max."""
    rec = rg.load_spec(name)
    assert rec.time_parallel == (name in TIME_PARALLEL)
    assert rec.affine.block_diagonal == (name in TIME_PARALLEL and name not in LOW_RANK)
    assert bool(rec.affine.low_rank) == (name in LOW_RANK)


def _assert_close(errors):
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


@pytest.mark.parametrize("name", ZOO)
def test_mlx_backend_matches_the_paper(name):
    _assert_close(compare(name, "mlx"))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("name", ZOO)
def test_kernels_match_the_paper(name, backend):
    _assert_close(compare(name, backend, "sequential"))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("name", TIME_PARALLEL)
def test_chunked_kernels_match_the_paper(name, backend):
    _assert_close(compare(name, backend, "chunked"))


# Split states: K = 4 state elements over 2 or 4 threads per lane (the sequential kernels).
SPLIT = [(name, 2) for name in ZOO if name not in ("mingru", "complex_lru")] + \
    [(name, 4) for name in ("gated_deltanet", "mamba2", "mlstm", "s4d")]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("name, split", SPLIT, ids=lambda x: str(x))
def test_split_state_kernels_match_the_paper(name, split, backend, monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules[__name__], "K", 4)
    _assert_close(compare(name, backend, "sequential", split=split))


def test_split_refuses_what_it_cannot_do():
    rec = rg.load_spec("gated_deltanet")
    q = mx.random.normal((1, 3, 1, 6))
    args = (q, q, mx.random.normal((1, 3, 1, 5)), mx.zeros((1, 3, 1)), mx.zeros((1, 3, 1)))
    with pytest.raises(ValueError, match="dividing the state size 6"):
        rec(*args, backend="metal-sim", schedule="sequential", split=4)
    with pytest.raises(ValueError, match="sequential schedule"):
        rg.load_spec("gla")(q, q, args[2], args[3], backend="metal-sim", schedule="chunked",
                            split=2)
    with pytest.raises(ValueError, match="kernel backends"):
        rec(*args, backend="mlx", split=2)


def test_mlstm_matches_the_unstabilised_cell():
    """The stabilised cell from zero states equals the unstabilised one (the stabiliser cancels
    in h); its normaliser and stabiliser are per head (shared by the lanes)."""
    mx.random.seed(3)
    inputs, _ = _draw("mlstm")
    rec = rg.load_spec("mlstm")
    h, finals = rec(*inputs, return_state=True, backend="mlx", seg=SEG)
    assert finals["n"].shape == (b, H, K) and finals["m"].shape == (b, H)
    assert rel_err(h, mlstm_unstabilised_ref(*inputs)) < TOL


def test_references_are_not_degenerate():
    """Every zoo reference's output and final state are finite, nonzero and of both signs."""
    for name in ZOO:
        mx.random.seed(sum(map(ord, name)))
        inputs, states = _draw(name)
        outs, fins = _reference(name, inputs, states)
        for x in outs + fins:
            assert mx.all(mx.isfinite(x)).item(), name
            assert mx.min(x).item() < 0 < mx.max(x).item(), name
            assert math.isfinite(mx.max(mx.abs(x)).item()) and mx.max(mx.abs(x)).item() < 1e3, name


def test_readme_zoo_table_matches_the_specs():
    """The spec language page's zoo table lists every bundled spec with its lines and
    time-parallel flag."""
    import re
    from pathlib import Path

    from mlx_recgen.resources import specs_dir

    text = (Path(__file__).resolve().parents[1] / "docs" / "spec-language.md").read_text()
    section = text.split("## The zoo: bundled specs", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| [^|]+ \| (\d+) \| (yes|no) \|$", section, re.M)
    assert sorted(name for name, _, _ in rows) == sorted(rg.list_specs())
    for name, lines, parallel in rows:
        source = (specs_dir() / f"{name}.py").read_text().splitlines()
        start = next(i for i, line in enumerate(source) if line.startswith("@rg.recurrence"))
        assert sum(1 for line in source[start:] if line.strip()) == int(lines), name
        assert rg.load_spec(name).time_parallel == (parallel == "yes"), name
