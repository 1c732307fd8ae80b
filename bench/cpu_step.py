"""The optimizer step on the CPU, as it runs when a GPU trains and the host steps (FSDP2's ``CPUOffloadPolicy``,
DeepSpeed's ZeRO-Offload): lowmemopt's optimizers against torch's fused AdamW and DeepSpeed's ``DeepSpeedCPUAdam``,
and against the memory floor, all measured in one run.

    cd /tmp && python /path/to/repo/bench/cpu_step.py                 # ~148M-parameter LLaMA, 2 threads
    cd /tmp && python /path/to/repo/bench/cpu_step.py --quick         # ~11M parameters, a few seconds
    cd /tmp && python /path/to/repo/bench/cpu_step.py --threads 16 --json cpu_step.json

Every optimizer is built once over the same fp32 parameters (one set, stepped by each optimizer in turn: the step's
time does not depend on the values) with the same fixed gradients; each keeps its own state. Each round times one
step of every optimizer and one large in-place ``add_``, in an order that rotates from round to round; a row's ratio
is the median over the rounds of its step time over torch's fused AdamW step time in the same round, so both sides of
every ratio ran under the same machine conditions.

Bytes moved per step, per parameter: parameter read and write (8) and gradient read (4) with fp32 parameters, plus
every state byte read and written once (2 x the state's bytes/param: fp32 AdamW 2 x 8 = 16, 28 in all); one ideal
pass, which multi-pass kernels (Adafactor's and CAME's factored statistics) exceed. The memory floor of a row is those
bytes over the memory bandwidth measured in the same rounds (``a.add_(b)``: ``a`` and ``b`` read, ``a`` written).
(Run from outside the repository root; see bench/README.md.)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from lowmemopt.benchmark import LLAMA_PRESETS, machine_info, state_bytes

LR, WD = 1e-3, 1e-2
ANCHOR = "torch-adamw-fused"
FLOOR = "memory floor (fp32 AdamW)"
#: bytes per parameter moved by one fp32 AdamW step: p read + write, g read, m and v read + write
ADAMW_FP32_BYTES = 8 + 4 + 16

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _lowmemopt(cls: str, bits: int, **kw) -> Factory:
    def make(params):
        import lowmemopt

        return getattr(lowmemopt, cls)(params, lr=LR, weight_decay=WD, state_bits=bits, **kw)

    return make


def _per_parameter(factory: Factory) -> Factory:
    """``factory``'s optimizer with the bucketed native call turned off during its steps (each CPU parameter its own
    native call, as before the bucket): what the bucket saves, measured in the same run."""

    def make(params):
        from lowmemopt.pipeline import native

        opt = factory(params)
        step = opt.step

        def per_parameter_step(*args, **kwargs):
            takes = native.takes
            native.takes = lambda plan: False
            try:
                return step(*args, **kwargs)
            finally:
                native.takes = takes

        opt.step = per_parameter_step
        return opt

    return make


def _torch_fused(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)


def _deepspeed_cpu_adam(params):
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # builds (or loads) its cpu_adam op

    return DeepSpeedCPUAdam(params, lr=LR, weight_decay=WD, adamw_mode=True, fp32_optimizer_states=True)


#: name -> (factory, what it is)
OPTIMIZERS: dict[str, tuple[Factory, str]] = {
    ANCHOR: (_torch_fused, "torch.optim.AdamW(fused=True), fp32 state: the anchor"),
    "deepspeed-cpuadam": (_deepspeed_cpu_adam, "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True), fp32 state"),
    "lowmemopt-adamw-32bit": (_lowmemopt("AdamW", 32), "lowmemopt.AdamW(state_bits=32)"),
    "lowmemopt-cpuadam": (
        _lowmemopt("CPUAdam", 32, adamw_mode=True),
        "lowmemopt.CPUAdam(adamw_mode=True): DeepSpeedCPUAdam's signature, fp32 state",
    ),
    "lowmemopt-adamw-16bit": (_lowmemopt("AdamW", 16), "lowmemopt.AdamW(state_bits=16): bf16 m, v"),
    "lowmemopt-adamw-8bit": (_lowmemopt("AdamW", 8), "lowmemopt.AdamW(state_bits=8)"),
    "lowmemopt-adamw-4bit": (_lowmemopt("AdamW", 4), "lowmemopt.AdamW(state_bits=4)"),
    "lowmemopt-lion-8bit": (_lowmemopt("Lion", 8), "lowmemopt.Lion(state_bits=8)"),
    "lowmemopt-sgd-8bit": (_lowmemopt("SGD", 8, momentum=0.9), "lowmemopt.SGD(momentum=0.9, state_bits=8)"),
    "lowmemopt-came-8bit": (_lowmemopt("CAME", 8), "lowmemopt.CAME(state_bits=8): 8-bit m, fp32 rows/columns"),
    "lowmemopt-adafactor": (
        _lowmemopt("Adafactor", 32, relative_step=False, scale_parameter=False),
        "lowmemopt.Adafactor(beta1=None): fp32 rows/columns only",
    ),
}
#: rows that run only when named in --optimizers
EXTRA: dict[str, tuple[Factory, str]] = {
    "lowmemopt-adamw-32bit-per-param": (
        _per_parameter(_lowmemopt("AdamW", 32)),
        "lowmemopt.AdamW(state_bits=32), one native call per parameter",
    ),
    "lowmemopt-adamw-8bit-per-param": (
        _per_parameter(_lowmemopt("AdamW", 8)),
        "lowmemopt.AdamW(state_bits=8), one native call per parameter",
    ),
}


def llama_names(preset: str) -> list[str]:
    """The parameter names of ``lowmemopt.benchmark.build_llama(preset)``, in :func:`llama_shapes`' order."""
    layer = [f"self_attn.{n}_proj.weight" for n in "qkvo"] + [f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    layers = [f"model.layers.{i}.{n}" for i in range(LLAMA_PRESETS[preset]["num_hidden_layers"]) for n in layer]
    return ["model.embed_tokens.weight"] + layers + ["model.norm.weight", "lm_head.weight"]


def _named(make: Callable[[list[tuple[str, torch.nn.Parameter]], dict], torch.optim.Optimizer]) -> Factory:
    """A factory of an optimizer that takes named parameters (Adam-mini), with the model's dim and heads."""

    def factory(params):
        preset = next(
            p
            for p, c in LLAMA_PRESETS.items()
            if len(llama_names(p)) == len(params) and llama_shapes(p)[0] == tuple(params[0].shape)
        )
        c = LLAMA_PRESETS[preset]
        shape = dict(dim=c["hidden_size"], n_heads=c["num_attention_heads"])
        return make(list(zip(llama_names(preset), params)), shape)

    return factory


def _adam_mini_reference(named, shape):
    import contextlib
    import io

    from adam_mini import Adam_mini

    with contextlib.redirect_stdout(io.StringIO()):  # (it prints every block it finds)
        opt = Adam_mini(named, lr=LR, weight_decay=WD, verbose=False, **shape)
    return opt


def _bnb_ademamix(bits: int) -> Factory:
    def make(params):
        import bitsandbytes as bnb

        return bnb.optim.AdEMAMix(params, lr=LR, weight_decay=WD, optim_bits=bits)

    return make


#: AdEMAMix and Adam-mini beside their references (run when named); REFERENCES pairs each with its reference, whose
#: step time in the same round is the denominator of its paired ratio
NEW: dict[str, tuple[Factory, str]] = {
    "bnb-ademamix-32bit": (_bnb_ademamix(32), "bitsandbytes.optim.AdEMAMix(optim_bits=32): its CPU step"),
    "bnb-ademamix-8bit": (_bnb_ademamix(8), "bitsandbytes.optim.AdEMAMix(optim_bits=8): its CPU step"),
    "lowmemopt-ademamix-32bit": (_lowmemopt("AdEMAMix", 32), "lowmemopt.AdEMAMix(state_bits=32)"),
    "lowmemopt-ademamix-8bit": (_lowmemopt("AdEMAMix", 8), "lowmemopt.AdEMAMix(state_bits=8)"),
    "adam-mini": (_named(_adam_mini_reference), "adam_mini.Adam_mini (1.1.1), fp32 state"),
    "lowmemopt-adam-mini-32bit": (
        _named(
            lambda named, shape: __import__("lowmemopt").AdamMini(named, lr=LR, weight_decay=WD, verbose=False, **shape)
        ),
        "lowmemopt.AdamMini(state_bits=32)",
    ),
    "lowmemopt-adam-mini-8bit": (
        _named(
            lambda named, shape: __import__("lowmemopt").AdamMini(
                named, lr=LR, weight_decay=WD, verbose=False, state_bits=8, **shape
            )
        ),
        "lowmemopt.AdamMini(state_bits=8)",
    ),
}
REFERENCES = {
    "lowmemopt-ademamix-32bit": "bnb-ademamix-32bit",
    "lowmemopt-ademamix-8bit": "bnb-ademamix-8bit",
    "lowmemopt-adam-mini-32bit": "adam-mini",
    "lowmemopt-adam-mini-8bit": "adam-mini",
}
EXTRA.update(NEW)
OPTIMIZERS.update(EXTRA)


def llama_shapes(preset: str) -> list[tuple[int, ...]]:
    """The parameter shapes of ``lowmemopt.benchmark.build_llama(preset)`` (a ``LlamaForCausalLM``: embedding; per
    layer q, k, v, o, gate, up, down and two norms; final norm; untied head), without building the model."""
    c = LLAMA_PRESETS[preset]
    h, i = c["hidden_size"], c["intermediate_size"]
    layer = [(h, h)] * 4 + [(i, h), (i, h), (h, i), (h,), (h,)]
    return [(c["vocab_size"], h)] + layer * c["num_hidden_layers"] + [(h,), (c["vocab_size"], h)]


def llama_params(preset: str, seed: int = 0) -> list[torch.nn.Parameter]:
    """fp32 parameters of those shapes (N(0, 0.02) matrices, norms at 1, as LLaMA initialises them), each with a fixed
    gradient ``1e-3 * N(0, 1)`` (the step's time does not depend on the values)."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in llama_shapes(preset):
        p = torch.nn.Parameter(torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen).mul_(1e-3)
        params.append(p)
    return params


@dataclass
class Row:
    name: str
    what: str = ""
    state_bytes_per_param: float | None = None
    moved_bytes_per_param: float | None = None
    times_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # per round, over the anchor's step in that round
    note: str = ""

    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None

    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def spread(self) -> str:
        if len(self.ratios) < 4:
            return ""
        q = statistics.quantiles(self.ratios, n=4)
        return f"{q[0]:.2f}-{q[2]:.2f}"


def build(
    names: list[str], params: list[torch.nn.Parameter]
) -> tuple[dict[str, torch.optim.Optimizer], dict[str, Row]]:
    """Each named optimizer over ``params`` (the anchor first), with its state made by one step; a row that cannot be
    built or stepped says why and leaves the run."""
    opts, rows = {}, {}
    for name in names:
        factory, what = OPTIMIZERS[name]
        row = rows[name] = Row(name, what)
        try:
            t0 = time.perf_counter()
            opt = factory(params)
            opt.step()  # allocates the state (and, for the first lowmemopt row, compiles the native kernels)
            built_s = time.perf_counter() - t0
        except ImportError as e:
            row.note = f"not available: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - any failure (an op that does not build) is reported in its row
            row.note = f"FAILED to build or step: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            opts[name] = opt
            row.state_bytes_per_param = state_bytes(opt) / sum(p.numel() for p in params)
            row.moved_bytes_per_param = 12 + 2 * row.state_bytes_per_param
            if built_s > 5:
                row.note = f"first step {built_s:.0f} s"
        print(f"  {name}: {'ok' if name in opts else row.note}", file=sys.stderr, flush=True)
    return opts, rows


def measure(
    opts: dict[str, torch.optim.Optimizer], rows: dict[str, Row], rounds: int, warmup: int, stream_numel: int
) -> list[float]:
    """``warmup`` + ``rounds`` rounds of one step of each optimizer and one in-place ``a.add_(b)`` of two
    ``stream_numel``-element fp32 tensors, the order rotating by one each round. Fills the rows' times and per-round
    ratios; returns the memory bandwidths of the timed rounds: 3 x the tensor's bytes (``a`` and ``b`` read, ``a``
    written) per second. In place, like an optimizer step, it writes only lines it has read; a ``copy_`` into another
    tensor would also read its destination before writing it (write-allocate), traffic that this count would miss."""
    b = torch.randn(stream_numel)
    a = torch.zeros_like(b)
    a.add_(b)  # first touch outside the timing
    tasks: list[tuple[str, Callable[[], object]]] = [(n, o.step) for n, o in opts.items()]
    tasks.append(("stream", lambda: a.add_(b)))
    bandwidths = []
    for r in range(warmup + rounds):
        shift = r % len(tasks)
        times = {}
        for name, fn in tasks[shift:] + tasks[:shift]:
            t0 = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - t0
        anchor = f"{ANCHOR} {1e3 * times[ANCHOR]:.1f} ms, " if ANCHOR in times else ""
        print(
            f"  round {r + 1}/{warmup + rounds}{' (warm-up)' if r < warmup else ''}: {anchor}"
            f"add_ {1e3 * times['stream']:.1f} ms",
            file=sys.stderr,
            flush=True,
        )
        if r < warmup:
            continue
        bandwidths.append(3 * b.numel() * b.element_size() / times["stream"])
        for name in opts:
            rows[name].times_s.append(times[name])
            if ANCHOR in times:
                rows[name].ratios.append(times[name] / times[ANCHOR])
    return bandwidths


def floor_s(bytes_per_param: float, n_params: int, bandwidth: float) -> float:
    return bytes_per_param * n_params / bandwidth


def table(rows: list[Row], n_params: int, bandwidth: float, out) -> None:
    anchor = next((r for r in rows if r.name == ANCHOR and r.times_s), None)
    print(
        "| optimizer | state B/param | moved B/param | median step (ms) | vs torch fused (median; quartiles) "
        "| memory floor (ms) | x floor | notes |",
        file=out,
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |", file=out)
    for r in rows:
        if not r.times_s:
            print(f"| {r.name} | — | — | — | — | — | — | {r.note.replace('|', '/')} |", file=out)
            continue
        floor = floor_s(r.moved_bytes_per_param, n_params, bandwidth)
        spread = f"; {r.spread()}" if r.spread() else ""
        ratio = f"{r.ratio():.2f}x{spread}" if r.ratios else "—"
        print(
            f"| {r.name} | {r.state_bytes_per_param:.3f} | {r.moved_bytes_per_param:.2f} | {1e3 * r.median_s():.4g} "
            f"| {ratio} | {1e3 * floor:.4g} | {r.median_s() / floor:.2f}x | {r.note} |",
            file=out,
        )
    floor = floor_s(ADAMW_FP32_BYTES, n_params, bandwidth)
    ratio = f"{floor / anchor.median_s():.2f}x" if anchor else "—"
    print(
        f"| {FLOOR} | 8.000 | {ADAMW_FP32_BYTES:.2f} | {1e3 * floor:.4g} | {ratio} | {1e3 * floor:.4g} | 1.00x "
        f"| {ADAMW_FP32_BYTES} B/param at the add_ bandwidth |",
        file=out,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--preset",
        choices=sorted(LLAMA_PRESETS),
        default=None,
        help="model (default 150m: ~148M parameters; --quick: 10m)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="small shapes: the 10m preset, 5 rounds, 16 MiB tensors for the bandwidth"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15; --quick 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds after the first step (default 2)")
    ap.add_argument(
        "--stream-mib", type=float, default=None, help="size of each tensor of the timed add_ (default 512; --quick 16)"
    )
    ap.add_argument(
        "--optimizers",
        default=None,
        help=f"comma-separated subset of: {', '.join(OPTIMIZERS)} "
        f"({ANCHOR} always runs; the *-per-param rows only when "
        "named)",
    )
    ap.add_argument("--json", default=None, help="write the settings and every timing here")
    args = ap.parse_args(argv)
    args.preset = args.preset or ("10m" if args.quick else "150m")
    args.rounds = args.rounds if args.rounds is not None else (5 if args.quick else 15)
    args.stream_mib = args.stream_mib if args.stream_mib is not None else (16.0 if args.quick else 512.0)
    if args.threads < 1 or args.rounds < 1 or args.warmup < 0 or args.stream_mib <= 0:
        ap.error("--threads and --rounds must be >= 1, --warmup >= 0, --stream-mib > 0")
    names = (
        [n for n in OPTIMIZERS if n not in EXTRA]
        if args.optimizers is None
        else [n for n in args.optimizers.split(",") if n]
    )
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        ap.error(f"unknown optimizers {unknown}; known: {', '.join(OPTIMIZERS)}")
    args.names = [ANCHOR] + [n for n in names if n != ANCHOR]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = sys.stdout
    params = llama_params(args.preset)
    n_params = sum(p.numel() for p in params)
    info = machine_info(torch.device("cpu"))
    print(
        f"# Optimizer step on the CPU\n\n- torch {info['torch']}, {info['cpu']}, {args.threads} thread(s), "
        f"load average {info['load_avg_1m']}",
        file=out,
    )
    print(
        f"- parameters: LlamaForCausalLM {LLAMA_PRESETS[args.preset]}'s shapes, fp32, {n_params / 1e6:.1f}M "
        f"parameters in {len(params)} tensors, random gradients; lr {LR}, weight decay {WD}",
        file=out,
    )
    print(
        f"- {args.warmup} + {args.rounds} rounds (untimed + timed), each one step of every optimizer and one "
        f"in-place add_ of two {args.stream_mib:g} MiB tensors, order rotating; ratio: median of the per-round "
        "ratios\n",
        file=out,
        flush=True,
    )
    opts, rows = build(args.names, params)
    gc.collect()
    bandwidths = measure(opts, rows, args.rounds, args.warmup, int(args.stream_mib * 2**20) // 4)
    bandwidth = statistics.median(bandwidths)
    table([rows[n] for n in args.names], n_params, bandwidth, out)
    paired = [
        (n, ref)
        for n, ref in REFERENCES.items()
        if rows.get(n) and rows[n].times_s and rows.get(ref) and rows[ref].times_s
    ]
    if paired:
        print(
            "\n| optimizer | its reference | step time vs the reference's (median of per-round ratios; quartiles) |\n"
            "| --- | --- | ---: |",
            file=out,
        )
        for n, ref in paired:
            ratios = [a / b for a, b in zip(rows[n].times_s, rows[ref].times_s)]
            spread = Row(n, ratios=ratios).spread()
            print(f"| {n} | {ref} | {statistics.median(ratios):.2f}x{'; ' + spread if spread else ''} |", file=out)
    anchor = rows[ANCHOR]
    print(
        f"\n{ANCHOR}: median {1e3 * anchor.median_s():.1f} ms per step; memory bandwidth (add_: 2 reads + 1 "
        f"write) median {bandwidth / 1e9:.1f} GB/s (range {min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f}); "
        f"load average at the end {machine_info(torch.device('cpu'))['load_avg_1m']}",
        file=out,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": info,
                    "settings": vars(args),
                    "n_params": n_params,
                    "bandwidths": bandwidths,
                    "rows": [asdict(rows[n]) for n in args.names],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
