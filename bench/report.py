"""The GPU check's report (``scripts/gpu-check``): one markdown file from the outputs the check leaves in its work
folder. Standard library only (``env`` also reads torch and triton if they import), so it runs, and is tested, anywhere.

    python bench/report.py env > WORK/env.json                  # GPU, driver, torch, triton, anchor libraries
    python bench/report.py assemble WORK --out report.md        # WORK/parts.tsv + the files it names -> report.md

``WORK/parts.tsv`` has one line per part that ran, tab-separated: ``kind name exit_code seconds command``, with kind
``tests`` (pytest wrote ``WORK/tests-<name>.xml``, a JUnit file, and ``WORK/tests-<name>.log``) or ``bench`` (the
script's stdout, already markdown, in ``WORK/bench-<name>.md``, its stderr in ``WORK/bench-<name>.log``) or ``note``
(the command column is the text). ``WORK/plan.tsv`` has one line per part the check meant to run, in order:
``name cap_seconds command``; the report's plan table gives each its cap, its time and whether it finished, was cut
at its cap or was not run. A part that crashed or timed out is reported with its exit code and the end of its log; the
report is written whatever happened.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

#: libraries the benchmarks compare against; a missing one only removes its rows
ANCHORS = ("bitsandbytes", "torchao", "galore-torch", "came-pytorch", "transformers", "lion-pytorch")
TIMEOUT_CODES = {124: "timed out", 137: "killed (timeout or out of memory)"}


# ---------------------------------------------------------------------------------------------------------------------
# environment


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> dict[str, str]:
    try:
        out = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    if not out:
        return {}
    name, driver, memory = [x.strip() for x in (out[0].split(",") + ["", "", ""])[:3]]
    return dict(smi_name=name, driver=driver, smi_memory=memory)


def collect_env() -> dict[str, object]:
    env: dict[str, object] = dict(
        python=platform.python_version(), platform=platform.platform(), cpu_count=os.cpu_count(), **_nvidia_smi()
    )
    try:
        import torch

        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env.update(
                gpu=props.name,
                gpu_memory_gib=round(props.total_memory / 2**30, 1),
                capability=f"{props.major}.{props.minor}",
                sms=props.multi_processor_count,
                gpu_count=torch.cuda.device_count(),
            )
    except Exception as exc:  # noqa: BLE001 - the report says what is missing
        env["torch"] = f"not importable ({type(exc).__name__}: {exc})"
    env["triton"] = _version("triton") or "not installed"
    env["lowmemopt"] = _version("lowmemopt") or "not installed"
    env["anchors"] = {name: _version(name) for name in ANCHORS}
    return env


# ---------------------------------------------------------------------------------------------------------------------
# parts


@dataclass
class Part:
    kind: str
    name: str
    rc: int
    seconds: float
    command: str


@dataclass
class TestSummary:
    tests: int = 0
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    failing: list[tuple[str, str]] = field(default_factory=list)  # (test id, first line of the message)


def read_parts(work: str) -> list[Part]:
    """The parts in the order they first ran; a part run again (same kind and name: a later run into the same work
    folder) keeps its last entry."""
    parts: dict[tuple[str, str], Part] = {}
    path = os.path.join(work, "parts.tsv")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        for line in fh:
            cols = line.rstrip("\n").split("\t")
            if len(cols) < 5:
                continue
            kind, name, rc, seconds, command = cols[0], cols[1], cols[2], cols[3], "\t".join(cols[4:])
            key = (kind, command if kind == "note" else name)
            parts[key] = Part(kind, name, int(rc or 0), float(seconds or 0), command)
    return list(parts.values())


def _test_id(case: ET.Element) -> str:
    """pytest's node id from a JUnit testcase (``classname`` ``tests.test_x`` or ``tests.test_x.TestClass``)."""
    classname, name = case.get("classname", ""), case.get("name", "")
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that names a module file
        if parts[i - 1].startswith("test"):
            module = "/".join(parts[:i]) + ".py"
            rest = parts[i:]
            return "::".join([module, *rest, name])
    return f"{classname}::{name}" if classname else name


def parse_junit(path: str) -> TestSummary:
    """Counts and failing test ids of one pytest JUnit file (one or several ``testsuite`` elements)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    s = TestSummary()
    for suite in suites:
        s.seconds += float(suite.get("time", 0) or 0)
        for case in suite.iter("testcase"):
            s.tests += 1
            bad = case.find("failure")
            kind = "failed"
            if bad is None:
                bad, kind = case.find("error"), "errors"
            if bad is not None:
                setattr(s, kind, getattr(s, kind) + 1)
                message = (bad.get("message") or bad.text or "").strip().splitlines()
                s.failing.append((_test_id(case), message[0][:200] if message else ""))
            elif case.find("skipped") is not None:
                s.skipped += 1
            else:
                s.passed += 1
    return s


def _tail(path: str, n: int = 15) -> str:
    if not os.path.exists(path):
        return "(no log)"
    with open(path, errors="replace") as fh:
        lines = fh.read().rstrip().splitlines()
    return "\n".join(lines[-n:]) or "(empty log)"


def _status(rc: int) -> str:
    return "ok" if rc == 0 else f"exit {rc}" + (f" ({TIMEOUT_CODES[rc]})" if rc in TIMEOUT_CODES else "")


def _demote(markdown: str, levels: int = 2) -> str:
    """Headings of an embedded bench output moved ``levels`` down, under the report's own."""
    return re.sub(r"^(#{1,4}) ", lambda m: "#" * min(6, len(m.group(1)) + levels) + " ", markdown, flags=re.M)


def _fence(text: str) -> str:
    return "```\n" + text.replace("```", "'''") + "\n```"


# ---------------------------------------------------------------------------------------------------------------------
# report


def env_section(env: dict) -> list[str]:
    if not env:
        return ["(environment not recorded)"]
    gpu = env.get("gpu") or env.get("smi_name") or "none visible"
    if env.get("gpu_memory_gib"):
        gpu += f", {env['gpu_memory_gib']} GiB, compute capability {env.get('capability')}, {env.get('sms')} SMs"
        if env.get("gpu_count", 1) > 1:
            gpu += f" ({env['gpu_count']} GPUs; the check uses one)"
    anchors = env.get("anchors", {})
    rows = [
        ("GPU", gpu),
        ("driver", env.get("driver") or "unknown"),
        ("torch", f"{env.get('torch')} (CUDA {env.get('torch_cuda')})"),
        ("triton", _triton_row(env.get("triton"))),
        ("python", f"{env.get('python')} on {env.get('platform')}, {env.get('cpu_count')} CPUs"),
        ("lowmemopt", env.get("lowmemopt")),
        (
            "anchor libraries",
            "; ".join(f"{k} {v}" if v else f"{k} not installed (its rows are skipped)" for k, v in anchors.items())
            or "none checked",
        ),
    ]
    return ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows]


def _triton_row(version: str | None) -> str | None:
    """The Triton version, with a caution before 3.7: it lays a tile's gathers out rows-first, so the kernels that keep
    row tiles there make shared-memory round trips (docs/kernels.md, "Triton versions"): their times are not 3.7's."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    if match and (int(match[1]), int(match[2])) < (3, 7):
        return (
            f"{version} (before 3.7: 8-bit AdamW/SGD/Lion/LAMB/LARS take column tiles; the 4-bit and "
            'Adafactor/CAME kernels make shared-memory round trips; docs/kernels.md, "Triton versions")'
        )
    return version


def read_plan(work: str) -> list[tuple[str, int, str]]:
    """``(name, cap in seconds, command)`` of each part the check meant to run, in order (a part planned again by a
    later run into the same work folder keeps its first place and its last entry)."""
    plan: dict[str, tuple[str, int, str]] = {}
    path = os.path.join(work, "plan.tsv")
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                cols = line.rstrip("\n").split("\t")
                if len(cols) >= 3 and cols[1].isdigit():
                    plan[cols[0]] = (cols[0], int(cols[1]), "\t".join(cols[2:]))
    return list(plan.values())


def plan_section(plan: list[tuple[str, int, str]], parts: list[Part]) -> list[str]:
    """The plan as a table: each part's cap, the seconds it took and how it ended (ok, exit N, cut at its cap, not
    run: too little of the deadline left)."""
    ran = {p.name: p for p in parts if p.kind in ("tests", "bench")}
    lines = ["| part | command | cap (s) | took (s) | result |", "| --- | --- | ---: | ---: | --- |"]
    for name, cap, command in plan:
        p = ran.get(name)
        if p is None:
            result, took = "not run (too little of the deadline left)", "—"
        else:
            result = ("cut at its cap: " if p.rc == 124 else "") + _status(p.rc)
            took = f"{p.seconds:.0f}"
        lines.append(f"| {name} | `{command}` | {cap} | {took} | {result} |")
    return lines


def tests_section(work: str, parts: list[Part]) -> tuple[list[str], bool]:
    """The test table and failing ids; True if any test failed or a run gave no result."""
    lines = [
        "| run | result | passed | failed | errors | skipped | time (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    failing, bad = [], False
    for p in parts:
        xml = os.path.join(work, f"tests-{p.name}.xml")
        if not os.path.exists(xml):
            bad = True
            lines.append(f"| `{p.command}` | no result: {_status(p.rc)} | — | — | — | — | {p.seconds:.0f} |")
            failing.append((p.name, None, _tail(os.path.join(work, f"tests-{p.name}.log"))))
            continue
        s = parse_junit(xml)
        # pytest exits 5 when nothing was collected (e.g. no slow GPU tests): not a failure
        result = "passed" if s.failed == s.errors == 0 and p.rc in (0, 5) else _status(p.rc)
        if s.tests == 0 and p.rc == 5:
            result = "no tests selected"
        bad |= s.failed > 0 or s.errors > 0 or p.rc not in (0, 5)
        lines.append(
            f"| `{p.command}` | {result} | {s.passed} | {s.failed} | {s.errors} | {s.skipped} | {p.seconds:.0f} |"
        )
        for test_id, message in s.failing:
            failing.append((p.name, test_id, message))
    if not parts:
        lines = ["(tests not run)"]
    if failing:
        lines += ["", "Failing tests:", ""]
        for run, test_id, message in failing:
            if test_id is None:
                lines += [f"- run `{run}` produced no JUnit file; the end of its log:", "", _fence(message)]
            else:
                lines.append(f"- `{test_id}`" + (f": {message}" if message else ""))
    return lines, bad


def bench_section(work: str, parts: list[Part]) -> tuple[list[str], bool]:
    lines, bad = [], False
    for p in parts:
        lines += [f"### {p.name}", "", f"`{p.command}`: {_status(p.rc)}, {p.seconds:.0f} s", ""]
        out = os.path.join(work, f"bench-{p.name}.md")
        body = open(out, errors="replace").read().strip() if os.path.exists(out) else ""
        if body:
            lines += [_demote(body, 3), ""]
        if p.rc != 0:
            bad = True
            lines += ["The end of its log:", "", _fence(_tail(os.path.join(work, f"bench-{p.name}.log"))), ""]
        elif not body:
            lines += ["(no output)", ""]
    return lines or ["(benchmarks not run)"], bad


def assemble(work: str, title: str = "lowmemopt GPU check") -> tuple[str, bool, bool]:
    """The report's markdown; (text, tests failed, a benchmark failed)."""
    parts = read_parts(work)
    env = {}
    env_path = os.path.join(work, "env.json")
    if os.path.exists(env_path):
        try:
            env = json.load(open(env_path))
        except ValueError:
            env = {}
    meta = {}
    meta_path = os.path.join(work, "meta.json")
    if os.path.exists(meta_path):
        meta = json.load(open(meta_path))
    tests, tests_bad = tests_section(work, [p for p in parts if p.kind == "tests"])
    benches, bench_bad = bench_section(work, [p for p in parts if p.kind == "bench"])
    notes = [p.command for p in parts if p.kind == "note"]
    verdict = "tests FAILED" if tests_bad else "all tests passed"
    if bench_bad:
        verdict += "; a benchmark failed (see below)"
    head = [f"# {title}", ""]
    for key in ("date", "commit", "mode", "command"):
        if meta.get(key):
            head.append(f"- {key}: {meta[key]}")
    head += [f"- result: **{verdict}**", ""]
    if notes:
        head += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    plan = read_plan(work)
    if plan:
        head += ["## Plan", ""] + plan_section(plan, parts) + [""]
    text = (
        "\n".join(
            head
            + ["## Environment", ""]
            + env_section(env)
            + ["", "## Tests", ""]
            + tests
            + ["", "## Benchmarks", ""]
            + benches
        )
        + "\n"
    )
    return text, tests_bad, bench_bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="print the environment as JSON")
    a = sub.add_parser("assemble", help="write the report from a work folder")
    a.add_argument("work")
    a.add_argument("--out", required=True)
    m = sub.add_parser("meta", help="write WORK/meta.json (date, commit, mode, command)")
    m.add_argument("work")
    m.add_argument("--mode", default="")
    m.add_argument("--command", default="")
    m.add_argument("--repo", default=".")
    args = ap.parse_args(argv)
    if args.cmd == "env":
        json.dump(collect_env(), sys.stdout, indent=1)
        print()
        return 0
    if args.cmd == "meta":
        try:
            commit = subprocess.run(
                ["git", "-C", args.repo, "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
        meta = dict(
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            commit=commit or "unknown",
            mode=args.mode,
            command=args.command,
        )
        with open(os.path.join(args.work, "meta.json"), "w") as fh:
            json.dump(meta, fh)
        return 0
    text, tests_bad, _ = assemble(args.work)
    with open(args.out, "w") as fh:
        fh.write(text)
    return 1 if tests_bad else 0


if __name__ == "__main__":
    sys.exit(main())
