"""README's examples run as written, and each shows that it worked by printing something."""

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)
    silent = []
    for code in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), {})
        if not out.getvalue().strip():
            silent.append(code.splitlines()[2] if len(code.splitlines()) > 2 else code)
    assert (tmp_path / "opt.pt").exists()
    assert not silent, f"README examples that print nothing (a reader cannot tell they worked): {silent}"


def test_quickstart_example_runs(tmp_path):
    assert "examples/quickstart.py" in README.read_text()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| lowmemopt.") or "torch.optim" in line]
    assert len(rows) == 6 and "3 steps" in proc.stdout


def test_readme_install_lines_keep_the_users_torch_and_say_what_the_tests_cost():
    """The demo's install line does not pin torch (a pinned torch from PyPI replaces a CPU user's torch with the CUDA
    build); the test section says the environment's size and the run's time before a user starts it."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    demo = text.split("### See it work: the demo", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert "lowmemopt demo" in demo and "torch==" not in demo, demo
    tests = text.split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"about 2\.5 GB", tests) and re.search(r"about \d+ minutes", tests), tests


def test_readme_says_what_of_the_demo_carries_over_to_other_cpus():
    """The demo's losses are quoted with what a user on another CPU should expect: the same digits on the same
    CPU, a measured spread elsewhere, and the 8-bit-minus-32-bit gap as what carries over."""
    text = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    demo = text.split("### See it work: the demo", 1)[1].split("## Choosing an optimizer", 1)[0]
    assert "digit for digit" in demo and "2.1094 / 2.0791" in demo and "8-bit-minus-32-bit gap" in demo
    assert "differ a little from one CPU" not in demo
