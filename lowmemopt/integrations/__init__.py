"""Integrations with training frameworks (:mod:`.transformers`: the HuggingFace Trainer), each importing its
framework lazily.
"""
