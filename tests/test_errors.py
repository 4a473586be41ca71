"""Errors: bad call inputs raise TypeError/ValueError naming the argument and the problem; bad
specs raise SpecError at decoration time naming the spec, the symbol and the problem."""

import inspect
import math
import re
import types
import warnings
from math import sqrt

import mlx.core as mx
import numpy as np
import pytest
import sympy

import mlx_recgen as rg
from mlx_recgen import Sum
from references import ssd_inputs

# ---------------------------------------------------------------------------------------------
# Bad call inputs
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def ssd():
    (u, delta, B, C, A), h0 = ssd_inputs(b=2, L=5, H=3, P=4, N=6)
    return rg.load_spec("ssd"), [u, delta, B, C, A], h0


def call(rec, args, **kw):
    return rec(*args, backend="mlx", **kw)


def test_wrong_rank(ssd):
    rec, (u, delta, B, C, A), _ = ssd
    with pytest.raises(ValueError, match=r"ssd\(\): argument 'u' has shape \(5, 3, 4\) \(3 axes\); "
                                         r"expected 4 axes \(B L H P\)"):
        call(rec, [u[0], delta, B, C, A])
    with pytest.raises(ValueError, match=r"argument 'A' .*expected 2 axes \(H N\)"):
        call(rec, [u, delta, B, C, A[None]])


def test_mismatched_axis_sizes(ssd):
    rec, (u, delta, B, C, A), _ = ssd
    with pytest.raises(ValueError, match=r"axis N has size 5 in 'C' \(2, 5, 3, 5\) but 6 in 'B'"):
        call(rec, [u, delta, B, C[..., :5], A])
    with pytest.raises(ValueError, match=r"axis L has size 4 in 'delta'.* but 5 in 'u'"):
        call(rec, [u, delta[:, :4], B, C, A])
    with pytest.raises(ValueError, match=r"axis H has size 2 in 'A'"):
        call(rec, [u, delta, B, C, A[:2]])


@pytest.mark.parametrize("dtype", [mx.int32, mx.bool_, mx.uint8])
def test_integer_dtype(ssd, dtype):
    """Bool and integer inputs are accepted (and not differentiated); initial states must be
    floating point."""
    rec, (u, delta, B, C, A), h0 = ssd
    call(rec, [u, delta, B, C, A.astype(dtype)])
    with pytest.raises(TypeError, match=r"argument 'initial_state' has dtype \w+; expected "
                                        r"float32, float16 or bfloat16$"):
        call(rec, [u, delta, B, C, A], initial_state=h0.astype(dtype))
    with pytest.raises(TypeError, match=r"argument 'A' has dtype float64; expected float32, "
                                        r"float16 or bfloat16, or bool or an integer type"):
        call(rec, [u, delta, B, C, A.astype(mx.float64)])


def test_not_an_array(ssd):
    rec, (u, delta, B, C, A), _ = ssd
    with pytest.raises(TypeError, match=r"argument 'A' must be an mx.array, got ndarray"):
        call(rec, [u, delta, B, C, np.array(A)])


def test_missing_input(ssd):
    rec, (u, delta, B, C, A), _ = ssd
    with pytest.raises(TypeError, match=r"ssd\(\) is missing input\(s\) \['A'\]"):
        call(rec, [u, delta, B, C])
    with pytest.raises(TypeError, match=r"missing input\(s\) \['delta', 'C'\]"):
        rec(u, B=B, A=A, backend="mlx")


def test_unexpected_keyword_and_extra_positional(ssd):
    rec, args, _ = ssd
    with pytest.raises(TypeError, match=r"ssd\(\) got an unexpected argument 'foo'"):
        call(rec, args, foo=args[0])
    with pytest.raises(TypeError, match=r"ssd\(\) takes 5 inputs .*, got 6"):
        call(rec, args + [args[-1]])
    with pytest.raises(TypeError, match=r"got input 'A' twice"):
        call(rec, args, A=args[-1])
    with pytest.raises(TypeError, match=r"unexpected argument 'seg'"):
        rec.reference(*args, seg=4)


def test_bad_initial_state(ssd):
    rec, args, h0 = ssd
    with pytest.raises(ValueError, match=r"argument 'initial_state' has shape \(2, 3, 4\) "
                                         r"\(3 axes\); expected 4 axes \(B H P N\)"):
        call(rec, args, initial_state=h0[..., 0])
    with pytest.raises(ValueError, match=r"axis N has size 5 in 'initial_state'"):
        call(rec, args, initial_state=h0[..., :5])
    with pytest.raises(ValueError, match=r"axis B has size 1 in 'initial_state'"):
        call(rec, args, initial_state=h0[:1])
    with pytest.raises(TypeError, match=r"argument 'initial_state' has dtype int32"):
        call(rec, args, initial_state=h0.astype(mx.int32))
    with pytest.raises(TypeError, match=r"initial_state has unknown state\(s\) \['g'\]"):
        call(rec, args, initial_state={"g": h0})
    with pytest.raises(TypeError, match=r"initial_state must be an mx.array or a dict"):
        call(rec, args, initial_state=[h0])


@pytest.mark.parametrize("seg", [0, -3, 2.0, True, "8", np.float64(4.0), np.True_,
                                 np.int64(0), mx.array(True), mx.array([4])])
def test_bad_seg(ssd, seg):
    rec, args, _ = ssd
    with pytest.raises(ValueError, match=r"ssd\(\): seg must be a positive integer, got "
                                         + re.escape(repr(seg))):
        call(rec, args, seg=seg)


@pytest.mark.parametrize("seg", [np.int64(2), np.int32(2), np.uint8(2), mx.array(2)])
def test_integer_like_seg(ssd, seg):
    """Integer-like values (``operator.index``) are accepted and used as the int they stand for."""
    rec, args, h0 = ssd
    y = call(rec, args, initial_state=h0, seg=seg)
    plan = rec.plan(*args, initial_state=h0, seg=seg, backend="mlx")
    assert type(plan.seg) is int and plan.seg == 2
    assert mx.array_equal(y, call(rec, args, initial_state=h0, seg=2)).item()
    from mlx_recgen import scans
    assert mx.array_equal(scans.ssd_scan(*args, seg=seg, backend="mlx"),
                          scans.ssd_scan(*args, seg=2, backend="mlx")).item()
    assert "SEG" in rec.source("forward", backend="metal", seg=seg)
    with pytest.raises(ValueError, match=r"ssd.source\(\): seg must be a positive integer"):
        rec.source("forward", backend="metal", seg=0)


def test_bad_backend_and_empty(ssd):
    rec, (u, delta, B, C, A), _ = ssd
    with pytest.raises(ValueError, match=r"backend must be one of .*got 'tpu'"):
        rec(u, delta, B, C, A, backend="tpu")
    with pytest.raises(ValueError, match=r"argument 'u' is empty"):
        call(rec, [u[:, :0], delta[:, :0], B[:, :0], C[:, :0], A])


def test_gpu_backends_follow_the_default_device(ssd, monkeypatch):
    """On a machine with a GPU whose MLX has the CPU as its default device, ``auto`` runs the
    MLX ops (a GPU kernel on the CPU's stream fails inside MLX) and an explicit GPU backend
    says why it cannot run. The GPU is made to look present; no kernel may be built."""
    _, args, _ = ssd
    rec = rg.Recurrence(rg.load_spec("ssd").spec)  # its own backends: no kernels built before
    built = []
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(mx, "cuda", types.SimpleNamespace(is_available=lambda: True),
                        raising=False)
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: built.append(kw), raising=False)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu, 0))
    assert rg.default_backend() == "mlx"
    assert mx.array_equal(rec(*args), call(rec, args)).item()
    with pytest.raises(ValueError, match=r"backend='cuda' runs its kernels on the GPU, but "
                                         r"MLX's default device is the CPU"):
        rec(*args, backend="cuda")
    assert not built
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
    assert rg.default_backend() == "cuda"


def test_unknown_spec_name():
    with pytest.raises(ValueError, match=r"unknown spec 'nope'; bundled specs are"):
        rg.load_spec("nope")


# ---------------------------------------------------------------------------------------------
# Bad specs (SpecError at decoration time)
# ---------------------------------------------------------------------------------------------

SCALAR = dict(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
              outputs={"y": "B L D"})
VECTOR = dict(lane="P", state={"h": "B P N"}, inputs={"a": "B L P", "C": "B L N"},
              outputs={"y": "B L P"})


def decl(base, **changes):
    return {**base, **changes}


def test_spec_error_is_a_value_error():
    assert issubclass(rg.SpecError, ValueError)


def test_unknown_axis():
    with pytest.raises(rg.SpecError, match=r"spec 'ua': tensor 'x': unknown axis 'Q'"):
        @rg.recurrence(**decl(SCALAR, inputs={"a": "B L D", "x": "B L Q"}))
        def ua(h, a, x):
            h = a * h + x
            return {"y": h}


def test_output_lacking_lane_axis():
    with pytest.raises(rg.SpecError, match=r"spec 'nl': output 'y' lacks the lane axis 'D'"):
        @rg.recurrence(**decl(SCALAR, outputs={"y": "B L"}))
        def nl(h, a, x):
            h = a * h + x
            return {"y": h}


def test_output_lacking_time_axis():
    with pytest.raises(rg.SpecError, match=r"spec 'nt': output 'y' lacks the time axis 'L'"):
        @rg.recurrence(**decl(SCALAR, outputs={"y": "B D"}))
        def nt(h, a, x):
            h = a * h + x
            return {"y": h}


def test_output_lacking_a_batch_axis():
    """Outputs carry every batch-like axis (DESIGN, ``recurrence`` docstring). An output that
    lacks one (here H, carried by 'y') has no defined value per H instance; the spec must be
    rejected at definition time instead of the output being silently summed over H."""
    with pytest.raises(rg.SpecError, match=r"spec 'omb': output 'z'.*axis 'H'"):
        @rg.recurrence(lane="P", state={"h": "B H P"}, inputs={"a": "B L H P"},
                       outputs={"y": "B L H P", "z": "B L P"})
        def omb(h, a):
            h = a * h + 1
            return {"y": h, "z": a}


def test_state_never_updated():
    with pytest.raises(rg.SpecError, match=r"spec 'nv': state 'h' is never updated by the body"):
        @rg.recurrence(**SCALAR)
        def nv(h, a, x):
            return {"y": a * h + x}
    with pytest.raises(rg.SpecError, match=r"spec 'nvv': state 'h' is never updated"):
        @rg.recurrence(**VECTOR)
        def nvv(h, a, C, n):
            return {"y": Sum(C[n] * h[n], n)}


def test_output_not_returned():
    with pytest.raises(rg.SpecError, match=r"spec 'nr': output\(s\) \['z'\] are declared but not "
                                           r"returned"):
        @rg.recurrence(**decl(SCALAR, outputs={"y": "B L D", "z": "B L D"}))
        def nr(h, a, x):
            h = a * h + x
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'nr2': the body must return a dict of outputs "
                                           r"\['y'\], got NoneType"):
        @rg.recurrence(**SCALAR)
        def nr2(h, a, x):
            h = a * h + x
    with pytest.raises(rg.SpecError, match=r"spec 'uo': the body returns undeclared outputs "
                                           r"\['zz'\]"):
        @rg.recurrence(**SCALAR)
        def uo(h, a, x):
            h = a * h + x
            return {"y": h, "zz": h}


@pytest.mark.parametrize("op", [sympy.floor, sympy.ceiling, sympy.sign])
def test_non_differentiable_op(op):
    name = op.__name__
    with pytest.raises(rg.SpecError, match=rf"spec 'nd': state 'h' uses '{name}', which is not a "
                                           r"differentiable op"):
        @rg.recurrence(**SCALAR)
        def nd(h, a, x):
            h = op(a) * h + x
            return {"y": h}
    with pytest.raises(rg.SpecError, match=rf"spec 'nd2': output 'y' uses '{name}'"):
        @rg.recurrence(**SCALAR)
        def nd2(h, a, x):
            h = a * h + x
            return {"y": op(h)}


def test_state_index_outside_sum():
    with pytest.raises(rg.SpecError, match=r"spec 'io': output 'y' depends on the state index "
                                           r"outside a Sum\(\.\.\., n\); a scalar is required"):
        @rg.recurrence(**VECTOR)
        def io(h, a, C, n):
            h[n] = a * h[n] + C[n]
            return {"y": C[n] * h[n]}
    with pytest.raises(rg.SpecError, match=r"spec 'iv': state 'h' uses the index 'n' as a value"):
        @rg.recurrence(**VECTOR)
        def iv(h, a, C, n):
            h[n] = a * h[n] + n
            return {"y": Sum(C[n] * h[n], n)}


def test_scalar_state_reads_vector_outside_sum():
    """A scalar state may not depend on the state index outside a Sum."""
    with pytest.raises(rg.SpecError, match=r"spec 'sv': state 'm' depends on the state index "
                                           r"outside a Sum"):
        @rg.recurrence(lane="P", state={"h": "B P N", "m": "B P"},
                       inputs={"a": "B L P", "C": "B L N"}, outputs={"y": "B L P"})
        def sv(h, m, a, C, n):
            h[n] = a * h[n] + C[n]
            m = m + C[n]
            return {"y": m}


def test_body_parameter_matching_nothing():
    with pytest.raises(rg.SpecError, match=r"spec 'ep': unknown body parameters \['bogus'\]"):
        @rg.recurrence(**SCALAR)
        def ep(h, a, x, bogus):
            h = a * h + x
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'epv': the body needs exactly one index "
                                           r"parameter for the state axis 'N'.*\['bogus', 'n'\]"):
        @rg.recurrence(**VECTOR)
        def epv(h, a, C, bogus, n):
            h[n] = a * h[n] + C[n]
            return {"y": Sum(C[n] * h[n], n)}
    with pytest.raises(rg.SpecError, match=r"spec 'mp': the body has no parameter for \['x'\]"):
        @rg.recurrence(**SCALAR)
        def mp(h, a):
            h = a * h
            return {"y": h}


def test_several_state_axes():
    with pytest.raises(rg.SpecError, match=r"spec 'sa': states carry several state axes "
                                           r"\['N', 'M'\]"):
        @rg.recurrence(lane="P", state={"h": "B P N M"}, inputs={"a": "B L P"},
                       outputs={"y": "B L P"})
        def sa(h, a, n):
            h[n] = a * h[n]
            return {"y": a}
    with pytest.raises(rg.SpecError, match=r"spec 'sa2': states carry several state axes"):
        @rg.recurrence(lane="P", state={"h": "B P N", "g": "B P M"}, inputs={"a": "B L P"},
                       outputs={"y": "B L P"})
        def sa2(h, g, a, n):
            h[n] = a * h[n]
            return {"y": a}


def test_other_malformed_specs():
    with pytest.raises(rg.SpecError, match=r"spec 'lt': lane and time are the same axis 'L'"):
        @rg.recurrence(lane="L", state={"h": "B L"}, inputs={"a": "B L"}, outputs={"y": "B L"})
        def lt(h, a):
            h = a * h
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'snl': state 'h' lacks the lane axis 'D', so "
                                           r"the lanes of an instance share it"):
        @rg.recurrence(**decl(SCALAR, state={"h": "B"}))
        def snl(h, a, x):
            h = h + a
            return {"y": a * h + x}
    with pytest.raises(rg.SpecError, match=r"spec 'st': state 'h' must not carry the time axis"):
        @rg.recurrence(**decl(SCALAR, state={"h": "B L D"}))
        def st(h, a, x):
            h = a * h + x
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'da': tensor 'a': an axis appears twice"):
        @rg.recurrence(**decl(SCALAR, inputs={"a": "B L D D", "x": "B L D"}))
        def da(h, a, x):
            h = a * h + x
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'rv': state 'h' has index axes; update it with "
                                           r"h\[\.\.\.\] = \.\.\., not by rebinding"):
        @rg.recurrence(**VECTOR)
        def rv(h, a, C, n):
            h = a
            return {"y": a}
    with pytest.raises(rg.SpecError, match=r"spec 'ai': input 'C' is read-only"):
        @rg.recurrence(**VECTOR)
        def ai(h, a, C, n):
            C[n] = a
            h[n] = a * h[n]
            return {"y": Sum(C[n] * h[n], n)}
    with pytest.raises(rg.SpecError, match=r"spec 'wc': 'h': component index must be an integer "
                                           r"in \[0, 2\), got 2"):
        @rg.recurrence(lane="P", state={"h": "B P 2"}, inputs={"a": "B L P"},
                       outputs={"y": "B L P 2"})
        def wc(h, a):
            h[0] = a * h[2]
            h[1] = a * h[1]
            return {"y": (h[0], h[1])}
    with pytest.raises(rg.SpecError, match=r"spec 'wn': output 'y' has 2 component\(s\), the "
                                           r"body returns 1"):
        @rg.recurrence(lane="P", state={"h": "B P 2"}, inputs={"a": "B L P"},
                       outputs={"y": "B L P 2"})
        def wn(h, a):
            h[0] = a * h[0]
            h[1] = a * h[1]
            return {"y": h[0]}
    with pytest.raises(rg.SpecError, match=r"spec 'br': tracing the body failed: "
                                           r"ZeroDivisionError"):
        @rg.recurrence(**SCALAR)
        def br(h, a, x):
            h = a * h + x
            return {"y": 1 / 0}


def test_tensor_names_must_be_identifiers():
    with pytest.raises(rg.SpecError, match=r"spec 'bad': 'x-1' is not a valid tensor name"):
        @rg.recurrence(**decl(SCALAR, inputs={"a": "B L D", "x-1": "B L D"}))
        def bad(h, a):
            h = a * h
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'num': '1x' is not a valid tensor name"):
        @rg.recurrence(**decl(SCALAR, outputs={"1x": "B L D"}))
        def num(h, a, x):
            h = a * h + x
            return {"1x": h}


@pytest.mark.parametrize("name", ["x\n#error injected", "x\r", "x\x00", "x */", "a b", "q'",
                                  "1x", "", "x\u2028y", 5])
def test_spec_names_that_could_reach_kernel_text_are_refused(name):
    """A spec's name reaches generated code (kernel names, a comment atop each kernel): a
    newline there would end the comment and compile what follows."""
    with pytest.raises(rg.SpecError, match=r"a spec name is made of letters, digits, '_', '-' "
                                           r"and '\.' and starts with a letter or '_'"):
        rg.recurrence(**SCALAR, name=name)(_scalar_body)


def test_a_body_whose_name_names_no_spec():
    with pytest.raises(rg.SpecError, match=r"spec '<lambda>': a spec name is made of .*; name "
                                           r"the spec with name=\.\.\."):
        rg.recurrence(**SCALAR)(lambda h, a, x: {"y": h})


def _scalar_body(h, a, x):
    h = a * h + x
    return {"y": h}


@pytest.mark.parametrize("bad", ["x\n", "x y", "", 5, ("x",), sympy.Symbol("z")])
def test_tensor_names_that_are_not_identifiers(bad):
    with pytest.raises(rg.SpecError, match=r"is not a valid tensor name"):
        rg.recurrence(**decl(SCALAR, inputs={"a": "B L D", bad: "B L D"}), name="t")(_scalar_body)


def test_a_digit_that_is_not_a_decimal_is_no_component_size():
    with pytest.raises(rg.SpecError, match=r"tensor 'x': '²' is not an axis name"):
        rg.recurrence(**decl(SCALAR, inputs={"a": "B L D", "x": "B L D ²"}))(_scalar_body)


@pytest.mark.parametrize("option", ["group", "seg", "backend", "schedule", "threads", "split",
                                    "initial_state", "return_state"])
def test_inputs_named_like_call_options_are_refused(option):
    """An input named like an option of the call could not be passed by keyword."""
    options = ("['initial_state', 'return_state', 'backend', 'seg', 'schedule', 'group', "
               "'threads', 'split']")
    with pytest.raises(rg.SpecError, match=re.escape(
            f"spec 'opt': input '{option}' is named like an option of the call; the call's "
            f"options {options} cannot name inputs")):
        rg.recurrence(**decl(SCALAR, inputs={"a": "B L D", option: "B L D"}), name="opt")(
            _scalar_body)


def test_call_options_are_the_keywords_of_the_call():
    """The names refused for inputs are the call's keyword options, those of its signature and
    those the kernel backends take from its keywords."""
    from mlx_recgen.function import Recurrence
    from mlx_recgen.spec import CALL_OPTIONS, KERNEL_OPTIONS

    keywords = [p.name for p in inspect.signature(Recurrence.__call__).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert sorted(CALL_OPTIONS) == sorted([*keywords, *KERNEL_OPTIONS])


def test_states_and_outputs_may_be_named_like_call_options():
    @rg.recurrence(lane="D", state={"seg": "B D"}, inputs={"a": "B L D", "x": "B L D"},
                   outputs={"backend": "B L D"})
    def named(seg, a, x):
        seg = a * seg + x
        return {"backend": seg}

    a, x, h0 = mx.random.normal((2, 3, 4)), mx.random.normal((2, 3, 4)), mx.random.normal((2, 4))
    y, h = named(a=a, x=x, initial_state={"seg": h0}, return_state=True, backend="mlx")
    assert mx.allclose(h, a[:, 2] * (a[:, 1] * (a[:, 0] * h0 + x[:, 0]) + x[:, 1]) + x[:, 2],
                       atol=1e-5)
    assert mx.allclose(y[:, 2], h)


# ---------------------------------------------------------------------------------------------
# Plain Python on traced values: the error names the spec language's answer
# ---------------------------------------------------------------------------------------------


def test_python_branch_on_a_traced_value():
    where = r"use rg\.where\(cond, a, b\) for a data-dependent branch"
    with pytest.raises(rg.SpecError, match=r"spec 'pif': `if a > 0:` branches on a traced value: "
                                           r"a Python `if`, `and`, .*" + where):
        @rg.recurrence(**SCALAR)
        def pif(h, a, x):
            if a > 0:
                h = a * h + x
            else:
                h = x
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'pand': `h = a \* h \+ \(x if a > 0 and x > 0 "
                                           r"else a\)` branches on a traced value.*" + where):
        @rg.recurrence(**SCALAR)
        def pand(h, a, x):
            h = a * h + (x if a > 0 and x > 0 else a)
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'chain': .*`h = \(0 < a < 1\) \* h \+ x` "
                                           r"branches on a traced value.*" + where):
        @rg.recurrence(**SCALAR)
        def chain(h, a, x):
            h = (0 < a < 1) * h + x
            return {"y": h}


def test_builtin_max_and_min_on_traced_values():
    with pytest.raises(rg.SpecError, match=r"spec 'bmax': `h = max\(a, x\) \* h \+ x` calls the "
                                           r"builtin max\(\) on traced values.*use "
                                           r"rg\.maximum\(a, b\)$"):
        @rg.recurrence(**SCALAR)
        def bmax(h, a, x):
            h = max(a, x) * h + x
            return {"y": h}

    def clip(z):  # a helper called by the body: the message shows the helper's line
        return min(z, 0.9)

    with pytest.raises(rg.SpecError, match=r"spec 'bmin': `return min\(z, 0\.9\)` calls the "
                                           r"builtin min\(\).*use rg\.minimum\(a, b\)$"):
        @rg.recurrence(**SCALAR)
        def bmin(h, a, x):
            h = clip(a) * h + x
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'vmax': .*builtin max\(\).*rg\.maximum"):
        @rg.recurrence(**VECTOR)
        def vmax(h, a, C, n):
            h[n] = max(a, 0.5) * h[n] + C[n]
            return {"y": Sum(C[n] * h[n], n)}


def mx_exp(h, a, x):
    h = a * h + mx.exp(x)
    return {"y": h}


def mx_tanh(h, a, x):
    h = mx.tanh(a) * h + x
    return {"y": h}


def math_exp(h, a, x):
    h = a * h + math.exp(x)
    return {"y": h}


def np_tanh(h, a, x):
    h = a * h + np.tanh(x)
    return {"y": h}


def np_maximum(h, a, x):
    h = np.maximum(a, 0.0) * h + x
    return {"y": h}


def np_where(h, a, x):
    h = a * h + np.where(x > 0, x, 0.0)
    return {"y": h}


def np_fabs(h, a, x):
    h = a * h + np.fabs(x)
    return {"y": h}


def squash(z):  # a helper the body calls, with a function imported by name
    return sqrt(z)


def math_sqrt_in_a_helper(h, a, x):
    h = a * h + squash(x)
    return {"y": h}


def np_sign(h, a, x):
    h = a * h + np.sign(x)
    return {"y": h}


def np_clip(h, a, x):  # a NumPy function written in Python: its own lines are not the body's
    h = a * h + np.clip(x, 0.0, 1.0)
    return {"y": h}


@pytest.mark.parametrize("body, line, written, library, use", [
    (mx_exp, "h = a * h + mx.exp(x)", "mx.exp", "MLX", "use rg.exp"),
    (mx_tanh, "h = mx.tanh(a) * h + x", "mx.tanh", "MLX", "use rg.tanh"),
    (math_exp, "h = a * h + math.exp(x)", "math.exp", "Python's math module", "use rg.exp"),
    (np_tanh, "h = a * h + np.tanh(x)", "np.tanh", "NumPy", "use rg.tanh"),
    (np_maximum, "h = np.maximum(a, 0.0) * h + x", "np.maximum", "NumPy", "use rg.maximum"),
    (np_where, "h = a * h + np.where(x > 0, x, 0.0)", "np.where", "NumPy", "use rg.where"),
    (np_fabs, "h = a * h + np.fabs(x)", "np.fabs", "NumPy", "use rg.abs"),
    (math_sqrt_in_a_helper, "return sqrt(z)", "sqrt", "Python's math module", "use rg.sqrt"),
    (np_sign, "h = a * h + np.sign(x)", "np.sign", "NumPy",
     "the spec language's functions are rg.exp, rg.log, "),
    (np_clip, "h = a * h + np.clip(x, 0.0, 1.0)", "np.clip", "NumPy",
     "the spec language's functions are rg.exp, rg.log, "),
])
def test_mlx_numpy_and_math_functions_on_traced_values(body, line, written, library, use):
    """Their errors on symbols (MLX: "Invalid type ... received in array initialization",
    math: "Cannot convert expression to float", NumPy: "loop of ufunc does not support ...", or
    a comparison's truth value) become one that names the spec language's function."""
    with pytest.raises(rg.SpecError, match=re.escape(
            f"spec '{body.__name__}': `{line}` calls {written}, a function of {library}, on a "
            f"traced value: the body runs once on symbols, which {library} cannot take; {use}")):
        rg.recurrence(**SCALAR)(body)


def test_library_functions_inside_a_reduction():
    with pytest.raises(rg.SpecError, match=r"calls mx\.exp, a function of MLX.*use rg\.exp$"):
        @rg.recurrence(**VECTOR)
        def vexp(h, a, C, n):
            h[n] = a * h[n] + C[n]
            return {"y": Sum(mx.exp(C[n]) * h[n], n)}


def test_library_functions_on_constants_are_fine():
    @rg.recurrence(**SCALAR)
    def constants(h, a, x):
        h = a * h + math.exp(0.5) * x + float(np.tanh(0.25))
        return {"y": h}

    a, x = mx.random.normal((1, 3, 2)), mx.random.normal((1, 3, 2))
    y = constants(a, x, backend="mlx")
    c, d = math.exp(0.5), math.tanh(0.25)
    assert mx.allclose(y[:, 0], c * x[:, 0] + d, atol=1e-5)


def test_an_input_the_body_never_reads_is_warned_about():
    with pytest.warns(UserWarning, match=r"^spec 'unread': input 'x' is never read: no state "
                                         r"update or output depends on it$") as caught:
        @rg.recurrence(**decl(SCALAR, inputs={"a": "B L D", "x": "B L D", "c": "D"}))
        def unread(h, a, x, c):
            h = a * h + c + (x - x)  # cancels: nothing depends on x
            return {"y": h}
    assert [w.filename for w in caught] == [__file__]  # points at the definition
    assert len(caught) == 1


def test_inputs_read_through_a_component_or_a_reduction_are_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        @rg.recurrence(lane="P", state={"h": "B P N"},
                       inputs={"a": "B L P 2", "C": "B L N", "D": "B L N"},
                       outputs={"y": "B L P"})
        def read(h, a, C, D, n):
            h[n] = a[1] * h[n] + C[n]
            return {"y": Sum(D[n] * h[n], n)}


def test_comparison_used_as_a_number():
    with pytest.raises(rg.SpecError, match=r"spec 'cnum': `h = \(a > 0\) \* h \+ x` uses a "
                                           r"comparison as a number.*rg\.where\(x > 0, 1\.0, "
                                           r"0\.0\)"):
        @rg.recurrence(**SCALAR)
        def cnum(h, a, x):
            h = (a > 0) * h + x
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'ceq': `h = a \* h \+ \(a == x\)` uses a "
                                           r"comparison as a number: .*`==`/`!=` on traced values "
                                           r"compare the expressions"):
        @rg.recurrence(**SCALAR)
        def ceq(h, a, x):
            h = a * h + (a == x)
            return {"y": h}


def test_output_lacking_a_batch_axis_of_the_state():
    """An axis that states carry and no output does is the state axis, not a batch axis; when the
    author meant a batch axis, the error says that outputs must carry it."""
    meant = r"if 'H' is a batch axis, every output must carry it"
    with pytest.raises(rg.SpecError, match=r"spec 'sb': the body needs exactly one index "
                                           r"parameter for the state axis 'H' \(after the "
                                           r"tensors\), got \[\]; 'H' is the state axis because "
                                           r"states carry it and no output does \(" + meant):
        @rg.recurrence(lane="P", state={"h": "B H P"}, inputs={"a": "B L H P"},
                       outputs={"y": "B L P"})
        def sb(h, a):
            h = a * h + 1
            return {"y": h}
    with pytest.raises(rg.SpecError, match=r"spec 'si': 'a' has index axes; use it as a\[\.\.\.\] "
                                           r"in expressions \('a' carries the state axis 'H', an "
                                           r"axis that no output carries; " + meant):
        @rg.recurrence(lane="P", state={"h": "B H P"}, inputs={"a": "B L H P"},
                       outputs={"y": "B L P"})
        def si(h, a, n):
            h[n] = a * h[n] + 1
            return {"y": Sum(h[n], n)}
    with pytest.raises(rg.SpecError, match=r"spec 'sn': states carry several state axes "
                                           r"\['H', 'N'\].*a batch axis must be carried by every "
                                           r"output"):
        @rg.recurrence(lane="P", state={"h": "B H P N"}, inputs={"a": "B L H P"},
                       outputs={"y": "B L P"})
        def sn(h, a, n):
            h[n] = a * h[n] + 1
            return {"y": Sum(h[n], n)}
    with pytest.raises(rg.SpecError, match=r"spec 'su': tensor 'a': unknown axis 'H' \(.*; batch "
                                           r"axes are the ones the outputs carry\)"):
        @rg.recurrence(lane="P", state={"h": "B P"}, inputs={"a": "B L H P"},
                       outputs={"y": "B L P"})
        def su(h, a):
            h = a * h + 1
            return {"y": h}
