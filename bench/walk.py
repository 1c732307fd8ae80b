"""Count the walk of one steady ``step()``: the calls between lowmemopt's modules, from ``LowMemOptimizer.step`` down
through the plan, the stages and the backends, recorded with ``sys.setprofile``.

    cd /tmp && python /path/to/repo/bench/walk.py                                # AdamW 8-bit (native CPU bucket),
                                                                                 # CAME 8-bit (per-tensor path)
    cd /tmp && python /path/to/repo/bench/walk.py --optimizer Lion --bits 4 --list

Over the step (after two warm-up steps), every Python call from one lowmemopt module into another while
``LowMemOptimizer.step`` is on the stack is a *stop*. A stop is a *climb* when the callee lies in a higher layer than
the caller (the layers of the ``layers`` import-linter contract in pyproject.toml, e.g. a callback of the pipeline
called from a backend), and a *return* when the callee is a module the walk already entered and left (it is not on the
stack). Calls within one module, into torch or C, and returns from calls are not stops. ``--list``: each stop, indented
by depth. (Run from outside the repository root; see bench/README.md.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def layers() -> list[list[str]]:
    """The ``layers`` contract's layers, highest first, each a list of its packages / modules."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["id"] == "layers":
            return [[m.strip() for m in layer.split("|")] for layer in contract["layers"]]
    raise SystemExit("pyproject.toml has no 'layers' contract")


def layer_of(module: str, table: list[list[str]]) -> int:
    """The index of ``module``'s layer (0: the highest); len(table) for a module in none."""
    for i, layer in enumerate(table):
        if any(module == m or module.startswith(m + ".") for m in layer):
            return i
    return len(table)


def walk(step, entry: tuple[str, str] = ("lowmemopt.optimizer", "step")) -> list[tuple[int, str, str]]:
    """``(depth, caller module, callee module.function)`` of each stop of ``step()`` (module docstring), counted
    while ``entry`` (module, function) is on the stack."""
    import lowmemopt

    files: dict[str, str] = {}

    def module_of(filename: str) -> str | None:
        name = files.get(filename)
        if name is None:
            name = ""
            for mod_name, mod in list(sys.modules.items()):
                if mod_name.startswith("lowmemopt") and getattr(mod, "__file__", None) == filename:
                    name = mod_name
                    break
            files[filename] = name
        return name or None

    stops: list[tuple[int, str, str]] = []
    stack: list[str] = []  # the lowmemopt module of each lowmemopt frame on the stack, while the entry runs
    active = [False]

    def profile(frame, event, arg):
        if event == "call":
            mod = module_of(frame.f_code.co_filename)
            if mod is None:
                return
            if not active[0]:
                if mod == entry[0] and frame.f_code.co_name == entry[1]:
                    active[0] = True
                    stack.append(mod)
                    stops.append((0, "", f"{mod}.{entry[1]}"))
                return
            if stack[-1] != mod:
                stops.append((len(stack), stack[-1], f"{mod}.{frame.f_code.co_name}"))
            stack.append(mod)
        elif event == "return" and active[0]:
            mod = module_of(frame.f_code.co_filename)
            if mod is None:
                return
            stack.pop()
            if not stack:
                active[0] = False

    del lowmemopt
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return stops


def count(stops: list[tuple[int, str, str]]) -> dict[str, int]:
    """Stops, climbs (into a higher layer) and returns (into a module entered and left before)."""
    table = layers()
    climbs = returns = 0
    entered: set[str] = set()
    on_stack: list[str] = []
    for depth, caller, callee in stops:
        mod = callee.rsplit(".", 1)[0]
        del on_stack[depth:]
        if caller and layer_of(mod, table) < layer_of(caller, table):
            climbs += 1
        if mod in entered and mod not in on_stack:
            returns += 1
        entered.add(mod)
        on_stack.append(mod)
    return {"stops": len(stops), "climbs": climbs, "returns": returns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", action="append", help="lowmemopt class (repeatable; default AdamW and CAME)")
    ap.add_argument("--bits", type=int, default=8, help="state_bits (default 8)")
    ap.add_argument("--params", type=int, default=4, help="parameters (matrices 64x96, default 4)")
    ap.add_argument("--list", action="store_true", help="print each stop")
    ap.add_argument("--tree", help="import lowmemopt from this source tree (e.g. an older checkout) instead")
    ap.add_argument(
        "--triton",
        action="store_true",
        help="the Triton path (CUDA's) under the interpreter: a steady step that takes the kept program, "
        "and one without it",
    )
    args = ap.parse_args()
    if args.triton:  # (before Triton is imported)
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]  # (the repo's kernels/ folder shadows)
    if args.tree:  # (the editable install's finder would map lowmemopt.kernels to its own tree)
        sys.meta_path[:] = [
            f for f in sys.meta_path if "editable" not in type(f).__module__ + getattr(f, "__name__", "")
        ]
        sys.path.insert(0, args.tree)
    import lowmemopt

    if args.tree:
        lowmemopt.__path__.append(args.tree)
        assert Path(lowmemopt.__file__).resolve().is_relative_to(Path(args.tree).resolve()), lowmemopt.__file__

    import contextlib

    gate = contextlib.nullcontext()
    if args.triton:  # launches build their tables only, as bench/host_overhead.py gates them (no kernel bodies run)
        from host_overhead import _stub_launches

        from lowmemopt.kernels import runtime

        _stub_launches()
        gate = runtime.cpu_interpreter()
    for name in args.optimizer or ["AdamW", "CAME"]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 96)) for _ in range(args.params)]
        cls = getattr(lowmemopt, name)
        try:
            opt = cls(params, lr=1e-3, state_bits=args.bits)
        except ValueError:  # (Adafactor: a manual lr needs relative_step=False; its default schedule then)
            opt = cls(params, state_bits=args.bits)
        for p in params:
            p.grad = torch.randn_like(p)
        with gate:
            for _ in range(2):
                opt.step()
            walks = [("CPU", walk(opt.step))]
            if args.triton:
                walks = [("Triton, kept program", walk(opt.step))]
                opt._program = None  # (the pipeline's walk: a step no program covers)
                walks.append(("Triton, pipeline", walk(opt.step)))
        for label, stops in walks:
            c = count(stops)
            print(
                f"{name} {args.bits}-bit, {args.params} parameters, {label}: {c['stops']} stops, {c['climbs']} "
                f"climbs back up, {c['returns']} returns to a module already left"
            )
            if args.list:
                for depth, caller, callee in stops:
                    print(f"  {'  ' * depth}{callee}   (from {caller})" if caller else f"  {callee}")


if __name__ == "__main__":
    os.environ.setdefault("LOWMEMOPT_COMPILE", "0")
    main()
