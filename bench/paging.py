"""Paged optimizer state: memory and step time of lowmemopt's paged AdamW (disk and host-RAM tiers) against the same
optimizer unpaged and, on a GPU, bitsandbytes' PagedAdamW8bit / PagedAdamW, in one run.

    cd /tmp && python /path/to/repo/bench/paging.py --small          # CPU, ~11M parameters: RSS and step time
    cd /tmp && python /path/to/repo/bench/paging.py                  # CPU, ~148M parameters
    cd /tmp && python /path/to/repo/bench/paging.py --device cuda    # GPU: device memory and step time
    cd /tmp && python /path/to/repo/bench/paging.py --disk-floor --offload-dir /scratch   # CPU: disk tier vs its floor
    cd /tmp && python /path/to/repo/bench/paging.py --disk-floor --cold --offload-dir /scratch   # ... read from disk

CPU: each configuration runs in its own process (so one's freed memory cannot hide another's peak) on a LLaMA-style
model with fixed random gradients. Reported: the optimizer state's size, the process's RSS above the model + gradients
after the warm-up steps, its peak during the timed steps (``VmHWM`` reset by ``/proc/self/clear_refs``), the median
step time, and the median process CPU time per step (all threads: less sensitive than wall time to other work on a
shared machine). ``--disk-floor``: the disk tier against a plain read + write of the same bytes, paired rounds in one
process (:func:`disk_floor`; with ``--cold`` the files are read from the disk, not the page cache). GPU: the same model
on the device; the ``cpu`` and ``disk`` rows get a budget of ``--budget-frac`` of the unpaged state (default 0:
everything pages), the ``auto`` row ``page_budget_bytes="auto"``. Reported: device memory held between steps by the
optimizer (torch's allocator), the peak during a step, the device's own used-memory (``cudaMemGetInfo``, which also sees
bitsandbytes' managed memory), the median step time, and beside each paged row its floor: the bytes it moves each way at
the copy bandwidth measured at the start of the run, one direction at a time and both at once. Without CUDA,
``--device cuda`` stops with an error.

(Run from outside the repository root; see bench/README.md.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from lowmemopt.memory import proc_status_bytes, reset_peak_rss

from common import LLAMA_PRESETS, build_llama, drop_from_page_cache, fixed_grads, fresh_params, machine_info, time_steps

CPU_CONFIGS = ["unpaged", "disk", "cpu"]
GPU_CONFIGS = ["unpaged", "cpu", "disk", "auto", "bnb-unpaged", "bnb-paged"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--small", action="store_true", help="~11M-parameter model instead of ~148M")
    parser.add_argument("--bits", type=int, default=8, choices=[32, 16, 8], help="state_bits (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument(
        "--configs",
        help="comma-separated subset (CPU: " + ", ".join(CPU_CONFIGS) + "; GPU: " + ", ".join(GPU_CONFIGS) + ")",
    )
    parser.add_argument(
        "--offload-dir",
        help="directory for the disk tier (default: a new one under the system's "
        "temporary directory; use a real disk: /tmp may be RAM-backed)",
    )
    parser.add_argument(
        "--budget-frac",
        type=float,
        default=0.0,
        help="GPU: page_budget_bytes of the cpu and disk rows as a fraction of the unpaged state\n"
        "(default 0: everything pages; the auto row has page_budget_bytes='auto')",
    )
    parser.add_argument(
        "--disk-floor",
        action="store_true",
        help="CPU: the disk tier against its floor, in one process: paired rounds of a paged step,\n"
        "an unpaged step and a plain pread + pwrite of the state's files",
    )
    parser.add_argument("--rounds", type=int, default=7, help="--disk-floor: rounds (default 7)")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="--disk-floor: the state's files dropped from the page cache (written out first) before\n"
        "each paged step and each floor: their reads come from the disk",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="CPU: run the configurations this many times, interleaved; report each one's best\n"
        "median (a shared machine's load changes between runs)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one CPU configuration, print JSON
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(
            "--device cuda: CUDA is not available on this machine; the GPU part needs a CUDA device "
            "(run without --device for the CPU part)"
        )
    known = GPU_CONFIGS if args.device.startswith("cuda") else CPU_CONFIGS
    args.config_list = [c.strip() for c in (args.configs or ",".join(known)).split(",") if c.strip()]
    unknown = [c for c in args.config_list if c not in known]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {known}")
    if args.steps < 1 or args.warmup < 0 or args.repeat < 1 or args.rounds < 1:
        parser.error("--steps, --repeat and --rounds must be >= 1, --warmup >= 0")
    return args


def _lowmemopt(params, config: str, bits: int, offload_dir: str | None, budget: int | str = 0):
    import lowmemopt

    if config == "auto":
        config, budget = "cpu", "auto"
    paging = {} if config == "unpaged" else dict(paged=config, offload_dir=offload_dir, page_budget_bytes=budget)
    return lowmemopt.AdamW(params, lr=1e-3, weight_decay=1e-2, state_bits=bits, **paging)


# ---------------------------------------------------------------------------------------------------------------------
# CPU: one process per configuration


def cpu_worker(args: argparse.Namespace) -> None:
    preset = "10m" if args.small else "150m"
    model = build_llama(preset)
    grads = fixed_grads(model)
    params = fresh_params([p.detach() for p in model.parameters()], grads)
    del model
    gc.collect()
    base = proc_status_bytes("VmRSS")
    opt = _lowmemopt(params, args.worker, args.bits, args.offload_dir)
    times, _ = time_steps(opt.step, steps=0, warmup=args.warmup, device=torch.device("cpu"))
    after_warmup = proc_status_bytes("VmRSS")
    reset_peak_rss()
    cpu_times = []

    def step():
        c0 = time.process_time()
        opt.step()
        cpu_times.append(time.process_time() - c0)

    times, note = time_steps(step, steps=args.steps, warmup=0, device=torch.device("cpu"))
    peak = proc_status_bytes("VmHWM")
    out = dict(
        config=args.worker,
        state_bytes=opt.state_nbytes(),
        n_params=sum(p.numel() for p in params),
        rss_after_warmup=after_warmup - base,
        peak_rss=peak - base,
        times_s=times,
        median_s=statistics.median(times),
        cpu_s=statistics.median(cpu_times),
        note=note,
    )
    opt.close()
    print(json.dumps(out))


def run_cpu(args: argparse.Namespace) -> list[dict]:
    runs: dict[str, list[dict]] = {c: [] for c in args.config_list}
    for _ in range(args.repeat):
        for config, result in zip(args.config_list, _run_cpu_once(args)):
            runs[config].append(result)
    results = []
    for config, rows in runs.items():
        ok = [r for r in rows if "error" not in r]
        best = min(ok, key=lambda r: r["median_s"]) if ok else rows[0]
        results.append(dict(best, runs=len(rows), medians_s=[r["median_s"] for r in ok]))
    return results


def _run_cpu_once(args: argparse.Namespace) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="lowmemopt-bench-", dir=args.offload_dir) as offload_dir:
        for config in args.config_list:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                config,
                "--bits",
                str(args.bits),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--offload-dir",
                offload_dir,
            ]
            if args.small:
                cmd.append("--small")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                results.append(dict(config=config, error=proc.stderr.strip().splitlines()[-1][:200]))
            else:
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"  {config}: done", file=sys.stderr)
    return results


def print_cpu_table(results: list[dict]) -> None:
    ref = next((r for r in results if r.get("config") == "unpaged" and "median_s" in r), None)
    print(
        "| configuration | state (MB) | RSS above model+grads after warm-up (MB) | peak during steps (MB) "
        "| median step (s) | vs unpaged | process CPU s / step | vs unpaged |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        if "error" in r:
            print(f"| {r['config']} | — | — | — | — | — | — | FAILED: {r['error']} |")
            continue
        ratio = f"{r['median_s'] / ref['median_s']:.2f}x" if ref else "—"
        cpu_ratio = f"{r['cpu_s'] / ref['cpu_s']:.2f}x" if ref else "—"
        print(
            f"| {_cpu_name(r['config'])} | {r['state_bytes'] / 1e6:.1f} | {r['rss_after_warmup'] / 1e6:.1f} "
            f"| {r['peak_rss'] / 1e6:.1f} | {r['median_s']:.3f} | {ratio} | {r['cpu_s']:.3f} | {cpu_ratio} |"
        )


def _cpu_name(config: str) -> str:
    return {"unpaged": "unpaged", "disk": 'paged="disk"', "cpu": 'paged="cpu"'}[config]


# ---------------------------------------------------------------------------------------------------------------------
# GPU: in one process, memory released between configurations


def _bnb(params, config: str, bits: int):
    import bitsandbytes as bnb

    cls = {
        ("bnb-unpaged", 8): bnb.optim.AdamW8bit,
        ("bnb-paged", 8): bnb.optim.PagedAdamW8bit,
        ("bnb-unpaged", 32): bnb.optim.AdamW,
        ("bnb-paged", 32): bnb.optim.PagedAdamW,
    }.get((config, bits))
    if cls is None:
        raise ValueError(f"bitsandbytes has no {bits}-bit AdamW")
    return cls(params, lr=1e-3, weight_decay=1e-2)


def _device_used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def run_gpu(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    preset = "10m" if args.small else "150m"
    model = build_llama(preset, device=device)
    grads = fixed_grads(model)
    reference = [p.detach() for p in model.parameters()]
    del model
    unpaged_state = _expected_state_bytes(reference, args.bits)
    results = []
    copies = copy_bandwidth(device)
    with tempfile.TemporaryDirectory(prefix="lowmemopt-bench-", dir=args.offload_dir) as offload_dir:
        files = file_bandwidth(offload_dir) if "disk" in args.config_list else None
        print(
            f"- pinned copy bandwidth: host->device {copies['h2d'] / 1e9:.1f} GB/s, device->host "
            f"{copies['d2h'] / 1e9:.1f} GB/s, both at once {copies['both'] / 1e9:.1f} GB/s"
            + (
                ""
                if files is None
                else f"; offload_dir files: write {files['write'] / 1e9:.2f} GB/s, read {files['read'] / 1e9:.2f} GB/s"
            )
            + "\n"
        )
        for config in args.config_list:
            row: dict = dict(config=config)
            params = opt = None
            try:
                params = fresh_params(reference, grads)
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.synchronize(device)
                base_alloc, base_used = torch.cuda.memory_allocated(device), _device_used(device)
                budget = "auto" if config == "auto" else int(args.budget_frac * unpaged_state)
                if config.startswith("bnb"):
                    opt = _bnb(params, config, args.bits)
                else:
                    opt = _lowmemopt(params, config, args.bits, offload_dir, budget)
                row.update(_measure_gpu(opt, args, device, base_alloc, base_used))
                row["budget"] = None if config.startswith("bnb") else budget
                row["floor"] = transfer_floor(row["moved"], config, copies, files) if row["moved"] else None
            except Exception as exc:  # noqa: BLE001 - a failing configuration becomes a table row
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            finally:
                if opt is not None and hasattr(opt, "close"):
                    opt.close()
                del opt, params
                gc.collect()
                torch.cuda.empty_cache()
            results.append(row)
            print(f"  {config}: done", file=sys.stderr)
    return results


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, reps: int = 5) -> dict[str, float]:
    """Measured bytes/s of page-locked host -> device (``h2d``) and device -> host (``d2h``) copies, one direction at
    a time, and of both at once on two streams (``both``: the bytes of both directions over the time they take
    together; the copy engines of each direction work at the same time): the floors of paged state's transfers."""
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    out = {}
    for name, pairs in (
        ("h2d", [(dev[0], host[0])]),
        ("d2h", [(host[1], dev[1])]),
        ("both", [(dev[0], host[0]), (host[1], dev[1])]),
    ):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for warm in (True, False):
            start.record()
            ends = []
            for stream, (dst, src) in zip(streams, pairs):
                stream.wait_event(start)
                with torch.cuda.stream(stream):
                    for _ in range(1 if warm else reps):
                        dst.copy_(src, non_blocking=True)
                ends.append(torch.cuda.Event())
                ends[-1].record(stream)
            for e in ends:
                torch.cuda.current_stream(device).wait_event(e)
            end.record()
            end.synchronize()
        out[name] = reps * nbytes * len(pairs) / (start.elapsed_time(end) / 1e3)
    return out


def file_bandwidth(directory: str, nbytes: int = 256 << 20) -> dict[str, float]:
    """Measured bytes/s of ``pwrite`` / ``pread`` of a file in ``directory`` (the disk tier's path: through the page
    cache, as the pager does)."""
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy()
    path = os.path.join(directory, "bandwidth.probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        t0 = time.perf_counter()
        os.pwrite(fd, data, 0)
        t1 = time.perf_counter()
        os.pread(fd, nbytes, 0)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        os.unlink(path)
    return dict(write=nbytes / (t1 - t0), read=nbytes / (t2 - t1))


def transfer_floor(
    moved: int, config: str, copies: dict[str, float], files: dict[str, float] | None
) -> dict[str, float]:
    """Seconds a step cannot beat, ``moved`` bytes each way at the measured bandwidths: ``serial`` one direction at a
    time (the sum), ``both`` both directions at once (2 x moved at the both-ways rate). For the disk tier, the file
    read and write (by the reader and writer threads) bound both as well."""
    serial = moved / copies["h2d"] + moved / copies["d2h"]
    both = 2 * moved / copies["both"] if "both" in copies else max(moved / copies["h2d"], moved / copies["d2h"])
    if config == "disk" and files is not None:
        io = max(moved / files["read"], moved / files["write"])
        serial, both = max(serial, io), max(both, io)
    return dict(serial=serial, both=both)


def _measure_gpu(opt, args: argparse.Namespace, device: torch.device, base_alloc: int, base_used: int) -> dict:
    time_steps(opt.step, steps=0, warmup=args.warmup, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    used = []

    def step():
        opt.step()
        used.append(_device_used(device))

    times, note = time_steps(step, steps=args.steps, warmup=0, device=device)
    from lowmemopt import paging

    return dict(
        moved=paging.moving_bytes(opt) if hasattr(opt, "state_nbytes") else 0,
        state_bytes=_state_bytes(opt),
        held_between_steps=torch.cuda.memory_allocated(device) - base_alloc,
        peak_in_step=torch.cuda.max_memory_allocated(device) - base_alloc,
        device_used=max(used) - base_used,
        times_s=times,
        median_s=statistics.median(times),
        note=note,
    )


def _expected_state_bytes(reference: list[torch.Tensor], bits: int) -> int:
    """lowmemopt AdamW's state size for these parameters at ``bits``, from its layout on meta tensors (no memory)."""
    meta = [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in reference]
    opt = _lowmemopt(meta, "unpaged", bits, None)
    group = opt.param_groups[0]
    return sum(
        t.nbytes
        for p in meta
        for t in opt._init_state(p, group, opt._slots(group, p)).values()
        if isinstance(t, torch.Tensor)
    )


def _state_bytes(opt) -> int:
    if hasattr(opt, "state_nbytes"):
        return int(opt.state_nbytes())
    from common import state_bytes

    return state_bytes(opt)


def print_gpu_table(results: list[dict], bits: int) -> None:
    ref = next((r for r in results if r.get("config") == "unpaged" and "median_s" in r), None)
    names = {
        "unpaged": "lowmemopt unpaged",
        "cpu": 'lowmemopt paged="cpu"',
        "disk": 'lowmemopt paged="disk"',
        "auto": 'lowmemopt paged="cpu", budget "auto"',
        "bnb-unpaged": f"bnb AdamW{'8bit' if bits == 8 else ''}",
        "bnb-paged": f"bnb PagedAdamW{'8bit' if bits == 8 else ''}",
    }
    print(
        "| configuration | state (MB) | budget (MB) | held on device between steps (MB) | peak in step (MB) "
        "| device used (MB) | median step (s) | vs unpaged | moved per step, each way (MB) | achieved (GB/s) "
        "| floor, one direction at a time (s) | floor, both at once (s) | vs floor (both) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        name = names[r["config"]]
        if "error" in r:
            print(f"| {name} | — | — | — | — | — | — | FAILED: {r['error']} | — | — | — | — | — |")  # noqa: E501
            continue
        ratio = f"{r['median_s'] / ref['median_s']:.2f}x" if ref else "—"
        budget = r["budget"] if r["budget"] is None or isinstance(r["budget"], str) else f"{r['budget'] / 1e6:.1f}"
        moved, floor = r.get("moved", 0), r.get("floor")
        flow = "—" if not moved else f"{2 * moved / r['median_s'] / 1e9:.1f}"
        serial = "—" if floor is None else f"{floor['serial']:.4f}"
        both = "—" if floor is None else f"{floor['both']:.4f}"
        vs_floor = "—" if floor is None else f"{r['median_s'] / floor['both']:.2f}x"
        print(
            f"| {name} | {r['state_bytes'] / 1e6:.1f} | {budget or '—'} | {r['held_between_steps'] / 1e6:.1f} "
            f"| {r['peak_in_step'] / 1e6:.1f} | {r['device_used'] / 1e6:.1f} | {r['median_s']:.4f} | {ratio} "
            f"| {moved / 1e6:.1f} | {flow} | {serial} | {both} | {vs_floor} |"
        )


# ---------------------------------------------------------------------------------------------------------------------
# CPU: the disk tier against its floor, paired


def disk_floor(args: argparse.Namespace) -> dict:
    """Paired rounds in one process: a ``paged="disk"`` step, an unpaged step of the same optimizer on a copy of the
    parameters, and a plain ``pread`` + ``pwrite`` of every file of the paged state (the same bytes the step moves,
    through the page cache as the step does). Per round: the paging's cost (paged - unpaged) over the floor (the
    plain read + write), and the paged step over the unpaged step plus the floor (under 1: the reads and writes
    overlap the update). Medians of the per-round ratios. ``--cold``: before each paged step and each floor the files
    are written out and dropped from the page cache, so that their reads come from the disk."""
    if args.cold and not hasattr(os, "posix_fadvise"):
        raise SystemExit("--cold needs os.posix_fadvise (Linux)")
    preset = "10m" if args.small else "150m"
    model = build_llama(preset)
    grads = fixed_grads(model)
    reference = [p.detach() for p in model.parameters()]
    del model
    with tempfile.TemporaryDirectory(prefix="lowmemopt-bench-", dir=args.offload_dir) as offload_dir:
        paged = _lowmemopt(fresh_params(reference, grads), "disk", args.bits, offload_dir)
        plain = _lowmemopt(fresh_params(reference, grads), "unpaged", args.bits, None)
        for _ in range(max(1, args.warmup)):
            paged.step()
            plain.step()
        from lowmemopt import paging

        pager = paging.pager_of(paged)
        paths = [pager.homes.path(t) for e in pager.entries.values() for t in e.home_tensors().values()]
        paths = [p for p in paths if p is not None]
        moved = paging.moving_bytes(paged)
        buffer = torch.empty(max(os.path.getsize(p) for p in paths), dtype=torch.uint8).numpy()

        def drop_from_cache():
            paging.settle(paged)
            for path in paths:
                drop_from_page_cache(path)

        def read_write():
            for path in paths:
                n = os.path.getsize(path)
                fd = os.open(path, os.O_RDWR)
                try:
                    view = memoryview(buffer)[:n]
                    os.preadv(fd, [view], 0)
                    os.pwrite(fd, view, 0)
                finally:
                    os.close(fd)

        rounds = []
        for _ in range(args.rounds):
            times = {}
            for name, fn in (("paged", paged.step), ("unpaged", plain.step), ("floor", read_write)):
                if args.cold and name != "unpaged":
                    drop_from_cache()
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times[name], times[name + "_cpu"] = time.perf_counter() - t0, time.process_time() - c0
                paging.settle(paged)  # (the next step's first read, started as this one ended: not beside the others)
            rounds.append(times)
        paged.close()

    def ratios(suffix: str) -> dict[str, float]:
        p, u, f = (f"paged{suffix}", f"unpaged{suffix}", f"floor{suffix}")
        return dict(
            cost_over_floor=statistics.median((r[p] - r[u]) / r[f] for r in rounds),
            paged_over_serial=statistics.median(r[p] / (r[u] + r[f]) for r in rounds),
            paged_over_unpaged=statistics.median(r[p] / r[u] for r in rounds),
        )

    return dict(
        moved=moved,
        files=len(paths),
        rounds=rounds,
        cold=args.cold,
        median={k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
        wall=ratios(""),
        cpu=ratios("_cpu"),
    )


def print_disk_floor(result: dict) -> None:
    m = result["median"]
    cached = "dropped from the page cache before each paged step and floor" if result["cold"] else "in the page cache"
    print(
        f"- disk tier: {result['moved'] / 1e6:.1f} MB of state each way per step, {result['files']} files ({cached})\n"
    )
    print(
        "| clock | paged step (s) | unpaged step (s) | floor: pread + pwrite of the same bytes (s) "
        "| paging's cost / floor | paged / (unpaged + floor) | paged / unpaged |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for clock, suffix in (("wall", ""), ("process CPU", "_cpu")):
        r = result["wall" if not suffix else "cpu"]
        print(
            f"| {clock} | {m['paged' + suffix]:.3f} | {m['unpaged' + suffix]:.3f} | {m['floor' + suffix]:.3f} "
            f"| {r['cost_over_floor']:.2f}x | {r['paged_over_serial']:.2f}x | {r['paged_over_unpaged']:.2f}x |"
        )
    print("\n(times: medians over the rounds; ratios: medians of the per-round ratios; process CPU: all threads)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        cpu_worker(args)
        return 0
    device = torch.device(args.device)
    preset = "10m" if args.small else "150m"
    print("## Paged optimizer state benchmark\n")
    for key, value in machine_info(device).items():
        print(f"- {key}: {value}")
    print(
        f"- model: LlamaForCausalLM {LLAMA_PRESETS[preset]}, fp32; AdamW at {args.bits} bits; warm-up "
        f"{args.warmup}, timed {args.steps} steps, median reported; LOWMEMOPT_COMPILE="
        f"{os.environ.get('LOWMEMOPT_COMPILE', '1')}\n"
    )
    sys.stdout.flush()
    t0 = time.perf_counter()
    if args.disk_floor:
        results = disk_floor(args)
        print_disk_floor(results)
    elif device.type == "cuda":
        results = run_gpu(args)
        print_gpu_table(results, args.bits)
    else:
        results = run_cpu(args)
        print_cpu_table(results)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"\n- wall time {time.perf_counter() - t0:.0f} s; load average (1 min) at the end: {load}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine_info(device), args=vars(args), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
