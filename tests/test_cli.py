"""The `lowmemopt` command: `main(argv)` as the console script calls it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import run

import lowmemopt
from lowmemopt.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 80)  # 5120 elements: 8-bit state, 20 blocks
        self.proj = torch.nn.Linear(80, 72)  # weight 5760: 8-bit, 23 blocks; bias 72: fp32
        self.head = torch.nn.Linear(72, 10, bias=False)  # 720: fp32


def test_cli_inspect_prints_metadata_and_format_summary(tmp_path, capsys):
    net = Net()
    opt = lowmemopt.AdamW(net.parameters(), lr=2e-3, state_bits=8)
    run(opt, list(net.parameters()), 3)
    path = tmp_path / "s.safetensors"
    lowmemopt.save_state(opt, path, model=net)
    assert cli_main(["inspect", str(path), "--params"]) == 0
    out = capsys.readouterr().out
    assert "format_version 1" in out and "optimizer: AdamW" in out and "keys: parameter names" in out
    assert "lr=0.002" in out and "state_bits=8" in out
    assert "params: 4 (4 with state), step 3" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    q8 = next(line for line in out.splitlines() if line.startswith("q8 (block 256)")).split()
    assert q8[3:] == ["4", "2", "21,760", "22,104"]  # embed 5120 (20 blocks), proj 5760 (23): 2 x 10880 + 2 x 4 x 43
    assert rows["fp32"][1:] == ["4", "2", "1,584", "6,336"]  # proj.bias 72, head.weight 720: 2 x 792 x 4 bytes
    assert rows["total"][1:] == ["8", "4", "23,344", "28,440"]
    assert f"file: {os.path.getsize(path):,} bytes" in out
    assert "proj.weight  (72, 80) float32  step=3  exp_avg=q8[dynamic, block 256, 23 blocks]" in out


def test_cli_inspect_bad_file_fails_cleanly(tmp_path, capsys):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    assert cli_main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "lowmemopt inspect:" in err and "truncated or corrupt" in err
    with pytest.raises(SystemExit):
        cli_main([])  # a subcommand is required


def test_console_script_is_registered():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["lowmemopt"] == "lowmemopt.cli:main"
