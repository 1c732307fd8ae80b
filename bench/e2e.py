"""End-to-end training step on one device: the user's real case, a ~1.1B LLaMA in bf16, each optimizer in its own
process.

The model is TinyLlama's layout built from a ``transformers.LlamaConfig`` (random init, nothing downloaded): hidden
2048, 22 layers, SwiGLU intermediate 5632, 32 heads, 4 key/value heads, vocab 32000 (1.10B parameters), in bf16, batch
4 x 1024 tokens. Every optimizer gets a fresh process (so the peak memory is its own: model, gradients, activations
and its state), the same initial weights (seed 0) and the same batches: sequences that follow a fixed random
successor table over a 256-token alphabet (``next = table[token]``), which a model learns in a few dozen steps, so the
loss after ``--steps`` steps says whether an optimizer trains at all.

Columns: peak device memory (``torch.cuda.max_memory_allocated``; on CPU the process's peak RSS), the median full
step (forward, backward, ``opt.step()``, ``zero_grad``) and the median ``opt.step()`` alone (CUDA events around it;
on CPU ``perf_counter``), both over the steps after ``--warmup``, and the loss of the last step (mean of the last
three). The ``-per-layer`` rows update each weight inside ``backward()`` (``step_in_backward``): their full step is
the one to compare (their ``opt.step()`` has nothing left to do), and their peak holds no full set of gradients. The
``-graph`` rows capture ``opt.step()`` in a CUDA graph after two eager steps (``capturable=True``) and replay it:
their ``opt.step()`` is the GPU's time alone (CUDA only; their gradients are zeroed in place, not freed). The
``-capturable`` row takes the same steps eagerly: no synchronization, an ordinary step's host work. After the table,
the project's performance targets on ``opt.step()`` (:data:`TARGETS`) whose rows both ran, with their ratios, PASS /
FAIL on a GPU. Ratios are to ``torch-adamw-fused`` measured in the same run. A row whose library is missing says
"not installed"; a row that fails says why; the run goes on.

    cd /tmp && python /path/to/lowmemopt/bench/e2e.py                          # 1.1B, every row (CUDA)
    python /path/to/lowmemopt/bench/e2e.py --layers 4 --steps 10 --json e.json # smaller
    python /path/to/lowmemopt/bench/e2e.py --device cpu --layers 1 --hidden 64 --intermediate 128 --heads 4 \\
        --kv-heads 2 --vocab 256 --batch 2 --seq 32 --steps 3 --warmup 1       # seconds on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

BASELINE = "torch-adamw-fused"
ALPHABET = 256  # tokens the synthetic sequences use (at most the vocabulary)


# ---------------------------------------------------------------------------------------------------------------------
# rows: name -> (lr, factory(model, lr, args) -> optimizer). Imports inside the factories: a missing library fails
# only its own row (ImportError -> "not installed").


def _lm(cls_name: str, **kw) -> Callable:
    def make(model, lr, args):
        import lowmemopt

        return getattr(lowmemopt, cls_name)(model.parameters(), lr=lr, state_bits=8, **kw)

    return make


def _lm_paged(model, lr, args):
    import lowmemopt

    # a budget below the state: ~2.03 bytes/param at 8 bits; give the pager a quarter of it
    budget = int(0.25 * 2.03 * sum(p.numel() for p in model.parameters()))
    return lowmemopt.AdamW(model.parameters(), lr=lr, state_bits=8, paged="cpu", page_budget_bytes=budget)


def _lm_galore(cls_name: str, projection: dict | None = None, **kw) -> Callable:
    def make(model, lr, args):
        import lowmemopt

        groups = lowmemopt.galore_param_groups(
            model, target_modules=["attn", "mlp"], rank=args.rank, update_proj_gap=200, scale=0.25, **(projection or {})
        )
        return getattr(lowmemopt, cls_name)(groups, lr=lr, state_bits=8, **kw)

    return make


def _lm_per_layer(cls_name: str, galore: bool = False, bucket_bytes: int = 0, **kw) -> Callable:
    """The optimizer with ``step_in_backward``: each weight updated inside ``backward()`` as its gradient is made, and
    the gradient freed (no full-size gradients held at once), or with ``bucket_bytes`` in buckets of that many
    gradient bytes; ``opt.step()`` then has nothing left to do."""
    inner = _lm_galore(cls_name, **kw) if galore else _lm(cls_name, **kw)

    def make(model, lr, args):
        import lowmemopt

        opt = inner(model, lr, args)
        # (the stepper kept with the optimizer: its hooks' handle)
        opt.bench_stepper = lowmemopt.step_in_backward(model, opt, bucket_bytes=bucket_bytes)
        return opt

    return make


class _GraphedStep:
    """``opt.step()`` captured in a CUDA graph and replayed (``capturable=True``): ``warm`` eager steps on a side
    stream (state, compiled kernels, cached launch tables), then the capture and a replay per step. The gradients stay
    where they are (``zero_grad`` zeroes them in place): the graph reads them by address."""

    def __init__(self, opt: Any, warm: int = 2) -> None:
        self.opt, self.warm, self.graph, self.steps = opt, warm, None, 0

    def step(self) -> None:
        if self.graph is None:
            self.steps += 1
            if self.steps <= self.warm:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.opt.step()
                torch.cuda.current_stream().wait_stream(side)
                return
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # (records the step; runs nothing)
                self.opt.step()
        self.graph.replay()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=False)


def _lm_capturable(cls_name: str, graph: bool, **kw) -> Callable:
    """The optimizer with ``capturable=True`` and a device-tensor lr: stepped eagerly (no synchronization, the host
    work of an ordinary step), or with ``graph`` its step captured in a CUDA graph and replayed."""

    def make(model, lr, args):
        import lowmemopt

        device = next(model.parameters()).device
        if graph and device.type != "cuda":
            raise RuntimeError("a CUDA graph needs a CUDA device")
        opt = getattr(lowmemopt, cls_name)(
            model.parameters(), lr=torch.tensor(lr, device=device), state_bits=8, capturable=True, **kw
        )
        return _GraphedStep(opt) if graph else opt

    return make


#: rows whose updates run inside backward(): their "full step" is the figure to compare
PER_LAYER_NOTE = "updates inside backward() (step_in_backward): compare the full step"


def _torch_fused(model, lr, args):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)


def _bnb(name: str) -> Callable:
    def make(model, lr, args):
        import bitsandbytes as bnb

        return getattr(bnb.optim, name)(model.parameters(), lr=lr, weight_decay=0.0)

    return make


def _torchao(model, lr, args):
    from torchao.optim import AdamW8bit

    return AdamW8bit(model.parameters(), lr=lr, weight_decay=0.0)


def _galore_torch(model, lr, args):
    from galore_torch import GaLoreAdamW8bit

    import lowmemopt

    groups = lowmemopt.galore_param_groups(
        model, target_modules=["attn", "mlp"], rank=args.rank, update_proj_gap=200, scale=0.25
    )
    for g in groups:  # galore-torch reads these keys from every projected group
        if "rank" in g:
            g.setdefault("proj_type", "std")
    return GaLoreAdamW8bit(groups, lr=lr, weight_decay=0.0)


def _came_pytorch(model, lr, args):
    from came_pytorch import CAME

    return CAME(model.parameters(), lr=lr, weight_decay=0.0)


_EXT = dict(relative_step=False, scale_parameter=False)
#: (lr, factory); the lowmemopt rows are every optimizer at 8-bit state, then the paged and GaLore variants
ROWS: dict[str, tuple[float, Callable]] = {
    BASELINE: (3e-4, _torch_fused),
    "bnb-adamw8bit": (3e-4, _bnb("AdamW8bit")),
    "bnb-paged-adamw8bit": (3e-4, _bnb("PagedAdamW8bit")),
    "torchao-adamw8bit": (3e-4, _torchao),
    "galore-torch-adamw8bit": (3e-4, _galore_torch),
    "came-pytorch": (2e-4, _came_pytorch),
    "lowmemopt-adamw-8bit": (3e-4, _lm("AdamW", weight_decay=0.0)),
    # capturable=True: eager (no synchronization in the step), and captured in a CUDA graph (no host work per step)
    "lowmemopt-adamw-8bit-capturable": (3e-4, _lm_capturable("AdamW", False, weight_decay=0.0)),
    "lowmemopt-adamw-8bit-graph": (3e-4, _lm_capturable("AdamW", True, weight_decay=0.0)),
    "lowmemopt-sgd-8bit": (1e-2, _lm("SGD", momentum=0.9)),
    "lowmemopt-lion-8bit": (3e-5, _lm("Lion")),
    "lowmemopt-lamb-8bit": (1e-3, _lm("LAMB")),
    "lowmemopt-lars-8bit": (1e-1, _lm("LARS", momentum=0.9)),
    "lowmemopt-adafactor-8bit": (1e-3, _lm("Adafactor", beta1=0.9, **_EXT)),
    "lowmemopt-came-8bit": (2e-4, _lm("CAME")),
    "lowmemopt-came-8bit-graph": (2e-4, _lm_capturable("CAME", True)),
    "lowmemopt-paged-adamw-8bit": (3e-4, _lm_paged),
    "lowmemopt-galore-adamw-8bit": (3e-4, _lm_galore("AdamW", weight_decay=0.0)),
    "lowmemopt-galore-came-8bit": (2e-4, _lm_galore("CAME")),
    # the projections as fp32 matmuls (the GaLore rows above take bf16 ones for bf16 weights: proj_dtype="param")
    "lowmemopt-galore-adamw-8bit-fp32proj": (3e-4, _lm_galore("AdamW", dict(proj_dtype="float32"), weight_decay=0.0)),
    "lowmemopt-galore-came-8bit-fp32proj": (2e-4, _lm_galore("CAME", dict(proj_dtype="float32"))),
    # per-layer updates: the finiteness check of each hook stays on the device (no synchronization per parameter)
    "lowmemopt-adamw-8bit-per-layer": (3e-4, _lm_per_layer("AdamW", weight_decay=0.0)),
    "lowmemopt-adamw-8bit-per-layer-32mib": (3e-4, _lm_per_layer("AdamW", bucket_bytes=32 << 20, weight_decay=0.0)),
    "lowmemopt-came-8bit-per-layer": (2e-4, _lm_per_layer("CAME")),
    "lowmemopt-galore-adamw-8bit-per-layer": (3e-4, _lm_per_layer("AdamW", galore=True, weight_decay=0.0)),
}


# ---------------------------------------------------------------------------------------------------------------------
# one row, in its own process


def build_model(args, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.seq),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: no transient fp32 copy of 1.1B weights on the device
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).to(dtype)
    finally:
        torch.set_default_dtype(default)
    model.config.use_cache = False
    return model


def make_batches(args, n: int = 8) -> list[torch.Tensor]:
    """``n`` batches of sequences that follow one fixed random successor table (learnable, deterministic)."""
    gen = torch.Generator().manual_seed(1234)
    alphabet = min(ALPHABET, args.vocab)
    table = torch.randperm(alphabet, generator=gen)
    out = []
    for _ in range(n):
        x = torch.empty(args.batch, args.seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, alphabet, (args.batch,), generator=gen)
        for t in range(1, args.seq):
            x[:, t] = table[x[:, t - 1]]
        out.append(x)
    return out


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_row(name: str, args) -> dict[str, Any]:
    device = torch.device(args.device)
    lr, factory = ROWS[name]
    model = build_model(args, device)
    if device.type == "cuda":  # the peak from here on: weights, gradients, activations, optimizer state
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    n_params = sum(p.numel() for p in model.parameters())
    try:
        opt = factory(model, lr, args)
    except ImportError as exc:
        return dict(name=name, error=f"not installed ({exc.name or exc})", n_params=n_params)
    batches = [b.to(device) for b in make_batches(args)]
    use_events = device.type == "cuda"
    full_s, opt_s, losses = [], [], []

    def sync():
        if use_events:
            torch.cuda.synchronize(device)

    for i in range(args.warmup + args.steps):
        x = batches[i % len(batches)]
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if use_events:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            stop.record()
        else:
            o0 = time.perf_counter()
            opt.step()
            o1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        sync()
        t1 = time.perf_counter()
        losses.append(float(loss.detach().float()))
        if not math.isfinite(losses[-1]):
            return dict(name=name, error=f"loss is {losses[-1]} at step {i + 1}", n_params=n_params, lr=lr)
        if i >= args.warmup:
            full_s.append(t1 - t0)
            opt_s.append(start.elapsed_time(stop) / 1e3 if use_events else o1 - o0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _peak_rss_bytes()
    return dict(
        name=name,
        n_params=n_params,
        lr=lr,
        peak_bytes=peak,
        peak_kind="device" if use_events else "rss",
        full_step_s=statistics.median(full_s),
        opt_step_s=statistics.median(opt_s),
        full_times_s=full_s,
        opt_times_s=opt_s,
        first_loss=losses[0],
        loss=statistics.fmean(losses[-3:]),
        steps=len(losses),
        note=PER_LAYER_NOTE if hasattr(opt, "bench_stepper") else "",
    )


# ---------------------------------------------------------------------------------------------------------------------
# driver


def _subprocess_row(name: str, argv: list[str], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", name, "--worker-out", out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return dict(name=name, error=f"timed out after {timeout:.0f} s")
        if os.path.exists(out):
            with open(out) as fh:
                return json.load(fh)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return dict(name=name, error=f"exit {proc.returncode}: {tail[0][:300]}")


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def _table_header(device_memory: bool, steps: int) -> list[str]:
    kind = "peak device memory" if device_memory else "peak RSS"
    return [
        f"| optimizer | lr | {kind} (GiB) | vs torch | full step (ms) | vs torch | `opt.step()` (ms) | vs torch "
        f"| loss after {steps} steps | notes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]


def _table_row(r: dict[str, Any], base: dict[str, Any] | None) -> str:
    """One row's markdown line; ratios to ``base`` (the baseline row, when it ran)."""

    def ratio(key):
        if base is None or r.get(key) is None or not base.get(key):
            return None
        return r[key] / base[key]

    if r.get("error"):
        return f"| {r['name']} | — | — | — | — | — | — | — | — | {r['error'].replace('|', '/')} |"
    gib = r["peak_bytes"] / 2**30
    return (
        f"| {r['name']} | {r['lr']:g} | {gib:.2f} | {_fmt(ratio('peak_bytes'), '.2f')}x "
        f"| {r['full_step_s'] * 1e3:.1f} | {_fmt(ratio('full_step_s'), '.2f')}x "
        f"| {r['opt_step_s'] * 1e3:.2f} | {_fmt(ratio('opt_step_s'), '.2f')}x "
        f"| {r['loss']:.3f} (from {r['first_loss']:.2f}) |" + (f" {r['note']} |" if r.get("note") else " |")
    )


def _baseline(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in rows if r["name"] == BASELINE and not r.get("error")), None)


def markdown_table(rows: list[dict[str, Any]], steps: int) -> str:
    """One markdown table; ratios to the baseline row (when it ran)."""
    base = _baseline(rows)
    device_memory = any(r.get("peak_kind") == "device" for r in rows)
    return "\n".join(_table_header(device_memory, steps) + [_table_row(r, base) for r in rows])


#: the project's end-to-end performance targets on ``opt.step()`` (1.1B bf16 on a GPU): (short name of the target,
#: row, anchor row, bound on the ratio of the row's time to the anchor's)
TARGETS = [
    ("fused 8-bit step", "lowmemopt-adamw-8bit", BASELINE, 1.0),
    ("fused 8-bit step", "lowmemopt-adamw-8bit-graph", BASELINE, 1.0),
    ("fused 8-bit step", "lowmemopt-adamw-8bit", "bnb-adamw8bit", 0.5),
    ("paged step", "lowmemopt-paged-adamw-8bit", "bnb-paged-adamw8bit", 1.5),
    ("GaLore step", "lowmemopt-galore-adamw-8bit", "galore-torch-adamw8bit", 0.8),
    ("GaLore step", "lowmemopt-galore-came-8bit", "galore-torch-adamw8bit", 1.0),
    ("CAME step", "lowmemopt-came-8bit", "lowmemopt-adamw-8bit", 2.0),
]
#: ``--optimizers core``: the rows ``scripts/gpu-check`` measures first (its default plan), the baseline first
CORE_ROWS = [
    BASELINE,
    "lowmemopt-adamw-8bit",
    "bnb-adamw8bit",
    "lowmemopt-came-8bit",
    "lowmemopt-paged-adamw-8bit",
    "bnb-paged-adamw8bit",
    "lowmemopt-galore-adamw-8bit",
    "galore-torch-adamw8bit",
]


def target_lines(rows: list[dict[str, Any]], gpu: bool) -> list[str]:
    """One line per target of :data:`TARGETS` whose rows both ran: the ``opt.step()`` ratio, and PASS / FAIL on a GPU
    (a CPU run's ratios are shown, judged by nothing: the targets are GPU figures)."""
    ran = {r["name"]: r for r in rows if not r.get("error") and r.get("opt_step_s")}
    out = []
    for label, name, anchor, bound in TARGETS:
        if name in ran and anchor in ran:
            ratio = ran[name]["opt_step_s"] / ran[anchor]["opt_step_s"]
            verdict = ("PASS" if ratio <= bound else "FAIL") if gpu else "not judged (CPU)"
            out.append(f"- {label}: {name} opt.step() <= {bound}x {anchor}: {ratio:.2f}x -> {verdict}")
    return out


def add_model_args(ap: argparse.ArgumentParser, batch: int = 4, seq: int = 1024) -> None:
    """The model's options (TinyLlama's layout by default), the batch, the GaLore rank and the dtype: shared with
    ``profile_step.py``, which builds the same model."""
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--seq", type=int, default=seq)
    ap.add_argument("--rank", type=int, default=256, help="GaLore rank of the attention and MLP weights")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(ap)
    ap.add_argument(
        "--optimizers",
        default=",".join(ROWS),
        help="comma-separated rows (default: all); 'targets' stands for the rows the performance "
        "targets compare (TARGETS), 'core' for CORE_ROWS (the optimizers a GPU check measures "
        "first: torch fused, bitsandbytes 8-bit and paged, lowmemopt AdamW 8-bit, paged, CAME "
        "8-bit, GaLore AdamW 8-bit, galore-torch)",
    )
    ap.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (state allocation, compiles)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per row")
    ap.add_argument("--json", default=None, help="write every row (all step times) here")
    ap.add_argument("--markdown", default=None, help="also write the table here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.optimizers = ",".join(checked_rows(args.optimizers))
    except ValueError as exc:
        ap.error(str(exc))
    return args


def target_rows() -> list[str]:
    """The rows :data:`TARGETS` compares, each once, the baseline first."""
    names = [BASELINE]
    for _, name, anchor, _ in TARGETS:
        names += [n for n in (anchor, name) if n not in names]
    return names


def expand_rows(spec: str) -> list[str]:
    """``--optimizers``' comma-separated names, ``targets`` replaced by :func:`target_rows` and ``core`` by
    :data:`CORE_ROWS`, each name once."""
    aliases = {"targets": target_rows(), "core": CORE_ROWS}
    names: list[str] = []
    for name in (n.strip() for n in spec.split(",")):
        names += [n for n in aliases.get(name, [name] if name else []) if n not in names]
    return names


def checked_rows(spec: str) -> list[str]:
    """:func:`expand_rows`, or ValueError naming the unknown rows (``scripts/gpu-check --e2e-rows`` asks too)."""
    names = expand_rows(spec)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"unknown row(s) {', '.join(unknown)}; known: targets, core, {', '.join(ROWS)}")
    return names


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        row = run_row(args.worker, args)
        with open(args.worker_out, "w") as fh:
            json.dump(row, fh)
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("e2e.py: no CUDA device (use --device cpu for a small run on the CPU)", file=sys.stderr)
        return 2
    names = [n for n in args.optimizers.split(",") if n]
    if BASELINE in names:  # first, so the others' ratios have it
        names.remove(BASELINE)
        names.insert(0, BASELINE)
    kv = args.hidden * args.kv_heads // args.heads  # grouped-query attention: k and v project to kv heads
    n = (
        args.layers
        * (2 * args.hidden**2 + 2 * args.hidden * kv + 3 * args.hidden * args.intermediate + 2 * args.hidden)
        + 2 * args.vocab * args.hidden
        + args.hidden
    )
    print(
        f"# End-to-end step: LLaMA {args.layers} x {args.hidden} (intermediate {args.intermediate}, {args.heads} "
        f"heads, {args.kv_heads} kv heads, vocab {args.vocab}; ~{n / 1e9:.2f}B parameters), {args.dtype}, batch "
        f"{args.batch} x {args.seq}, {args.warmup} warm-up + {args.steps} timed steps, device {args.device}\n",
        flush=True,
    )
    info = dict(
        torch=torch.__version__,
        device=args.device,
        gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
    )
    steps = args.steps + args.warmup
    print("\n".join(_table_header(args.device.startswith("cuda"), steps)), flush=True)
    rows, rc = [], 0
    try:
        for name in names:
            t0 = time.perf_counter()
            row = _subprocess_row(name, argv, args.timeout)
            rows.append(row)
            # each row as it completes (a run cut short keeps the rows done: the table here, and the JSON)
            print(_table_row(row, _baseline(rows)), flush=True)
            status = row.get("error") or (
                f"{row['full_step_s'] * 1e3:.1f} ms full step, "
                f"{row['opt_step_s'] * 1e3:.2f} ms opt.step, loss {row['loss']:.3f}"
            )
            print(f"  {name}: {status} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(
                        dict(
                            machine=info,
                            rows=rows,
                            args={k: v for k, v in vars(args).items() if not k.startswith("worker")},
                        ),
                        fh,
                        indent=1,
                    )
    except KeyboardInterrupt:  # (Ctrl-C, or gpu-check's deadline): the verdicts of the rows done, then stop
        print(
            f"\nInterrupted after {len(rows)} of {len(names)} rows; not run: {', '.join(names[len(rows) :])}",
            flush=True,
        )
        rc = 130
    targets = target_lines(rows, args.device.startswith("cuda"))
    if targets:
        print("\nTargets (performance, on opt.step()):\n" + "\n".join(targets), flush=True)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(markdown_table(rows, steps) + "\n" + "".join(f"{line}\n" for line in targets))
    return rc


if __name__ == "__main__":
    sys.exit(main())
