"""The spec language's shared states, group axes and non-differentiable inputs, against
hand-written MLX loops.

Every case compares the outputs, the final states and the gradient of a weighted loss with
respect to every floating-point input and every initial state with a plain per-step MLX loop
written from the math (differentiated by MLX autodiff; nothing here runs the compiler's
reference). Inputs are drawn with both signs, except where the math needs a sign (a
feature map's output, a normaliser). Backends: ``mlx``, ``metal-sim`` (marker ``sim``) and
``cuda`` (marker ``gpu``, skipped without MLX's CUDA backend), in both schedules where the spec
is state-affine.
"""

from __future__ import annotations

import functools
import shutil

import mlx.core as mx
import pytest

import mlx_recgen as rg
from conftest import KERNEL_BACKENDS, assert_nvcc_compiles, rel_err


KERNELS = KERNEL_BACKENDS
# (backend, schedule): the pure-MLX backend runs the sequential schedule only; "reference" is
# rec.reference, the spec's expressions evaluated per step on MLX arrays
RUNS = [pytest.param("reference", "sequential", id="reference"),
        pytest.param("mlx", "sequential", id="mlx-sequential")] + [
    pytest.param(p.values[0], schedule, marks=p.marks, id=f"{p.values[0]}-{schedule}")
    for p in KERNELS for schedule in ("sequential", "chunked")]
SEQUENTIAL_RUNS = [r for r in RUNS if r.values[1] == "sequential"]


def _normal(shape, scale=1.0):
    return scale * mx.random.normal(shape)


def _uniform(shape, lo, hi):
    return mx.random.uniform(lo, hi, shape)


def _check(rec, reference, inputs, states, backend, schedule, tol=1e-5, **call):
    """Outputs, final states and the gradients of every float input and initial state of
    ``rec`` on ``backend`` against ``reference(*inputs, *states) -> (outputs, finals)`` (lists
    in declaration order). Bool and integer inputs must get zeros of their shape and dtype.
    Returns the recurrence's results and gradients."""
    names = list(rec.spec.states)
    n_in = len(inputs)

    def run_rec(*args):
        if backend == "reference":
            fn = rec.reference
        else:
            fn = functools.partial(rec, backend=backend, schedule=schedule, **call)
        outs, fins = fn(*args[:n_in], initial_state=dict(zip(names, args[n_in:])),
                        return_state=True)
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        return outs + ([fins[k] for k in names] if isinstance(fins, dict) else [fins])

    def run_ref(*args):
        outs, fins = reference(*args)
        return list(outs) + list(fins)

    args = [*inputs, *states]
    ref_values = run_ref(*args)
    weights = [_normal(v.shape) for v in ref_values]

    def loss(fn):
        return lambda *a: sum(mx.sum(v.astype(mx.float32) * w) for v, w in zip(fn(*a), weights))

    floats = [i for i, x in enumerate(args) if x.dtype in (mx.float32, mx.float16, mx.bfloat16)]
    values = run_rec(*args)
    # (MLX cannot differentiate rec.reference's fp32 cast of some integer types)
    argnums = tuple(floats) if backend == "reference" else tuple(range(len(args)))
    grads = dict(zip(argnums, mx.grad(loss(run_rec), argnums=argnums)(*args)))
    ref_grads = dict(zip(floats, mx.grad(loss(run_ref), argnums=tuple(floats))(*args)))
    mx.eval(values, ref_values, grads, ref_grads)
    labels = [*rec.spec.outputs, *(f"final {s}" for s in names)]
    for label, v, r in zip(labels, values, ref_values):
        assert v.shape == r.shape, label
        assert rel_err(v, r) < tol, label
    labels = [*rec.spec.inputs, *(f"initial {s}" for s in names)]
    for i, (label, x) in enumerate(zip(labels, args)):
        if i not in grads:
            continue
        g = grads[i]
        assert g.shape == x.shape and g.dtype == x.dtype, label
        if i in ref_grads and not mx.any(ref_grads[i]).item():  # only read by a condition
            assert not mx.any(g).item(), f"gradient of {label}"
        elif i in ref_grads:
            assert rel_err(g, ref_grads[i]) < tol, f"gradient of {label}"
        else:
            assert not mx.any(g).item(), f"gradient of {label} (not differentiable)"
    return values, grads


# ---------------------------------------------------------------------------------------------
# States without the lane axis: shared by the lanes of an instance
# ---------------------------------------------------------------------------------------------


@rg.recurrence(lane="V", state={"S": "B H K V", "z": "B H K"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V"},
               outputs={"o": "B L H V"})
def normalised_linear_attention(S, z, q, k, v, i):
    S[i] = S[i] + k[i] * v
    z[i] = z[i] + k[i]
    return {"o": rg.Sum(q[i] * S[i], i) / rg.Sum(q[i] * z[i], i)}


def normalised_linear_attention_ref(q, k, v, S0, z0):
    """S[k,v] += k[k] v[v];  z[k] += k[k];  o[v] = Σ_k q[k] S[k,v] / Σ_k q[k] z[k]."""
    S, z, outs = S0, z0, []
    for t in range(q.shape[1]):
        S = S + k[:, t][..., None] * v[:, t][:, :, None, :]
        z = z + k[:, t]
        num = mx.sum(q[:, t][..., None] * S, axis=2)
        den = mx.sum(q[:, t] * z, axis=-1)
        outs.append(num / den[..., None])
    return [mx.stack(outs, axis=1)], [S, z]


# (b, L, H, K, V, seg, threads): V = 40 lanes take two simdgroups and pad 24 lanes; with
# threads=32 they take two threadgroups, so the lanes' shares of z's adjoint span groups
SHARED_SIZES = [(2, 13, 2, 3, 5, 4, None), (1, 9, 1, 4, 40, 3, None), (2, 7, 2, 3, 40, 2, 32)]


def _with_threads(runs, options, threads, ids):
    """Every run with every option whose ``threads(option)`` it takes: threads= applies to the
    kernel backends only."""
    return [pytest.param(*r.values, *o, marks=r.marks, id=f"{ids(o)}-{r.id}")
            for o in options for r in runs
            if not (threads(o) and r.values[0] in ("mlx", "reference"))]


@pytest.mark.parametrize("backend, schedule, sizes", _with_threads(
    RUNS, [(s,) for s in SHARED_SIZES], lambda o: o[0][-1],
    lambda o: "b{}-L{}-H{}-K{}-V{}-seg{}-tg{}".format(*o[0])))
def test_linear_attention_with_shared_normaliser(backend, schedule, sizes):
    """The normaliser z [B, H, K] is shared by the value lanes: no copy per lane."""
    b, L, H, K, V, seg, threads = sizes
    # q and k are feature maps' outputs (positive), so the normaliser stays away from zero
    inputs = [_uniform((b, L, H, K), 0.2, 1.0), _uniform((b, L, H, K), 0.2, 1.0),
              _normal((b, L, H, V))]
    states = [_normal((b, H, K, V)), _uniform((b, H, K), 0.5, 1.5)]
    call = dict(seg=seg) if threads is None else dict(seg=seg, threads=threads)
    _check(normalised_linear_attention, normalised_linear_attention_ref, inputs, states,
           backend, schedule, **call)


@rg.recurrence(lane="V", state={"S": "B K V", "z": "B K", "c": "B"},
               inputs={"k": "B L K", "v": "B L V", "g": "B L"}, outputs={"o": "B L V"})
def shared_feeds_lanes(S, z, c, k, v, g, i):
    """S reads the shared z (one affine block of a lane state and a shared state); the output
    reads the shared scalar c."""
    a = rg.sigmoid(g)
    S[i] = a * S[i] + z[i] * v + k[i]
    z[i] = 0.5 * z[i] + k[i]
    c = a * c + g
    return {"o": rg.Sum(k[i] * S[i], i) + c * v}


def shared_feeds_lanes_ref(k, v, g, S0, z0, c0):
    S, z, c, outs = S0, z0, c0, []
    for t in range(k.shape[1]):
        a = mx.sigmoid(g[:, t])
        S = a[:, None, None] * S + z[..., None] * v[:, t][:, None, :] + k[:, t][..., None]
        z = 0.5 * z + k[:, t]
        c = a * c + g[:, t]
        outs.append(mx.sum(k[:, t][..., None] * S, axis=1) + c[:, None] * v[:, t])
    return [mx.stack(outs, axis=1)], [S, z, c]


@pytest.mark.parametrize("backend, schedule, threads",
                         _with_threads(RUNS, [(None,), (32,)], lambda o: o[0],
                                       lambda o: f"tg{o[0]}"))
def test_lane_state_reading_shared_states(backend, schedule, threads):
    """The chunked carry carries the block {S, z} per lane; z's adjoint gets a share from every
    lane's S; c's from every lane's output."""
    b, L, K, V = 2, 13, 3, 37
    inputs = [_normal((b, L, K)), _normal((b, L, V)), _normal((b, L))]
    states = [_normal((b, K, V)), _normal((b, K)), _normal((b,))]
    assert shared_feeds_lanes.time_parallel
    call = dict(seg=3) if threads is None else dict(seg=3, threads=threads)
    _check(shared_feeds_lanes, shared_feeds_lanes_ref, inputs, states, backend, schedule, **call)


@rg.recurrence(lane="V", state={"C": "B H K V", "n": "B H K", "m": "B H"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "f": "B L H",
                       "ig": "B L H"},
               outputs={"h": "B L H V"})
def mlstm(C, n, m, q, k, v, f, ig, j):
    """mLSTM with the stabiliser m and the normaliser n shared by the value lanes."""
    log_f = -rg.softplus(-f)  # log sigmoid(f)
    m_new = rg.maximum(log_f + m, ig)
    f_gate = rg.exp(log_f + m - m_new)
    i_gate = rg.exp(ig - m_new)
    C[j] = f_gate * C[j] + i_gate * k[j] * v
    n[j] = f_gate * n[j] + i_gate * k[j]
    m = m_new
    den = rg.maximum(rg.abs(rg.Sum(q[j] * n[j], j)), rg.exp(-m))
    return {"h": rg.Sum(q[j] * C[j], j) / den}


def mlstm_ref(q, k, v, f, ig, C0, n0, m0):
    C, n, m, outs = C0, n0, m0, []
    for t in range(q.shape[1]):
        log_f = -mx.logaddexp(-f[:, t], 0.0)
        m_new = mx.maximum(log_f + m, ig[:, t])
        f_gate = mx.exp(log_f + m - m_new)
        i_gate = mx.exp(ig[:, t] - m_new)
        C = f_gate[..., None, None] * C + (i_gate[..., None] * k[:, t])[..., None] * v[:, t][:, :, None, :]
        n = f_gate[..., None] * n + i_gate[..., None] * k[:, t]
        m = m_new
        den = mx.maximum(mx.abs(mx.sum(q[:, t] * n, axis=-1)), mx.exp(-m))
        outs.append(mx.sum(q[:, t][..., None] * C, axis=2) / den[..., None])
    return [mx.stack(outs, axis=1)], [C, n, m]


@pytest.mark.parametrize("backend, schedule", SEQUENTIAL_RUNS)
@pytest.mark.parametrize("V", [5, 40])
def test_mlstm_with_shared_stabiliser_and_normaliser(backend, schedule, V):
    """A shared scalar state with a nonlinear update (the running max m) beside a shared vector
    state (n): the cotangents reaching them from every lane's C and h are summed over lanes."""
    b, L, H, K = 2, 11, 2, 4
    inputs = [_normal((b, L, H, K)), _normal((b, L, H, K), K ** -0.5), _normal((b, L, H, V)),
              _normal((b, L, H), 2.0), _normal((b, L, H), 2.0)]
    states = [_normal((b, H, K, V)), _normal((b, H, K)), _normal((b, H))]
    assert not mlstm.time_parallel
    _check(mlstm, mlstm_ref, inputs, states, backend, schedule, tol=1e-4, seg=4)


@pytest.mark.parametrize("backend", [pytest.param("mlx"), *KERNELS])
def test_forward_mode_through_a_shared_state(backend):
    """mx.jvp runs the tangent recurrence, whose tangent of z is shared too."""
    b, L, H, K, V = 2, 7, 2, 3, 5
    inputs = [_uniform((b, L, H, K), 0.2, 1.0), _uniform((b, L, H, K), 0.2, 1.0),
              _normal((b, L, H, V))]
    states = [_normal((b, H, K, V)), _uniform((b, H, K), 0.5, 1.5)]
    tangents = [_normal(x.shape) for x in [*inputs, *states]]

    def run(*a):
        return normalised_linear_attention(*a[:3], initial_state={"S": a[3], "z": a[4]},
                                           backend=backend, seg=3)

    def ref(*a):
        return normalised_linear_attention_ref(*a)[0][0]

    _, (tan,) = mx.jvp(run, [*inputs, *states], tangents)
    _, (ref_tan,) = mx.jvp(ref, [*inputs, *states], tangents)
    assert rel_err(tan, ref_tan) < 1e-5


def test_shared_state_reading_lane_varying_values_is_refused():
    decl = dict(lane="V", state={"S": "B K V", "z": "B K"}, inputs={"k": "B L K", "v": "B L V"},
                outputs={"o": "B L V"})
    with pytest.raises(rg.SpecError, match=r"spec 'zv': state 'z' lacks the lane axis 'V', so "
                                           r"the lanes of an instance share it .* its update "
                                           r"reads input 'v', which varies over the lanes"):
        @rg.recurrence(**decl)
        def zv(S, z, k, v, i):
            S[i] = S[i] + k[i] * v
            z[i] = z[i] + k[i] * v
            return {"o": rg.Sum(S[i] * z[i], i)}
    with pytest.raises(rg.SpecError, match=r"spec 'zs': state 'z' lacks the lane axis .* reads "
                                           r"state 'S', which varies over the lanes"):
        @rg.recurrence(**decl)
        def zs(S, z, k, v, i):
            S[i] = S[i] + k[i] * v
            z[i] = z[i] + rg.Sum(k[i] * S[i], i)
            return {"o": rg.Sum(S[i] * z[i], i)}
    with pytest.raises(rg.SpecError, match=r"spec 'zr': state 'z' .* reads input 'v'"):
        @rg.recurrence(**decl)
        def zr(S, z, k, v, i):  # through a reduction computed before z's update
            S[i] = S[i] + k[i]
            r = rg.Sum(k[i] * v, i)
            z[i] = z[i] + r
            return {"o": rg.Sum(S[i] * z[i], i) * v}


# ---------------------------------------------------------------------------------------------
# Group axes: one input serves a group of instances
# ---------------------------------------------------------------------------------------------


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L Hk K", "k": "B L Hk K", "v": "B L H V", "beta": "B L H",
                       "g": "B L H"},
               outputs={"o": "B L H V"}, groups={"Hk": "H"})
def grouped_gated_delta(S, q, k, v, beta, g, i):
    """Gated delta rule with grouped key heads (Qwen3-Next: Hk key heads serve H value heads)."""
    a = rg.sigmoid(g)
    r = rg.Sum(k[i] * S[i], i)
    S[i] = a * S[i] + rg.sigmoid(beta) * (v - a * r) * k[i]
    return {"o": rg.Sum(q[i] * S[i], i)}


def _members(H, Hk):
    """The group of every head: head h reads group h // (H / Hk)."""
    return mx.array([h // (H // Hk) for h in range(H)])


def grouped_gated_delta_ref(q, k, v, beta, g, S0):
    """S[k,v] <- a S - a β (Σ_k k S) k + β v k, with q and k of head h at group h // (H/Hk)."""
    groups = _members(v.shape[2], q.shape[2])
    S, outs = S0, []
    for t in range(v.shape[1]):
        qt, kt = q[:, t][:, groups], k[:, t][:, groups]  # [b, H, K]
        a, bt = mx.sigmoid(g[:, t]), mx.sigmoid(beta[:, t])  # [b, H]
        r = mx.sum(kt[..., None] * S, axis=2)  # [b, H, V]
        S = (a[..., None, None] * S
             + (bt[..., None] * (v[:, t] - a[..., None] * r))[:, :, None, :] * kt[..., None])
        outs.append(mx.sum(qt[..., None] * S, axis=2))
    return [mx.stack(outs, axis=1)], [S]


@pytest.mark.parametrize("backend, schedule", SEQUENTIAL_RUNS)
@pytest.mark.parametrize("H, Hk, V", [(4, 2, 5), (3, 1, 33), (2, 2, 5)])
def test_grouped_key_heads(backend, schedule, H, Hk, V):
    b, L, K = 2, 9, 3
    inputs = [_normal((b, L, Hk, K), 0.5), _normal((b, L, Hk, K), 0.5), _normal((b, L, H, V)),
              _normal((b, L, H)), _normal((b, L, H))]
    _check(grouped_gated_delta, grouped_gated_delta_ref, inputs, [_normal((b, H, K, V))],
           backend, schedule, seg=4)


@rg.recurrence(lane="P", state={"h": "B H P N"},
               inputs={"u": "B L H P", "delta": "B L H", "Bm": "B L G N", "Cm": "B L G N",
                       "A": "G N"},
               outputs={"y": "B L H P"}, groups={"G": "H"})
def grouped_ssd(h, u, delta, Bm, Cm, A, n):
    """SSD with Mamba-2's n_groups: B and C (and here A) per group of heads."""
    h[n] = rg.exp(delta * A[n]) * h[n] + delta * Bm[n] * u
    return {"y": rg.Sum(Cm[n] * h[n], n)}


def grouped_ssd_ref(u, delta, Bm, Cm, A, h0):
    groups = _members(u.shape[2], Bm.shape[2])
    h, outs = h0, []
    for t in range(u.shape[1]):
        dt = delta[:, t][..., None]  # [b, H, 1]
        Bt, Ct = Bm[:, t][:, groups], Cm[:, t][:, groups]  # [b, H, N]
        decay = mx.exp(dt * A[groups][None])  # [b, H, N]
        h = decay[:, :, None, :] * h + (dt * Bt)[:, :, None, :] * u[:, t][..., None]
        outs.append(mx.sum(Ct[:, :, None, :] * h, axis=-1))
    return [mx.stack(outs, axis=1)], [h]


@pytest.mark.parametrize("backend, schedule", RUNS)
@pytest.mark.parametrize("H, G, P", [(4, 2, 5), (3, 1, 33)])
def test_grouped_ssd(backend, schedule, H, G, P):
    """Grouped time-varying inputs and a grouped parameter (A lacks the batch axis too): its
    gradient is summed over lanes, time (per segment when chunked), batch and group members."""
    b, L, N = 2, 13, 3
    inputs = [_normal((b, L, H, P)), _uniform((b, L, H), 0.05, 0.6), _normal((b, L, G, N), 0.5),
              _normal((b, L, G, N), 0.5), -_uniform((G, N), 0.3, 1.5)]
    _check(grouped_ssd, grouped_ssd_ref, inputs, [_normal((b, H, P, N), 0.5)], backend,
           schedule, seg=4)


def test_group_sizes_that_do_not_divide():
    b, L, K, V = 1, 3, 2, 3
    args = [mx.zeros((b, L, 2, K)), mx.zeros((b, L, 2, K)), mx.zeros((b, L, 3, V)),
            mx.zeros((b, L, 3)), mx.zeros((b, L, 3))]
    with pytest.raises(ValueError, match=r"grouped_gated_delta\(\): axis H has size 3, which its "
                                         r"group axis Hk of size 2 \(in '[qk]'\) does not divide"):
        grouped_gated_delta(*args, backend="mlx")
    with pytest.raises(ValueError, match=r"axis Hk has size 1 in 'k' .* but 2 in 'q'"):
        grouped_gated_delta(args[0], args[1][:, :, :1], *args[2:], backend="mlx")


def test_bad_group_declarations():
    base = dict(lane="V", state={"S": "B H K V"}, outputs={"o": "B L H V"})

    def body(S, q, v, i):
        S[i] = S[i] + q[i] * v
        return {"o": rg.Sum(q[i] * S[i], i)}

    def declare(name, **kw):
        rg.recurrence(**{**base, "inputs": {"q": "B L Hk K", "v": "B L H V"}, **kw},
                      name=name)(body)

    with pytest.raises(rg.SpecError, match=r"spec 'g1': 'groups' must be a dict"):
        declare("g1", groups=["Hk", "H"])
    with pytest.raises(rg.SpecError, match=r"spec 'g2': groups: 'Hk' groups 'K', which is not a "
                                           r"batch-like axis"):
        declare("g2", groups={"Hk": "K"})
    with pytest.raises(rg.SpecError, match=r"spec 'g3': groups: group axis 'B' is also the time, "
                                           r"lane or a batch-like axis"):
        declare("g3", groups={"B": "H"})
    with pytest.raises(rg.SpecError, match=r"spec 'g4': groups: no input carries the group axis "
                                           r"'G'"):
        declare("g4", groups={"Hk": "H", "G": "H"})
    with pytest.raises(rg.SpecError, match=r"spec 'g5': input 'q' carries \['H', 'Hk'\], which all "
                                           r"index 'H'"):
        declare("g5", groups={"Hk": "H"}, inputs={"q": "B L H Hk K", "v": "B L H V"})
    with pytest.raises(rg.SpecError, match=r"spec 'g6': state 'S' carries the group axis 'Hk'; "
                                           r"only inputs may"):
        declare("g6", groups={"Hk": "H"}, state={"S": "B H Hk K V"})
    with pytest.raises(rg.SpecError, match=r"spec 'g7': tensor 'q': unknown axis 'Hk'"):
        declare("g7")


# ---------------------------------------------------------------------------------------------
# Bool and integer inputs: usable in conditions and arithmetic, never differentiated
# ---------------------------------------------------------------------------------------------


@rg.recurrence(lane="D", state={"h": "B D"},
               inputs={"a": "B L D", "x": "B L D", "mask": "B L", "pos": "B L", "length": "B"},
               outputs={"y": "B L D"})
def masked_lru(h, a, x, mask, pos, length):
    """A padding mask holds the state; positions past a sequence's length read zero."""
    h = rg.where(mask, a * h + x, h)
    return {"y": rg.where(pos < length, h, 0.0) + 0.1 * mask * x + 0.01 * pos * h}


def masked_lru_ref(a, x, mask, pos, length, h0):
    h, outs = h0, []
    live = (pos < length[:, None])[..., None]  # [b, L, 1]
    m = mask[..., None]
    for t in range(x.shape[1]):
        h = mx.where(m[:, t] != 0, a[:, t] * h + x[:, t], h)
        outs.append(mx.where(live[:, t], h, 0.0) + 0.1 * m[:, t].astype(mx.float32) * x[:, t]
                    + 0.01 * pos[:, t, None].astype(mx.float32) * h)
    return [mx.stack(outs, axis=1)], [h]


def _masked_lru_inputs(b=2, L=11, D=5, dtypes=(mx.bool_, mx.int32, mx.int64)):
    mask = (mx.random.uniform(shape=(b, L)) < 0.7).astype(dtypes[0])
    pos = mx.broadcast_to(mx.arange(L), (b, L)).astype(dtypes[1])
    length = mx.array([L - 3, L][:b]).astype(dtypes[2])
    return [_uniform((b, L, D), -0.9, 0.9), _normal((b, L, D)), mask, pos, length]


@pytest.mark.parametrize("backend, schedule", RUNS)
@pytest.mark.parametrize("dtypes", [(mx.bool_, mx.int32, mx.int64),
                                    (mx.uint8, mx.int16, mx.uint32)], ids=["bool-i32-i64", "u8-i16-u32"])
def test_bool_and_integer_inputs(backend, schedule, dtypes):
    """The mask and positions are used in conditions and in arithmetic; their gradients are
    zeros of their own shape and dtype."""
    b, D = 2, 40  # two simdgroups, 24 padded lanes
    inputs = _masked_lru_inputs(b=b, D=D, dtypes=dtypes)
    _check(masked_lru, masked_lru_ref, inputs, [_normal((b, D))], backend, schedule, seg=3)


@pytest.mark.parametrize("backend", [pytest.param("mlx"), *KERNELS])
def test_float_mask_is_differentiated(backend):
    """The same input passed as floats is an ordinary differentiable input."""
    inputs = _masked_lru_inputs(dtypes=(mx.float32, mx.float32, mx.float32))
    _check(masked_lru, masked_lru_ref, inputs, [_normal((2, 5))], backend, "sequential", seg=3)


@pytest.mark.parametrize("backend", [pytest.param("mlx"), *KERNELS])
def test_forward_mode_with_integer_inputs(backend):
    inputs = _masked_lru_inputs()
    h0 = _normal((2, 5))
    primals = [*inputs, h0]
    tangents = [mx.zeros_like(p) if p.dtype not in (mx.float32,) else _normal(p.shape)
                for p in primals]

    def run(*a):
        return masked_lru(*a[:-1], initial_state=a[-1], backend=backend, seg=3)

    _, (tan,) = mx.jvp(run, primals, tangents)
    _, (ref_tan,) = mx.jvp(lambda *a: masked_lru_ref(*a)[0][0], primals, tangents)
    assert rel_err(tan, ref_tan) < 1e-5


INT_DTYPES = {"mask": mx.bool_, "pos": mx.int32, "length": mx.int64}


@pytest.mark.parametrize("schedule, kernels", [
    ("sequential", ["backward"]), ("chunked", ["local_adjoint", "gradients"])])
def test_integer_inputs_have_no_gradient_buffer(schedule, kernels):
    """The backward of a call with integer inputs writes no gradient for them: no buffer, no
    store, no lane reduction."""
    for kernel in kernels:
        text = masked_lru.source(kernel, backend="metal", dtype=INT_DTYPES, schedule=schedule)
        assert "const device bool* u_mask" in text
        for name in INT_DTYPES:
            assert f"u_d_{name}" not in text
        if kernel != "local_adjoint":
            assert "device float* u_d_a " in text and "device float* u_d_x " in text
    # the mask and length lack the lane axis, yet no gradient of theirs is reduced over lanes
    assert "float red[" in masked_lru.source("backward", backend="metal")
    assert "float red[" not in masked_lru.source("backward", backend="metal", dtype=INT_DTYPES)
    assert "mask: not differentiable" in masked_lru._for_dtypes(
        [mx.float32, mx.float32, mx.bool_, mx.int32, mx.int64]).adjoint_ir()


def test_integer_initial_state_is_refused():
    args = _masked_lru_inputs()
    with pytest.raises(TypeError, match=r"argument 'initial_state' has dtype int32; expected "
                                        r"float32, float16 or bfloat16$"):
        masked_lru(*args, initial_state=mx.zeros((2, 5), dtype=mx.int32), backend="mlx")


# ---------------------------------------------------------------------------------------------
# All three at once, and the CUDA text
# ---------------------------------------------------------------------------------------------


@rg.recurrence(lane="V", state={"S": "B H K V", "z": "B H K"},
               inputs={"q": "B L Hk K", "k": "B L Hk K", "v": "B L H V", "g": "B L H",
                       "mask": "B L"},
               outputs={"o": "B L H V"}, groups={"Hk": "H"})
def masked_grouped_attention(S, z, q, k, v, g, mask, i):
    """Gated linear attention with grouped query/key heads, a shared normaliser and padding."""
    a = rg.where(mask, rg.sigmoid(g), 1.0)
    S[i] = a * S[i] + mask * rg.exp(k[i]) * v
    z[i] = a * z[i] + mask * rg.exp(k[i])
    return {"o": rg.Sum(rg.exp(q[i]) * S[i], i) / rg.Sum(rg.exp(q[i]) * z[i], i)}


def masked_grouped_attention_ref(q, k, v, g, mask, S0, z0):
    groups = _members(v.shape[2], q.shape[2])
    S, z, outs = S0, z0, []
    for t in range(v.shape[1]):
        m = mask[:, t, None].astype(mx.float32)  # [b, 1]
        a = mx.where(mask[:, t, None] != 0, mx.sigmoid(g[:, t]), 1.0)  # [b, H]
        fq, fk = mx.exp(q[:, t][:, groups]), mx.exp(k[:, t][:, groups])  # [b, H, K]
        S = a[..., None, None] * S + (m[..., None] * fk)[..., None] * v[:, t][:, :, None, :]
        z = a[..., None] * z + m[..., None] * fk
        outs.append(mx.sum(fq[..., None] * S, axis=2) / mx.sum(fq * z, axis=-1)[..., None])
    return [mx.stack(outs, axis=1)], [S, z]


@pytest.mark.parametrize("backend, schedule", RUNS)
def test_shared_state_group_axes_and_a_mask_together(backend, schedule):
    """z's cotangent reaches the grouped k through every lane (summed in-kernel over lanes,
    then over the group's members after the kernel)."""
    b, L, H, Hk, K, V = 2, 13, 4, 2, 3, 40
    inputs = [_normal((b, L, Hk, K), 0.5), _normal((b, L, Hk, K), 0.5), _normal((b, L, H, V)),
              _normal((b, L, H)), mx.random.uniform(shape=(b, L)) < 0.8]
    states = [_normal((b, H, K, V)), _uniform((b, H, K), 0.5, 1.5)]
    _check(masked_grouped_attention, masked_grouped_attention_ref, inputs, states, backend,
           schedule, seg=4)


def test_second_order_on_the_mlx_backend():
    """A gradient of a gradient (backend='mlx' differentiates its own backward): the shares of
    the shared state's adjoint, the grouped inputs' sums and the mask's zero cotangent are all
    differentiable MLX operations."""
    b, L, H, Hk, K, V = 2, 7, 4, 2, 3, 5
    q, k = _normal((b, L, Hk, K), 0.5), _normal((b, L, Hk, K), 0.5)
    v, g = _normal((b, L, H, V)), _normal((b, L, H))
    mask = mx.random.uniform(shape=(b, L)) < 0.8
    S0, z0 = _normal((b, H, K, V)), _uniform((b, H, K), 0.5, 1.5)

    def grad_norm(fn):
        def loss(q, k, z0):
            outs, (S, z) = fn(q, k, v, g, mask, S0, z0)
            return mx.sum(outs[0] * outs[0]) + mx.sum(z * z * z)

        def norm(q, k, z0):
            return sum(mx.sum(x * x) for x in mx.grad(loss, argnums=(0, 1, 2))(q, k, z0))
        return mx.grad(norm, argnums=(0, 1, 2))(q, k, z0)

    def run(q, k, v, g, mask, S0, z0):
        o, st = masked_grouped_attention(q, k, v, g, mask, initial_state={"S": S0, "z": z0},
                                         return_state=True, backend="mlx", seg=3)
        return [o], (st["S"], st["z"])

    for got, ref in zip(grad_norm(run), grad_norm(masked_grouped_attention_ref)):
        assert rel_err(got, ref) < 1e-4


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_text_compiles(tmp_path):
    """The CUDA text of a spec with all three features compiles with nvcc (MLX's device header
    replaced by a stub): a kernel of every template, the sequential ones with lanes in several
    threadgroups (the chunked outputs, local adjoint and gradients kernels are the forward and
    backward templates in segment mode)."""
    header = tmp_path / "mlx" / "backend" / "cuda" / "device" / "utils.cuh"
    header.parent.mkdir(parents=True)
    header.write_text("#include <cstdint>\n#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n")
    kernels = [("sequential", k, 1100) for k in ("forward", "backward")]
    kernels += [("chunked", k, 40) for k in ("summary", "carry", "adjoint_carry")]
    sources = []
    for schedule, kernel, lanes in kernels:
        sources.append(tmp_path / f"{schedule}_{kernel}.cu")
        sources[-1].write_text(masked_grouped_attention.source(
            kernel, backend="cuda", schedule=schedule, dtype={"mask": mx.bool_}, lanes=lanes))
    assert_nvcc_compiles(sources, flags=("-arch=sm_90", f"-I{tmp_path}"))
