"""Files that are not lowmemopt state files, given to ``load_state`` and to ``lowmemopt inspect``: each is named for
what it is (a torch.save file, a truncated one, JSON, a pickle, a zip archive) with what reads it, never reported as
a corrupt safetensors file; the optimizer is left unchanged."""

from __future__ import annotations

import json
import pickle
import zipfile

import pytest
import torch
from helpers import make_params, run

import lowmemopt
from lowmemopt.checkpoint import CheckpointError
from lowmemopt.checkpoint.sniff import file_kind
from lowmemopt.inspection import inspect

LOAD_STATE_DICT = "opt.load_state_dict(torch.load(path, weights_only=True))"


def _optimizer():
    params = make_params([(40, 30)])
    opt = lowmemopt.AdamW(params, lr=1e-2)
    run(opt, params, 2)
    return params, opt


def _files(tmp_path, opt) -> dict[str, tuple[str, list[str]]]:
    """name -> (kind, phrases load_state's error holds)."""
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    torch.save(opt.state_dict(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    data = (tmp_path / "opt.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_hidden_layers": 32}))
    (tmp_path / "list.json").write_text("\n  [1, 2, 3]")
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"lr": 0.1}, protocol=4))
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("readme.txt", "hello")
    torch_advice = [LOAD_STATE_DICT, "lowmemopt inspect"]
    return {
        "opt.pt": ("torch", ["a torch.save file (a zip archive), not an optimizer state file"] + torch_advice),
        "legacy.pt": ("torch-legacy", ["a torch.save file in torch's legacy (pickle) format"] + torch_advice),
        "cut.pt": (
            "torch-truncated",
            ["a zip archive cut short (no end record", "OSError: [Errno 22]", "save the state again"],
        ),
        "config.json": ("json", ["a JSON file (a model's config.json?)", "lowmemopt estimate"]),
        "list.json": ("json", ["a JSON file"]),
        "plain.pkl": ("pickle", ["a Python pickle file", LOAD_STATE_DICT]),
        "other.zip": ("zip", ["a zip archive (not a torch.save file)"]),
    }


def test_load_state_names_each_kind_of_file_and_changes_nothing(tmp_path):
    params, opt = _optimizer()
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[params[0]].items()}
    for name, (kind, phrases) in _files(tmp_path, opt).items():
        assert file_kind(tmp_path / name)[0] == kind, name
        with pytest.raises(CheckpointError) as err:
            lowmemopt.load_state(opt, tmp_path / name)
        message = str(err.value)
        assert "header of" not in message and "corrupt state file" not in message, message
        for phrase in phrases:
            assert phrase in message, (name, phrase, message)
    for k, v in opt.state[params[0]].items():
        assert torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else v == before[k]


def test_inspect_names_each_kind_of_file(tmp_path, capsys):
    _, opt = _optimizer()
    files = _files(tmp_path, opt)
    for name in ("opt.pt", "legacy.pt"):  # torch.save files of a state_dict(): described
        assert inspect(str(tmp_path / name)) == 0
        assert "optimizer state_dict() saved with torch.save (lowmemopt state" in capsys.readouterr().out
    expected = {
        "cut.pt": files["cut.pt"][1],
        "config.json": files["config.json"][1],
        "other.zip": [
            "a zip archive (not a torch.save file), not an optimizer state file",
            "lowmemopt inspect reads a .safetensors file",
        ],
    }
    for name, phrases in expected.items():
        assert inspect(str(tmp_path / name)) == 1
        err = capsys.readouterr().err
        for phrase in phrases:
            assert phrase in err, (name, phrase, err)


def test_a_state_file_is_still_a_state_file(tmp_path):
    """A safetensors header length whose bytes begin like a zip, pickle or JSON does not fool the sniffing."""
    params, opt = _optimizer()
    lowmemopt.save_state(opt, tmp_path / "opt.safetensors")
    assert file_kind(tmp_path / "opt.safetensors")[0] == "safetensors"
    lowmemopt.load_state(opt, tmp_path / "opt.safetensors")
    for head in (b"PK", b"\x80\x02", b"{\x00"):  # a header length of these low bytes, then JSON
        n = int.from_bytes(head + b"\x00" * (8 - len(head)), "little")
        (tmp_path / "st.bin").write_bytes(n.to_bytes(8, "little") + b"{" + b" " * (n - 1))
        assert file_kind(tmp_path / "st.bin")[0] == "safetensors", head
