"""Docstrings say what and where; the rationale lives in docs/ (scripts/docstring-ratio counts it): docstring lines
stay at most 0.12 of the other lines of lowmemopt/ and kernels/, and no module's own docstring runs over 15 lines."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _counter():
    loader = importlib.machinery.SourceFileLoader("docstring_ratio", str(ROOT / "scripts" / "docstring-ratio"))
    spec = importlib.util.spec_from_loader("docstring_ratio", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_docstrings_stay_concise():
    doc, other, long = _counter().count(ROOT)
    assert doc / other <= 0.12, f"docstring lines {doc} / other lines {other} = {doc / other:.3f}"
    assert not long, f"module docstrings over 15 lines: {long}"


def test_the_docstring_count_can_fail(tmp_path):
    for root in ("lowmemopt", "kernels"):
        (tmp_path / root).mkdir()
    (tmp_path / "kernels" / "k.py").write_text("x = 1\n")
    essay = (
        '"""' + "\n".join(f"line {i}" for i in range(20)) + '\n"""\n\n\ndef f():\n    """One line."""\n    return 1\n'
    )
    (tmp_path / "lowmemopt" / "m.py").write_text(essay)
    doc, other, long = _counter().count(tmp_path)
    assert doc == 21 and long == [(20, "lowmemopt/m.py")]
    assert doc / other > 0.12
