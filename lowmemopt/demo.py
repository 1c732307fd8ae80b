"""A short, offline training run for trying optimizers: a byte-level language model on the Python standard library's own
source (present on every machine, no download): a small MLP (:func:`train_bytes`) or a LLaMA-style transformer
(:func:`train_llama_bytes`, needs transformers). :func:`compare` runs several optimizers on the LLaMA model for
``lowmemopt demo``, measuring state and peak memory (:mod:`lowmemopt.memory`), step time and loss; :func:`table` and
:func:`plot` show the results. Also used by ``examples/quickstart.py`` and the end-to-end tests."""

from __future__ import annotations

import gc
import statistics
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "stdlib_bytes",
    "file_bytes",
    "ByteMLP",
    "LLAMA_BYTES",
    "train_bytes",
    "train_llama_bytes",
    "Choice",
    "DEMO_CHOICES",
    "choice",
    "compare",
    "table",
    "figure",
    "plot",
    "twins",
]


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


def file_bytes(path: str | Path) -> torch.Tensor:
    """A text (any) file's bytes as int64, for training on your own data; raises ValueError if it is too short."""
    data = Path(path).read_bytes()
    if len(data) < 1024:
        raise ValueError(f"{path}: {len(data)} bytes; the demo needs at least 1024 bytes of text")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


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
    """Train a fresh :class:`ByteMLP`; returns the losses, the mean of the last 20 (``final``), the held-out loss
    (:func:`heldout_loss`), state bytes and the median step times."""
    torch.manual_seed(seed)
    model = ByteMLP()

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(windows[:, :-1]), windows[:, -1])

    # one prediction per window: 4096 windows, as many predictions as the LLaMA's 64 windows of 64 bytes
    return _fit(model, loss_of, make_optimizer, steps, seed, batch, model.context + 1, data, heldout_windows=4096)


def train_llama_bytes(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    steps: int,
    seed: int = 0,
    batch: int = 8,
    seq: int = 64,
    data: torch.Tensor | None = None,
    config: dict | None = None,
) -> dict:
    """Train a fresh ``LlamaForCausalLM`` (:data:`LLAMA_BYTES`) on byte windows, as :func:`train_bytes`."""
    model = _llama(seed, config)

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        return model(input_ids=windows, labels=windows).loss

    return _fit(model, loss_of, make_optimizer, steps, seed, batch, seq, data)


def _llama(seed: int, config: dict | None = None, device: str | torch.device = "cpu") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA_BYTES, **(config or {})})).to(device)


def _fit(
    model,
    loss_of,
    make_optimizer,
    steps,
    seed,
    batch,
    width,
    data,
    on_step=None,
    memory=None,
    heldout_windows: int = 64,
) -> dict:
    """The training loop: seeded random windows, ``loss_of(windows)``, one optimizer step each, ``memory`` sampled."""
    data = stdlib_bytes() if data is None else data
    opt = make_optimizer(list(model.parameters()))
    sample = memory.sample if memory is not None else (lambda: None)
    gen = torch.Generator().manual_seed(seed + 1)
    losses, step_times, times = [], [], []
    for t in range(steps):
        t_start = time.perf_counter()
        idx = torch.randint(0, data.numel() - width, (batch,), generator=gen)
        windows = data[idx.unsqueeze(1) + torch.arange(width)].to(_device_of(model))
        loss = loss_of(windows)
        sample()
        opt.zero_grad()
        loss.backward()
        sample()
        t0 = time.perf_counter()
        opt.step()
        _sync(model)
        t1 = time.perf_counter()
        sample()
        step_times.append(t1 - t0)
        times.append(t1 - t_start)
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(t, losses[-1])
    tail = losses[-20:]
    heldout = heldout_loss(loss_of, data, width, _device_of(model), heldout_windows)
    state = sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    # median: the first steps may compile the CPU fast path (seconds, once)
    step_s = statistics.median(step_times) if step_times else 0.0
    train_step_s = statistics.median(times) if times else 0.0
    return dict(
        losses=losses,
        final=sum(tail) / len(tail),
        heldout=heldout,
        state_bytes=state,
        step_s=step_s,
        train_step_s=train_step_s,
        state_bits=opt.defaults.get("state_bits"),
    )


#: the held-out windows' generator seed: a fixed set of windows, the same for every run and not drawn from the
#: training stream's generator
HELDOUT_SEED = 12345


def heldout_loss(
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    data: torch.Tensor,
    width: int,
    device: torch.device | str = "cpu",
    n: int = 64,
) -> float:
    """The loss on ``n`` fixed windows of ``width`` bytes (:data:`HELDOUT_SEED`), without gradients: a final loss
    that does not depend on which batches happened to come last in training."""
    gen = torch.Generator().manual_seed(HELDOUT_SEED)
    idx = torch.randint(0, data.numel() - width, (n,), generator=gen)
    with torch.no_grad():
        return float(loss_of(data[idx.unsqueeze(1) + torch.arange(width)].to(device)))


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _sync(model: torch.nn.Module) -> None:
    device = _device_of(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------------------------
# lowmemopt demo: several optimizers on the LLaMA model, same batches


@dataclass
class Choice:
    """One optimizer of the demo: a registry name (:mod:`lowmemopt.registry`), its keywords, optional GaLore groups."""

    name: str
    label: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    galore: dict[str, Any] | None = None

    def make(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        import lowmemopt
        from .registry import model_params, resolve_optimizer

        resolved = resolve_optimizer(self.name)
        if self.galore is not None:
            params: Any = lowmemopt.galore_param_groups(model, **self.galore)
        else:
            params = model_params(resolved.cls, model)
        return resolved.cls(params, **{**resolved.kwargs, **self.kwargs})

    def settings(self) -> str:
        """The hyper-parameters this run uses, for the legend and the table: ``lr 2e-3, wd 0.01``, and for GaLore
        groups ``GaLore rank 48, scale 1, new subspace every 100 steps``."""
        parts = [f"lr {_short_number(self.kwargs['lr'])}"] if "lr" in self.kwargs else []
        if self.kwargs.get("weight_decay"):
            parts.append(f"wd {_short_number(self.kwargs['weight_decay'])}")
        if self.galore is not None:
            g = self.galore
            parts.append(
                f"GaLore rank {g.get('rank')}, scale {_short_number(g.get('scale', 0.25))}, "
                f"new subspace every {g.get('update_proj_gap', 200)} steps"
            )
        return ", ".join(parts)

    def algorithm(self) -> str:
        """The algorithm's class name (``AdamW`` for ``adamw8bit``), ``GaLore-`` in front for GaLore groups: runs with
        the same algorithm differ only in their storage options."""
        from .registry import resolve_optimizer

        cls = resolve_optimizer(self.name).cls
        base = next((k for k in cls.__mro__ if k.__module__.startswith("lowmemopt.optim.")), cls)
        return ("GaLore-" if self.galore is not None else "") + base.__name__


def _short_number(x: float) -> str:
    """``0.002`` -> ``2e-3``, ``0.01`` -> ``0.01``, ``1.0`` -> ``1``: a hyper-parameter as a reader writes it."""
    if x != 0 and abs(x) < 1e-2:
        mantissa, exponent = f"{x:e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    return f"{x:g}"


#: the demo's default optimizers, each with its own learning rate (not a tuned comparison of the algorithms: AdamW
#: 8-bit against 32-bit is the like-for-like pair). CAME's lr: 5e-4 and up are unstable on this model (see
#: tests/test_training.py).
DEMO_CHOICES: dict[str, Choice] = {
    "adamw": Choice("adamw", "AdamW 32-bit", dict(lr=2e-3, weight_decay=0.01)),
    "adamw8bit": Choice("adamw8bit", "AdamW 8-bit", dict(lr=2e-3, weight_decay=0.01)),
    "came8bit": Choice("came8bit", "CAME 8-bit", dict(lr=2e-4, weight_decay=0.01)),
    "galore_came8bit": Choice(
        "came8bit",
        "GaLore-CAME 8-bit",
        dict(lr=2e-4, weight_decay=0.01),
        galore=dict(target_modules="all-linear", rank=48, update_proj_gap=100, scale=1.0),
    ),
}


def choice(name: str, lr: float | None = None) -> Choice:
    """The demo's preset for ``name`` (see :data:`DEMO_CHOICES`), else any lowmemopt optimizer by name with
    ``lr=1e-3``; ``lr`` overrides the learning rate. Raises ValueError for unknown names."""
    from .registry import resolve_optimizer

    key = name.strip().lower().replace("-", "_")
    if key in DEMO_CHOICES:
        c = DEMO_CHOICES[key]
        c = Choice(c.name, c.label, dict(c.kwargs), None if c.galore is None else dict(c.galore))
    else:
        resolved = resolve_optimizer(name)
        galore = dict(target_modules="all-linear", rank=48, update_proj_gap=100, scale=1.0) if resolved.galore else None
        c = Choice(name, name, dict(lr=1e-3), galore)
    if lr is not None:
        c.kwargs["lr"] = lr
    return c


def compare(
    choices: Sequence[Choice],
    steps: int = 300,
    *,
    data: torch.Tensor | None = None,
    seed: int = 0,
    batch: int = 8,
    seq: int = 64,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Train a fresh :data:`LLAMA_BYTES` model (same init, same batches) with each choice for ``steps`` steps.

    Each result: ``label``, ``name``, ``algorithm`` (:meth:`Choice.algorithm`), ``settings`` (:meth:`Choice.settings`),
    ``state_bits``, ``losses``, ``final``
    (mean of the last 20 steps' losses), ``heldout`` (:func:`heldout_loss`),
    ``state_bytes``, ``peak_bytes`` (peak memory in use above what was in use before the model was built: weights,
    gradients, state, activations; None where it cannot be measured), ``step_s`` (median ``optimizer.step()``) and
    ``train_step_s`` (median whole step), or ``skipped`` (a reason) for a choice this lowmemopt cannot run (GaLore
    before it is available). Before measuring, each choice takes three steps on a throw-away model, so one-time
    compilation stays out of the time and memory."""
    import lowmemopt
    from .memory import PeakMemory

    data = stdlib_bytes() if data is None else data
    if data.numel() <= seq + 1:
        raise ValueError(f"the data has {data.numel()} bytes; it needs more than seq + 1 = {seq + 1}")
    results = []
    for c in choices:
        if c.galore is not None and not hasattr(lowmemopt, "galore_param_groups"):
            results.append(dict(label=c.label, skipped="GaLore is not available in this version of lowmemopt"))
            continue
        _run_choice(c, 3, data, seed, batch, seq, device, None, None)  # warm-up: compile (2 graphs), first touch
        gc.collect()
        memory = PeakMemory(device)
        bar = _progress(steps, c.label) if progress else None
        try:
            r = _run_choice(c, steps, data, seed, batch, seq, device, bar, memory)
        finally:
            if bar is not None:
                bar.close()
        results.append(
            dict(
                label=c.label, name=c.name, algorithm=c.algorithm(), settings=c.settings(), peak_bytes=memory.peak, **r
            )
        )
        gc.collect()
    return results


def _run_choice(c: Choice, steps, data, seed, batch, seq, device, bar, memory) -> dict:
    model = _llama(seed, device=device)

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        return model(input_ids=windows, labels=windows).loss

    def on_step(t: int, loss: float) -> None:
        bar.update(1)
        if t % 10 == 0 or t == steps - 1:  # one step's loss; the table's final loss is the mean of the last 20
            bar.set_postfix({"this step's loss": f"{loss:.3f}"}, refresh=False)

    return _fit(
        model,
        loss_of,
        lambda params: c.make(model),
        steps,
        seed,
        batch,
        seq,
        data,
        on_step=on_step if bar is not None else None,
        memory=memory,
    )


def _progress(steps: int, label: str):
    from tqdm.auto import tqdm

    return tqdm(total=steps, desc=f"{label:<18}", unit="step", dynamic_ncols=True)


def table(results: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of :func:`compare`'s results."""
    lines = [
        "| optimizer | settings | state memory | peak memory | optimizer step | train step "
        "| final loss (mean of last 20 steps) | held-out loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['label']} | — | — | — | — | — | — | skipped: {r['skipped']} |")
            continue
        peak = "n/a" if r["peak_bytes"] is None else _mib(r["peak_bytes"])
        lines.append(
            f"| {r['label']} | {r.get('settings', '')} | {_mib(r['state_bytes'])} | {peak} | "
            f"{r['step_s'] * 1e3:.1f} ms | {r['train_step_s'] * 1e3:.1f} ms | {r['final']:.4f} | "
            f"{r['heldout']:.4f} |"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


#: line style and marker per curve, in order: curves that lie on top of each other (AdamW 32-bit under 8-bit) still
#: show as different lines
_STYLES = [("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 1)), "P")]


def twins(results: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(low-bit result, its 32-bit twin) pairs of :func:`compare`'s results: same ``algorithm`` (optimizer class and
    GaLore or not), the first at 16 or 8 bits, the second at 32."""
    ran = [r for r in results if "skipped" not in r and r.get("algorithm") and r.get("state_bits")]
    full = {r["algorithm"]: r for r in ran if r["state_bits"] == 32}
    return [(r, full[r["algorithm"]]) for r in ran if r["state_bits"] < 32 and r["algorithm"] in full]


def _smooth(losses: Sequence[float], k: int = 20) -> tuple[list[int], list[float]]:
    """Steps and the ``k``-step moving average (the average of steps ``t-k+1..t`` plotted at ``t``)."""
    x = torch.tensor(losses, dtype=torch.float64)
    k = max(1, min(k, len(x)))
    return list(range(k, len(x) + 1)), x.unfold(0, k, 1).mean(1).tolist()


def figure(results: Sequence[dict[str, Any]], title: str = ""):
    """The demo's figure: smoothed loss curves, 8-bit (16-bit) minus 32-bit loss, state and peak memory bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if "skipped" not in r]
    pairs = twins(ran)
    widths = [3, 2, 2] if pairs else [3, 2]
    fig, axes = plt.subplots(1, len(widths), figsize=(4.4 * len(widths), 4.2), gridspec_kw=dict(width_ratios=widths))
    ax_loss, ax_mem = axes[0], axes[-1]
    colors = {}
    n = max((len(r["losses"]) for r in ran), default=1)
    for i, r in enumerate(ran):
        style, marker = _STYLES[i % len(_STYLES)]
        x, y = _smooth(r["losses"])
        every = max(1, n // 8)
        label = r["label"] + (f"\n({r['settings']})" if r.get("settings") else "")
        (line,) = ax_loss.plot(
            x,
            y,
            label=label,
            ls=style,
            marker=marker,
            ms=5,
            lw=max(1.0, 2.6 - 0.35 * i),
            markevery=(min(len(x) - 1, i * every // max(1, len(ran))), every),
            zorder=3 + i,
            markerfacecolor="none" if i % 2 else None,
        )
        colors[r["label"]] = line.get_color()
        ax_loss.plot(range(1, len(r["losses"]) + 1), r["losses"], color=line.get_color(), alpha=0.12, lw=0.8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (nats/byte)")
    ax_loss.set_title("loss (20-step moving average)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=7, loc="upper right")
    if pairs:
        ax_diff = axes[1]
        ax_diff.axhline(0.0, color="0.3", lw=0.8)
        for low, full in pairs:
            m = min(len(low["losses"]), len(full["losses"]))
            x, y = _smooth([a - b for a, b in zip(low["losses"][:m], full["losses"][:m])])
            ax_diff.plot(x, y, color=colors[low["label"]], lw=1.6, label=f"{low['label']} − {full['label']}")
        ax_diff.set_xlabel("step")
        ax_diff.set_ylabel("loss difference (nats/byte)")
        low_bits = "/".join(f"{b}-bit" for b in sorted({low["state_bits"] for low, _ in pairs}, reverse=True))
        ax_diff.set_title(f"{low_bits} − 32-bit loss (20-step average)")
        ax_diff.grid(alpha=0.3)
        ax_diff.legend(fontsize=8)
    x = range(len(ran))
    state = [r["state_bytes"] / 2**20 for r in ran]
    bars = [ax_mem.bar([i - 0.2 for i in x], state, width=0.4, label="optimizer state")]
    if any(r.get("peak_bytes") is not None for r in ran):
        peak = [(r["peak_bytes"] or 0) / 2**20 for r in ran]
        bars.append(ax_mem.bar([i + 0.2 for i in x], peak, width=0.4, label="peak memory"))
    for b in bars:
        ax_mem.bar_label(b, fmt="%.1f", fontsize=7, padding=1)
    ax_mem.set_xticks(list(x), [r["label"].replace(" ", "\n", 1) for r in ran], fontsize=8)
    ax_mem.set_ylabel("MiB")
    ax_mem.set_title("memory (MiB)")
    ax_mem.margins(y=0.12)
    ax_mem.legend(fontsize=8)
    ax_mem.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


#: the PNG's resolution (dots per inch) and palette size: a plot of a few flat colours keeps its look in 128 colours at
#: about a third of the bytes of full RGBA (76 KB instead of 210 KB for the default demo)
DPI = 150
PALETTE_COLORS = 128


def plot(results: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Write :func:`figure` as a PNG at :data:`DPI` (a palette image of :data:`PALETTE_COLORS`); returns the path."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image  # a dependency of matplotlib

    fig = figure(results, title)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, dpi=DPI, format="png")
    finally:
        plt.close(fig)
    buffer.seek(0)
    image = Image.open(buffer).convert("RGB").quantize(PALETTE_COLORS, dither=Image.Dither.NONE)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="png", optimize=True, dpi=(DPI, DPI))
    return path
