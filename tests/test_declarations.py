"""Each algorithm is declared once, in its own module (``@fused(KernelSet(...))`` in ``optim/X.py``): nothing outside
an algorithm's files names it as a string, and every declaration resolves to the kernels it names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import lowmemopt
from lowmemopt.cpu.elementwise import NativeKernel
from lowmemopt.cpu.factored import FactoredStep
from lowmemopt.work.kernel_set import KernelSet

ROOT = Path(__file__).resolve().parents[1]


def _declarations() -> dict[str, KernelSet]:
    """Every kernel declaration of an optimizer class lowmemopt exports, by name."""
    out = {}
    for name in lowmemopt.__all__:
        cls = getattr(lowmemopt, name)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            kernels = cls.algorithm.kernels if getattr(cls, "algorithm", None) is not None else None
            if kernels is not None:
                out[kernels.name] = kernels
    return out


def _own_files(declarations: dict[str, KernelSet]) -> set[str]:
    """The algorithms' own Python files: ``lowmemopt/optim/*`` and the kernel modules their declarations name."""
    return {f"kernels/{k.triton.split(':')[0]}.py" for k in declarations.values() if k.triton}


def _named(paths: list[Path], names: set[str], root: Path) -> list[str]:
    """``path:line 'name'`` for each string literal (docstrings aside) in ``paths`` that is one of ``names``."""
    out = []
    for path in paths:
        tree = ast.parse(path.read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs:
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.value!r}")
    return out


def _outside(root: Path, own: set[str]) -> list[Path]:
    files = [*(root / "lowmemopt").rglob("*.py"), *(root / "kernels").glob("*.py")]
    return sorted(
        f
        for f in files
        if not str(f.relative_to(root)).startswith("lowmemopt/optim/") and str(f.relative_to(root)) not in own
    )


def test_no_module_outside_an_algorithms_files_names_it():
    declared = _declarations()
    assert {"adam", "sgd", "signsgd", "lion", "lamb", "lars", "adafactor", "came", "ademamix"} <= declared.keys()
    files = _outside(ROOT, _own_files(declared))
    assert len(files) > 100
    assert _named(files, set(declared), ROOT) == []


def test_the_name_check_can_fail(tmp_path):
    (tmp_path / "lowmemopt" / "optim").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "lowmemopt" / "optim" / "adamw.py").write_text('NAME = "adam"\n')
    (tmp_path / "kernels" / "adamw.py").write_text('LABEL = "adam"\n')
    (tmp_path / "lowmemopt" / "table.py").write_text('"""The "adam" kernel."""\nFUSED = {"adam", "other"}\n')
    files = _outside(tmp_path, {"kernels/adamw.py"})
    assert _named(files, {"adam"}, tmp_path) == ["lowmemopt/table.py:2 'adam'"]


@pytest.mark.parametrize("name", sorted(_declarations()))
def test_each_declaration_names_kernels_that_exist(name):
    kernels = _declarations()[name]
    assert isinstance(kernels.native, (NativeKernel, FactoredStep, type(None))), kernels.native
    if kernels.triton is None:
        assert not kernels.capturable  # (a capturable step runs the Triton kernels)
        return
    pytest.importorskip("triton")
    from lowmemopt.kernels import registry

    for fmt in registry.FORMATS:
        kernel = registry.lookup(kernels, fmt)
        assert (kernel.algorithm, kernel.fmt) == (name, fmt)
        assert callable(kernel.launch) and callable(kernel.slots)
