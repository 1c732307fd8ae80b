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
MAX_LINES = 680


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


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package in ``tree`` with pyproject.toml's contracts."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = str(tree)
    lint = Path(sys.executable).with_name("lint-imports")
    cmd = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
    return subprocess.run(cmd + [str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept(tmp_path):
    pytest.importorskip("importlinter")
    out = _lint(_package_tree(tmp_path))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


@pytest.mark.parametrize("where,line", [
    ("quant/upward.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..optimizer import LowMemOptimizer\n"),
    ("pipeline/upward.py", "def f():\n    from ..optim import AdamW\n"),
    ("kernels/upward.py", "import lowmemopt\n"),
])
def test_the_contracts_can_fail(tmp_path, where, line):
    """A module that imports upwards (a type hint, a deferred import, the root package) breaks them."""
    pytest.importorskip("importlinter")
    tree = _package_tree(tmp_path)
    (tree / "lowmemopt" / where).write_text(line)
    out = _lint(tree)
    assert out.returncode != 0
    assert "lowmemopt." + where[:-3].replace("/", ".") in out.stdout


def test_no_module_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in [*(ROOT / "lowmemopt").rglob("*.py"), *(ROOT / "kernels").glob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
