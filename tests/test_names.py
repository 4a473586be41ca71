"""Spellings of the identifiers that generated code derives from spec names."""

import os
import re
import subprocess
import sys

import mlx.core as mx
import pytest

import mlx_recgen as rg
from mlx_recgen.backends.kernels import CHUNKED_KERNELS, SEQUENTIAL_KERNELS, KernelBackend
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
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", kernel_name(rec.spec.name, "forward", "", ""))
    lines = rec.source("forward", backend="metal").splitlines()
    assert [line for line in lines if name in line] == [
        next(line for line in lines if line.startswith(f"// mlx-recgen: spec '{name}', "))]


def _lru(h, a, x):
    h = a * h + x
    return {"y": h}


# -- kernel names identify the kernel text -------------------------------------------------------


def _same_name(update):
    """A recurrence named "same" whose state update is ``update(h, a, x)``."""
    def body(h, a, x):
        h = update(h, a, x)
        return {"y": h}

    return rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
                         outputs={"y": "B L D"}, name="same")(body)


SIZES = {"B": 4, "L": 128, "D": 64}  # those kernel_source (rec.source) assumes


def _names_at_a_call(rec, dtype, schedule):
    """The kernel names the CUDA backend gives the kernel factory in one forward and one backward
    pass with inputs of ``dtype``, by kind (the factory records them; its kernels return zeros)."""
    names = {}

    def factory(name, **_):
        def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        names[name.removeprefix("recgen_same_").rsplit("_", 1)[0]] = name
        return kernel

    impl = KernelBackend(rec, "cuda")
    impl._factory = factory
    inputs = [mx.zeros((4, 128, 64), dtype=dtype)] * 2
    states = [mx.zeros((4, 64))]
    outs, finals, residuals = impl.forward(inputs, states, SIZES, 32, dtype, schedule=schedule)
    impl.backward(inputs, states, residuals, outs, finals, SIZES, 32, schedule=schedule)
    return names


def test_kernel_names_carry_a_digest_of_the_kernel_text():
    """Two specs of one name, and the fp32 and bf16 kernels of one spec, get different kernel
    names (MLX before 0.32.2 caches compiled CUDA modules by name); the same text the same name,
    which is the one in the text ``rec.source`` shows."""
    scaled = _same_name(lambda h, a, x: a * h + x)
    shifted = _same_name(lambda h, a, x: a * h + x + 1)
    for schedule, kinds in (("sequential", SEQUENTIAL_KERNELS), ("chunked", CHUNKED_KERNELS)):
        fp32 = _names_at_a_call(scaled, mx.float32, schedule)
        assert sorted(fp32) == sorted(kinds)
        assert _names_at_a_call(_same_name(lambda h, a, x: a * h + x), mx.float32, schedule) == fp32
        other = _names_at_a_call(shifted, mx.float32, schedule)
        changed = {"sequential": kinds, "chunked": ("summary", "outputs")}[schedule]
        assert all(other[k] != fp32[k] for k in changed)
        bf16 = _names_at_a_call(scaled, mx.bfloat16, schedule)
        assert bf16["backward" if schedule == "sequential" else "gradients"] != \
            fp32["backward" if schedule == "sequential" else "gradients"]
        for dtype, names in ((mx.float32, fp32), (mx.bfloat16, bf16)):
            for kind in kinds:
                text = scaled.source(kind, backend="cuda", dtype=dtype, schedule=schedule)
                assert names[kind] in text


def test_kernel_names_are_the_same_in_another_process():
    """The digest is of the text alone (no per-process hash seed)."""
    code = ("import re, mlx_recgen as rg; print(re.search(r'recgen_rglru_backward_[0-9a-f]{12}', "
            "rg.load_spec('rglru').source('backward', backend='cuda')).group())")
    here = re.search(r"recgen_rglru_backward_[0-9a-f]{12}",
                     rg.load_spec("rglru").source("backward", backend="cuda")).group()
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "7"}).stdout.strip()
    assert there == here
