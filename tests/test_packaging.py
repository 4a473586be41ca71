"""The package metadata: runtime dependencies, one MLX build per Linux install, the licence."""

from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LINUX = dict(default_environment(), sys_platform="linux", platform_system="Linux")


def _requirements(extras):
    """The requirements a Linux install with ``extras`` asks for, extras of extras included."""
    wanted = list(PROJECT["dependencies"])
    for extra in extras:
        wanted += PROJECT["optional-dependencies"][extra]
    out = []
    for text in wanted:
        r = Requirement(text)
        if r.marker is None or r.marker.evaluate(dict(LINUX, extra="")):
            out.append(r)
    return out


def _mlx_builds(extras) -> set:
    """The extras of ``mlx`` requested: ``cpu``, ``cuda13``, ... (each one MLX build)."""
    return {e for r in _requirements(extras) if r.name == "mlx" for e in r.extras}


def test_runtime_dependencies():
    names = {Requirement(t).name for t in PROJECT["dependencies"]}
    assert {"mlx", "sympy", "jinja2", "numpy"} <= names  # numpy: the simulator imports it


@pytest.mark.parametrize("extras, build", [
    (["cpu"], {"cpu"}), (["cuda"], {"cuda13"}), (["dev"], {"cpu"}),
    (["dev", "mlx-lm"], {"cpu"}), (["cuda", "test"], {"cuda13"}), (["cuda", "mlx-lm"], {"cuda13"}),
    (["cuda", "test", "mlx-lm"], {"cuda13"}), (["cpu", "bench"], {"cpu"}),
])
def test_one_mlx_build_per_linux_install(extras, build):
    assert _mlx_builds(extras) == build


def test_cuda_needs_mlx_that_caches_modules_by_content():
    (mlx,) = [r for r in _requirements(["cuda"]) if r.name == "mlx" and r.extras]
    assert "0.32.2" in mlx.specifier and "0.32.1" not in mlx.specifier


def test_licence_and_metadata():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 The mlx-recgen authors" in text
    assert PROJECT["authors"]
    assert "License :: OSI Approved :: MIT License" in PROJECT["classifiers"]
