"""The wheel holds every package of the source tree: pyproject.toml lists its packages one by one, so a new
subpackage that is not listed works in an editable install and is missing from a regular one."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_packages() -> set[str]:
    """The importable packages under lowmemopt/ (and kernels/, installed as lowmemopt.kernels)."""
    found = {".".join(d.relative_to(ROOT).parts) for d in (ROOT / "lowmemopt").rglob("__init__.py")}
    found = {name.removesuffix(".__init__.py") for name in found}
    return found | {"lowmemopt.kernels"}


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    missing = sorted(source_packages() - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}: a regular install would miss them"


def test_the_package_finder_sees_subpackages():
    assert {"lowmemopt", "lowmemopt.cli", "lowmemopt.pipeline"} <= source_packages()
