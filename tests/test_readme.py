"""The README's and the docs pages' Python snippets and the example run as written, and their
links lead somewhere."""

from __future__ import annotations

import os
import re
import runpy
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Pages whose Python blocks are fragments (signatures with placeholders), not programs: their
# links are checked, their snippets not run. Every other page's snippets run.
FRAGMENT_PAGES = {"docs/simulator.md", "docs/scan.md"}
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _read(page):
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def _pages():
    docs = sorted(f"docs/{n}" for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return ["README.md", *docs]


def _snippets():
    return [(page, i, code) for page in _pages() if page not in FRAGMENT_PAGES
            for i, code in enumerate(re.findall(r"```python\n(.*?)```", _read(page), re.S))]


@pytest.mark.parametrize("page, index, snippet", _snippets(),
                         ids=[f"{p} snippet {i}" for p, i, _ in _snippets()])
def test_python_snippet_runs(page, index, snippet, capsys):
    if "mlx_lm" in snippet:  # the mlx-lm integration's example needs the mlx-lm extra
        pytest.importorskip("mlx_lm")
    exec(compile(snippet, f"{page} snippet {index}", "exec"), {})


def _slug(heading: str) -> str:
    """The anchor a Markdown heading gets (GitHub's rule: lower case, punctuation dropped,
    spaces to hyphens)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page) -> set:
    text = FENCE.sub("", _read(page))
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", _pages())
def test_links_lead_somewhere(page):
    """Every relative link of the README and the docs pages names a file of the repository, and
    its anchor a heading of that page."""
    text = FENCE.sub("", _read(page))
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or page != "README.md"
    for link in links:
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        assert os.path.exists(os.path.join(ROOT, target)), f"{page}: {link}"
        if anchor and target.endswith(".md"):
            assert anchor in _anchors(target), f"{page}: {link}"


def test_readme_links_every_docs_page():
    """No page is left out of the README's list."""
    readme = _read("README.md")
    for page in _pages()[1:]:
        assert f"]({page})" in readme, page


def test_readme_sets_up_and_tests_as_ci_does():
    """The README's first commands install the extras CI installs and run CI's test command, so
    that nothing CI tests is skipped for a reader (the mlx-lm tests skip without mlx-lm)."""
    first = re.search(r"```bash\n(.*?)```", _read("README.md"), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first.splitlines()]
    assert commands[:2] == ['pip install -e ".[dev,mlx-lm]" && mlx-recgen demo',
                            "python -m pytest -q"]
    ci = _read(".ci/run")
    extras = re.search(r"pip install .*-e \"\.\[([\w,-]+)\]\"", ci).group(1)
    assert sorted(extras.split(",")) == ["dev", "mlx-lm"]
    assert re.search(r"^python -m pytest -q$", ci, re.M)


def test_example_writes_whole_kernels(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["delta_rule.py", str(tmp_path)])
    scope = runpy.run_path(os.path.join(ROOT, "examples", "delta_rule.py"), run_name="__main__")
    for kernel in ("forward", "backward"):
        text = (tmp_path / f"delta_rule_{kernel}.metal").read_text()
        assert text == scope["delta_rule"].source(kernel, backend="metal")
        assert "[[kernel]]" in text and text.rstrip().endswith(";")
