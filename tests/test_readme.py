"""The README's Python snippets and the example run as written."""

from __future__ import annotations

import os
import re
import runpy
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _snippets():
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


@pytest.mark.parametrize("index", range(len(_snippets())))
def test_readme_python_snippet_runs(index, capsys):
    snippet = _snippets()[index]
    if "mlx_lm" in snippet:  # the mlx-lm integration's example needs the mlx-lm extra
        pytest.importorskip("mlx_lm")
    exec(compile(snippet, f"README.md snippet {index}", "exec"), {})


def test_example_writes_whole_kernels(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["delta_rule.py", str(tmp_path)])
    scope = runpy.run_path(os.path.join(ROOT, "examples", "delta_rule.py"), run_name="__main__")
    for kernel in ("forward", "backward"):
        text = (tmp_path / f"delta_rule_{kernel}.metal").read_text()
        assert text == scope["delta_rule"].source(kernel, backend="metal")
        assert "[[kernel]]" in text and text.rstrip().endswith(";")
