"""Integrations with training frameworks: :mod:`lowmemopt.integrations.transformers` (the HuggingFace Trainer).

Each submodule imports its framework lazily, so ``import lowmemopt.integrations`` needs nothing extra."""
