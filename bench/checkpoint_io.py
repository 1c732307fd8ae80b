"""Checkpoint cost: time and peak memory of ``lowmemopt.save_state`` and ``lowmemopt.load_state`` on a large state.

    cd /tmp && python /path/to/repo/bench/checkpoint_io.py                      # 750M elements at 8 bits: ~1.5 GB file
    cd /tmp && python /path/to/repo/bench/checkpoint_io.py --numel 2e8 --bits 32 --cold --dir /big/disk

Each save and each load runs in a fresh process (freed memory cannot hide a peak): an AdamW state of ``--numel``
elements in four parameters at ``--bits`` (random values, made without a step; the parameters are zeros that are never
touched, so never resident), then one ``save_state`` (or one ``load_state`` of that file into a fresh optimizer at the
same bits). Reported per round: seconds, and the growth of the peak resident set above the resident set just before the
call (``VmHWM`` reset by ``/proc/self/clear_refs``, Linux), and the process's CPU time (steadier than wall time on a
shared machine). Rounds alternate save and load; the table shows medians. With ``--cold``, the file's pages are dropped
from the page cache after each call (``posix_fadvise(DONTNEED)``) so a load reads what a cold resume reads from the
disk. One thread.

(Run from outside the repository root; see bench/README.md.)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def random_state(numel: int, bits: int, fill: bool):
    """An AdamW at ``bits`` over four zero parameters of ``numel / 4`` elements; ``fill``: with a random state (step 7),
    made without running a step (also the state of ``tests/load_rss_worker.py``)."""
    import lowmemopt

    params = [torch.nn.Parameter(torch.zeros(numel // 4)) for _ in range(4)]
    opt = lowmemopt.AdamW(params, state_bits=bits)
    if fill:
        gen = torch.Generator().manual_seed(0)
        group = opt.param_groups[0]
        for p in params:
            state = opt._init_state(p, group, opt._slots(group, p))
            state["step"] = 7
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.dtype == torch.uint8:
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
                elif isinstance(t, torch.Tensor):
                    t.copy_(torch.rand(t.shape, generator=gen))
    return opt


def _measured(call) -> dict[str, float]:
    from lowmemopt.memory import proc_status_bytes, reset_peak_rss

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    base = proc_status_bytes("VmRSS")
    reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    call()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dict(seconds=seconds, cpu_s=cpu, peak_growth=proc_status_bytes("VmHWM") - base)


def worker(what: str, numel: int, bits: int, path: str, cold: bool) -> None:
    import lowmemopt
    from lowmemopt.benchmark import drop_from_page_cache

    torch.set_num_threads(1)
    if what == "save":
        opt = random_state(numel, bits, fill=True)
        out = _measured(lambda: lowmemopt.save_state(opt, path))
    else:
        warm = path + ".warm"  # code pages and codec tables first: they do not grow with the state
        lowmemopt.save_state(random_state(1 << 16, bits, fill=True), warm)
        lowmemopt.load_state(random_state(1 << 16, bits, fill=False), warm)
        os.unlink(warm)
        opt = random_state(numel, bits, fill=False)
        out = _measured(lambda: lowmemopt.load_state(opt, path))
    if cold:
        drop_from_page_cache(path)
    out.update(state_bytes=opt.state_nbytes(), file_bytes=os.path.getsize(path))
    print(json.dumps(out))


def _run(what: str, numel: int, bits: int, path: str, cold: bool) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", what, str(numel), str(bits), path, str(int(cold))],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=float, default=7.5e8, help="state elements (default 7.5e8)")
    parser.add_argument("--bits", type=int, default=8, choices=[32, 16, 8, 4], help="state_bits (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="save + load rounds (default 3)")
    parser.add_argument("--dir", help="where the file goes (default: a temporary directory)")
    parser.add_argument("--cold", action="store_true", help="drop the file from the page cache after each call")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        what, numel, bits, path, cold = args.worker
        return worker(what, int(numel), int(bits), path, cold == "1")
    numel = int(args.numel) // 4 * 4
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "state.safetensors")
        rounds = []
        for _ in range(args.rounds):
            rounds.append(
                (_run("save", numel, args.bits, path, args.cold), _run("load", numel, args.bits, path, args.cold))
            )
    save, load = [r[0] for r in rounds], [r[1] for r in rounds]
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    state = save[0]["state_bytes"]
    print(
        f"AdamW state_bits={args.bits}, {numel:,} elements: state {state / 1e9:.3f} GB, file "
        f"{save[0]['file_bytes'] / 1e9:.3f} GB; median of {args.rounds} rounds (each in a fresh process)"
    )
    print("| call | seconds | CPU seconds | peak RSS growth | growth / state |")
    print("| --- | --- | --- | --- | --- |")
    for name, rows in (("save_state", save), ("load_state", load)):
        growth = med(rows, "peak_growth")
        print(
            f"| {name} | {med(rows, 'seconds'):.2f} | {med(rows, 'cpu_s'):.2f} | {growth / 1e9:.3f} GB | "
            f"{growth / state:.3f}x |"
        )
    print(
        "rounds:",
        json.dumps(
            [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for pair in rounds for r in pair]
        ),
    )


if __name__ == "__main__":
    main()
