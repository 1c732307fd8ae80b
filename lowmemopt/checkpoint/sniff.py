"""What a file is from its first bytes (safetensors, ``torch.save``, JSON, pickle, zip), so ``load_state`` and
``lowmemopt inspect`` can say what reads a file that is not a state file.
"""

from __future__ import annotations

import os
import zipfile

from ..quant.convert import CheckpointError

__all__ = ["file_kind", "check_state_file_kind", "TORCH_KINDS", "TRUNCATED_ADVICE"]

#: the first pickle of torch's legacy (pre-zip) ``torch.save`` format: protocol 2, torch's magic number
_LEGACY_TORCH_HEAD = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
#: the kinds :func:`file_kind` gives a ``torch.save`` file
TORCH_KINDS = ("torch", "torch-legacy", "torch-truncated")
_LOAD_STATE_DICT = "opt.load_state_dict(torch.load(path, weights_only=True))"
#: what to do about a ``torch-truncated`` file
TRUNCATED_ADVICE = (
    "torch.load fails on it with 'OSError: [Errno 22] Invalid argument' (or 'PytorchStreamReader "
    "failed'); nothing can load it: save the state again, or copy the whole file again"
)


def file_kind(path: str | os.PathLike) -> tuple[str, str]:
    """``(kind, description)`` of the file at ``path``: ``"safetensors"`` (recognised first, by the ``{`` after its
    8-byte length), ``"torch"``, ``"torch-legacy"``, ``"torch-truncated"``, ``"json"``, ``"pickle"``, ``"zip"``,
    ``"unknown"``."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
            size = os.fstat(fh.fileno()).st_size
    except OSError:
        return "unknown", "an unreadable file"
    if head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= size - 8:
        return "safetensors", "a safetensors file"
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(path):
            return "torch-truncated", (
                "a zip archive cut short (no end record: an interrupted save or an incomplete "
                "copy), most likely a torch.save file"
            )
        with zipfile.ZipFile(path) as archive:
            if any(name.endswith("/data.pkl") for name in archive.namelist()):
                return "torch", "a torch.save file (a zip archive)"
        return "zip", "a zip archive (not a torch.save file)"
    if head.startswith(_LEGACY_TORCH_HEAD):
        return "torch-legacy", "a torch.save file in torch's legacy (pickle) format"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle", "a Python pickle file"
    if head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] in (b"{", b"["):
        return "json", "a JSON file (a model's config.json?)"
    return "unknown", "a file of unknown kind"


def check_state_file_kind(path: str | os.PathLike) -> None:
    """Raise CheckpointError for a file that is recognisably not safetensors, saying what it is and what reads it."""
    kind, what = file_kind(path)
    if kind in ("safetensors", "unknown"):
        return
    path = os.fspath(path)
    if kind == "torch-truncated":
        raise CheckpointError(f"{path}: {what}; {TRUNCATED_ADVICE}")
    if kind in TORCH_KINDS:
        advice = (
            f"an optimizer.state_dict() saved with torch.save loads with {_LOAD_STATE_DICT}; "
            f"`lowmemopt inspect {path}` shows what the file holds"
        )
    elif kind == "json":
        advice = "a model's config.json is what `lowmemopt estimate` reads"
    else:
        advice = f"a torch.save file of optimizer.state_dict() loads with {_LOAD_STATE_DICT}"
    raise CheckpointError(
        f"{path}: {what}, not an optimizer state file written by lowmemopt.save_state "
        f"(load_state reads those); {advice}"
    )
