"""The benchmark model (a LLaMA of a preset size, built from its config: no download), its fixed gradients, and
fresh copies of its parameters for each optimizer."""

from __future__ import annotations

from typing import Iterable

import torch

#: LLaMA shapes (SwiGLU MLP, untied embeddings). "150m" is GaLore's LLaMA-130M layout with 14 instead of 12 layers
#: (148.3M parameters; 12 layers give 134.1M); "10m" is a quick configuration with the same kinds of tensors.
LLAMA_PRESETS: dict[str, dict[str, int]] = {
    "150m": dict(
        hidden_size=768, num_hidden_layers=14, intermediate_size=2048, num_attention_heads=12, vocab_size=32000
    ),
    "10m": dict(hidden_size=256, num_hidden_layers=6, intermediate_size=688, num_attention_heads=4, vocab_size=12000),
}


def build_llama(preset: str = "150m", device: str | torch.device = "cpu", seed: int = 0) -> torch.nn.Module:
    """A randomly initialised fp32 ``LlamaForCausalLM`` of the given preset (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA_PRESETS[preset])
    return LlamaForCausalLM(config).to(device=device, dtype=torch.float32)


def fixed_grads(model: torch.nn.Module, mode: str = "random", seed: int = 0) -> list[torch.Tensor]:
    """One gradient per parameter, made once (``"random"`` or ``"backward"``)."""
    params = list(model.parameters())
    if mode == "random":
        gen = torch.Generator(device=params[0].device).manual_seed(seed)
        return [torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype).mul_(1e-3) for p in params]
    if mode == "backward":
        torch.manual_seed(seed)
        tokens = torch.randint(0, model.config.vocab_size, (2, 128), device=params[0].device)
        model.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        model.zero_grad(set_to_none=True)
        return grads
    raise ValueError(f"unknown gradient mode {mode!r} (random, backward)")


def fresh_params(reference: Iterable[torch.Tensor], grads: Iterable[torch.Tensor]) -> list[torch.nn.Parameter]:
    """New leaf parameters holding copies of ``reference``, each with its (shared, read-only) gradient attached."""
    params = []
    for ref, g in zip(reference, grads):
        p = torch.nn.Parameter(ref.detach().clone())
        p.grad = g
        params.append(p)
    return params
