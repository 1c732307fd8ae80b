"""Log records that other libraries print while ``lowmemopt``'s commands import them, dropped."""

from __future__ import annotations

import logging

__all__ = ["IMPORT_NOISE", "DropImportNoise", "quiet_import_noise"]


#: log records that other libraries print while they are imported and that say nothing about a lowmemopt command,
#: as (logger, text in the message): torchao (imported by transformers' model code when it is installed, as the test
#: and bench extras install it) cannot load its optional CUDA / mxfp8 extensions built for another torch, and registers
#: enums with torch's pytree in a way torch now calls deprecated. Only these two, only in the command: a library's
#: other messages, and lowmemopt used from Python, are left alone.
IMPORT_NOISE = (
    ("torchao", "Failed to load "),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)


class DropImportNoise(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)


def quiet_import_noise() -> None:
    """Drop :data:`IMPORT_NOISE` from the loggers that print it (before the imports that would print it)."""
    for name, text in IMPORT_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropImportNoise) and f.text == text for f in logger.filters):
            logger.addFilter(DropImportNoise(text))
