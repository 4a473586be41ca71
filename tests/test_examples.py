"""The training example runs: two steps of each layer at tiny sizes, with --compare; by
default, and as the documentation runs it, it writes outside the files the repository keeps."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import runpy
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(os.path.join(ROOT, "examples", "train_tiny_lm.py"))


@pytest.mark.parametrize("layer", ["mamba2", "gated_deltanet", "gla", "rglru"])
def test_train_tiny_lm_two_steps(example, layer, tmp_path, capsys):
    result = example["main"](["--layer", layer, "--backend", "mlx", "--steps", "2",
                              "--batch", "2", "--seq", "16", "--dim", "32", "--layers", "1",
                              "--out", str(tmp_path), "--compare", "--compare-steps", "1",
                              "--eval-batches", "1", "--sample", "4", "--log-every", "1"])
    saved = json.loads((tmp_path / f"tiny-lm-{layer}-cpu.json").read_text())
    assert saved["layer"] == layer and saved["steps"] == 2 and len(saved["losses"]) == 2
    assert (tmp_path / saved["curve"]).is_file()
    for key in ("final_loss", "eval_loss", "tokens_per_s"):
        assert math.isfinite(saved[key]) and saved[key] > 0, key
    assert 0 < saved["losses"][0] < 7  # about log(256) = 5.5 at the start
    c = result["compare"]
    assert c["tokens_per_s"] > 0 and c["tokens_per_s_loop"] > 0
    # the same model from the same weights on the same batch: the same first loss
    assert abs(c["first_loss"] - c["first_loss_loop"]) < 1e-4 * c["first_loss"]
    assert capsys.readouterr().out.startswith("def ")


def _documented_commands():
    """The example's command lines in the README's and docs pages' bash blocks."""
    pages = [os.path.join(ROOT, "README.md"),
             *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    for page in pages:
        with open(page) as f:
            for block in re.findall(r"```bash\n(.*?)```", f.read(), re.S):
                for line in block.replace("\\\n", " ").splitlines():
                    if "examples/train_tiny_lm.py" in line:
                        yield line.split("examples/train_tiny_lm.py", 1)[1].split("#")[0]


def test_runs_write_outside_the_kept_results(example):
    """A run writes to runs/tiny-lm (ignored by git) unless told otherwise, and no documented
    command writes over the results kept in benchmarks/results."""
    assert example["parse_args"]([]).out == "runs/tiny-lm"
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "/runs/" in f.read().split()
    commands = list(_documented_commands())
    assert commands
    for command in commands:
        out = example["parse_args"](shlex.split(command)).out
        assert out.split("/")[0] == "runs", (command, out)
