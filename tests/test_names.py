"""A public function or class name has one owner in the package: two modules that define the same public name make
a reader ask which one a call reaches. Exceptions: the per-module interfaces that a registry looks up by attribute
(each Triton kernel module's ``launch``, ``slots`` and ``compile_variants``), and the names still to be renamed,
listed below so that the list can only shrink."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: one function per kernel module, by design: kernels/registry.py and kernels/variants.py read them by attribute
INTERFACES = {"launch", "slots", "compile_variants"}
#: defined in two modules today, each to get a name of its own (never add to this list)
TO_RENAME = {
    "Slot",
    "applies",
    "code_book",
    "copy_files",
    "decode_into",
    "encode_into",
    "encode_table",
    "init_state",
    "step",
}


def shared_names(files: list[Path]) -> dict[str, list[str]]:
    """{name: modules} for each public top-level function or class defined in more than one of ``files``."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in files:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith(
                "_"
            ):
                where[node.name].append(str(path))
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_public_names_have_one_owner():
    files = sorted([*(ROOT / "lowmemopt").rglob("*.py"), *(ROOT / "kernels").glob("*.py")])
    shared = shared_names(files)
    new = sorted(set(shared) - INTERFACES - TO_RENAME)
    assert not new, {name: shared[name] for name in new}
    assert TO_RENAME <= set(shared), f"renamed, so off the list: {sorted(TO_RENAME - set(shared))}"
    assert "step_items" not in shared  # the three backends' entries are named for their backend


def test_the_name_check_can_fail(tmp_path):
    (tmp_path / "a.py").write_text("def step_items():\n    pass\n\n\ndef _private():\n    pass\n")
    (tmp_path / "b.py").write_text("class step_items:\n    pass\n\n\ndef _private():\n    pass\n")
    assert shared_names([tmp_path / "a.py", tmp_path / "b.py"]) == {
        "step_items": [str(tmp_path / "a.py"), str(tmp_path / "b.py")]
    }
