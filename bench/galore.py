"""GaLore on a LLaMA-style model: lowmemopt's GaLore (AdamW 32/8-bit, Adafactor, CAME, LAMB, LARS 8-bit) against
galore-torch's GaLoreAdamW, GaLoreAdamW8bit and GaLoreAdafactor in one run: state bytes and step time (ratios to torch's
fused AdamW measured in the same run), then the SVD cost of one projector refresh of every layer, full against
randomized SVD, with the randomized subspace's quality (principal angles, captured gradient energy).

The attention and MLP weights (``target_modules=["attn", "mlp"]``) are projected at ``--rank`` (GaLore's setting for
its 130M LLaMA: 256; 64 with ``--small``), ``update_proj_gap=200``, ``scale=0.25``; embeddings, norms and the LM head
are plain groups. lr 1e-3, weight decay 1e-2 everywhere; Adafactor with an external lr (``relative_step=False``,
``scale_parameter=False``, as the HF Trainer sets it for GaLore; the ``-scaled`` row keeps ``scale_parameter``, so its
step reads RMS(p) of the full weights); LARS with momentum 0.9.

    cd /tmp && python /path/to/repo/bench/galore.py --small --grads backward           # ~11M parameters, quick
    cd /tmp && python /path/to/repo/bench/galore.py --grads backward --json galore.json  # ~148M parameters

The step times are for steps that do not refresh the projector (199 of every 200); the first step (state allocation and
one SVD per projected matrix) is reported in the notes, and the refresh's SVD cost on its own in the second table.
Gradients: ``--grads backward`` (one real forward/backward) gives the SVD-quality table a real gradient spectrum; random
gradients have a flat one, the worst case for a randomized SVD. galore-torch's ``GaLoreAdamW8bit`` overwrites each
projected ``p.grad`` (the fixed gradients are re-attached before its steps) and calls ``torch.cuda.synchronize()``
after every parameter (a no-op for its row on a CPU run).
(Run from outside the repository root; see bench/README.md.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import statistics
import sys
import time
from typing import Callable

import torch

from common import (
    BASELINE,
    LLAMA_PRESETS,
    OPTIMIZERS,
    Result,
    build_llama,
    fixed_grads,
    machine_info,
    parse_bench_args,
    print_table,
    run_benchmark,
    run_rows,
    state_bytes as _common_state_bytes,
)

Factory = Callable[..., torch.optim.Optimizer]
TARGETS = ["attn", "mlp"]
_EXTERNAL_LR = dict(relative_step=False, scale_parameter=False)
_SETTINGS: dict = {}  # rank and projected parameter indices, set by main() before any factory runs


def _groups(params: list[torch.Tensor], **galore_extra) -> list[dict]:
    projected = set(_SETTINGS["projected"])
    galore = dict(
        params=[p for i, p in enumerate(params) if i in projected],
        rank=_SETTINGS["rank"],
        update_proj_gap=200,
        scale=0.25,
        proj_type="std",
        **galore_extra,
    )
    return [dict(params=[p for i, p in enumerate(params) if i not in projected]), galore]


def _lowmemopt(cls_name: str, bits: int | None = None, **fixed) -> Factory:
    def make(params, lr, weight_decay):
        import lowmemopt

        storage = {} if bits is None else dict(state_bits=bits)
        return getattr(lowmemopt, cls_name)(_groups(params), lr=lr, weight_decay=weight_decay, **storage, **fixed)

    return make


class _GaLoreTorch8bit:
    """galore-torch's ``GaLoreAdamW8bit`` for a benchmark: it replaces each projected ``p.grad`` by the low-rank
    gradient (a training loop makes a new one each step), so the fixed gradients are re-attached before every step; on a
    CPU run its ``torch.cuda.synchronize()`` calls are made no-ops."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer, self.state = optimizer, optimizer.state
        self.grads = {p: p.grad for g in optimizer.param_groups for p in g["params"]}

    def step(self):
        for p, g in self.grads.items():
            p.grad = g
        real = torch.cuda.synchronize
        if not torch.cuda.is_available():
            torch.cuda.synchronize = lambda *a, **k: None
        try:
            return self.optimizer.step()
        finally:
            torch.cuda.synchronize = real


def _galore_torch(cls_name: str, **fixed) -> Factory:
    def make(params, lr, weight_decay):
        import galore_torch

        if cls_name == "GaLoreAdamW":
            fixed.setdefault("no_deprecation_warning", True)
        opt = getattr(galore_torch, cls_name)(_groups(params), lr=lr, weight_decay=weight_decay, **fixed)
        return _GaLoreTorch8bit(opt) if cls_name == "GaLoreAdamW8bit" else opt

    return make


GALORE: dict[str, Factory] = {
    BASELINE: OPTIMIZERS[BASELINE],
    "lowmemopt-adamw-32bit (full rank)": OPTIMIZERS["lowmemopt-adamw-32bit"],
    "galore-torch-adamw": _galore_torch("GaLoreAdamW"),
    "lowmemopt-galore-adamw-32bit": _lowmemopt("GaLoreAdamW"),
    "galore-torch-adamw8bit": _galore_torch("GaLoreAdamW8bit"),
    "lowmemopt-galore-adamw-8bit": _lowmemopt("GaLoreAdamW8bit"),
    "galore-torch-adafactor": _galore_torch("GaLoreAdafactor", **_EXTERNAL_LR),
    "lowmemopt-galore-adafactor-32bit": _lowmemopt("GaLoreAdafactor", **_EXTERNAL_LR),
    "lowmemopt-galore-came-8bit": _lowmemopt("CAME", 8),
    "lowmemopt-galore-adafactor-8bit-scaled": _lowmemopt("Adafactor", 8, beta1=0.9, relative_step=False),
    "lowmemopt-galore-lamb-8bit": _lowmemopt("LAMB", 8),
    "lowmemopt-galore-lars-8bit": _lowmemopt("LARS", 8, momentum=0.9),
}


def galore_state_bytes(optimizer) -> int:
    """State bytes, galore-torch's projector included: its ``GaLoreProjector`` objects hold the basis, which the generic
    counter in common.py does not open (lowmemopt keeps it as a plain ``galore.proj`` tensor, counted already)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    total = _common_state_bytes(inner)
    for st in inner.state.values():
        proj = st.get("projector") if isinstance(st, dict) else None
        if proj is not None and proj.ortho_matrix is not None:
            mats = proj.ortho_matrix if isinstance(proj.ortho_matrix, list) else [proj.ortho_matrix]
            total += sum(m.numel() * m.element_size() for m in mats)
    return total


def _run(name: str, reference, grads, args, device, partner=None) -> Result:
    """run_benchmark, plus galore-torch's projector bytes and the first (refresh) step's time in the note.
    ``partner``: the baseline's step, timed alternately (paired ratios, see lowmemopt.benchmark.time_steps)."""
    import lowmemopt.benchmark as common  # run_benchmark looks these two up in its own module

    first: list[float] = []
    real_time_steps = common.time_steps

    def time_steps(step, **kw):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first.append(time.perf_counter() - t0)
        return real_time_steps(step, **kw)

    real_state_bytes = common.state_bytes
    common.time_steps, common.state_bytes = time_steps, galore_state_bytes
    try:
        r = run_benchmark(
            name,
            reference,
            grads,
            steps=args.steps,
            warmup=args.warmup,
            device=device,
            max_step_s=args.max_step_s,
            factory=GALORE[name],
            partner=partner,
        )
    finally:
        common.time_steps, common.state_bytes = real_time_steps, real_state_bytes
    if first and not r.error:
        r.note = (f"first step {first[0]:.2f} s" + (f"; {r.note}" if r.note else "")).strip()
    if name == "galore-torch-adamw8bit" and device.type == "cpu" and not r.error:
        r.note += "; torch.cuda.synchronize no-op'd"
    return r


def svd_table(shapes_grads: list[torch.Tensor], rank: int, repeats: int = 1) -> dict:
    """Time one refresh of every projected matrix with the full and the randomized SVD (lowmemopt's compute_basis,
    fp32 on the gradient's device), and compare the randomized bases with the full ones."""
    from lowmemopt.projection import captured_energy, principal_angles
    from lowmemopt.projection.projector import choose_side, compute_basis

    def sync():
        if shapes_grads[0].is_cuda:
            torch.cuda.synchronize()

    out = {}
    bases = {}
    for method in ("full", "randomized"):
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            bases[method] = [compute_basis(g, rank, choose_side("std", *g.shape), method, seed=0) for g in shapes_grads]
            sync()
            times.append(time.perf_counter() - t0)
        out[f"{method}_s"] = min(times)
    mean_angles, max_angles, energy, ratios = [], [], [], []
    for g, full, rand in zip(shapes_grads, bases["full"], bases["randomized"]):
        ((key, f),) = full.items()
        r = rand[key]
        # stored transposed: P^T (k x m) for the left side, Q^T (n x k) for the right; compare column spans
        f_cols, r_cols = (f.t(), r.t()) if f.shape[0] < f.shape[1] else (f, r)
        theta = principal_angles(f_cols, r_cols)
        mean_angles.append(float(theta.mean()))
        max_angles.append(float(theta.max()))
        a = g if f.shape[0] < f.shape[1] else g.t()  # the side the columns live on
        energy.append(captured_energy(a, f_cols))
        ratios.append(captured_energy(a, r_cols) / energy[-1])
    out.update(
        matrices=len(shapes_grads),
        speedup=out["full_s"] / out["randomized_s"],
        mean_angle_rad_median=statistics.median(mean_angles),
        max_angle_rad_median=statistics.median(max_angles),
        max_angle_rad_worst=max(max_angles),
        full_svd_energy_mean=statistics.fmean(energy),
        energy_ratio_mean=statistics.fmean(ratios),
        energy_ratio_worst=min(ratios),
    )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_bench_args(__doc__.split("\n\n")[0], GALORE, argv)


def main(argv: list[str] | None = None) -> int:
    rank_arg = None
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--rank" in argv:  # our one extra option, taken out before the shared parser sees the rest
        i = argv.index("--rank")
        rank_arg = int(argv[i + 1])
        del argv[i : i + 2]
    args = parse_args(argv)
    device = torch.device(args.device)
    preset = "10m" if args.small else "150m"
    rank = rank_arg or (64 if args.small else 256)

    info = machine_info(device)
    info["galore_torch"] = _dist_version("galore-torch")
    print("## GaLore: step time, state and SVD cost\n")
    for key, value in info.items():
        print(f"- {key}: {value}")

    import lowmemopt

    model = build_llama(preset, device=device)
    names = [n for n, _ in model.named_parameters()]
    groups = lowmemopt.galore_param_groups(model, TARGETS, rank=rank)
    projected_ids = {id(p) for p in groups[-1]["params"]}
    _SETTINGS.update(rank=rank, projected=[i for i, p in enumerate(model.parameters()) if id(p) in projected_ids])
    n_params = sum(p.numel() for p in model.parameters())
    n_proj = sum(p.numel() for p in groups[-1]["params"])
    print(
        f"- model: LlamaForCausalLM {LLAMA_PRESETS[preset]}, fp32, {n_params / 1e6:.1f}M parameters in "
        f"{len(names)} tensors; {len(projected_ids)} matrices ({n_proj / 1e6:.1f}M parameters) projected at rank "
        f"{rank} (target_modules={TARGETS})"
    )
    print(
        f"- gradients: {args.grads} (the same for every optimizer); warm-up {args.warmup}, timed {args.steps} steps, "
        "median reported"
    )
    print(
        "- ratios: to the baseline's own row\n"
        if args.unpaired
        else "- ratios: to the baseline's steps timed alternately with each optimizer's (paired)\n"
    )
    sys.stdout.flush()

    grads = fixed_grads(model, mode=args.grads)
    reference = [p.detach() for p in model.parameters()]
    del model

    results = run_rows(
        args.names,
        lambda name, partner: _run(name, reference, grads, args, device, partner),
        None if args.unpaired else GALORE[BASELINE],
        reference,
        grads,
        device,
    )
    print_table(results)
    by_name = {r.name: r for r in results}
    pairs = [
        ("lowmemopt-galore-adamw-32bit", "galore-torch-adamw"),
        ("lowmemopt-galore-adamw-8bit", "galore-torch-adamw8bit"),
        ("lowmemopt-galore-adafactor-32bit", "galore-torch-adafactor"),
        ("lowmemopt-galore-came-8bit", "galore-torch-adamw8bit"),
    ]
    lines = []
    for ours, theirs in pairs:
        a, b = by_name.get(ours), by_name.get(theirs)
        if a and b and a.median_s and b.median_s and a.state_bytes and b.state_bytes:
            lines.append(f"| {ours} / {theirs} | {a.state_bytes / b.state_bytes:.3f} | {a.median_s / b.median_s:.2f} |")
    if lines:
        print("\n| lowmemopt / galore-torch | state bytes ratio | step time ratio |\n| --- | ---: | ---: |")
        print("\n".join(lines))

    print(f"\n### One projector refresh: SVD of all {len(_SETTINGS['projected'])} projected gradients (rank {rank})\n")
    svd = svd_table([grads[i].float() for i in _SETTINGS["projected"]], rank, repeats=3)
    print(
        "| SVD | time (s), best of 3 | principal angles to the full SVD's subspace (rad): mean, median over "
        "matrices / largest, median / worst | gradient energy captured: fraction of ||G||^2 (mean) / relative to "
        "the full SVD, mean / worst |\n| --- | ---: | --- | --- |"
    )
    print(f"| full (torch.linalg.svd) | {svd['full_s']:.2f} | 0 / 0 / 0 | {svd['full_svd_energy_mean']:.4f} / 1 / 1 |")
    print(
        f"| randomized (8 oversamples, 2 power iterations) | {svd['randomized_s']:.2f} "
        f"({svd['speedup']:.2f}x) | {svd['mean_angle_rad_median']:.3g} / {svd['max_angle_rad_median']:.3g} / "
        f"{svd['max_angle_rad_worst']:.3g} | — / {svd['energy_ratio_mean']:.4f} / {svd['energy_ratio_worst']:.4f} |"
    )

    info["load_avg_1m_end"] = machine_info(device)["load_avg_1m"]
    print(
        f"\nload average (1 min) at start {info['load_avg_1m']}, at end {info['load_avg_1m_end']} "
        f"(torch uses {info['torch_threads']} threads; a higher load means contended timings)"
    )
    if args.json:
        payload = {
            "machine": info,
            "model": {
                "preset": preset,
                "config": LLAMA_PRESETS[preset],
                "n_params": n_params,
                "projected_params": n_proj,
                "rank": rank,
                "target_modules": TARGETS,
            },
            "settings": {
                "steps": args.steps,
                "warmup": args.warmup,
                "grads": args.grads,
                "baseline": BASELINE,
                "lr": 1e-3,
                "weight_decay": 1e-2,
                "update_proj_gap": 200,
                "scale": 0.25,
            },
            "results": [r.to_dict() for r in results],
            "svd": svd,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
