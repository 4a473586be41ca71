"""Spellings of the identifiers that generated code derives from spec names."""

import re

import mlx.core as mx
import pytest

import mlx_recgen as rg
from mlx_recgen.render.names import (PREFIX, MLX_INPUT_SUFFIXES, Identifiers, kernel_identifiers,
                                     kernel_name)
from mlx_recgen.schedule import MetaLayout


def test_identifiers_keep_readable_forms_and_never_repeat():
    ids = Identifiers()
    assert ids.add(("buffer", "q"), "q", MLX_INPUT_SUFFIXES) == "u_q"
    assert ids.add(("buffer", "q_shape"), "q_shape") == "u_q_shape_1"  # MLX's name for q's shape
    assert ids.add(("base", "q"), "q_base") == "u_q_base"
    assert ids.add(("buffer", "q_base"), "q_base") == "u_q_base_1"
    assert ids.add(("value", "λ"), "λ_v") == "u_u03bb_v"
    assert ids.add(("buffer", "q"), "ignored") == "u_q"  # a key is spelled once
    assert PREFIX == "u_"


@rg.recurrence(lane="P", state={"h": "B P N", "h_s": "B P"},
               inputs={"q": "B L N", "q_base": "B L P", "q_stride_L": "B L", "d_q": "B L P",
                       "idx_B": "N", "h_init": "B L P", "q_shape": "P"},
               outputs={"y": "B L P"})
def contrived(h, h_s, q, q_base, q_stride_L, d_q, idx_B, h_init, q_shape, n):
    h[n] = rg.sigmoid(q_stride_L) * h[n] + q[n] * q_base * idx_B[n] + d_q + h_init
    h_s = h_s * q_shape + rg.Sum(q[n] * h[n], n)
    return {"y": h_s}


def test_kernel_identifiers_of_a_contrived_spec():
    """Names built to meet each other's derived spellings still get distinct identifiers, all
    valid ASCII C identifiers with the prefix, none an input buffer's MLX-derived name."""
    ids = kernel_identifiers(contrived, MetaLayout(contrived.spec))
    spellings = [s for _, s in ids.items()]
    assert len(set(spellings)) == len(spellings)
    assert all(re.fullmatch(r"u_[A-Za-z0-9_]+", s) for s in spellings)
    buffers = [s for k, s in ids.items() if k[0] in ("buffer", "init", "ckpt", "d", "d_final")]
    assert not {b + x for b in buffers for x in MLX_INPUT_SUFFIXES} & set(spellings)


@pytest.mark.sim
def test_contrived_spec_runs_on_the_simulator():
    from test_kernels import _check_against_reference

    b, L, P, N = 2, 6, 5, 3
    inputs = [mx.random.normal((b, L, N)) * 0.5, mx.random.normal((b, L, P)),
              mx.random.normal((b, L)), mx.random.normal((b, L, P)), mx.random.normal((N,)),
              mx.random.normal((b, L, P)), mx.random.normal((P,)) * 0.5]
    states = [mx.random.normal((b, P, N)), mx.random.normal((b, P))]
    _check_against_reference(contrived, inputs, states, "metal-sim", seg=4)


@pytest.mark.parametrize("name", ["rg-lru", "gla.v2", "λ_scan"])
def test_spec_names_beyond_identifiers(name):
    """Names with '-', '.' or non-ASCII letters are accepted; the kernels are named by an ASCII
    C identifier, and the name itself appears only in the comment atop the kernel."""
    rec = rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
                        outputs={"y": "B L D"}, name=name)(_lru)
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", kernel_name(rec.spec.name, "forward"))
    lines = rec.source("forward", backend="metal").splitlines()
    assert [line for line in lines if name in line] == [
        next(line for line in lines if line.startswith(f"// mlx-recgen: spec '{name}', "))]


def _lru(h, a, x):
    h = a * h + x
    return {"y": h}
