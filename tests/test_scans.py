"""``mlx_recgen.scans``: the mlx-recurrence-compatible API. Each scan against its ``_reference``
and the hand references, the ``_with_state`` state layouts, gradients (initial state included)
and the keyword-only extras."""

import inspect

import mlx.core as mx
import pytest

from mlx_recgen import scans
from conftest import rel_err
from references import (gla_inputs, gla_ref, rglru_inputs, rglru_ref, rotlru_inputs, ssd_inputs,
                        ssd_ref, value_and_grads)

F32 = mx.float32
TOL = 1e-5


def rotlru_interleaved_ref(a, cos, sin, x, h0=None):
    """Rotational LRU on the interleaved layout: x[..., 2p] drives u_p, x[..., 2p+1] drives w_p;
    the state [b, 2P] holds (u_0, w_0, u_1, w_1, ...)."""
    a, cos, sin, x = (t.astype(F32) for t in (a, cos, sin, x))
    b, L, D = x.shape
    if h0 is None:
        u = w = mx.zeros((b, D // 2), F32)
    else:
        u, w = h0[:, 0::2].astype(F32), h0[:, 1::2].astype(F32)
    ys = []
    for t in range(L):
        at, ct, st = a[:, t], cos[:, t], sin[:, t]
        u, w = at * (ct * u - st * w) + x[:, t, 0::2], at * (st * u + ct * w) + x[:, t, 1::2]
        ys.append(mx.stack([u, w], axis=-1).reshape(b, D))
    return mx.stack(ys, axis=1), mx.stack([u, w], axis=-1).reshape(b, D)


def _rotlru_inputs(b=2, L=13, P=5):
    (a, cos, sin, x), h0 = rotlru_inputs(b, L, P)
    return [a, cos, sin, x.reshape(b, L, 2 * P)], h0.reshape(b, 2 * P)


# name -> (scan, with_state, reference, hand reference, inputs, expected state shape)
SCANS = {
    "ssd": (scans.ssd_scan, scans.ssd_scan_with_state, scans.ssd_scan_reference, ssd_ref,
            lambda: ssd_inputs(b=2, L=13, H=3, P=5, N=4), (2, 3, 5, 4)),
    "gla": (scans.gla_scan, scans.gla_scan_with_state, scans.gla_scan_reference, gla_ref,
            lambda: gla_inputs(b=2, L=13, H=3, K=4, V=6), (2, 3, 4, 6)),
    "rglru": (scans.rglru_scan, scans.rglru_scan_with_state, scans.rglru_scan_reference,
              rglru_ref, lambda: rglru_inputs(b=2, L=13, D=7, negative=True), (2, 7)),
    "rotlru": (scans.rotlru_scan, scans.rotlru_scan_with_state, scans.rotlru_scan_reference,
               rotlru_interleaved_ref, lambda: _rotlru_inputs(b=2, L=13, P=5), (2, 10)),
}
NAMES = list(SCANS)
OUTPUT_SHAPES = {"ssd": (2, 13, 3, 5), "gla": (2, 13, 3, 6), "rglru": (2, 13, 7),
                 "rotlru": (2, 13, 10)}


@pytest.mark.parametrize("name", NAMES)
def test_scan_matches_references(name):
    scan, with_state, reference, hand, make, state_shape = SCANS[name]
    inputs, h0 = make()
    y_hand, h_hand = hand(*inputs, h0)
    y_hand0, _ = hand(*inputs)

    y = scan(*inputs, initial_state=h0, seg=4, backend="mlx")
    y_ref = reference(*inputs, initial_state=h0)
    assert tuple(y.shape) == tuple(y_hand.shape) == OUTPUT_SHAPES[name]
    assert rel_err(y, y_hand) < TOL
    assert rel_err(y_ref, y_hand) < TOL
    # zero initial state by default; default seg and backend
    assert rel_err(scan(*inputs), y_hand0) < TOL
    assert rel_err(reference(*inputs), y_hand0) < TOL
    assert rel_err(scan(*inputs, backend="mlx", seg=1), y_hand0) < TOL


@pytest.mark.parametrize("name", NAMES)
def test_with_state_layout(name):
    scan, with_state, reference, hand, make, state_shape = SCANS[name]
    inputs, h0 = make()
    assert tuple(h0.shape) == state_shape
    y_hand, h_hand = hand(*inputs, h0)
    y, h = with_state(*inputs, initial_state=h0, seg=5, backend="mlx")
    assert tuple(h.shape) == state_shape, f"{name}: state layout {h.shape}"
    assert h.dtype == F32
    assert rel_err(y, y_hand) < TOL
    assert rel_err(h, h_hand) < TOL
    # the returned state continues the scan
    y2, h2 = with_state(*inputs, initial_state=h, backend="mlx")
    y2_hand, h2_hand = hand(*inputs, h_hand)
    assert rel_err(y2, y2_hand) < TOL and rel_err(h2, h2_hand) < TOL


@pytest.mark.parametrize("name", NAMES)
def test_scan_gradients(name):
    scan, with_state, reference, hand, make, state_shape = SCANS[name]
    inputs, h0 = make()
    y_hand, h_hand = hand(*inputs, h0)
    Wy, Wh = mx.random.normal(y_hand.shape), mx.random.normal(h_hand.shape)

    def ours(*args):
        return with_state(*args[:-1], initial_state=args[-1], seg=3, backend="mlx")

    _, _, g = value_and_grads(ours, inputs, h0, Wy, Wh)
    _, _, g_hand = value_and_grads(hand, inputs, h0, Wy, Wh)
    for i, (a, b) in enumerate(zip(g, g_hand)):
        assert a.shape == b.shape
        assert rel_err(a, b) < TOL, f"{name}: gradient of argument {i}"

    def ref_loss(*args):
        return mx.sum(reference(*args[:-1], initial_state=args[-1]) * Wy)

    def our_loss(*args):
        return mx.sum(scan(*args[:-1], initial_state=args[-1], backend="mlx") * Wy)

    argnums = tuple(range(len(inputs) + 1))
    for a, b in zip(mx.grad(our_loss, argnums=argnums)(*inputs, h0),
                    mx.grad(ref_loss, argnums=argnums)(*inputs, h0)):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("name", NAMES)
def test_extras_are_keyword_only(name):
    """``initial_state`` and ``backend`` are keyword-only; ``seg`` is positional-or-keyword (as
    in mlx-recurrence); the references take neither ``seg`` nor a positional state."""
    scan, with_state, reference, hand, make, state_shape = SCANS[name]
    inputs, h0 = make()
    n = len(inputs)
    for fn in (scan, with_state):
        params = inspect.signature(fn).parameters
        for extra in ("initial_state", "backend"):
            assert params[extra].kind is inspect.Parameter.KEYWORD_ONLY, (fn.__name__, extra)
        assert params["seg"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert list(params).index("seg") == n and params["seg"].default == 32
        assert [p for p in params][:n] == [p for p in inspect.signature(reference).parameters][:n]
        with pytest.raises(TypeError):
            fn(*inputs, 8, h0)  # seg, then initial_state positionally
        with pytest.raises(ValueError, match=r"seg must be a positive integer"):
            fn(*inputs, h0)  # a state where seg goes
    with pytest.raises(TypeError):
        reference(*inputs, h0)
    with pytest.raises(TypeError):
        reference(*inputs, seg=4)
    assert inspect.signature(reference).parameters["initial_state"].kind is \
        inspect.Parameter.KEYWORD_ONLY


def test_scans_positional_api_names():
    """The positional parameters of mlx-recurrence, in its order, seg last."""
    def names(fn):
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    for suffix, seg in (("", ["seg"]), ("_with_state", ["seg"]), ("_reference", [])):
        assert names(getattr(scans, "ssd_scan" + suffix)) == ["u", "delta", "B", "C", "A_neg"] + seg
        assert names(getattr(scans, "gla_scan" + suffix)) == ["q", "k", "v", "gates"] + seg
        assert names(getattr(scans, "rglru_scan" + suffix)) == ["a", "x"] + seg
        assert names(getattr(scans, "rotlru_scan" + suffix)) == ["a", "cs", "sn", "x"] + seg


# The keyword names of mlx-recurrence for each scan's inputs.
PEER_NAMES = {"ssd": ["u", "delta", "B", "C", "A_neg"], "gla": ["q", "k", "v", "gates"],
              "rglru": ["a", "x"], "rotlru": ["a", "cs", "sn", "x"]}


@pytest.mark.parametrize("name", NAMES)
def test_peer_call_forms(name):
    """The call forms mlx-recurrence accepts: seg by position or keyword, inputs by keyword."""
    scan, with_state, reference, hand, make, state_shape = SCANS[name]
    inputs, _ = make()
    y_hand, h_hand = hand(*inputs)
    kw = dict(zip(PEER_NAMES[name], inputs))
    outputs = [scan(*inputs, 4), scan(*inputs, seg=4), scan(**kw, seg=4), scan(**kw),
               scan(*inputs[:1], **dict(list(kw.items())[1:]), seg=4),
               reference(*inputs), reference(**kw)]
    for i, y in enumerate(outputs):
        assert rel_err(y, y_hand) < TOL, f"{name}: call form {i}"
    for y, h in (with_state(*inputs, 4), with_state(**kw, seg=4), with_state(*inputs)):
        assert tuple(h.shape) == state_shape
        assert rel_err(y, y_hand) < TOL and rel_err(h, h_hand) < TOL


def test_rotlru_rotation_aliases():
    """rotlru's ``cs``/``sn`` (mlx-recurrence) and ``cos``/``sin`` name the same arguments."""
    (a, c, s, x), h0 = _rotlru_inputs(b=2, L=9, P=4)
    y_hand, h_hand = rotlru_interleaved_ref(a, c, s, x, h0)
    for fn in (scans.rotlru_scan, scans.rotlru_scan_with_state, scans.rotlru_scan_reference):
        for kw in (dict(cs=c, sn=s), dict(cos=c, sin=s), dict(cs=c, sin=s)):
            out = fn(a, x=x, initial_state=h0, **kw)
            y = out[0] if isinstance(out, tuple) else out
            assert rel_err(y, y_hand) < TOL, (fn.__name__, sorted(kw))
        with pytest.raises(TypeError, match=fn.__name__ + r"\(\) got both 'cs' and its alias 'cos'"):
            fn(a, c, s, x, cos=c)
        with pytest.raises(TypeError, match=fn.__name__ + r"\(\) missing required argument "
                                                          r"'sn' \(or 'sin'\)"):
            fn(a, cs=c, x=x)
        with pytest.raises(TypeError, match=fn.__name__ + r"\(\) missing required argument 'x'"):
            fn(a, c, s)


def _scan_inputs(name):
    inputs, h0 = SCANS[name][4]()
    return list(inputs), h0


def _shrunk(x, axis):
    return x[(slice(None),) * axis + (slice(0, x.shape[axis] - 1),)]


# (scan, how the call is broken, the message expected): every message names the scan, the
# parameter and its documented axes, never the spec's own names (g, A, cos, [B, L, P, 2]).
BAD_CALLS = [
    ("ssd", lambda a, h: (a[:4] + [a[4][:2]], {}),
     r"ssd_scan\(\): argument 'A_neg' \[H, N\] has shape \(2, 4\), so H = 2, but argument "
     r"'u' \[B, L, H, Dh\] has H = 3"),
    ("ssd", lambda a, h: (a[:4] + [a[4].astype(mx.int32)], {}),
     r"ssd_scan\(\): argument 'A_neg' \[H, N\] has dtype int32"),
    ("ssd", lambda a, h: (a[:4] + [a[4][None]], {}),
     r"ssd_scan\(\): argument 'A_neg' \[H, N\] has shape \(1, 3, 4\) \(3 axes\); expected 2"),
    ("ssd", lambda a, h: ([a[0], a[1][..., None]] + a[2:], {}),
     r"ssd_scan\(\): argument 'delta' \[B, L, H\] has shape"),
    ("ssd", lambda a, h: (a, {"initial_state": _shrunk(h, 2)}),
     r"ssd_scan\(\): 'initial_state' \[B, H, Dh, N\] has shape \(2, 3, 4, 4\), so Dh = 4, "
     r"but argument 'u' \[B, L, H, Dh\] has Dh = 5"),
    ("ssd", lambda a, h: (a, {"seg": 0}), r"ssd_scan\(\): seg must be a positive integer, got 0"),
    ("ssd", lambda a, h: (a, {"backend": "tpu"}), r"ssd_scan\(\): backend must be one of"),
    ("gla", lambda a, h: (a[:3] + [a[3][:, :4]], {}),
     r"gla_scan\(\): argument 'gates' \[B, L, H\] has shape \(2, 4, 3\), so L = 4, but "
     r"argument 'q' \[B, L, H, Dk\] has L = 13"),
    ("gla", lambda a, h: (a[:3] + [a[3][..., None]], {}),
     r"gla_scan\(\): argument 'gates' \[B, L, H\] has shape \(2, 13, 3, 1\) \(4 axes\)"),
    ("gla", lambda a, h: (a[:3] + ["g"], {}),
     r"gla_scan\(\): argument 'gates' \[B, L, H\] must be an mx.array, got str"),
    ("gla", lambda a, h: (a, {"initial_state": _shrunk(h, 3)}),
     r"gla_scan\(\): 'initial_state' \[B, H, Dk, Dv\] has shape \(2, 3, 4, 5\), so Dv = 5"),
    ("rglru", lambda a, h: ([a[0], _shrunk(a[1], 2)], {}),
     r"rglru_scan\(\): argument 'x' \[B, L, D\] has shape \(2, 13, 6\), so D = 6, but argument "
     r"'a' \[B, L, D\] has D = 7"),
    ("rglru", lambda a, h: ([a[0], a[1][:, :0]], {}),
     r"rglru_scan\(\): argument 'x' \[B, L, D\] is empty"),
    ("rotlru", lambda a, h: (a[:3] + [a[3][..., :8]], {}),
     r"rotlru_scan\(\): argument 'x' \[B, L, D\] has shape \(2, 13, 8\), so D = 8, but argument "
     r"'a' \[B, L, D/2\] has D/2 = 5"),
    ("rotlru", lambda a, h: (a[:3] + [a[3][..., :9]], {}),
     r"rotlru_scan\(\): argument 'x' \[B, L, D\] holds \(u, w\) pairs along D, which must be "
     r"even; got shape \(2, 13, 9\)"),
    ("rotlru", lambda a, h: ([a[0], a[1], a[2][:1], a[3]], {}),
     r"rotlru_scan\(\): argument 'sn' \[B, L, D/2\] has shape \(1, 13, 5\), so B = 1, but "
     r"argument 'a' \[B, L, D/2\] has B = 2"),
    ("rotlru", lambda a, h: (a[:3] + [a[3][0]], {}),
     r"rotlru_scan\(\): argument 'x' \[B, L, D\] has shape \(13, 10\) \(2 axes\); expected 3"),
    ("rotlru", lambda a, h: (a, {"initial_state": h.reshape(2, 5, 2)}),
     r"rotlru_scan\(\): 'initial_state' \[B, D\] has shape \(2, 5, 2\) \(3 axes\); expected 2"),
    ("rotlru", lambda a, h: (a, {"initial_state": h[:, :8]}),
     r"rotlru_scan\(\): 'initial_state' \[B, D\] has shape \(2, 8\), so D = 8, but argument "
     r"'a' \[B, L, D/2\] has D/2 = 5"),
    ("rotlru", lambda a, h: (a, {"seg": 1.5}), r"rotlru_scan\(\): seg must be a positive integer"),
]


@pytest.mark.parametrize("name, breaks, message", BAD_CALLS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
def test_scan_errors_name_the_scans_parameters(name, breaks, message):
    scan, with_state, reference = SCANS[name][:3]
    inputs, h0 = _scan_inputs(name)
    args, kwargs = breaks(inputs, h0)
    options = {"backend": "mlx", **kwargs}
    with pytest.raises((TypeError, ValueError), match=message):
        scan(*args, **options)
    with_state_message = message.replace(r"_scan\(\)", r"_scan_with_state\(\)")
    with pytest.raises((TypeError, ValueError), match=with_state_message):
        with_state(*args, **options)
    if not {"seg", "backend"} & set(kwargs):
        with pytest.raises((TypeError, ValueError),
                           match=message.replace(r"_scan\(\)", r"_scan_reference\(\)")):
            reference(*args, **kwargs)
