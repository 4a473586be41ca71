"""The ``mlx-recgen`` command line: one-line errors, what ``demo`` reports, and ``check``
finding planted bugs (inputs of both signs, initial-state gradients, an independent reference)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

import mlx_recgen as rg
from mlx_recgen import cli
from mlx_recgen.backends.mlx_backend import MLXBackend
from mlx_recgen.render.expr import MLXPrinter

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _main(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def bad_spec_files(tmp_path):
    files = {
        "syntax": "import mlx_recgen as rg\ndef oops(:\n",
        "import": "import no_such_module_here\n",
        "spec_error": ('import mlx_recgen as rg\n'
                       '@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D"},\n'
                       '               outputs={"y": "B L Q"})\n'
                       'def bad(h, x):\n    h = h + x\n    return {"y": h}\n'),
        "empty": "x = 1\n",
        "exits": "import sys\nsys.exit()\n",
        "exits_3": "raise SystemExit(3)\n",
    }
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["show", "no_such_spec"], r"unknown spec 'no_such_spec'; bundled specs are"),
    (["show", "ssd", "--seg", "0"], r"show: --seg must be a positive integer, got 0"),
    (["show", "ssd", "--kernel", "carry", "--schedule", "sequential"],
     r"the sequential schedule's kernels are \('forward', 'backward'\), got 'carry'"),
    (["show", "examples/delta_rule.py", "--kernel", "summary"], r"has no chunked kernels: its "
                                                                r"multiplier is diagonal plus low"),
    (["check", "ssd", "--seg", "-2", "--backend", "mlx"], r"check: --seg must be a positive"),
    (["check", "ssd", "--backend", "tpu"], r"unknown backend 'tpu'; choose one of"),
    (["adjoint", "{dir}/syntax.py"], r"cannot load spec file '.*syntax.py': SyntaxError: "),
    (["adjoint", "{dir}/import.py"], r"cannot load spec file '.*import.py': ModuleNotFoundError"),
    (["adjoint", "{dir}/spec_error.py"], r"spec 'bad': output 'y' lacks the lane axis 'D'"),
    (["adjoint", "{dir}/empty.py"], r"spec 'empty': .*empty.py defines no recurrence"),
    (["show", "{dir}/missing.py"], r"spec file not found: .*missing.py"),
    (["show", "{dir}/exits.py"], r"cannot load spec file '.*exits.py': SystemExit: it exits at "
                                 r"import \(code None\)"),
    (["adjoint", "{dir}/exits_3.py:f"], r"cannot load spec file '.*exits_3.py:f': SystemExit: "
                                        r"it exits at import \(code 3\)"),
    (["show", "{dir}/in:a/missing.py"], r"spec file not found: .*/in:a/missing.py$"),
    (["show", "{dir}/in:a/missing.py:name"], r"spec file not found: .*/in:a/missing.py$"),
])
def test_errors_are_one_line_on_stderr(capsys, bad_spec_files, argv, message):
    import re

    argv = [a.format(dir=bad_spec_files) for a in argv]
    rc, out, err = _main(capsys, *argv)
    assert rc == 1
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("mlx-recgen: error: ") and re.search(message, err), err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_demo_on_a_missing_backend_fails_before_printing(capsys, backend):
    if backend == "metal" and mx.metal.is_available():
        pytest.skip("this machine has Metal")
    if backend == "cuda" and hasattr(mx, "cuda") and mx.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, out, err = _main(capsys, "demo", "--backend", backend)
    assert rc == 1 and out == ""
    assert err.startswith(f"mlx-recgen: error: backend='{backend}' needs") and err.count("\n") == 1
    rc, out, err = _main(capsys, "check", "ssd", "--backend", backend)
    assert rc == 1 and out == "" and err.count("\n") == 1


@pytest.mark.parametrize("kernel", ["summary", "carry", "outputs", "local_adjoint",
                                    "adjoint_carry", "gradients"])
def test_show_prints_the_chunked_kernels(capsys, kernel):
    rc, out, _ = _main(capsys, "show", "gla", "--kernel", kernel, "--backend", "cuda")
    assert rc == 0 and f"custom_kernel_recgen_gla_{kernel}" in out
    assert ("element" if "carry" in kernel else "segment") in out


def test_show_prints_the_scan_and_matrix_kernels(capsys):
    """``--schedule scan`` prints the scan kernels (``rec.source``); the matrix kernels print with
    the spec's readout kind and decay sign (``matrix_kernels.spec_matrix_source``), and specs the
    kernels do not serve are refused with the reason."""
    rc, out, _ = _main(capsys, "show", "rglru", "--schedule", "scan", "--backend", "metal")
    assert rc == 0 and "simd_shuffle_xor" in out and "recgen_rglru_forward" in out
    rc, out, _ = _main(capsys, "show", "rglru", "--schedule", "scan", "--kernel", "backward",
                       "--backend", "cuda")
    assert rc == 0 and "recgen_rglru_backward" in out
    for kernel in ("states", "outputs", "adjoint"):
        rc, out, _ = _main(capsys, "show", "gla", "--schedule", "matrix", "--kernel", kernel)
        assert rc == 0 and "simdgroup_multiply_accumulate" in out, kernel
    rc, out, _ = _main(capsys, "show", "gla", "--kernel", "states", "--backend", "cuda")
    assert rc == 0 and "mma.sync" in out
    for argv, message in [(("ssd", "--kernel", "states"), "scalar decay"),
                          (("rglru", "--kernel", "states"), "no matrix form"),
                          (("gla", "--schedule", "scan"), "no scan kernels"),
                          (("rglru", "--schedule", "scan", "--kernel", "states"), "scan schedule's")]:
        rc, out, err = _main(capsys, "show", *argv)
        assert rc == 1 and message in err, (argv, err)


def test_spec_file_in_a_directory_named_with_a_colon(capsys, tmp_path):
    """A ':' in a directory's name belongs to the path; ``path.py:name`` still names a
    recurrence."""
    folder = tmp_path / "in:a"
    folder.mkdir()
    (folder / "delta_rule.py").write_text((EXAMPLES / "delta_rule.py").read_text())
    for spec in (folder / "delta_rule.py", f"{folder / 'delta_rule.py'}:delta_rule"):
        rc, out, err = _main(capsys, "adjoint", str(spec))
        assert rc == 0 and err == "" and out.startswith("forward step:")


def test_show_metal_sim_prints_the_metal_kernel(capsys):
    """The simulator runs the Metal text as it is: ``show --backend metal-sim`` prints it."""
    for kernel in ("forward", "summary"):
        rc, metal, _ = _main(capsys, "show", "gla", "--kernel", kernel, "--backend", "metal")
        rc_sim, sim, err = _main(capsys, "show", "gla", "--kernel", kernel, "--backend",
                                 "metal-sim")
        assert rc == rc_sim == 0 and err == "" and sim == metal and "kernel" in sim


def test_check_says_where_its_backend_came_from(capsys, monkeypatch):
    """check's default backend (metal-sim) is reported as the default, a requested one as
    requested."""
    monkeypatch.setattr(cli, "check", lambda rec, backend, seg, sizes: ([("output h", 0.0)],
                                                                          "stub inputs"))
    rc, out, err = _main(capsys, "check", "rglru")
    assert rc == 0 and err == ""
    assert "rglru on backend 'metal-sim' (the default; --backend chooses another)" in out
    rc, out, err = _main(capsys, "check", "rglru", "--backend", "metal-sim")
    assert rc == 0 and "rglru on backend 'metal-sim' (requested with --backend)" in out
    rc, out, err = _main(capsys, "check", "rglru", "--backend", "auto")
    assert rc == 0 and f"rglru on backend '{rg.default_backend()}' (the best available" in out


def test_traceback_flag_reraises(capsys):
    with pytest.raises(ValueError, match="unknown spec"):
        cli.main(["--traceback", "show", "no_such_spec"])


def test_demo_reports_every_check(capsys):
    assert cli.demo("mlx", length=20) == 0
    out = capsys.readouterr().out
    for row in ("output y", "final state h", "grad q", "grad k", "grad v", "grad beta",
                "grad h (initial state)"):
        assert f"  {row} " in out, row
    assert "tolerance 1e-04" in out
    assert "Backend 'mlx' (requested with --backend)" in out
    assert out.strip().splitlines()[-1].startswith("OK: max relative error")


def test_resolve_backend_says_why():
    assert cli.resolve_backend("mlx") == ("mlx", "requested with --backend")
    backend, why = cli.resolve_backend(None)
    assert backend == rg.default_backend() and why.startswith("the best available")


def test_check_command_output(capsys):
    rc, out, err = _main(capsys, "check", "rglru", "--backend", "mlx")
    assert rc == 0 and err == ""
    assert "both signs" in out and "grad h (initial state)" in out and "final state h" in out
    assert "rglru on mlx: OK" in out and "tolerance 1e-04" in out


# ---------------------------------------------------------------------------------------------
# check() finds what the old check could not
# ---------------------------------------------------------------------------------------------


def _spec(body_op):
    @rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
                   outputs={"y": "B L D"}, name=f"planted_{body_op.__name__}")
    def planted(h, a, x):
        h = 0.5 * rg.tanh(a) * h + body_op(x)
        return {"y": h}
    return planted


def _failing(rows):
    return {name for name, err in rows if not err < cli.TOLERANCE}


def test_check_passes_on_a_correct_spec():
    rows, description = cli.check(_spec(rg.abs), "mlx")
    assert cli.passed(rows) and "both signs" in description
    assert [r for r, _ in rows] == ["output y", "final state h", "grad a", "grad x",
                                    "grad h (initial state)"]


def test_check_finds_a_renderer_bug_on_negative_inputs(monkeypatch):
    """abs printed as the identity: invisible on positive inputs, caught on both signs, because
    the reference does not go through the printer."""
    monkeypatch.setitem(MLXPrinter.CALLS, "abs", "")
    rec = _spec(rg.abs)
    rows, _ = cli.check(rec, "mlx")
    assert {"output y", "final state h", "grad a"} <= _failing(rows)
    positive = [mx.random.uniform(0.2, 0.9, (2, 19, 7)) for _ in range(2)]
    rows, _ = cli.check(rec, "mlx", case=(positive, [mx.zeros((2, 7))], "positive"))
    assert cli.passed(rows)  # what a positive-only check would have concluded


def test_check_finds_a_renderer_bug_in_a_function(monkeypatch):
    monkeypatch.setitem(MLXPrinter.CALLS, "sin", "mx.cos")
    rows, _ = cli.check(_spec(rg.sin), "mlx")
    assert "output y" in _failing(rows)


def test_check_finds_a_wrong_initial_state_gradient(monkeypatch):
    backward = MLXBackend.backward

    def wrong(self, *args, **kwargs):
        grads, d_init = backward(self, *args, **kwargs)
        return grads, [2 * d for d in d_init]

    monkeypatch.setattr(MLXBackend, "backward", wrong)
    rows, _ = cli.check(_spec(rg.tanh), "mlx")
    assert _failing(rows) == {"grad h (initial state)"}


def test_check_falls_back_to_positive_inputs_for_a_log():
    rows, description = cli.check(_spec(rg.log), "mlx")
    assert cli.passed(rows) and "positive" in description


def test_check_scales_inputs_down_for_an_unstable_recurrence():
    @rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
                   outputs={"y": "B L D"})
    def growing(h, a, x):
        h = rg.exp(8 * a) * h + x  # explodes over 19 steps unless a is small
        return {"y": h}

    rows, description = cli.check(growing, "mlx")
    assert cli.passed(rows) and "both signs" in description and "0.5" not in description


def test_check_avoids_inputs_where_the_reference_gradient_is_nan():
    """where(x > 0, sqrt(x), 0): autodiff of the reference gives NaN gradients for negative x
    (the untaken branch), so the check moves on to positive inputs."""
    def root(x):
        return rg.where(x > 0, rg.sqrt(x), 0.0)

    rows, description = cli.check(_spec(root), "mlx")
    assert cli.passed(rows) and "positive" in description


def test_list_shows_every_spec_with_its_math(capsys):
    rc, out, err = _main(capsys, "list")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 2 * len(rg.list_specs())
    math = {line.split()[0]: line.split(None, 1)[1] for line in lines[::2]}
    assert sorted(math) == sorted(rg.list_specs())
    assert math["rglru"] == "h <- a * h + x;  y = h"
    assert math["mlstm"] == ("m <- max(log f + m, i~);  C <- f' C + i' k v^T;  n <- f' n + i' k;  "
                             "h = C^T q / max(|n^T q|, exp(-m))")
    assert lines[lines.index(next(l for l in lines if l.startswith("s4d "))) + 1].strip() \
        .startswith("S4D (Gu et al. 2022)")
