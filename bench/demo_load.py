"""``lowmemopt demo`` on an idle and on a loaded machine: wall and CPU time under each OpenMP wait policy, and CAME
8-bit's step against AdamW 8-bit's on the demo LLaMA, paired.

    cd /tmp && python /path/to/lowmemopt/bench/demo_load.py                     # demo, idle and loaded, each policy
    cd /tmp && python /path/to/lowmemopt/bench/demo_load.py --part step --rounds 16

``--part demo``: runs ``lowmemopt demo --steps N --optimizers LIST`` in a fresh process per run under each of
:data:`POLICIES` (OpenMP's waiting), idle and beside ``--busy`` processes that each keep one core busy (default: one
per core), the policies alternating, ``--repeat`` times. Wall time, and the demo process's own CPU time (user +
system, from its ``wait4`` rusage: the busy processes are not counted). ``--part step``: CAME 8-bit and AdamW 8-bit
on the parameters of the demo's LLaMA (``lowmemopt.demo.LLAMA_BYTES``), fixed gradients, stepped alternately,
``--rounds`` rounds of 5 steps each; the median of the per-round ratios of wall time. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

#: (label, the OpenMP variables of the run; None: unset): the demo's own choice, sleep at once, libgomp's default
#: (spin ~300k rounds, then sleep), a short spin (GOMP_SPINCOUNT: the rounds a waiting thread spins before it sleeps)
POLICIES = (
    ("the demo's choice (by the load it finds)", {"OMP_WAIT_POLICY": None}),
    ("`OMP_WAIT_POLICY=PASSIVE`", {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("libgomp's default (unset)", {"OMP_WAIT_POLICY": ""}),
    ("`GOMP_SPINCOUNT=20000`", {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "20000"}),
)


def busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes that each keep one core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_demo(steps: int, optimizers: str, policy: dict[str, str], out: str) -> tuple[float, float]:
    """``(wall s, CPU s)`` of one ``lowmemopt demo`` run with the OpenMP variables ``policy``."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", *policy)}
    env |= {k: v for k, v in policy.items() if v is not None}
    cmd = [sys.executable, "-c", "import sys; from lowmemopt.cli import main; sys.exit(main(sys.argv[1:]))"]
    cmd += ["demo", "--steps", str(steps)]
    cmd += ["--optimizers", optimizers, "--out", out]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"demo failed ({status}): {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def demo_table(steps: int, optimizers: str, repeat: int, loads: list[int], policies=POLICIES) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for load in loads:
            times: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in policies}
            for r in range(repeat):
                hogs = busy(load)
                try:
                    for label, policy in policies if r % 2 == 0 else policies[::-1]:
                        times[label].append(run_demo(steps, optimizers, policy, out))
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
            for label, _ in policies:
                walls = ", ".join(f"{w:.0f} s" for w, _ in times[label])
                cpus = ", ".join(f"{c:.0f} s" for _, c in times[label])
                rows.append(f"| {'idle' if not load else f'{load} busy processes'} | {label} | {walls} | {cpus} |")
    print(f"\n`lowmemopt demo --steps {steps} --optimizers {optimizers}`, {os.cpu_count()} CPUs\n")
    print("| machine | OpenMP's waiting | wall time | CPU time (the demo's) |\n| --- | --- | --- | --- |")
    print("\n".join(rows))


def step_table(rounds: int, steps: int = 5) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # (before torch: as the demo runs)
    from lowmemopt.cli.noise import quiet_import_noise

    quiet_import_noise()  # (torchao's, imported by transformers' model code)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import lowmemopt
    from lowmemopt.demo import LLAMA_BYTES

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_BYTES))
    makers = {
        "AdamW 8-bit": lambda ps: lowmemopt.AdamW(ps, lr=2e-3, weight_decay=0.01, state_bits=8),
        "CAME 8-bit": lambda ps: lowmemopt.CAME(ps, lr=2e-4, weight_decay=0.01, state_bits=8),
    }
    opts = {}
    for name, make in makers.items():
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-2
        opts[name] = make(params)
        opts[name].step()  # (state made)
    ratios = []
    for r in range(rounds):
        took = {}
        for name in list(opts) if r % 2 == 0 else list(opts)[::-1]:
            start = time.perf_counter()
            for _ in range(steps):
                opts[name].step()
            took[name] = (time.perf_counter() - start) / steps
        ratios.append(took["CAME 8-bit"] / took["AdamW 8-bit"])
    n = sum(p.numel() for p in model.parameters())
    threads = torch.get_num_threads()
    print(f"\nThe demo LLaMA ({n / 1e6:.2f}M parameters), {rounds} rounds of {steps} steps, {threads} threads")
    print("\n| CAME 8-bit / AdamW 8-bit step | median of the per-round ratios | range |\n| --- | ---: | --- |")
    print(f"| wall time | {statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["demo", "step", "both"], default="both")
    ap.add_argument("--policies", default="", help="comma-separated indices into POLICIES (default: all)")
    ap.add_argument("--steps", type=int, default=100, help="demo training steps per optimizer (default 100)")
    ap.add_argument("--optimizers", default="adamw,adamw8bit,came8bit,galore_came8bit", help="the demo's (default)")
    ap.add_argument("--repeat", type=int, default=1, help="demo runs per policy and load (default 1)")
    ap.add_argument("--busy", type=int, default=os.cpu_count(), help="busy processes of the loaded runs")
    ap.add_argument("--rounds", type=int, default=16, help="paired rounds of the step ratio (default 16)")
    args = ap.parse_args()
    if args.part in ("demo", "both"):
        chosen = [POLICIES[int(i)] for i in args.policies.split(",")] if args.policies else POLICIES
        demo_table(args.steps, args.optimizers, args.repeat, [0, args.busy], chosen)
    if args.part in ("step", "both"):
        step_table(args.rounds)


if __name__ == "__main__":
    main()
