"""lowmemopt.traced_step: the traced peak of a training step (fake tensors) against the same step run for real on the
CPU and counted the same way (torch's storages, exact bytes), within 5%, on small LLaMA configs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lowmemopt.estimate import estimate, model_from_config  # noqa: E402
from lowmemopt.memtrace import LiveMemory  # noqa: E402
from lowmemopt.traced_step import build_optimizer, measure_step, real_model, step_workspace, trace_step  # noqa: E402


def _llama(hidden: int, intermediate: int, layers: int, heads: int, vocab: int) -> dict:
    return dict(model_type="llama", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=1024,
                tie_word_embeddings=False)


#: name -> (config, batch, seq); the parameter counts are what the names say, roughly
CONFIGS = {
    "10m": (_llama(256, 688, 4, 4, 8000), 4, 128),
    "40m": (_llama(512, 1376, 6, 8, 16000), 4, 256),
    "150m": (_llama(768, 2048, 12, 12, 32000), 2, 256),
}
#: (registry name, state_bits, GaLore rank, per-layer updates)
OPTIMIZERS = {
    "adamw32": ("adamw", 32, None, False),
    "adamw8": ("adamw", 8, None, False),
    "galore_adamw8_per_layer": ("galore_adamw_8bit", 8, 32, True),
    "came8": ("came", 8, None, False),
}
CELLS = [pytest.param(c, o, ck, id=f"{c}-{o}-{'ckpt' if ck else 'full'}",
                      marks=[pytest.mark.slow] if c != "10m" else [])
         for c in CONFIGS for o in OPTIMIZERS for ck in (False, True)]


@pytest.mark.parametrize("config,opt,checkpointing", CELLS)
def test_traced_peak_matches_the_real_step(config, opt, checkpointing):
    cfg, batch, seq = CONFIGS[config]
    name, bits, rank, per_layer = OPTIMIZERS[opt]
    kw = dict(batch=batch, seq=seq, galore_rank=rank, checkpointing=checkpointing, per_layer=per_layer)
    traced = trace_step(cfg, name, bits, device="cpu", **kw)
    real = measure_step(real_model(cfg), name, bits, **kw)
    assert abs(traced.peak / real.peak - 1) <= 0.05, (traced, real)
    # the parts that are laid out, not traced, are exact
    for part in ("weights", "optimizer state"):
        assert traced.at_peak[part] == real.at_peak[part], part
    assert traced.params == real.params


def test_the_trace_counts_what_the_layout_estimate_counts():
    """Weights and optimizer state at the traced peak are the meta layout's (exact, :func:`estimate`), and the
    activations grow with the batch while the rest does not."""
    cfg, batch, seq = CONFIGS["10m"]
    meta = model_from_config(cfg)
    layout = estimate(meta, "adamw", 8)
    buffers = sum(b.numel() * b.element_size() for b in meta.buffers())  # (the rotary frequencies)
    small = trace_step(cfg, "adamw", 8, batch=1, seq=seq, device="cpu")
    large = trace_step(cfg, "adamw", 8, batch=4, seq=seq, device="cpu")
    for t in (small, large):
        assert t.at_peak["weights"] == layout.weights + buffers and t.at_peak["optimizer state"] == layout.state
    assert large.peak - large.at_peak["weights"] - large.at_peak["optimizer state"] > \
        3.5 * (small.peak - small.at_peak["weights"] - small.at_peak["optimizer state"])


def test_checkpointing_and_per_layer_updates_lower_the_traced_peak():
    cfg = _llama(256, 688, 8, 4, 2000)
    plain = trace_step(cfg, "adamw", 32, batch=8, seq=128, device="cpu")
    ckpt = trace_step(cfg, "adamw", 32, batch=8, seq=128, checkpointing=True, device="cpu")
    both = trace_step(cfg, "adamw", 32, batch=8, seq=128, checkpointing=True, per_layer=True, device="cpu")
    assert ckpt.at_peak["activations"] < plain.at_peak["activations"] / 2
    assert both.peak < ckpt.peak
    assert both.at_peak["gradients"] < ckpt.at_peak["gradients"] or ckpt.at_peak["gradients"] == 0


def test_galore_step_workspace_by_construction():
    """A GaLore matrix's update holds its low-rank gradient and update, the full-size update and, at a basis
    refresh, the SVD's factors; a per-layer step holds one matrix's, a whole step all the low-rank gradients."""
    cfg = _llama(128, 256, 2, 4, 500)
    model = model_from_config(cfg, torch.bfloat16)
    opt = build_optimizer(model, "galore_adamw_8bit", 8, 16)
    each = step_workspace(opt, "cuda", per_layer=True)
    whole = step_workspace(opt, "cuda")
    m, n = 256, 128  # gate / up: the largest
    k = min(m, n)
    refresh = m * n * 4 + (m * k + k * n + k) * 4
    assert max(each.values()) == refresh  # (rank 16: the refresh holds more than a steady update)
    assert sum(each.values()) > whole[None] > max(each.values())
    assert step_workspace(build_optimizer(model, "adamw", 8), "cuda") == {}


def test_live_memory_counts_a_storage_once_and_forgets_it_when_freed():
    tracker = LiveMemory()
    with tracker:
        a = torch.empty(1000)
        b = a.view(10, 100)  # the same storage
        assert tracker.total == 4000
        c = torch.empty(10, dtype=torch.float64)
        assert tracker.total == 4080 and tracker.peak == 4080
        del a, b
        assert tracker.total == 80
    tracker.hold(100)
    assert tracker.peak == 4080 and tracker.total == 80
    tracker.hold(5000)
    assert tracker.peak == 5080 and tracker.at_peak["step workspace"] == 5000 and tracker.total == 80
    rounded = LiveMemory(round_to=512)
    with rounded:
        d = torch.empty(3)
    assert rounded.total == 512
    del c, d
