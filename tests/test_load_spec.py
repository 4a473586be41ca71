"""Loading a spec from a file: the file is run once per content, so an edited file is loaded
again in the same process."""

from __future__ import annotations

import re
import sys

import mlx.core as mx
import pytest

import mlx_recgen as rg

SPEC_FILE = '''
import mlx_recgen as rg


@rg.recurrence(lane="D", state={{"h": "B D"}}, inputs={{"a": "B L D", "x": "B L D"}},
               outputs={{"y": "B L D"}})
def scaled(h, a, x):
    h = a * h + {c} * x
    return {{"y": h}}
'''


def _hand_loop(a, x, c):
    h, ys = mx.zeros(a[:, 0].shape), []
    for t in range(a.shape[1]):
        h = a[:, t] * h + c * x[:, t]
        ys.append(h)
    return mx.stack(ys, axis=1)


def test_an_edited_spec_file_is_loaded_again(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as most users run
    path = tmp_path / "scaled.py"
    a = mx.random.normal((2, 6, 3), key=mx.random.key(3))
    x = mx.random.normal((2, 6, 3), key=mx.random.key(4))
    loaded = []
    for c in ("0.5", "0.5", "0.7", "-2.5", "0.7"):  # edits of one size, at once, and another size
        path.write_text(SPEC_FILE.format(c=c))
        for name in (path, f"{path}:scaled"):
            rec = rg.load_spec(name)
            assert mx.allclose(rec(a, x, backend="mlx"), _hand_loop(a, x, float(c)), atol=1e-5)
        loaded.append(rec)
    assert loaded[1] is loaded[0]  # unchanged: the same recurrence
    assert loaded[2] is not loaded[1] and loaded[4] is not loaded[3]


def test_an_edited_spec_file_errors_quote_its_new_text(tmp_path):
    path = tmp_path / "broken.py"
    for line in ("h = a * h + max(x, h)", "h = a * h + min(x, h)"):
        path.write_text(SPEC_FILE.format(c="1.0").replace("h = a * h + 1.0 * x", line))
        with pytest.raises(rg.SpecError, match=re.escape(f"`{line}`")):
            rg.load_spec(path)
