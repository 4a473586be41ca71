"""The matrix schedule on the kernel backends (``backends/matrix_kernels.py``): the states of
scalar positive decay run as generated kernels whose products are the target's matrix units
(``simdgroup_matrix`` on Metal through the simulator, ``mma.sync`` on CUDA under ``gpu``), the
rest in MLX ops. Checked against the papers' loops (``references``), independent of the
compiler: outputs, final states and every gradient, with L not a multiple of the chunk, one
short chunk, both kinds of readout (before and after the update), grouped heads, exact fp32
products, and a planted error in the matrix products that the comparison catches."""

from __future__ import annotations

import dataclasses
import shutil

import mlx.core as mx
import pytest

import mlx_recgen as rg
from conftest import KERNEL_BACKENDS, assert_nvcc_compiles, rel_err
from references import gla_ref, ssd_ref
from mlx_recgen.backends import matrix_kernels as mk
from mlx_recgen.backends.mlx_source import without_mlx_header
from mlx_recgen.render import matrix as render_matrix
from mlx_recgen.render.dialects import DIALECTS
from mlx_recgen.render.matrix import WALK_KINDS
from test_matrix import _assert_matches
import test_zoo
from test_zoo import _draw, _from_spec, _reference, _to_spec

SCALAR_DECAY_ZOO = ["mamba2", "retnet"]  # the zoo's matrix specs of scalar decay, besides gla
VECTOR_DECAY_ZOO = ["rwkv6", "hgrn2", "rwkv7"]  # those of a decay per state element
TOL = 2e-5
# On CUDA the products run in TF32 (a 10-bit mantissa), ours and MLX's matmuls of the VJP alike:
# an H100 measured up to 3e-4 on outputs and 5.6e-3 on a gradient that sums many products
TF32_TOL = 2e-2


def _tol(backend):
    return TF32_TOL if backend == "cuda" else TOL


@pytest.fixture(params=["kernels", "matmuls"])
def readouts(request, monkeypatch):
    """The readouts in the outputs kernel and the chunks' backward in the chunk-gradients kernel,
    or both as MLX's matmuls around the weights kernels (``OUTPUTS_BY_MATMULS``,
    ``GRADIENTS_BY_MATMULS``), on every kernel backend; afterwards, that path is the one that
    ran (the one backward kernel wherever its group memory is given)."""
    by_matmuls = request.param == "matmuls"
    for backend in ("metal", "metal-sim", "cuda"):
        monkeypatch.setitem(mk.OUTPUTS_BY_MATMULS, backend, by_matmuls)
        monkeypatch.setitem(mk.GRADIENTS_BY_MATMULS, backend, by_matmuls)
    ran = {"readouts": [], "one kernel": [], "products": []}

    def counting(method, what):
        def counted(self, shape, *args):
            ran[what].append(shape)
            return method(self, shape, *args)
        return counted

    monkeypatch.setattr(mk.MatrixKernels, "_outputs_by_matmuls",
                        counting(mk.MatrixKernels._outputs_by_matmuls, "readouts"))
    monkeypatch.setattr(mk.MatrixKernels, "chunk_gradients",
                        counting(mk.MatrixKernels.chunk_gradients, "one kernel"))
    monkeypatch.setattr(mk.MatrixKernels, "_chunk_gradients",
                        counting(mk.MatrixKernels._chunk_gradients, "products"))
    yield request.param
    assert bool(ran["readouts"]) == by_matmuls, f"the readouts did not run as {request.param}"
    assert ran["one kernel"] or ran["products"], "no backward ran"
    if by_matmuls:
        assert not ran["one kernel"]
    else:
        assert all(s.gradient_tiles is not None for s in ran["one kernel"])
        assert all(s.gradient_tiles is None for s in ran["products"])


@pytest.fixture(params=["walk", "chunks"])
def states_path(request, monkeypatch):
    """The states through the chunks in the walk kernel (for any number of groups) or in the
    states and chain kernels (``WALKS``, ``WALK_GROUPS``), on every kernel backend;
    afterwards, that path is the one that ran."""
    walk = request.param == "walk"
    monkeypatch.setattr(mk, "WALK_GROUPS", 1 if walk else 1 << 62)
    for backend in ("metal", "metal-sim", "cuda"):
        monkeypatch.setitem(mk.WALKS, backend, True)
    ran = _walks_chosen(monkeypatch)
    yield request.param
    assert ran and all(walked == walk for walked in ran), \
        f"the states did not pass through the chunks as {request.param}: {ran}"


def _walks_chosen(monkeypatch) -> list:
    """The choices ``MatrixKernels.walk`` makes from now on (True: the walk), as they are made."""
    chosen = []
    choose = mk.MatrixKernels.walk

    def counted(self, shape, instances):
        chosen.append(choose(self, shape, instances))
        return chosen[-1]

    monkeypatch.setattr(mk.MatrixKernels, "walk", counted)
    return chosen


def _assert_gla_matches(backend, q, k, v, g, S0, seg, tol):
    """GLA on ``backend``'s matrix kernels against the paper's loop: outputs, final state and
    every gradient (``test_matrix._assert_matches``)."""
    gla = rg.load_spec("gla")

    def run(i, s):
        y, S = gla(*i, initial_state=s[0], return_state=True, backend=backend,
                   schedule="matrix", seg=seg)
        return [y], [S]

    _assert_matches(run, lambda i, s: [[x] for x in gla_ref(*i, S0=s[0])], [q, k, v, g], [S0],
                    tol=tol)


def _run(name, backend, seg):
    rec = rg.load_spec(name)

    def run(inputs, states):
        y, finals = rec(*inputs, initial_state=_to_spec(name, states), return_state=True,
                        backend=backend, schedule="matrix", seg=seg)
        return [y], _from_spec(name, finals)

    return run


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("seg", [4, 16])  # L = 11: kernel chunks of 16, one partial chunk
@pytest.mark.parametrize("name", SCALAR_DECAY_ZOO)
def test_zoo_matches_the_paper(name, seg, backend, kernel_calls, readouts,
                               states_path):
    mx.random.seed(sum(map(ord, name)) + seg)
    inputs, states = _draw(name)
    _assert_matches(_run(name, backend, seg), lambda i, s: _reference(name, i, s), inputs,
                    states, tol=_tol(backend))
    assert kernel_calls


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("L, seg", [(150, 64), (40, 16), (70, 32), (100, 48)])
def test_gla_over_several_chunks(L, seg, backend, kernel_calls, readouts,
                                 states_path):
    """GLA's scalar gate (readout after the update) over chunks of 64, 16, 32 and 48 steps (a
    chunk that is no multiple of a simdgroup's 32 lanes), with a state of sizes that are no
    multiple of the tiles."""
    mx.random.seed(L)
    _assert_gla_matches(backend, *_gla_inputs(2, L, 3, 20, 12), seg=seg, tol=_tol(backend))
    assert {s.C for s in kernel_calls} == {seg} and all(s.diagonal for s in kernel_calls)


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("L", [150, 40])  # ten chunks of 16, the last partial; three
def test_walks_with_chunks_in_flight(stages, L, kernel_calls, monkeypatch):
    """A walk that holds ``stages`` chunks of rows at a time, the copies of ``stages - 1`` in
    flight while one is multiplied (``render.matrix.WALK_STAGES``: CUDA's walks on tiles of
    halves take four), over more chunks than that and fewer, forward and adjoint: GLA's outputs,
    final state and every gradient match the paper's loop in the simulator, whose race checks
    cover a buffer's copies against the product still reading it (Metal's copies are done as
    they are issued: the groups of copies are no-ops there)."""
    monkeypatch.setitem(render_matrix.WALK_STAGES, "float", stages)
    kernels = mk.matrix_kernels("metal-sim")
    monkeypatch.setattr(kernels, "_kernels", type(kernels._kernels)(8))  # rendered anew
    monkeypatch.setattr(kernels, "_shapes", type(kernels._shapes)(8))
    monkeypatch.setattr(mk, "WALK_GROUPS", 1)
    monkeypatch.setitem(mk.WALKS, "metal-sim", True)
    walked = _walks_chosen(monkeypatch)
    mx.random.seed(L + stages)
    _assert_gla_matches("metal-sim", *_gla_inputs(2, L, 3, 20, 12), seg=16, tol=TOL)
    assert walked and all(walked) and kernel_calls
    assert f"STAGES = {stages};" in mk.matrix_source("walk", "metal-sim", seg=16)


def _gla_inputs(b, L, H, K, V):
    """GLA's ``q, k, v, g, S0``: normal, the gate uniform in [0.7, 1)."""
    q, k = mx.random.normal((b, L, H, K)), mx.random.normal((b, L, H, K))
    v, S0 = mx.random.normal((b, L, H, V)), mx.random.normal((b, H, K, V))
    return q, k, v, mx.random.uniform(0.7, 1.0, (b, L, H)), S0


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("L, seg", [(60, 16), (91, 32)])
def test_rows_of_four_over_a_partial_last_chunk(L, seg, backend, kernel_calls, readouts,
                                                states_path):
    """Factors whose rows the kernels copy four floats at a time, with a state that fills its
    tiles: a chunk's copies then check no bounds, except in a last chunk that ends a few steps
    past T, whose rows past T lie in the next instance's data and must read as zeros."""
    mx.random.seed(L)
    _assert_gla_matches(backend, *_gla_inputs(2, L, 3, 16, 16), seg=seg, tol=_tol(backend))
    assert {(s.C, s.K, s.V) for s in kernel_calls} == {(seg, 16, 16)}


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "g": "B L H"},
               outputs={"y": "B L H V"})
def gla_with_skip(S, q, k, v, g, i):
    """GLA whose output also adds ``g v``: ``v`` is read twice."""
    S[i] = g * S[i] + k[i] * v
    return {"y": rg.Sum(q[i] * S[i], i) + g * v}


def _half_case(name, backend):
    """``(run, inputs, states, reference, whether the kernels write the readouts and the
    gradients of c, a and b in half precision)`` of a case of
    ``test_half_factors_reach_the_kernels_as_given``."""
    if name != "gla_with_skip":
        inputs, states = _draw(name)
        halved = {"retnet": (True, True, True, True), "mamba2": (False, False, False, False)}
        return _run(name, backend, 16), inputs, states, lambda i, s: _reference(name, i, s), \
            halved[name]
    *inputs, S0 = _gla_inputs(2, 21, 2, 8, 4)

    def run(i, s):
        y, S = gla_with_skip(*i, initial_state=s[0], return_state=True, backend=backend,
                             schedule="matrix", seg=16)
        return [y], [S]

    def reference(i, s):
        y, S = gla_ref(*i, S0=s[0])
        return [y + i[3][..., None] * i[2]], [S]

    return run, inputs, [S0], reference, (False, True, True, False)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("name", ["retnet", "mamba2", "gla_with_skip"])
def test_half_factors_reach_the_kernels_as_given(name, dtype, backend, kernel_calls, readouts,
                                                 states_path, monkeypatch):
    """Factors that are inputs given in half precision (RetNet's ``q``, ``k``, ``v``; Mamba-2's
    ``B`` and ``C``, one per group of heads) reach the kernels as given, and the kernels widen
    them as they read them: no fp32 copy of them is made. Widening is exact, so outputs, final
    states and every gradient are those of the same call on the same values in fp32
    (cotangents that half precision holds exactly), bit for bit in the simulator, which agree
    with the paper's loop. The kernels write in half precision the readouts that are outputs
    as they are (RetNet's) and the gradients that nothing is added to after them (not
    Mamba-2's ``B`` and ``C``, summed over a group's heads, nor ``v`` where the output reads it
    too), so each is rounded once. Where a walk multiplies two such factors as they are
    (CUDA's tiles of halves, ``Dialect.half_tiles``), its rows scaled by the decays are rounded
    to half precision first, as FLA's kernels do, and the outputs and backward kernels, given
    halves only, multiply them as they are too, their weighted scores rounded to half
    precision: there the results are the fp32 call's to within two of that precision's
    epsilons."""
    mx.random.seed(len(name) + (dtype == mx.float16))
    run, inputs, states, reference, halved = _half_case(name, backend)
    inputs = [x.astype(dtype) for x in inputs]  # the values half precision holds
    widened = [x.astype(mx.float32) for x in inputs]
    read, written = [], []
    kernel = mk.MatrixKernels._kernel

    def spy(self, shape, kind, factors=(), grads=(), *ends):
        read.append((kind, [x.dtype for x in factors]))
        written.append((kind, list(grads)))
        return kernel(self, shape, kind, factors, grads, *ends)

    monkeypatch.setattr(mk.MatrixKernels, "_kernel", spy)

    def results(inputs):
        def loss(*args):
            (y,), finals = run(list(args[:len(inputs)]), list(args[len(inputs):]))
            w = mx.cos(mx.arange(y.size) / 7).astype(dtype).reshape(y.shape)
            return mx.sum(y.astype(mx.float32) * w) + sum(mx.sum(S * S) for S in finals)

        (y,), finals = run(inputs, states)
        grads = mx.grad(loss, argnums=tuple(range(len(inputs) + len(states))))(*inputs, *states)
        return [y, *finals, *grads]

    halves = results(inputs)
    assert any(kind in mk.STRIDED and dtype in dtypes for kind, dtypes in read)
    for kind, halved_by_kind in (("outputs", halved[:1]), ("chunk_gradients", halved[1:])):
        wrote = [grads for k, grads in written if k == kind]
        assert bool(wrote) == (readouts == "kernels")
        assert all(g == [dtype if h else mx.float32 for h in halved_by_kind] for g in wrote)
    if halved[0]:  # the readouts' cotangent comes in half precision too, and is read as it is
        assert all(d[3] == dtype for k, d in read if k == "chunk_gradients")
    half_reads = list(read)
    read.clear()
    singles = results(widened)
    assert read and not any(dtype in dtypes for _, dtypes in read)
    states_dtypes = [S.dtype for S in states]
    assert [x.dtype for x in halves] == [dtype, *states_dtypes, *(x.dtype for x in inputs),
                                         *states_dtypes]
    half_tiles = backend == "cuda" and mk._HALF_TAGS[dtype] in DIALECTS["cuda"].half_tiles and any(
        kind in WALK_KINDS and dtypes == [dtype, dtype] for kind, dtypes in half_reads)
    for h, f in zip(halves, singles):
        if backend == "metal-sim":
            assert mx.array_equal(h, f.astype(h.dtype)).item()
        elif half_tiles:
            assert rel_err(h.astype(mx.float32), f.astype(mx.float32)) < 2 * mx.finfo(dtype).eps
        else:  # MLX fuses the elementwise passes around the kernels (the decay's logarithm)
            # by the graph, which the inputs' dtypes change: fp32 results move by a few ulps,
            # and so a half-precision result may round the other way (an ulp of some entries)
            tol = 1e-5 if h.dtype == mx.float32 else mx.finfo(h.dtype).eps
            assert rel_err(h, f.astype(h.dtype)) < tol
    (y_ref,), _ = reference(widened, states)
    assert rel_err(halves[0].astype(mx.float32), y_ref) < 1e-2
    assert kernel_calls


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_a_changed_switch_takes_effect_in_the_next_call(backend, kernel_calls, monkeypatch):
    """The switches between kernels (here ``WALK_GROUPS``) are read as a call is traced, and a
    GPU call replays its compiled trace: the traces are kept under the switches
    (``MatrixKernels.switches``), so the same call after a switch changes runs the path the
    switch now names, with the same results."""
    mx.random.seed(5)
    q, k, v, g, S0 = _gla_inputs(2, 40, 2, 16, 8)
    gla = rg.load_spec("gla")
    chosen = _walks_chosen(monkeypatch)
    monkeypatch.setitem(mk.WALKS, backend, True)
    results = []
    for groups in (1, 1 << 62):
        monkeypatch.setattr(mk, "WALK_GROUPS", groups)
        chosen.clear()
        y, S = gla(q, k, v, g, initial_state=S0, return_state=True, backend=backend,
                   schedule="matrix", seg=16)
        mx.eval(y, S)
        assert chosen and set(chosen) == {groups == 1}, f"WALK_GROUPS={groups} ran {chosen}"
        results.append((y, S))
    for a, b in zip(*results):
        assert rel_err(a, b) < _tol(backend)
    assert kernel_calls


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_gla_with_a_state_of_64_x_64(backend, kernel_calls, states_path):
    """A state of the largest tiles: on CUDA the walk takes it in tiles of 64 x 64 (Metal's group
    memory gives the walk smaller ones)."""
    mx.random.seed(64)
    b, L, H, K, V = 1, 150, 2, 64, 64
    q, k = mx.random.normal((b, L, H, K)) / 8, mx.random.normal((b, L, H, K))
    v, S0 = mx.random.normal((b, L, H, V)), mx.random.normal((b, H, K, V))
    g = mx.random.uniform(0.8, 1.0, (b, L, H))
    _assert_gla_matches(backend, q, k, v, g, S0, seg=64, tol=_tol(backend))
    assert kernel_calls


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_bf16_over_several_tiles_of_the_state(backend, kernel_calls, monkeypatch):
    """GLA in bf16 with a state of 64 x 64 a head, through the walk: on CUDA every kernel then
    multiplies tiles of bf16 (``matrix_kernels._tile``), the backward's over two tiles of K and
    two of V, the outputs' and walks' over one. Outputs, final state and the gradients of q, k,
    v and the initial state agree with the same call on the inputs' values in fp32 within two
    bf16 epsilons (the rounded weights and rows). The gate is bf16 too: with an fp32 gate the
    call's outputs, and so their cotangent, would be fp32, and the backward's kernels would
    multiply floats (``_tile``: halves only where every factor is one)."""
    monkeypatch.setattr(mk, "WALK_GROUPS", 1)
    monkeypatch.setitem(mk.WALKS, backend, True)
    tiles = []
    tile_of = mk._tile

    def spy(dialect, shape, kind, halves):
        tiles.append((kind, shape.gradient_tiles, tile_of(dialect, shape, kind, halves)))
        return tiles[-1][-1]

    monkeypatch.setattr(mk, "_tile", spy)
    mx.random.seed(65)
    b, L, H, K, V = 1, 150, 2, 64, 64
    q, k = mx.random.normal((b, L, H, K)) / 8, mx.random.normal((b, L, H, K))
    v, S0 = mx.random.normal((b, L, H, V)), mx.random.normal((b, H, K, V))
    g = mx.random.uniform(0.8, 1.0, (b, L, H))
    gla = rg.load_spec("gla")
    halves = [x.astype(mx.bfloat16) for x in (q, k, v, g)]

    def results(q, k, v, g):
        def loss(q, k, v, S0):
            y, S = gla(q, k, v, g, initial_state=S0, return_state=True, backend=backend,
                       schedule="matrix", seg=64)
            w = mx.cos(mx.arange(y.size) / 7).astype(q.dtype).reshape(y.shape)
            return mx.sum(y.astype(mx.float32) * w) + mx.sum(S * S)

        y, S = gla(q, k, v, g, initial_state=S0, return_state=True, backend=backend,
                   schedule="matrix", seg=64)
        return [y, S, *mx.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, S0)]

    got = results(*halves)
    want = results(*(x.astype(mx.float32) for x in halves))
    for h, f in zip(got, want):
        assert rel_err(h.astype(mx.float32), f) < 2 * mx.finfo(mx.bfloat16).eps
    assert kernel_calls
    kinds = {kind for kind, _, tile in tiles if tile != "float"}
    if backend == "cuda":  # halves in every kernel that multiplies them; the backward's 2 x 2 tiles
        assert kinds == {"walk", "adjoint_walk", "outputs", "chunk_gradients"}
        assert all(t == (32, 32) for kind, t, _ in tiles if kind == "chunk_gradients")
    else:
        assert not kinds


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("given, returned", [(False, False), (True, False), (False, True)])
def test_the_walks_skip_the_ends_a_call_does_not_need(backend, given, returned, kernel_calls,
                                                      monkeypatch):
    """A call without ``initial_state`` runs walks that start from zero without reading a
    state, and a call that does not return its final state runs walks that write none (nor its
    adjoint walk reads the zero cotangent of one): ``MatrixKernels.states``' ``ends``. The
    outputs, the final state where returned and every gradient (the initial state's where
    given) agree with the paper's loop."""
    monkeypatch.setattr(mk, "WALK_GROUPS", 1)
    monkeypatch.setitem(mk.WALKS, backend, True)
    walks = []
    kernel_of = mk.MatrixKernels._kernel

    def spy(self, shape, kind, inputs=(), outputs=(), ends=(True, True)):
        if kind in WALK_KINDS:
            walks.append((kind, ends))
        return kernel_of(self, shape, kind, inputs, outputs, ends)

    monkeypatch.setattr(mk.MatrixKernels, "_kernel", spy)
    mx.random.seed(11)
    b, L, H, K, V = 2, 100, 2, 16, 8
    q, k = mx.random.normal((b, L, H, K)), mx.random.normal((b, L, H, K))
    v, S0 = mx.random.normal((b, L, H, V)), mx.random.normal((b, H, K, V))
    g = mx.random.uniform(0.8, 1.0, (b, L, H))
    w = mx.random.normal((b, L, H, V))
    gla = rg.load_spec("gla")

    def loss(q, k, v, g, S0):
        r = gla(q, k, v, g, initial_state=S0 if given else None, return_state=returned,
                backend=backend, schedule="matrix", seg=32)
        return mx.sum(r[0] * w) + mx.sum(r[1] * r[1]) if returned else mx.sum(r * w)

    def loss_ref(q, k, v, g, S0):
        y, S = gla_ref(q, k, v, g, S0=S0 if given else None)
        return mx.sum(y * w) + (mx.sum(S * S) if returned else 0.0)

    args = [q, k, v, g, S0]
    argnums = (0, 1, 2, 3, 4) if given else (0, 1, 2, 3)
    got = mx.value_and_grad(loss, argnums=argnums)(*args)
    want = mx.value_and_grad(loss_ref, argnums=argnums)(*args)
    for x, y in zip([got[0], *got[1]], [want[0], *want[1]]):
        assert rel_err(x, y) < _tol(backend)
    assert kernel_calls
    assert set(walks) == {("walk", (given, returned)), ("adjoint_walk", (returned, given))}


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_strong_decays_keep_their_digits(backend, kernel_calls, readouts,
                                         states_path):
    """Decays of e^-3 to e^-10 a step run the log decay to -600 over a chunk of 64, where a
    difference of two running sums keeps four digits of a weight: the kernels sum each
    exponent over its own range, as the MLX ops do, and agree with the paper's loop as closely
    as for mild decays (a difference of running sums was 10x off on the final state)."""
    mx.random.seed(5)
    b, L, H, K, V = 2, 150, 2, 8, 4
    q, k = mx.random.normal((b, L, H, K)), mx.random.normal((b, L, H, K))
    v, S0 = mx.random.normal((b, L, H, V)), mx.random.normal((b, H, K, V))
    g = mx.exp(-mx.random.uniform(3.0, 10.0, (b, L, H)))
    _assert_gla_matches(backend, q, k, v, g, S0, seg=64, tol=_tol(backend) / 4)
    assert kernel_calls


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "g": "B L H"},
               outputs={"y": "B L H V"})
def read_before(S, q, k, v, g, i):
    """A readout of the state before the update: y = Σ q S_{t-1}, then S <- g S + k vᵀ."""
    y = rg.Sum(q[i] * S[i], i)
    S[i] = g * S[i] + k[i] * v
    return {"y": y}


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "g": "B L H"},
               outputs={"y": "B L H V"})
def read_decayed(S, q, k, v, g, i):
    """A readout of the decayed state before the update: y = Σ q g S_{t-1} (the decay's step
    included, the step's added term not: no diagonal in the causal weights)."""
    y = rg.Sum(q[i] * g * S[i], i)
    S[i] = g * S[i] + k[i] * v
    return {"y": y}


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("decayed", [False, True], ids=["before the update", "decayed"])
def test_a_readout_of_the_state_before_the_update(decayed, backend, kernel_calls, readouts,
                                                  states_path):
    """``y = Σ q S_{t-1}`` (neither the step's decay nor its added term: ``read_before``) and
    ``y = Σ q g S_{t-1}`` (the decay, not the added term: ``read_decayed``)."""
    mx.random.seed(3 + decayed)
    b, L, H, K, V = 2, 37, 2, 8, 8
    q, k, v = (mx.random.normal((b, L, H, n)) for n in (K, K, V))
    # a gate of both signs: its sign is carried apart from log |g|
    g = mx.random.uniform(0.5, 1.0, (b, L, H)) * mx.where(mx.random.uniform(shape=(b, L, H)) < 0.5,
                                                         -1.0, 1.0)
    S0 = mx.random.normal((b, H, K, V))
    rec = read_decayed if decayed else read_before

    def ref(i, s):
        q, k, v, g = i
        S, ys = s[0], []
        for t in range(L):
            gt = g[:, t][..., None, None]
            ys.append(mx.einsum("bhk,bhkv->bhv", q[:, t], gt * S if decayed else S))
            S = gt * S + k[:, t][..., None] * v[:, t][..., None, :]
        return [mx.stack(ys, axis=1)], [S]

    def run(i, s):
        y, S = rec(*i, initial_state=s[0], return_state=True, backend=backend, schedule="matrix",
                   seg=16)
        return [y], [S]

    _assert_matches(run, ref, [q, k, v, g], [S0], tol=_tol(backend))
    assert kernel_calls and kernel_calls[0].inclusive == decayed and not kernel_calls[0].diagonal


def test_exact_products_on_the_scalar_units(monkeypatch, kernel_calls):
    """``MLX_ENABLE_TF32=0`` on CUDA selects exact fp32 products on the scalar units; the same
    text runs here through the simulator."""
    monkeypatch.setattr(mk.MatrixKernels, "units", lambda self: False)
    mx.random.seed(4)
    inputs, states = _draw("mamba2")
    _assert_matches(_run("mamba2", "metal-sim", 16), lambda i, s: _reference("mamba2", i, s),
                    inputs, states)
    assert kernel_calls and not kernel_calls[0].units
    assert "simdgroup_multiply_accumulate" not in mk.matrix_source("outputs", "metal",
                                                                  units=False)
    assert "simdgroup_multiply_accumulate" in mk.matrix_source("outputs", "metal", units=True)


def test_a_planted_error_in_the_matrix_products_is_caught(kernel_calls, monkeypatch):
    """The simulator's simdgroup matrices follow Metal's semantics: a product that loads B
    untransposed where it should transpose gives wrong readouts, and the comparison fails."""
    kernels = mk.matrix_kernels("metal-sim")
    prelude = kernels.dialect.matrix_prelude
    planted = prelude.replace("ulong2(j, k), TB)", "ulong2(j, k), false)")
    assert planted != prelude
    monkeypatch.setattr(kernels, "dialect",
                        dataclasses.replace(kernels.dialect, matrix_prelude=planted))
    monkeypatch.setattr(kernels, "_kernels", type(kernels._kernels)(4))  # rendered anew
    mx.random.seed(5)
    inputs, states = _draw("retnet")
    with pytest.raises(AssertionError):
        _assert_matches(_run("retnet", "metal-sim", 16),
                        lambda i, s: _reference("retnet", i, s), inputs, states)
    assert kernel_calls


def test_cuda_padding_and_tiles_in_group_memory(kernel_calls, monkeypatch):
    """CUDA pads the rows of the products' operands (``Dialect.matrix_pads``); the same padding
    run through the simulator gives the papers' numbers (Metal itself pads nothing). At chunks
    of 32 the states kernel's 64 x 32 tiles fit Metal's 32 KB of group memory too (at 64 only
    CUDA's 48 KB: ``state_tiles``)."""
    kernels = mk.matrix_kernels("metal-sim")
    cuda_pads = mk.DIALECTS["cuda"].matrix_pads
    assert cuda_pads != (0, 0)
    declared_only = dataclasses.replace(mk.DIALECTS["cuda"], dynamic_shared_bytes=0)
    assert mk.state_tiles(64, 64, 64, declared_only) == (64, 32)
    assert mk.state_tiles(64, 64, 64, kernels.dialect) == (32, 32)
    monkeypatch.setattr(kernels, "dialect",
                        dataclasses.replace(kernels.dialect, matrix_pads=cuda_pads))
    monkeypatch.setattr(kernels, "_kernels", type(kernels._kernels)(4))
    mx.random.seed(9)
    b, L, H, K, V = 2, 70, 2, 50, 20  # a state over tiles of 64 x 32, neither filled
    q, k = mx.random.normal((b, L, H, K)), mx.random.normal((b, L, H, K))
    v, S0 = mx.random.normal((b, L, H, V)), mx.random.normal((b, H, K, V))
    g = mx.random.uniform(0.7, 1.0, (b, L, H))
    gla = rg.load_spec("gla")

    def run(i, s):
        y, S = gla(*i, initial_state=s[0], return_state=True, backend="metal-sim",
                   schedule="matrix", seg=32)
        return [y], [S]

    _assert_matches(run, lambda i, s: [[x] for x in gla_ref(*i, S0=s[0])], [q, k, v, g], [S0],
                    tol=TOL)
    assert {s.state_tiles for s in kernel_calls} == {(64, 32)}
    text = mk.MatrixRenderer(kernels.dialect, kernel_calls[0]).states(False)
    assert f"LDX = {64 + cuda_pads[1]}" in text


@pytest.mark.parametrize("name, L, seg", [("gla", 150, 64), ("mamba2", 100, 48)])
def test_the_chunk_gradients_kernel_at_chunks_past_one_simdgroup(name, L, seg, kernel_calls,
                                                                 monkeypatch):
    """At chunks of more than 32 steps only CUDA's group memory holds the chunk-gradients
    kernel (two simdgroups of a chunk's steps, two of each row's columns); the simulator runs it
    with as much group memory as CUDA gives (GLA: a decay of either sign and the readout after
    the update; Mamba-2: a positive decay and grouped B and C)."""
    from mlx_recgen.sim import kernel as sim_kernel

    kernels = mk.matrix_kernels("metal-sim")
    cuda = mk.DIALECTS["cuda"]
    monkeypatch.setattr(kernels, "dialect", dataclasses.replace(
        kernels.dialect, shared_bytes=cuda.dynamic_shared_bytes))
    monkeypatch.setattr(sim_kernel, "THREADGROUP_BYTES", cuda.dynamic_shared_bytes)
    monkeypatch.setattr(kernels, "_kernels", type(kernels._kernels)(8))
    monkeypatch.setattr(kernels, "_cores", type(kernels._cores)(8))
    mx.random.seed(L)
    if name == "gla":
        b, H, K, V = 2, 2, 20, 12
        q, k = mx.random.normal((b, L, H, K)), mx.random.normal((b, L, H, K))
        v, S0 = mx.random.normal((b, L, H, V)), mx.random.normal((b, H, K, V))
        g = mx.random.uniform(0.7, 1.0, (b, L, H)) * mx.where(
            mx.random.uniform(shape=(b, L, H)) < 0.2, -1.0, 1.0)
        _assert_gla_matches("metal-sim", q, k, v, g, S0, seg=seg, tol=TOL)
    else:
        monkeypatch.setattr(test_zoo, "L", L)
        inputs, states = _draw(name)
        _assert_matches(_run(name, "metal-sim", seg), lambda i, s: _reference(name, i, s),
                        inputs, states, tol=TOL)
    assert kernel_calls and all(s.C == seg and s.gradient_tiles is not None
                                for s in kernel_calls)


def test_cuda_tiles_beyond_declared_memory_are_sized_at_launch():
    """Past the 48 KB a CUDA kernel may declare, its arrays are pointers into dynamic shared
    memory, laid out one after another, and the kernel asks for exactly their bytes at launch;
    a kernel that fits declares its arrays. Where neither fits, no shape is made."""
    made = []
    kernels = mk.MatrixKernels("cuda")
    kernels._factory = lambda **definition: made.append(definition)
    shape = kernels.shape(64, 64, 64, inclusive=False)
    assert (shape.KT, shape.VT) == (64, 64) and shape.state_tiles == (64, 64)
    assert shape.gradient_tiles == (32, 32)
    for kind, dynamic in (("outputs", True), ("states", True), ("weights_adjoint", False),
                          ("chunk_gradients", True)):
        memory = mk.MatrixRenderer(kernels.dialect, shape).memory(kind)
        assert memory.dynamic == dynamic
        assert (memory.bytes > kernels.dialect.shared_bytes) == dynamic
        kernels._kernel(shape, kind)
        body = made[-1]["source"]
        assert ("extern __shared__" in body) == dynamic
        assert made[-1].get("shared_memory") == (memory.bytes if dynamic else None)
        if dynamic:  # each array where the previous one ends
            offsets = [int(line.split("recgen_group + ")[1].split(";")[0])
                       for line in body.splitlines() if "= recgen_group + " in line]
            sizes = [n for *_, n in memory.arrays]
            assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
        # only the backward kernel bounds its registers to two groups a core
        assert ("__launch_bounds__(256, 2)" in made[-1]["header"]) == (kind == "chunk_gradients")
    small = dataclasses.replace(mk.DIALECTS["cuda"], dynamic_shared_bytes=0)
    assert mk.tiles(64, 64, 64, small) == (16, 32)
    # the backward's [C, C] arrays and six tiles: not in 48 KB at chunks of 64, nor in Metal's
    # 32 KB (the matmuls' path runs there), which holds them at chunks of 32
    assert mk.gradient_tiles(64, 64, 64, small) is None
    assert mk.gradient_tiles(64, 64, 64, mk.DIALECTS["metal"]) is None
    assert mk.gradient_tiles(32, 64, 64, mk.DIALECTS["metal"]) == (32, 16)
    none = dataclasses.replace(small, shared_bytes=1024)
    assert mk.tiles(64, 64, 64, none) is None


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_log_decays_at_and_below_the_floor(backend, readouts, states_path, kernel_calls):
    """The kernels floor log d as they read it (``matrix.LOG_FLOOR``): GLA with its gate in
    log space (``ops.gla_g``) where some gates are -inf (a zero multiplier), far below the
    floor or just either side of it, read as the caller's (B, T, H) layout gives them. Outputs,
    final state and every gradient are finite and match the loop's (``gla_ref`` on ``exp(g)``),
    the gate's gradient none where it was floored (the loop's: exp(g) times a finite sum, 0 or
    1e-44)."""
    from mlx_recgen import ops

    rec = rg.Recurrence(ops.gla_g.spec)
    B, T, H, K, V = 2, 40, 2, 8, 8
    mx.random.seed(11)
    q, k = (mx.random.normal((B, T, H, K)) * K ** -0.5 for _ in range(2))
    v = mx.random.normal((B, T, H, V))
    g = mx.random.uniform(-1.0, 0.0, (B, T, H))
    steps = mx.arange(T)[None, :, None]
    for t, value in ((3, -float("inf")), (17, -150.0), (20, -100.5), (33, -99.5)):
        g = mx.where(steps == t, value, g)
    S0 = mx.random.normal((B, H, K, V))
    cotangent = mx.random.normal((B, T, H, V))

    def ours(q, k, v, g, S0):
        return rec(q, k, v, g, initial_state=S0, return_state=True, backend=backend,
                   schedule="matrix", seg=16)

    def loop(q, k, v, g, S0):
        return gla_ref(q, k, v, mx.exp(g), S0)

    def loss(f):
        return lambda *xs: mx.sum(f(*xs)[0] * cotangent) + mx.sum(f(*xs)[1] ** 2)

    xs = [q, k, v, g, S0]
    got, want = ours(*xs), loop(*xs)
    grads = mx.grad(loss(ours), argnums=tuple(range(5)))(*xs)
    wanted = mx.grad(loss(loop), argnums=tuple(range(5)))(*xs)
    for x, y in [*zip(got, want), *zip(grads, wanted)]:
        assert mx.all(mx.isfinite(x)).item()
        assert rel_err(x, y) < _tol(backend)
    # a floored step's log d has no cotangent (as MLX's maximum gives), exactly
    assert mx.all(grads[3][:, mx.array([3, 17, 20])] == 0).item()
    assert kernel_calls


def test_the_kernels_read_factors_where_they_lie(states_path):
    """The states (or walk), outputs and chunk-gradients kernels take ``c``, ``a``, ``b`` as
    ``(*batch, T, X)`` views at any strides (``matrix_kernels.STRIDED``): transposed from the
    spec's layout, sliced, broadcast over a batch axis, every other column. They give the
    numbers of contiguous copies bit for bit, and the chunk form in MLX ops within rounding;
    gradients come back in the views' shapes, bit for bit those of the copies, and so does the
    readouts' cotangent, given transposed (the batch shape of the readouts lets it reach the
    kernels as it lies). (The walk copies
    rows of four floats where they lie side by side, ``c``'s and ``a``'s, and ``b``'s one float
    at a time.)"""
    kernels = mk.matrix_kernels("metal-sim")
    B, H, T, K, V = 2, 3, 40, 16, 8
    shape = kernels.shape(16, K, V, inclusive=True, diagonal=True)
    core = kernels.core(shape)
    mx.random.seed(3)
    c = mx.transpose(mx.random.normal((B, T + 1, H, K)), (0, 2, 1, 3))[:, :, 1:]
    a = mx.broadcast_to(mx.random.normal((B, 1, T, K)), (B, H, T, K))
    # every other column: the backward's copies of b one float at a time (c's, four)
    b = mx.transpose(mx.random.normal((B, T, H, 2 * V)), (0, 2, 1, 3))[..., ::2]
    log_d = mx.random.uniform(-0.5, 0.0, (B * H, T))
    S0 = mx.random.normal((B * H, K, V))
    views = core(c, a, b, log_d, log_d, S0)
    copies = core(*(mx.contiguous(x) for x in (c, a, b)), log_d, log_d, S0)
    in_ops = mk.core_in_ops(shape, *(x.reshape(B * H, T, -1) for x in (c, a, b)), log_d, log_d,
                            S0)
    assert views[0].shape == (B, H, T, V)  # the readouts in the factors' batch shape
    for x, y, z in zip(views, copies, in_ops):
        assert mx.array_equal(x, y).item()
        assert rel_err(x, z.reshape(x.shape)) < TOL
    cotangents = [mx.random.normal(y.shape) for y in views]
    # the readouts' cotangent as a caller's layout gives it: transposed from (B, T, H, V)
    cotangents[0] = mx.transpose(mx.random.normal((B, T, H, V)), (0, 2, 1, 3))
    _, grads = mx.vjp(lambda c, a, b: core(c, a, b, log_d, log_d, S0), [c, a, b], cotangents)
    _, grads_of_copies = mx.vjp(lambda c, a, b: core(c, a, b, log_d, log_d, S0),
                                [mx.contiguous(x) for x in (c, a, b)],
                                [mx.contiguous(x) for x in cotangents])
    for g, h, x in zip(grads, grads_of_copies, (c, a, b)):
        assert g.shape == x.shape and mx.array_equal(g, h).item()


@pytest.fixture
def decay_score_calls(monkeypatch):
    """Counts the decay-score kernels built for a call (chunk, state size), so a test knows a
    decay per state element ran in them; the matrix kernels on for every backend."""
    monkeypatch.setenv("MLX_RECGEN_MATRIX_KERNELS", "1")
    calls = []
    method = mk.MatrixKernels.decay_scores

    def counted(self, C, K):
        calls.append((C, K))
        return method(self, C, K)

    monkeypatch.setattr(mk.MatrixKernels, "decay_scores", counted)
    return calls


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("seg", [8, 16])  # L = 11: a partial last chunk; one short chunk
@pytest.mark.parametrize("name", VECTOR_DECAY_ZOO)
def test_vector_decays_in_the_decay_score_kernels(name, seg, backend, decay_score_calls):
    """A decay per state element (RWKV-6, HGRN2 with gates of both signs, RWKV-7's delta rule):
    the chunks' causal weights in the decay-score kernels, the rest in MLX ops."""
    mx.random.seed(sum(map(ord, name)) + seg)
    inputs, states = _draw(name)
    _assert_matches(_run(name, backend, seg), lambda i, s: _reference(name, i, s), inputs,
                    states, tol=_tol(backend))
    assert {C for C, _ in decay_score_calls} == {min(seg, 16)}  # L = 11: a chunk of 11 in 16


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("L, seg, decay", [(150, 64, (0.05, 0.6)), (70, 32, (0.05, 0.6)),
                                           (100, 48, (2.0, 8.0)), (40, 16, (2.0, 8.0))],
                         ids=["64", "32", "48-strong", "16-strong"])
def test_ssd_over_several_chunks(L, seg, decay, backend, decay_score_calls):
    """SSD's ``exp(dt A[n])`` over chunks of 16 to 64 steps with a state of 20 elements (no
    multiple of the kernels' tiles of the state axis). The strong decays (``dt A`` down to -40
    a step) take a chunk's running sums of ``log d`` far below fp32's range of ``exp``: the
    weights must go through the pivots, as ``exp(Λ_t)`` and ``exp(-Λ_j)`` apart would overflow."""
    mx.random.seed(L)
    b, H, P, N = 2, 2, 3, 20
    inputs = [mx.random.normal((b, L, H, P)), mx.random.uniform(*decay, (b, L, H)),
              0.5 * mx.random.normal((b, L, H, N)), 0.5 * mx.random.normal((b, L, H, N)),
              -mx.exp(0.5 * mx.random.normal((H, N)))]
    h0 = 0.5 * mx.random.normal((b, H, P, N))
    rec = rg.load_spec("ssd")

    def run(i, s):
        y, h = rec(*i, initial_state=s[0], return_state=True, backend=backend,
                   schedule="matrix", seg=seg)
        return [y], [h]

    def ref(i, s):
        y, h = ssd_ref(*i, h0=s[0])
        return [y], [h]

    _assert_matches(run, ref, inputs, [h0], tol=_tol(backend))
    assert set(decay_score_calls) == {(seg, N)}


def test_chunks_the_decay_score_kernels_do_not_take_stay_in_mlx_ops(decay_score_calls):
    """A chunk of 72 steps, longer than the kernels' 64: MLX ops, the same numbers as
    backend='mlx'."""
    mx.random.seed(6)
    rec = rg.load_spec("ssd")
    inputs = [mx.random.normal((1, 80, 2, 4)), mx.random.uniform(0.05, 0.5, (1, 80, 2)),
              mx.random.normal((1, 80, 2, 8)), mx.random.normal((1, 80, 2, 8)),
              -mx.exp(mx.random.normal((2, 8)))]
    a = rec(*inputs, backend="metal-sim", schedule="matrix", seg=72)
    b = rec(*inputs, backend="mlx", schedule="matrix", seg=72)
    assert mx.array_equal(a, b).item() and not decay_score_calls


def test_the_switch(monkeypatch, kernel_calls):
    """``MLX_RECGEN_MATRIX_KERNELS``: 0 runs MLX ops (the same numbers as backend='mlx'),
    anything but 0 or 1 is refused; unset, Metal runs the kernels and CUDA does not."""
    mx.random.seed(7)
    inputs, states = _draw("mamba2")
    rec = rg.load_spec("mamba2")
    monkeypatch.setenv("MLX_RECGEN_MATRIX_KERNELS", "0")
    a = rec(*inputs, backend="metal-sim", schedule="matrix")
    assert mx.array_equal(a, rec(*inputs, backend="mlx", schedule="matrix")).item()
    assert not kernel_calls
    monkeypatch.setenv("MLX_RECGEN_MATRIX_KERNELS", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        rec(*inputs, backend="metal-sim", schedule="matrix")
    monkeypatch.delenv("MLX_RECGEN_MATRIX_KERNELS")
    assert mk.enabled("metal") and mk.enabled("metal-sim") and mk.enabled("cuda")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("inclusive,signed,diagonal", [(False, False, False), (True, False, False),
                                                       (False, True, False), (True, True, True)])
def test_the_cores_mlx_op_form(backend, inclusive, signed, diagonal):
    """``core_in_ops``, the MLX-op form of the kernels' core that its forward-mode rule
    differentiates, gives the kernels' readouts, final state and chunk starts (over a partial
    last chunk, decays of both signs), and the core's forward-mode rule passes each tangent to
    its own argument (the sign has none)."""
    kernels = mk.MatrixKernels(backend)
    shape = kernels.shape(16, 8, 16, inclusive, signed, units=False, diagonal=diagonal)
    mx.random.seed(5)
    I, T = 3, 37
    c, a = mx.random.normal((I, T, 8)), mx.random.normal((I, T, 8))
    b = mx.random.normal((I, T, 16))
    log_d = mx.log(mx.random.uniform(0.3, 1.0, (I, T)))
    sign = mx.where(mx.random.uniform(shape=(I, T)) < 0.3, -1.0, 1.0)
    init = mx.random.normal((I, 8, 16))
    primals = [c, a, b, log_d, sign, init]
    got = kernels.core(shape)(*primals)
    want = mk.core_in_ops(shape, c, a, b, log_d, sign if signed else None, init)
    for x, y in zip(got, want):
        assert rel_err(x, y) < _tol(backend)
    tangents = [mx.random.normal(x.shape) for x in primals]
    _, jvp = mx.jvp(kernels.core(shape), primals, tangents)

    def values(c, a, b, log_d, init):
        return mk.core_in_ops(shape, c, a, b, log_d, sign if signed else None, init)

    _, want = mx.jvp(values, [c, a, b, log_d, init], [*tangents[:4], tangents[5]])
    for x, y in zip(jvp, want):
        assert rel_err(x, y) < _tol(backend)


def test_forward_mode_and_second_order_through_the_kernels(kernel_calls, monkeypatch):
    """``mx.jvp`` (the tangent recurrence) through the kernels' core agrees with the sequential
    schedule on backend='mlx'. A gradient of a gradient raises there, over one chunk or several
    (the kernels in the VJP have no derivatives: it was silently wrong over several chunks),
    and with the kernels off the MLX-op form gives it."""
    mx.random.seed(8)
    gla = rg.load_spec("gla")
    q, k, v = (mx.random.normal((1, 40, 2, 3)) for _ in range(3))
    g = mx.random.uniform(0.5, 1.0, (1, 40, 2))

    def y_of(g, schedule, backend):
        L = g.shape[1]
        return gla(q[:, :L], k[:, :L], v[:, :L], g, backend=backend, schedule=schedule, seg=16)

    _, jk = mx.jvp(lambda g: y_of(g, "matrix", "metal-sim"), [g], [mx.ones_like(g)])
    _, js = mx.jvp(lambda g: y_of(g, "sequential", "mlx"), [g], [mx.ones_like(g)])
    assert rel_err(jk[0], js[0]) < TOL

    def second(g, schedule, backend):
        first = mx.grad(lambda g: mx.sum(y_of(g, schedule, backend) ** 2))
        return mx.grad(lambda g: mx.sum(first(g) ** 2))(g)

    for steps in (9, 40):
        with pytest.raises(NotImplementedError, match="MLX_RECGEN_MATRIX_KERNELS=0"):
            mx.eval(second(g[:, :steps], "matrix", "metal-sim"))
    assert kernel_calls
    monkeypatch.setenv("MLX_RECGEN_MATRIX_KERNELS", "0")
    assert rel_err(second(g, "matrix", "metal-sim"), second(g, "sequential", "mlx")) < 1e-4


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("kind", mk.KERNELS)
def test_cuda_text_compiles(tmp_path, kind):
    """The matrix kernels' CUDA text (the tensor-core MMA and the exact loop, signed or not;
    the kernels that read factors where they lie also with bf16 and fp16 factors, at sizes
    that take four elements a copy and a store and at sizes that take one, and with bf16
    factors and exact products) compiles with nvcc for sm_90, MLX's device header replaced by
    a stand-in."""
    halves = [(True, True, d, n) for d in (mx.bfloat16, mx.float16) for n in (64, 30)] \
        + [(False, True, mx.bfloat16, 64)] if kind in mk.STRIDED else []
    sources = []
    for units, signed, factors, n in [(u, s, mx.float32, 64) for u in (True, False)
                                      for s in (False, True)] + halves:
        text = mk.matrix_source(kind, "cuda", inclusive=signed, signed=signed, units=units,
                                diagonal=signed, factors=factors, state_size=n,
                                lanes=n if n == 64 else 6)
        text = without_mlx_header(text)
        # bf16 factors and states: the outputs and backward kernels multiply tiles of them on
        # the matrix units (exact products take floats)
        half_tiles = units and factors == mx.bfloat16 and kind in ("outputs", "chunk_gradients")
        assert ("constexpr int LDWH" in text) == half_tiles
        sources.append(tmp_path / f"{kind}_{units}_{signed}_{str(factors)[-8:]}_{n}.cu")
        sources[-1].write_text(text)
    assert_nvcc_compiles(sources)


def test_the_simulator_runs_uncompiled_where_a_gpu_is_the_default(monkeypatch, kernel_calls):
    """With a GPU as MLX's default device (an MLX with a CUDA or Metal backend) the matrix form
    compiles its computation, except around the simulator's kernels, which evaluate their
    inputs and cannot be traced: there it stays plain MLX ops and agrees with the paper's loop
    (compiled, it raised ``SimulatorTransformError``)."""
    real = mx.default_device()
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
    mx.random.seed(11)
    b, L, H, K, V = 1, 40, 2, 8, 4
    q, k = mx.random.normal((b, L, H, K)), mx.random.normal((b, L, H, K))
    v, S0 = mx.random.normal((b, L, H, V)), mx.random.normal((b, H, K, V))
    g = mx.sigmoid(mx.random.normal((b, L, H)) + 2)
    gla = rg.load_spec("gla")

    def run(i, s):
        y, S = gla(*i, initial_state=s[0], return_state=True, backend="metal-sim",
                   schedule="matrix", seg=16)
        return [y], [S]

    with mx.stream(real):
        _assert_matches(run, lambda i, s: [[x] for x in gla_ref(*i, S0=s[0])], [q, k, v, g],
                        [S0], tol=TOL)
    assert kernel_calls


def _naive_decay_scores(c, a, row_log, col_log, dW=None, tangents=None):
    """``W[t, j] = Σ_k c[t, k] a[j, k] exp(row_log[t, k] - col_log[j, k])`` for ``j < t``, by
    loops over the pairs in float64 numpy: the kernels' definition, apart from their code; with
    the cotangent ``dW``, the four gradients, with ``tangents``, W's tangent, each term
    differentiated by hand."""
    import numpy as np

    c, a, row_log, col_log = (np.asarray(x, dtype=np.float64) for x in (c, a, row_log, col_log))
    R, C, _ = c.shape
    W, grads = np.zeros((R, C, C)), [np.zeros_like(c) for _ in range(4)]
    for t in range(C):
        for j in range(t):
            term = c[:, t] * a[:, j] * np.exp(row_log[:, t] - col_log[:, j])  # (R, K)
            W[:, t, j] = np.sum(term, -1)
            if dW is not None:
                g = dW[:, t, j, None] * term
                grads[0][:, t] += g / np.where(c[:, t] == 0, 1, c[:, t])
                grads[1][:, j] += g / np.where(a[:, j] == 0, 1, a[:, j])
                grads[2][:, t] += g
                grads[3][:, j] -= g
            if tangents is not None:
                uc, ua, ur, ul = (x.astype(np.float64) for x in tangents)
                W[:, t, j] = np.sum(term * (uc[:, t] / c[:, t] + ua[:, j] / a[:, j]
                                            + ur[:, t] - ul[:, j]), -1)
    return grads if dW is not None else W


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("C, K, scale", [(64, 64, 0.5), (8, 3, 0.5), (40, 20, 0.5),
                                         (32, 17, 30.0)],
                         ids=["64x64", "8x3", "40x20", "32x17-strong"])
def test_decay_score_kernels_alone(C, K, scale, backend):
    """The decay-score kernels, their VJP and their JVP against their definition summed pair
    by pair in float64: chunks of 8 to 64 steps, state sizes that are no multiple of the
    kernels' tiles, and decays of up to -90 a step (``scale`` 30), whose running sums leave
    fp32's range of ``exp`` within a chunk: only the kernels' ranges through the quads keep
    each factor finite."""
    import numpy as np

    rng = np.random.default_rng(C + K)
    R = 3
    c, a = (rng.standard_normal((R, C, K)).astype(np.float32) for _ in range(2))
    log_d = -scale * rng.uniform(0.0, 3.0, (R, C, K)).astype(np.float32)
    col_log = np.cumsum(log_d, axis=1, dtype=np.float32)
    row_log = col_log - log_d
    kernels = mk.MatrixKernels(backend)
    assert kernels.decay_scores_fit(C)
    scores = kernels.decay_scores(C, K)
    xs = (c, a, row_log, col_log)
    args = [mx.array(x) for x in xs]

    def close(got, want):
        return np.allclose(np.array(got), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())

    assert close(scores(*args), _naive_decay_scores(*xs))
    dW = rng.standard_normal((R, C, C)).astype(np.float32)
    _, grads = mx.vjp(scores, args, [mx.array(dW)])
    for got, want in zip(grads, _naive_decay_scores(*xs, dW=dW)):
        assert close(got, want)
    u = [rng.standard_normal(x.shape).astype(np.float32) for x in xs]
    _, (tangent,) = mx.jvp(scores, args, [mx.array(x) for x in u])
    assert close(tangent, _naive_decay_scores(*xs, tangents=u))
