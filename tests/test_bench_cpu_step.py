"""bench/cpu_step.py on a tiny LLaMA: its table (a row per optimizer, bytes moved per step from each one's state,
ratios to torch's fused AdamW, the memory floor row), a row whose library is missing, and its argument checks."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import load_bench

from lowmemopt.benchmark import LLAMA_PRESETS

TINY = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2, vocab_size=128)


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setitem(LLAMA_PRESETS, "tiny", TINY)
    threads = torch.get_num_threads()
    yield load_bench("cpu_step")
    torch.set_num_threads(threads)


def _rows(text: str) -> dict[str, list[str]]:
    return {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| "))
    }


def test_tiny_run_prints_every_row_and_the_memory_floor(bench, capsys, tmp_path, monkeypatch):
    def missing(params):
        raise ModuleNotFoundError("No module named 'deepspeed'")

    monkeypatch.setitem(bench.OPTIMIZERS, "deepspeed-cpuadam", (missing, "DeepSpeedCPUAdam"))
    names = "deepspeed-cpuadam,lowmemopt-adamw-32bit,lowmemopt-adamw-4bit,lowmemopt-came-8bit"
    assert (
        bench.main(
            [
                "--preset",
                "tiny",
                "--rounds",
                "3",
                "--warmup",
                "0",
                "--stream-mib",
                "1",
                "--threads",
                "1",
                "--optimizers",
                names,
                "--json",
                str(tmp_path / "run.json"),
            ]
        )
        == 0
    )
    rows = _rows(capsys.readouterr().out)
    assert list(rows)[2:] == ["torch-adamw-fused", *names.split(","), bench.FLOOR]  # header, rule
    assert "not available: ModuleNotFoundError" in rows["deepspeed-cpuadam"][-1]
    fused, adamw32, adamw4 = rows["torch-adamw-fused"], rows["lowmemopt-adamw-32bit"], rows["lowmemopt-adamw-4bit"]
    for cells in (fused, adamw32, adamw4, rows["lowmemopt-came-8bit"]):
        state, moved = float(cells[0]), float(cells[1])
        assert moved == pytest.approx(12 + 2 * state, abs=0.011) and float(cells[2]) > 0 and float(cells[4]) > 0
    assert float(fused[0]) == pytest.approx(8, abs=0.01) and fused[3].startswith("1.00x")
    assert float(adamw4[0]) < float(adamw32[0]) == pytest.approx(8, abs=0.01)
    floor = rows[bench.FLOOR]
    assert float(floor[1]) == bench.ADAMW_FP32_BYTES == 28 and floor[5] == "1.00x"
    assert floor[2] == floor[4]  # its step time is its floor
    run = json.loads((tmp_path / "run.json").read_text())
    by_name = {r["name"]: r for r in run["rows"]}
    assert len(run["bandwidths"]) == 3 and all(b > 0 for b in run["bandwidths"])
    assert len(by_name["lowmemopt-came-8bit"]["ratios"]) == 3 and by_name["deepspeed-cpuadam"]["times_s"] == []
    assert torch.get_num_threads() == 1


def test_llama_shapes_are_the_bench_models():
    """The shapes of ``build_llama("150m")`` / ``("10m")``, LlamaForCausalLM's, counted once (transformers
    compared them): 148,264,704 and 10,890,496 parameters in 129 and 57 tensors."""
    bench = load_bench("cpu_step")
    for preset, n, tensors in (("150m", 148_264_704, 129), ("10m", 10_890_496, 57)):
        shapes = bench.llama_shapes(preset)
        assert sum(torch.Size(s).numel() for s in shapes) == n and len(shapes) == tensors


def test_bad_arguments(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--optimizers", "lowmemopt-adamw-2bit"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--threads", "0"])
    args = bench.parse_args(["--quick", "--optimizers", "lowmemopt-adamw-8bit"])
    assert args.preset == "10m" and args.names == ["torch-adamw-fused", "lowmemopt-adamw-8bit"]


def test_per_parameter_rows_run_only_when_named(bench, capsys):
    """The rows with the bucketed native call turned off are not in a default run; named, they run, and the bucket
    is back on after each of their steps."""
    from lowmemopt.pipeline import native

    assert not set(bench.EXTRA) & set(bench.parse_args([]).names)
    takes = native.takes
    assert (
        bench.main(
            [
                "--preset",
                "tiny",
                "--rounds",
                "2",
                "--warmup",
                "0",
                "--stream-mib",
                "1",
                "--threads",
                "1",
                "--optimizers",
                "lowmemopt-adamw-8bit-per-param",
            ]
        )
        == 0
    )
    assert native.takes is takes
    assert float(_rows(capsys.readouterr().out)["lowmemopt-adamw-8bit-per-param"][2]) > 0
