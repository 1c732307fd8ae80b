"""The layering of docs/pipeline.md ("The plan, and the layers") as import-linter contracts (``[tool.importlinter]``
in pyproject.toml): command line and integrations -> optimizer classes -> optimizer base -> pipeline -> backends and
storage -> quant, nothing below the optimizer importing it, no import cycle inside a package, none through a package's
``__init__`` (which ``acyclic_siblings`` does not see); and no module over the size a newcomer can read."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600  # "no module over 600 lines" (_too_long)


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
    return subprocess.run(
        cmd + [str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_contracts_are_kept(tmp_path):
    pytest.importorskip("importlinter")
    out = _lint(_package_tree(tmp_path))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


@pytest.mark.parametrize(
    "where,line",
    [
        (
            "quant/upward.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..optimizer import LowMemOptimizer\n",
        ),
        ("pipeline/upward.py", "def f():\n    from ..optim import AdamW\n"),
        ("kernels/upward.py", "import lowmemopt\n"),
        (
            "pipeline/upward.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..projection.stage import GaLoreStage\n",
        ),  # (the projection stage's type)
    ],
)
def test_the_contracts_can_fail(tmp_path, where, line):
    """A module that imports upwards (a type hint, a deferred import, the root package) breaks them."""
    pytest.importorskip("importlinter")
    tree = _package_tree(tmp_path)
    (tree / "lowmemopt" / where).write_text(line)
    out = _lint(tree)
    assert out.returncode != 0
    assert "lowmemopt." + where[:-3].replace("/", ".") in out.stdout


# A package whose __init__ imports one of its modules (directly or through others) that imports the package back: the
# package is half-initialised while that module runs. grimp (import-linter's graph) sees deferred imports too.
_INIT_CYCLES = """
import grimp
graph = grimp.build_graph("lowmemopt", cache_dir=None)
for package in sorted(graph.modules):
    for module in sorted(graph.find_descendants(package)):
        if graph.direct_import_exists(importer=package, imported=module):
            chain = graph.find_shortest_chain(importer=module, imported=package)
            if chain:
                print(" -> ".join((package, *chain)))
"""


def _init_cycles(tree: Path) -> list[str]:
    """Every package ``__init__`` of the package in ``tree`` that imports a module of its own which imports it back,
    as ``package -> module -> ... -> package``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = str(tree)
    out = subprocess.run(
        [sys.executable, "-c", _INIT_CYCLES], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_no_package_init_is_in_a_cycle(tmp_path):
    pytest.importorskip("grimp")
    assert _init_cycles(_package_tree(tmp_path)) == []


def test_the_init_cycle_check_can_fail(tmp_path):
    """A planted package whose __init__ imports its module (deferred, as lowmemopt.cpu did) and the module imports a
    name of the __init__ back."""
    pytest.importorskip("grimp")
    tree = _package_tree(tmp_path)
    planted = tree / "lowmemopt" / "quant" / "planted"
    planted.mkdir()
    (planted / "__init__.py").write_text(
        "ON = True\n\n\ndef run():\n    from .worker import work\n\n    return work()\n"
    )
    (planted / "worker.py").write_text("from . import ON\n\n\ndef work():\n    return ON\n")
    assert _init_cycles(tree) == [
        "lowmemopt.quant.planted -> lowmemopt.quant.planted.worker -> lowmemopt.quant.planted"
    ]


def _too_long(paths, limit: int) -> dict[str, int]:
    """{path: lines} of the files in ``paths`` over ``limit`` lines."""
    return {str(p): n for p in paths if (n := len(Path(p).read_text().splitlines())) > limit}


def test_no_module_is_too_long():
    long = _too_long(
        [*(ROOT / "lowmemopt").rglob("*.py"), *(ROOT / "kernels").glob("*.py"), *(ROOT / "lowmemopt").rglob("*.[ch]")],
        MAX_LINES,
    )  # the C kernels' sources too
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_size_check_can_fail(tmp_path):
    for n in (600, 601):
        (tmp_path / f"m{n}.py").write_text("x = 1\n" * n)
    assert _too_long(sorted(tmp_path.glob("*.py")), 600) == {str(tmp_path / "m601.py"): 601}


# Below the pipeline, a bucket's options come resolved in its record (lowmemopt.work.record.BucketRecord), never as a
# param group dict: the modules of the update stage's backends name no `group` (an argument, a variable, `.group`).
# (lowmemopt.work.record resolves groups: the one place that reads them. Still reading groups below the pipeline:
# the paging stage's tiers and budgets, the 1-bit communicate stage, the checkpoint conversion of quant.convert; and
# Item.group is carried for the GaLore stage above.)
_RECORD_ONLY = [
    "lowmemopt/work/capture.py",
    "lowmemopt/rounding.py",
    "lowmemopt/compiled.py",
    "lowmemopt/cpu",
    "kernels",
    "lowmemopt/pipeline/backends.py",
]


def _group_reads(paths) -> list[str]:
    """``path:line name`` for each argument, name or attribute called ``group`` in the Python files of ``paths``."""
    import ast

    out = []
    for path in paths:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            name = (
                node.arg
                if isinstance(node, ast.arg)
                else node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else None
            )
            if name == "group":
                out.append(
                    f"{Path(path).relative_to(ROOT) if Path(path).is_relative_to(ROOT) else path}:{node.lineno} {name}"
                )
    return out


def test_no_backend_reads_a_param_group():
    files = [
        f
        for entry in _RECORD_ONLY
        for f in ([ROOT / entry] if entry.endswith(".py") else sorted((ROOT / entry).rglob("*.py")))
    ]
    assert len(files) > 30, files
    assert _group_reads(files) == []


def test_the_group_check_can_fail(tmp_path):
    (tmp_path / "backend.py").write_text("def step(p, group):\n    return group['lr']\n")
    (tmp_path / "clean.py").write_text("def step(p, record):\n    return record.hyper['lr']\n")
    assert _group_reads([tmp_path / "backend.py", tmp_path / "clean.py"]) == [
        f"{tmp_path / 'backend.py'}:1 group",
        f"{tmp_path / 'backend.py'}:2 group",
    ]


# Modules that hold a stage (which gathers (param, group) pairs into items) and a backend: the backend's functions
# take the items and their Update only. (The per-tensor backends' entry is lowmemopt.pipeline.backends.step_per_tensor,
# checked whole above; the native CPU bucket's is native.step_native_bucket; plan.update_of makes an Update from a
# record.)
_RECORD_ONLY_FUNCTIONS = {
    "lowmemopt/pipeline/native.py": ["step_native_bucket"],
    "lowmemopt/pipeline/plan.py": ["update_of"],
}


def _function_group_reads(path: Path, names: list[str]) -> list[str]:
    """:func:`_group_reads` of the functions ``names`` of ``path`` (each must exist)."""
    import ast

    tree = ast.parse(path.read_text())
    found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert set(names) <= found.keys(), f"{path}: no function {sorted(set(names) - found.keys())}"
    out = []
    for name in names:
        for node in ast.walk(found[name]):
            got = (
                node.arg
                if isinstance(node, ast.arg)
                else node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else None
            )
            if got == "group":
                out.append(f"{name}:{node.lineno} group")
    return out


def test_no_backend_function_reads_a_param_group():
    for path, names in _RECORD_ONLY_FUNCTIONS.items():
        assert _function_group_reads(ROOT / path, names) == [], path


def test_the_function_group_check_can_fail(tmp_path):
    (tmp_path / "mixed.py").write_text(
        "def stage(p, group):\n    return backend(p, group['lr'])\n\n\n"
        "def backend(p, lr, it=None):\n    return p * lr + it.group['wd']\n"
    )
    assert _function_group_reads(tmp_path / "mixed.py", ["backend"]) == ["backend:6 group"]
    assert _function_group_reads(tmp_path / "mixed.py", ["stage"]) == ["stage:1 group", "stage:2 group"]
    with pytest.raises(AssertionError, match="no function"):
        _function_group_reads(tmp_path / "mixed.py", ["missing"])


# The projection stage is typed (docs/pipeline.md, "The plan, and the layers"): Plan.galore is annotated with the
# protocol the pipeline defines, not Any, and GaLore's stage object has each of its operations with its parameters.
def _stage_problems(plan_cls: type, field_name: str, protocol: type, stage: object) -> list[str]:
    """What keeps ``plan_cls.<field_name>`` from being a typed stage: its resolved annotation must be ``protocol |
    None`` with ``protocol`` a ``typing.Protocol``, and ``stage`` must have each public method of ``protocol`` with
    the same parameters (after ``self``)."""
    import inspect
    import types
    import typing

    problems = []
    hint = typing.get_type_hints(plan_cls).get(field_name)
    if typing.get_origin(hint) not in (typing.Union, types.UnionType) or set(typing.get_args(hint)) != {
        protocol,
        type(None),
    }:
        problems.append(f"{plan_cls.__name__}.{field_name} is annotated {hint!r}, not {protocol.__name__} | None")
    if not getattr(protocol, "_is_protocol", False):
        problems.append(f"{protocol.__name__} is not a typing.Protocol")
    for name, fn in vars(protocol).items():
        if name.startswith("_") or not callable(fn):
            continue
        want = list(inspect.signature(fn).parameters)[1:]
        have = getattr(stage, name, None)
        if have is None:
            problems.append(f"{type(stage).__name__} has no {name}")
        elif list(inspect.signature(have).parameters) != want:
            problems.append(
                f"{type(stage).__name__}.{name} takes {list(inspect.signature(have).parameters)}, the protocol {want}"
            )
    return problems


def test_the_projection_stage_is_typed():
    from lowmemopt.pipeline.plan import Plan, ProjectionStage
    from lowmemopt.projection.stage import GALORE

    assert _stage_problems(Plan, "galore", ProjectionStage, GALORE) == []
    assert len([n for n in vars(ProjectionStage) if not n.startswith("_")]) >= 15


class _Stage(Protocol):
    def project(self, items: list) -> None: ...

    def apply(self, items: list, flags: Any = None) -> None: ...


@dataclass
class _Untyped:
    galore: Any = None


@dataclass
class _Typed:
    galore: _Stage | None = None


class _Partial:
    def project(self, things: list) -> None: ...


def test_the_stage_check_can_fail():
    assert _stage_problems(_Untyped, "galore", _Stage, _Partial()) == [
        "_Untyped.galore is annotated typing.Any, not _Stage | None",
        "_Partial.project takes ['things'], the protocol ['items']",
        "_Partial has no apply",
    ]
    assert _stage_problems(_Typed, "galore", _Stage, _Partial()) == [
        "_Partial.project takes ['things'], the protocol ['items']",
        "_Partial has no apply",
    ]
