"""4-bit optimizer state: training loss against 32 bits, and state bytes and step time against torchao's AdamW4bit.

    cd /tmp && python /path/to/lowmemopt/bench/fourbit.py                # LLaMA (demo config), 300 steps, ~5 min on CPU
    python /path/to/lowmemopt/bench/fourbit.py --model mlp --steps 150   # the byte MLP: seconds
    python /path/to/lowmemopt/bench/fourbit.py --maps                    # the 4-bit map candidates' error on Adam state
    python /path/to/lowmemopt/bench/fourbit.py --seeds 0,1,2 --optimizers 'CAME 32-bit,CAME 4-bit'  # gaps per seed

Training: a fresh, randomly initialised model of :mod:`lowmemopt.demo` (``llama``: ``LLAMA_BYTES``, 1.9M parameters;
``mlp``: the byte MLP) on the Python standard library's source, the same batches for every optimizer; the loss is the
final model's loss on fixed held-out windows (:func:`lowmemopt.demo.heldout_loss`). Each 4-bit run is compared with its
32-bit twin (target: within 2%). Step time is the median ``opt.step()`` (torchao's first steps compile).

``--maps``: trains fp32 AdamW, then quantizes its state with each candidate 4-bit map (block 128) and prints the
relative L2 error of the update ``m_hat / (sqrt(v_hat) + eps)`` rebuilt from it: how the maps of
:mod:`lowmemopt.quant.q4` were chosen.
"""

from __future__ import annotations

import argparse
import sys

import torch

import lowmemopt
from lowmemopt.demo import train_bytes, train_llama_bytes
from lowmemopt.quant import q4

#: (label, optimizer factory, its 32-bit twin's label); hyper-parameters per model
RUNS = {
    "llama": dict(adamw=dict(lr=1e-3, weight_decay=0.01), came=dict(lr=2e-4, weight_decay=0.01)),
    "mlp": dict(adamw=dict(lr=3e-3, weight_decay=0.01), came=dict(lr=1e-3, weight_decay=0.01)),
}


def optimizers(model: str, torchao: bool = True) -> dict:
    kw = RUNS[model]
    out = {
        "AdamW 32-bit": lambda p: lowmemopt.AdamW(p, **kw["adamw"]),
        "AdamW 8-bit": lambda p: lowmemopt.AdamW(p, state_bits=8, **kw["adamw"]),
        "AdamW 4-bit": lambda p: lowmemopt.AdamW(p, state_bits=4, **kw["adamw"]),
        "CAME 32-bit": lambda p: lowmemopt.CAME(p, **kw["came"]),
        "CAME 4-bit": lambda p: lowmemopt.CAME(p, state_bits=4, **kw["came"]),
    }
    if torchao:
        try:
            from torchao.optim import AdamW4bit
        except ImportError:
            print("torchao not installed: its AdamW4bit row is skipped", file=sys.stderr)
        else:
            # torchao's default: block 128, and tensors under 4096 elements keep fp32 state (as lowmemopt's)
            out["torchao AdamW4bit"] = lambda p: AdamW4bit(p, **kw["adamw"])
    return out


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors. A tensor subclass (torchao's 4-bit state) counts its inner tensors
    (codes and scales; its 16-entry code book too), not the fp32 size it presents."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if not isinstance(v, torch.Tensor):
                continue
            if type(v) is not torch.Tensor and hasattr(v, "__tensor_flatten__"):
                names, _ = v.__tensor_flatten__()
                total += sum(getattr(v, n).numel() * getattr(v, n).element_size() for n in names)
            else:
                total += v.numel() * v.element_size()
    return total


def train(model: str, make, steps: int, seed: int = 0) -> dict:
    fit = train_llama_bytes if model == "llama" else train_bytes
    holder = {}

    def make_and_keep(p):
        holder["opt"] = make(p)
        return holder["opt"]

    r = fit(make_and_keep, steps, seed=seed)
    r["state_bytes"] = state_bytes(holder["opt"])
    return r


def n_params(model: str) -> int:
    from lowmemopt.demo import ByteMLP, _llama

    m = _llama(0) if model == "llama" else ByteMLP()
    return sum(p.numel() for p in m.parameters())


def run(model: str, steps: int, seed: int = 0, names: list[str] | None = None, torchao: bool = True) -> list[dict]:
    rows = []
    for name, make in optimizers(model, torchao).items():
        if names and name not in names:
            continue
        r = train(model, make, steps, seed)
        rows.append(
            dict(name=name, heldout=r["heldout"], final=r["final"], state_bytes=r["state_bytes"], step_s=r["step_s"])
        )
        print(f"  {name}: held-out {r['heldout']:.4f}", file=sys.stderr)
    return rows


def table(rows: list[dict], numel: int) -> str:
    base = {r["name"].split()[0]: r["heldout"] for r in rows if r["name"].endswith("32-bit")}
    lines = [
        "| optimizer | held-out loss | vs 32-bit | state bytes | B / param | step (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        family = "AdamW" if "AdamW" in r["name"] else r["name"].split()[0]
        ref = base.get(family)
        rel = f"{100 * (r['heldout'] - ref) / ref:+.2f}%" if ref else "—"
        lines.append(
            f"| {r['name']} | {r['heldout']:.4f} | {rel} | {r['state_bytes']:,} | "
            f"{r['state_bytes'] / numel:.3f} | {1e3 * r['step_s']:.2f} |"
        )
    return "\n".join(lines)


def _gaps(rows: list[dict]) -> dict[str, float]:
    """Each row's held-out loss relative to its 32-bit twin's, in percent (rows without a twin are left out)."""
    base = {r["name"].split()[0]: r["heldout"] for r in rows if r["name"].endswith("32-bit")}
    out = {}
    for r in rows:
        ref = base.get("AdamW" if "AdamW" in r["name"] else r["name"].split()[0])
        if ref and not r["name"].endswith("32-bit"):
            out[r["name"]] = 100 * (r["heldout"] - ref) / ref
    return out


def gap_table(per_seed: list[list[dict]], seeds: list[int]) -> str:
    """Loss gap to the 32-bit twin per seed, and the mean over seeds."""
    gaps = [_gaps(rows) for rows in per_seed]
    lines = [
        "| optimizer | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
        "| --- |" + " ---: |" * (len(seeds) + 1),
    ]
    for name in gaps[0]:
        vals = [g[name] for g in gaps]
        lines.append(f"| {name} | " + " | ".join(f"{v:+.2f}%" for v in vals) + f" | {sum(vals) / len(vals):+.2f}% |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# map candidates


def _candidates() -> tuple[dict, dict]:
    signed = {
        f"pow2 top7 {bits}": q4.signed_codes(q4.pow2_grid(bits)[-7:])
        for bits in [(1, 1, 0, 0, 0), (0, 1, 0, 0, 0, 0), (1, 1, 1, 0), (1, 0, 0, 0, 0, 0, 0), (0,) * 7]
    }
    unsigned = {
        f"pow2 {bits}": q4.pow2_grid(bits) + [1.0]
        for bits in [(1, 1, 1, 1, 1) + (0,) * 5, (1,) * 6 + (0,) * 3, (1,) * 4 + (0,) * 7, (1,) * 7 + (0,), (0,) * 15]
    }
    try:
        from torchao.optim.quant_utils import create_dynamic_map

        signed["torchao 4-bit dynamic"] = create_dynamic_map(True, 3, 4)
    except ImportError:
        pass
    signed["linear"] = [i / 8 for i in range(-7, 9)]
    unsigned["linear, zero-free (torchao, lpmm)"] = [i / 16 for i in range(1, 17)]
    unsigned["squares of linear, zero-free"] = [(i / 16) ** 2 for i in range(1, 17)]
    return signed, unsigned


def map_errors(steps: int, model: str = "llama", block_size: int = 128) -> str:
    holder = {}

    def make(p):
        holder["opt"] = torch.optim.AdamW(p, **RUNS[model]["adamw"])
        return holder["opt"]

    train(model, make, steps)
    states = [s for p, s in holder["opt"].state.items() if p.numel() >= 4096]
    m = torch.cat([s["exp_avg"].reshape(-1) for s in states])
    v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in states])
    b1, b2 = RUNS[model]["adamw"].get("betas", (0.9, 0.999))
    bc1, bc2 = 1 - b1**steps, 1 - b2**steps

    def update(m_, v_):
        return (m_ / bc1) / ((v_ / bc2).sqrt() + 1e-8)

    u = update(m, v)

    def err(uq):
        return float((uq - u).norm() / u.norm())

    def rt(x, name):
        nib, am = q4.quantize(x, name, block_size)
        return q4.dequantize(nib, am, x.numel(), name, block_size)

    signed, unsigned = _candidates()
    lines = [
        f"fp32 AdamW state of the {model} after {steps} steps ({m.numel():,} elements), block {block_size}: "
        "relative L2 error of m_hat / (sqrt(v_hat) + eps)",
        "",
        "| slot | map | error | mean log(v_q / v) |",
        "| --- | --- | ---: | ---: |",
    ]
    for label, codes in signed.items():
        q4.register_map("_cand", codes, signed=True)
        lines.append(f"| m | {label} | {err(update(rt(m, '_cand'), v)):.4f} | |")
    pos = v > 0
    for label, codes in unsigned.items():
        q4.register_map("_cand", codes, signed=False)
        vq = rt(v, "_cand")
        bias = float(torch.log(vq[pos] / v[pos]).mean())
        lines.append(f"| v | {label} | {err(update(m, vq)):.4f} | {bias:+.3f} |")
    both = err(update(rt(m, "pow2x4"), rt(v, "upow2x4")))
    lines.append(f"| m and v | pow2x4, upow2x4 (the state maps) | {both:.4f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("llama", "mlp"), default="llama")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--seeds",
        help="comma-separated seeds (e.g. 0,1,2): a table per seed, then each row's loss gap "
        "to its 32-bit twin per seed and its mean (one seed's gap is mostly the run's noise)",
    )
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--optimizers", help="comma-separated subset of the rows, e.g. 'AdamW 32-bit,AdamW 4-bit'")
    ap.add_argument("--maps", action="store_true", help="measure the 4-bit map candidates instead")
    args = ap.parse_args(argv)
    if args.maps:
        print(map_errors(args.steps, args.model))
        return 0
    names = [n.strip() for n in args.optimizers.split(",")] if args.optimizers else None
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    per_seed = []
    for seed in seeds:
        rows = run(args.model, args.steps, seed, names, torchao=not args.no_torchao)
        print(
            f"{args.model}, {args.steps} steps, seed {seed}, {n_params(args.model):,} parameters, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        print(table(rows, n_params(args.model)))
        per_seed.append(rows)
    if len(seeds) > 1:
        print(gap_table(per_seed, seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
