"""A short, offline training run for trying optimizers: a byte-level language model on the Python standard library's own
source (present on every machine, no download): a small MLP (:func:`train_bytes`) or a LLaMA-style transformer
(:func:`train_llama_bytes`, needs transformers). Used by ``examples/quickstart.py`` and the end-to-end tests."""

from __future__ import annotations

import statistics
import sysconfig
import time
from pathlib import Path
from typing import Callable

import torch

__all__ = ["stdlib_bytes", "ByteMLP", "LLAMA_BYTES", "train_bytes", "train_llama_bytes"]


def stdlib_bytes(limit: int = 400_000) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's top-level ``*.py`` files (sorted by name), as int64."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class ByteMLP(torch.nn.Module):
    """Predicts the next byte from the previous ``context`` bytes: embedding -> GELU MLP -> 256 logits."""

    def __init__(self, context: int = 8, dim: int = 48, hidden: int = 256):
        super().__init__()
        self.context = context
        self.embed = torch.nn.Embedding(256, dim)
        self.hidden = torch.nn.Linear(context * dim, hidden)
        self.out = torch.nn.Linear(hidden, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(1)
        return self.out(torch.nn.functional.gelu(self.hidden(h)))


#: a LLaMA-style byte-level LM (1.9M parameters): transformers' LlamaForCausalLM over the 256 byte values
LLAMA_BYTES = dict(
    vocab_size=256,
    hidden_size=192,
    num_hidden_layers=4,
    intermediate_size=512,
    num_attention_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def train_bytes(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    steps: int,
    seed: int = 0,
    batch: int = 128,
    data: torch.Tensor | None = None,
) -> dict:
    """Train a fresh :class:`ByteMLP`; returns losses, the mean of the last 20, state bytes and mean step time."""
    torch.manual_seed(seed)
    model = ByteMLP()

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(windows[:, :-1]), windows[:, -1])

    return _fit(model, loss_of, make_optimizer, steps, seed, batch, model.context + 1, data)


def train_llama_bytes(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    steps: int,
    seed: int = 0,
    batch: int = 8,
    seq: int = 64,
    data: torch.Tensor | None = None,
    config: dict | None = None,
) -> dict:
    """Train a fresh, randomly initialised ``LlamaForCausalLM`` (:data:`LLAMA_BYTES`, overridden by ``config``) on
    windows of ``seq`` bytes, next-byte loss at every position. Needs ``transformers``. Returns what
    :func:`train_bytes` returns."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA_BYTES, **(config or {})}))

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        return model(input_ids=windows, labels=windows).loss

    return _fit(model, loss_of, make_optimizer, steps, seed, batch, seq, data)


def _fit(model, loss_of, make_optimizer, steps, seed, batch, width, data) -> dict:
    """The training loop: random windows of ``width`` bytes (seeded), ``loss_of(windows)``, one optimizer step each."""
    data = stdlib_bytes() if data is None else data
    opt = make_optimizer(list(model.parameters()))
    gen = torch.Generator().manual_seed(seed + 1)
    losses, step_times = [], []
    for _ in range(steps):
        idx = torch.randint(0, data.numel() - width, (batch,), generator=gen)
        windows = data[idx.unsqueeze(1) + torch.arange(width)]
        loss = loss_of(windows)
        opt.zero_grad()
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        step_times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    tail = losses[-20:]
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    # median: the first steps may compile the CPU fast path (seconds, once)
    step_s = statistics.median(step_times) if step_times else 0.0
    return dict(losses=losses, final=sum(tail) / len(tail), state_bytes=state, step_s=step_s)
