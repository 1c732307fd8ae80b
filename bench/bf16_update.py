"""bf16 / fp16 weights without an fp32 master copy: does ``bf16_update`` reach the fp32-weights loss?

A fine-tune at a small learning rate, where most AdamW updates are below half a bf16 ulp of their weight: a model is
first trained in fp32 (AdamW, lr 3e-3), then fine-tuned from that point four ways with the same batches: fp32
weights, and bf16 (or fp16) weights with ``bf16_update="nearest"`` / ``"stochastic"`` / ``"kahan"``. Printed: the
held-out loss before and after the fine-tune, the gap to fp32, and the optimizer step time relative to nearest.

    python bench/bf16_update.py                      # ByteMLP (seconds)
    python bench/bf16_update.py --dtype fp16         # fp16 weights (fp16's ulp is 8 times finer: try --lr 1e-5)
    python bench/bf16_update.py --model llama        # the demo's LLaMA (lowmemopt.demo.LLAMA_BYTES), shrunk
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import lowmemopt
from lowmemopt.demo import ByteMLP, heldout_loss, stdlib_bytes

MODES = ("fp32", "nearest", "stochastic", "kahan")


def _model(kind: str, seed: int) -> tuple[torch.nn.Module, int]:
    torch.manual_seed(seed)
    if kind == "mlp":
        m = ByteMLP()
        return m, m.context + 1
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowmemopt.demo import LLAMA_BYTES

    cfg = dict(LLAMA_BYTES, hidden_size=128, num_hidden_layers=2, intermediate_size=256)
    return LlamaForCausalLM(LlamaConfig(**cfg)), 33


def _loss_fn(kind: str, model: torch.nn.Module):
    if kind == "mlp":
        return lambda w: torch.nn.functional.cross_entropy(model(w[:, :-1]), w[:, -1])
    return lambda w: model(input_ids=w, labels=w).loss


def _train(kind, model, width, data, opt, steps, batch, seed):
    loss_of = _loss_fn(kind, model)
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        idx = torch.randint(0, data.numel() - width, (batch,), generator=gen)
        loss = loss_of(data[idx.unsqueeze(1) + torch.arange(width)])
        opt.zero_grad()
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run(
    kind: str = "mlp",
    pre_steps: int = 300,
    steps: int = 300,
    lr: float = 1e-4,
    batch: int = 64,
    seed: int = 0,
    modes=MODES,
    dtype: str = "bf16",
) -> dict:
    """Losses (held-out, fp32 evaluation of the weights) and median step times per mode; ``dtype``: the 16-bit
    weights' (``"bf16"`` or ``"fp16"``)."""
    data = stdlib_bytes()
    base, width = _model(kind, seed)
    _train(kind, base, width, data, lowmemopt.AdamW(base.parameters(), lr=3e-3), pre_steps, batch, seed + 1)
    heldout = lambda m: heldout_loss(_loss_fn(kind, m), data, width, n=2048 if kind == "mlp" else 128)  # noqa: E731
    out = {"start": heldout(base)}
    for mode in modes:
        model = copy.deepcopy(base)
        if mode != "fp32":
            model = model.to(DTYPES[dtype])
        opt = lowmemopt.AdamW(
            model.parameters(), lr=lr, weight_decay=0.0, bf16_update="nearest" if mode == "fp32" else mode
        )
        step_s = _train(kind, model, width, data, opt, steps, batch, seed + 2)
        out[mode] = dict(loss=heldout(model.float()), step_s=step_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "llama"), default="mlp")
    ap.add_argument("--pre-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the 16-bit weights' dtype")
    a = ap.parse_args()
    r = run(a.model, a.pre_steps, a.steps, a.lr, a.batch, dtype=a.dtype)
    ref = r["fp32"]["loss"]
    print(f"{a.model}: fine-tune {a.steps} steps at lr {a.lr:g} (AdamW) from held-out loss {r['start']:.4f}")
    print("| weights | held-out loss | vs fp32 | step time vs nearest |")
    print("| --- | --- | --- | --- |")
    for mode in MODES:
        name = "fp32" if mode == "fp32" else f"{a.dtype} {mode}"
        ratio = r[mode]["step_s"] / r["nearest"]["step_s"]
        print(f"| {name} | {r[mode]['loss']:.4f} | {100 * (r[mode]['loss'] / ref - 1):+.2f}% | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
