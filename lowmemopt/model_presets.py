"""Model configs that ``lowmemopt estimate`` knows by name, so that it needs no download: the published
``config.json`` values of common LLaMA-shaped models that decide their parameter shapes (hidden size, SwiGLU
intermediate size, layers, attention and key/value heads, vocabulary, tied embeddings) and the dtype they ship in.

``lowmemopt estimate llama-2-7b`` uses the preset ``llama-2-7b``; its Hugging Face Hub id
(``meta-llama/Llama-2-7b-hf``, case-insensitive, chat / instruct variants too) names the same preset. Pure data and
string lookups: no torch import, so the command checks its arguments before the slow imports.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "hub_ids", "missing_config_message", "preset", "preset_names"]


def _llama(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    max_positions: int,
    dtype: str,
    **extra: Any,
) -> dict[str, Any]:
    return dict(
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype=dtype,
        **extra,
    )


#: preset name -> (the Hub ids whose published config.json it copies, the config). Llama 2: vocab 32000, fp16;
#: Llama 3 / 3.1 / 3.3: vocab 128256, grouped-query attention with 8 key/value heads, bf16.
PRESETS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "llama-2-7b": (
        ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf"),
        _llama(4096, 11008, 32, 32, 32, 32000, 4096, "float16"),
    ),
    "llama-2-13b": (
        ("meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-13b-chat-hf"),
        _llama(5120, 13824, 40, 40, 40, 32000, 4096, "float16"),
    ),
    "llama-2-70b": (
        ("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-chat-hf"),
        _llama(8192, 28672, 80, 64, 8, 32000, 4096, "float16"),
    ),
    "llama-3-8b": (
        (
            "meta-llama/Meta-Llama-3-8B",
            "meta-llama/Meta-Llama-3-8B-Instruct",
            "meta-llama/Llama-3.1-8B",
            "meta-llama/Llama-3.1-8B-Instruct",
            "meta-llama/Meta-Llama-3.1-8B",
            "meta-llama/Meta-Llama-3.1-8B-Instruct",
        ),
        _llama(4096, 14336, 32, 32, 8, 128256, 8192, "bfloat16", rope_theta=500000.0),
    ),
    "llama-3-70b": (
        (
            "meta-llama/Meta-Llama-3-70B",
            "meta-llama/Meta-Llama-3-70B-Instruct",
            "meta-llama/Llama-3.1-70B",
            "meta-llama/Llama-3.1-70B-Instruct",
            "meta-llama/Meta-Llama-3.1-70B",
            "meta-llama/Meta-Llama-3.1-70B-Instruct",
            "meta-llama/Llama-3.3-70B-Instruct",
        ),
        _llama(8192, 28672, 80, 64, 8, 128256, 8192, "bfloat16", rope_theta=500000.0),
    ),
}

#: short names of the presets whose size says which one is meant (70B: say llama-2-70b or llama-3-70b)
_SHORT = {"llama-7b": "llama-2-7b", "llama-13b": "llama-2-13b", "llama-8b": "llama-3-8b"}


def preset_names() -> list[str]:
    """The preset names, then the short ones (``llama-7b``...)."""
    return [*PRESETS, *_SHORT]


def preset(name: str) -> tuple[str, dict[str, Any]] | None:
    """``(preset name, a copy of its config)`` for a preset name, a short name or a Hub id of :data:`PRESETS`
    (case-insensitive); None for anything else."""
    key = name.strip().lower()
    key = _SHORT.get(key, key)
    if key not in PRESETS:
        key = next((p for p, (ids, _) in PRESETS.items() if key in (i.lower() for i in ids)), "")
    return (key, dict(PRESETS[key][1])) if key else None


def missing_config_message(path: str) -> str:
    """What to say when ``path`` is neither a file nor a preset (a Hub id, say)."""
    return (
        f"{path}: no such file, and not a preset. lowmemopt estimate reads a model's config.json from disk and "
        "downloads nothing: give its path (e.g. `hf download meta-llama/Llama-2-7b-hf config.json --local-dir "
        f"llama-2-7b`, then llama-2-7b/config.json) or a preset: {', '.join(preset_names())}"
    )


def hub_ids(name: str) -> tuple[str, ...]:
    """The Hub ids whose published config the preset ``name`` copies."""
    return PRESETS[name][0]
