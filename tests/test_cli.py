"""The `lowmemopt` command: `main(argv)` as the console script calls it."""

from __future__ import annotations

import os
import subprocess
import sys
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
    assert (
        "lowmemopt optimizer state file, file format version 3" in out
        and "optimizer: AdamW" in out
        and "keys: parameter names" in out
    )
    assert "lr=0.002" in out and "state_bits=8" in out
    assert "params: 4 (4 with state), step 3" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    q8 = next(line for line in out.splitlines() if line.startswith("q8 (block 256)")).split()
    assert q8[3:] == ["4", "2", "21,760", "22,104"]  # embed 5120 (20 blocks), proj 5760 (23): 2 x 10880 + 2 x 4 x 43
    assert rows["fp32"][1:] == ["4", "2", "1,584", "6,336"]  # proj.bias 72, head.weight 720: 2 x 792 x 4 bytes
    assert rows["total"][1:] == ["8", "4", "23,344", "28,440"]
    assert f"file: {os.path.getsize(path):,} bytes" in out
    assert "proj.weight  (72, 80) float32  step=3  exp_avg=q8[pow2, block 256, 23 blocks]" in out


def test_cli_inspect_bad_file_fails_cleanly(tmp_path, capsys):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    assert cli_main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "lowmemopt inspect:" in err and "truncated or corrupt" in err
    with pytest.raises(SystemExit):
        cli_main([])  # a subcommand is required


def test_cli_inspect_summarises_a_torch_save_state_dict(tmp_path, capsys):
    net = Net()
    opt = lowmemopt.AdamW(net.parameters(), lr=2e-3, state_bits=8)
    run(opt, list(net.parameters()), 3)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")  # README's file
    assert cli_main(["inspect", str(tmp_path / "opt.pt"), "--params"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state_dict() saved with torch.save (lowmemopt state, state_dict format version 2)" in out
    assert "lr=0.002" in out and "state_bits=8" in out and "params: 4 (4 with state), step 3" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    q8 = next(line for line in out.splitlines() if line.startswith("q8 (block 256)")).split()
    assert q8[3:] == ["4", "2", "21,760", "22,104"]  # the same figures as the safetensors file's summary
    assert rows["fp32"][1:] == ["4", "2", "1,584", "6,336"] and rows["total"][1:] == ["8", "4", "23,344", "28,440"]
    assert "exp_avg=q8 (block 256) (5,760)" in out  # --params: proj.weight's slots

    # torch.optim state one level down in a dict (as README's GaLore example saves), in the legacy format
    ref = torch.optim.AdamW(Net().parameters())
    run(ref, [p for g in ref.param_groups for p in g["params"]], 2)
    torch.save({"opt": ref.state_dict(), "epoch": 3}, tmp_path / "ref.pt", _use_new_zipfile_serialization=False)
    assert cli_main(["inspect", str(tmp_path / "ref.pt")]) == 0
    out = capsys.readouterr().out
    assert "ref.pt (key 'opt'): optimizer state_dict() saved with torch.save (no lowmemopt format version" in out
    assert next(line for line in out.splitlines() if line.startswith("fp32")).split()[1:] == [
        "8",
        "4",
        "23,344",
        "93,376",
    ]  # 2 x 11,672 fp32 elements


def test_cli_inspect_says_what_it_expects_of_other_torch_files(tmp_path, capsys):
    torch.save(Net().state_dict(), tmp_path / "model.pt")
    assert cli_main(["inspect", str(tmp_path / "model.pt")]) == 1
    err = capsys.readouterr().err
    assert "a torch.save file holding 4 tensors (a model's state_dict()?), not an optimizer state_dict()" in err
    assert "a .safetensors file written by lowmemopt.save_state" in err
    torch.save({"when": __import__("datetime").date(2024, 1, 1)}, tmp_path / "pickled.pt")  # not weights_only-safe
    assert cli_main(["inspect", str(tmp_path / "pickled.pt")]) == 1
    err = capsys.readouterr().err
    assert "torch.load(weights_only=True) cannot read (UnpicklingError: WeightsUnpickler error" in err
    (tmp_path / "cut.pt").write_bytes((tmp_path / "model.pt").read_bytes()[:300])
    assert cli_main(["inspect", str(tmp_path / "cut.pt")]) == 1
    err = capsys.readouterr().err
    assert "a zip archive cut short (no end record: an interrupted save or an incomplete copy)" in err
    assert "torch.load fails on it with 'OSError: [Errno 22] Invalid argument'" in err


def test_cli_inspect_tells_torch_files_from_safetensors_by_content(tmp_path):
    from lowmemopt.checkpoint.sniff import file_kind

    torch.save({"a": torch.zeros(2)}, tmp_path / "zip.bin")
    torch.save({"a": torch.zeros(2)}, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    # a safetensors header of 640 bytes: its length field begins with the bytes of a pickle's protocol 2 opcode
    (tmp_path / "st.bin").write_bytes((640).to_bytes(8, "little") + b"{" + b" " * 639)
    assert file_kind(tmp_path / "zip.bin")[0] == "torch" and file_kind(tmp_path / "legacy.bin")[0] == "torch-legacy"
    assert (tmp_path / "st.bin").read_bytes()[:2] == b"\x80\x02" and file_kind(tmp_path / "st.bin")[0] == "safetensors"
    assert file_kind(tmp_path / "missing")[0] == "unknown"


def test_the_command_drops_only_the_known_import_noise():
    import logging

    from lowmemopt.cli.noise import (
        IMPORT_NOISE as _IMPORT_NOISE,
        DropImportNoise as _DropImportNoise,
        quiet_import_noise as _quiet_import_noise,
    )

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.getMessage()))

    loggers = {name: logging.getLogger(name) for name, _ in _IMPORT_NOISE}
    before = {name: list(logger.filters) for name, logger in loggers.items()}
    for logger in loggers.values():  # as in a fresh process (other tests here ran commands)
        logger.filters[:] = [f for f in logger.filters if not isinstance(f, _DropImportNoise)]
    others = {name: len(logger.filters) for name, logger in loggers.items()}
    handler = Keep()
    logging.getLogger().addHandler(handler)
    try:
        _quiet_import_noise()
        _quiet_import_noise()  # once is enough: no second filter
        assert all(len(loggers[n].filters) == others[n] + 1 for n in loggers)
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.",
            "<enum 'E'>",
        )
        logging.getLogger("torchao").warning("something else torchao says")
        logging.getLogger("elsewhere").warning("Failed to load what the user asked for")
    finally:
        logging.getLogger().removeHandler(handler)
        for name, logger in loggers.items():
            logger.filters[:] = before[name]
    assert seen == [("torchao", "something else torchao says"), ("elsewhere", "Failed to load what the user asked for")]


def test_the_estimate_command_prints_no_import_noise(tmp_path):
    """With torchao installed (the test extra), transformers' model code imports it; the command stays quiet."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    config = tmp_path / "config.json"
    config.write_text(
        '{"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, '
        '"num_hidden_layers": 1, "num_attention_heads": 2}'
    )
    code = (
        f"from lowmemopt.cli import main; raise SystemExit(main(['estimate', {str(config)!r}, '--optimizer', 'adamw']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "LlamaForCausalLM from" in proc.stdout and proc.stderr == ""


def test_console_script_is_registered():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["lowmemopt"] == "lowmemopt.cli:main"


# ---------------------------------------------------------------------------------------------------------------------
# demo


def test_cli_demo_reduced_run(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    monkeypatch.setattr("lowmemopt.compiled.ENABLED", False)  # the eager path: no compile in a 4-step run
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    out = tmp_path / "out"
    names = "adamw,adamw8bit,came8bit,galore_came8bit"
    assert (
        cli_main(
            [
                "demo",
                "--steps",
                "4",
                "--optimizers",
                names,
                "--data",
                str(text),
                "--out",
                str(out),
                "--batch",
                "2",
                "--seq",
                "16",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"on {text.stat().st_size:,} bytes of {text}" in printed and "4 steps of 2 x 16 bytes" in printed
    assert (
        "| optimizer | settings | state memory | peak memory | optimizer step | train step "
        "| final loss (mean of last 20 steps) | held-out loss |" in printed
    )
    assert "| AdamW 8-bit | lr 2e-3, wd 0.01 |" in printed and "| CAME 8-bit | lr 2e-4, wd 0.01 |" in printed
    if hasattr(lowmemopt, "galore_param_groups"):
        assert (
            "| GaLore-CAME 8-bit | lr 2e-4, wd 0.01, GaLore rank 48, scale 1, new subspace every 100 steps |" in printed
        )
    assert "the progress bars show one step's loss; \"final loss\" is the mean of the last 20 steps' losses" in printed
    assert f"wrote the plot to {out / 'demo.png'}" in printed
    for label in ("AdamW 32-bit", "AdamW 8-bit", "CAME 8-bit", "GaLore-CAME 8-bit"):
        assert f"| {label} |" in printed
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import json

    report = json.loads((out / "demo.json").read_text())
    runs = {r["label"]: r for r in report["results"]}
    assert report["steps"] == 4 and report["data"] == str(text)
    for label in ("AdamW 32-bit", "AdamW 8-bit", "CAME 8-bit"):
        r = runs[label]
        assert len(r["losses"]) == 4 and all(x == x for x in r["losses"]) and r["step_s"] > 0
        if r["peak_bytes"] is not None:  # measured (glibc / CUDA): holds at least the weights, grads and state
            assert r["peak_bytes"] > r["state_bytes"]
    assert runs["AdamW 8-bit"]["state_bytes"] < runs["AdamW 32-bit"]["state_bytes"] / 3
    assert runs["AdamW 8-bit"]["losses"][0] == runs["AdamW 32-bit"]["losses"][0]  # same init, same first batch
    assert (runs["AdamW 8-bit"]["algorithm"], runs["AdamW 8-bit"]["state_bits"]) == ("AdamW", 8)
    assert (runs["AdamW 32-bit"]["algorithm"], runs["AdamW 32-bit"]["state_bits"]) == ("AdamW", 32)
    if hasattr(lowmemopt, "galore_param_groups"):
        assert runs["GaLore-CAME 8-bit"]["state_bytes"] < runs["CAME 8-bit"]["state_bytes"]
    else:
        assert "skipped" in runs["GaLore-CAME 8-bit"] and "note: GaLore-CAME 8-bit skipped" in printed


def _fake_results(steps: int = 60) -> list[dict]:
    """compare()'s results for three runs, two of whose curves coincide (AdamW 32-bit and 8-bit)."""
    losses = [3.0 - 0.01 * t for t in range(steps)]

    def run(label, algorithm, bits, curve, state, peak):
        return dict(
            label=label,
            name=label,
            algorithm=algorithm,
            state_bits=bits,
            losses=curve,
            final=curve[-1],
            heldout=curve[-1],
            state_bytes=state,
            peak_bytes=peak,
            step_s=0.01,
            train_step_s=0.02,
        )

    return [
        run("AdamW 32-bit", "AdamW", 32, losses, 14 * 2**20, 61 * 2**20),
        run("AdamW 8-bit", "AdamW", 8, [x + 0.02 for x in losses], int(3.6 * 2**20), 51 * 2**20),
        run("CAME 8-bit", "CAME", 8, [x + 0.5 for x in losses], int(1.9 * 2**20), 49 * 2**20),
        dict(label="GaLore-X", skipped="not here"),
    ]


def test_demo_plot_shows_coinciding_curves_their_difference_and_labelled_memory(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from lowmemopt import demo

    results = _fake_results()
    assert [(a["label"], b["label"]) for a, b in demo.twins(results)] == [("AdamW 8-bit", "AdamW 32-bit")]
    fig = demo.figure(results, "title")
    ax_loss, ax_diff, ax_mem = fig.axes
    curves = [line for line in ax_loss.get_lines() if line.get_label() in ("AdamW 32-bit", "AdamW 8-bit", "CAME 8-bit")]
    assert len(curves) == 3
    assert len({(line.get_linestyle(), line.get_marker()) for line in curves}) == 3  # each curve its own look
    (diff,) = [line for line in ax_diff.get_lines() if line.get_label().startswith("AdamW 8-bit")]
    assert diff.get_ydata() == pytest.approx([0.02] * len(diff.get_ydata()))  # 8-bit minus 32-bit, smoothed
    assert "8-bit − 32-bit" in ax_diff.get_title()
    labels = {t.get_text() for t in ax_mem.texts}
    assert {"14.0", "3.6", "1.9", "61.0", "51.0", "49.0"} <= labels  # every bar carries its MiB
    import matplotlib.pyplot as plt

    plt.close(fig)
    path = demo.plot(results, tmp_path / "demo.png")
    with Image.open(path) as image:
        assert min(image.info["dpi"]) >= 150 and image.size[0] >= 1500
    # each curve's legend entry gives its run's settings, where the results have them
    fig = demo.figure([dict(r, settings="lr 2e-3, wd 0.01") if "skipped" not in r else r for r in results])
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend[:2] == ["AdamW 32-bit\n(lr 2e-3, wd 0.01)", "AdamW 8-bit\n(lr 2e-3, wd 0.01)"]
    plt.close(fig)
    # without a 32-bit twin there is no difference panel
    fig = demo.figure([r for r in results if r.get("label") != "AdamW 32-bit"])
    assert len(fig.axes) == 2
    plt.close(fig)


def test_cli_demo_default_output_folder_ignores_itself(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    from lowmemopt import demo
    from lowmemopt.cli import DEMO_OUT

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "compare", lambda *a, **k: _fake_results(4))
    assert cli_main(["demo", "--steps", "4", "--optimizers", "adamw,adamw8bit", "--device", "cpu"]) == 0
    folder = tmp_path / DEMO_OUT
    assert (folder / "demo.png").exists() and (folder / "demo.json").exists()
    assert (folder / ".gitignore").read_text().splitlines()[-1] == "*"
    printed = capsys.readouterr().out
    assert f"output to {folder}" in printed and f"wrote the plot to {folder / 'demo.png'}" in printed
    gitignore = (ROOT / ".gitignore").read_text().splitlines()
    assert f"/{DEMO_OUT}/" in gitignore  # and the checkout's own .gitignore names it
    assert f"`{DEMO_OUT}/demo.png`" in (ROOT / "README.md").read_text()  # where README says the plot goes
    # a folder the user names gets no .gitignore
    assert cli_main(["demo", "--steps", "4", "--optimizers", "adamw", "--device", "cpu", "--out", "mine"]) == 0
    assert (tmp_path / "mine" / "demo.png").exists() and not (tmp_path / "mine" / ".gitignore").exists()


def test_cli_demo_bad_input(tmp_path, capsys):
    pytest.importorskip("transformers")
    assert cli_main(["demo", "--optimizers", "adamz"]) == 1
    assert "unknown optimizer 'adamz'" in capsys.readouterr().err
    assert cli_main(["demo", "--data", str(tmp_path / "missing.txt")]) == 1
    assert "lowmemopt demo:" in capsys.readouterr().err
    assert cli_main(["demo", "--steps", "0"]) == 1
    assert "--steps" in capsys.readouterr().err


def test_cli_demo_names_missing_packages(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli_main(["demo"]) == 1
    err = capsys.readouterr().err
    assert "lowmemopt demo needs matplotlib" in err and "pip install 'lowmemopt[demo]'" in err


# ---------------------------------------------------------------------------------------------------------------------
# bench


def test_cli_bench_quick_table(monkeypatch, capsys):
    pytest.importorskip("transformers")
    from lowmemopt import benchmark

    monkeypatch.setitem(
        benchmark.LLAMA_PRESETS,
        "10m",
        dict(hidden_size=32, num_hidden_layers=1, intermediate_size=48, num_attention_heads=2, vocab_size=64),
    )

    def missing_library(params, lr, weight_decay):
        raise ModuleNotFoundError("No module named 'came_pytorch'", name="came_pytorch")

    monkeypatch.setitem(benchmark.FACTORED, "came-pytorch", missing_library)
    monkeypatch.setattr("lowmemopt.compiled.ENABLED", False)
    assert (
        cli_main(
            [
                "bench",
                "--suite",
                "factored",
                "--optimizers",
                "lowmemopt-came-8bit,came-pytorch",
                "--steps",
                "1",
                "--warmup",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "### Factored optimizers: step time and state" in out and "fp32, 0.0M parameters" in out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) == {"optimizer", "---", "torch-adamw-fused", "lowmemopt-came-8bit", "came-pytorch"}
    assert "| 8.0" in rows["torch-adamw-fused"] and "| 1.00x |" in rows["torch-adamw-fused"]  # + step tensors
    assert "| not installed (came_pytorch): pip install '.[bench]' |" in rows["came-pytorch"]
    assert "FAILED" not in out
    assert "### Optimizer step benchmark" not in out


def test_cli_bench_bad_input(capsys):
    pytest.importorskip("transformers")
    assert cli_main(["bench", "--suite", "steps"]) == 1
    assert "unknown suite 'steps'" in capsys.readouterr().err
    assert cli_main(["bench", "--optimizers", "adamw"]) == 1
    err = capsys.readouterr().err
    assert "unknown optimizer 'adamw'" in err and "lowmemopt-adamw-8bit" in err


def test_cli_parses_arguments_without_importing_torch(tmp_path):
    """`lowmemopt --help` (and each subcommand's) imports neither torch nor lowmemopt's optimizers: only the
    subcommand that runs does."""
    commands = ("demo", "bench", "estimate", "inspect", "tune")
    code = (
        "import sys\nfrom lowmemopt.cli import main\n"
        f"for argv in ([], ['--help'], *([c, '--help'] for c in {commands})):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('IMPORTED', sorted(m for m in sys.modules if m == 'torch' or m.startswith('lowmemopt.')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: lowmemopt" in proc.stdout and "lowmemopt demo" in proc.stdout
    imported = "IMPORTED ['lowmemopt.cli', 'lowmemopt.cli.estimate', 'lowmemopt.cli.noise', 'lowmemopt.version']"
    assert proc.stdout.splitlines()[-1] == imported  # (the command's own modules: the standard library only)


def test_demo_default_optimizers_are_the_demo_presets():
    from lowmemopt import demo
    from lowmemopt.cli import DEMO_CHOICES

    assert DEMO_CHOICES == tuple(demo.DEMO_CHOICES)


def test_lazy_package_keeps_its_public_names():
    """The names ``import lowmemopt`` gives (imported on first use) are those of ``__all__``, and submodules are
    reachable as attributes."""
    names: dict = {}
    exec("from lowmemopt import *", names)
    assert set(lowmemopt.__all__) <= set(names) and {"AdamW", "AdamW8bit", "save_state", "CAME4bit"} <= set(names)
    assert lowmemopt.AdamW is names["AdamW"] and lowmemopt.quant.formats.Q8 is not None
    assert set(lowmemopt.__all__) <= set(dir(lowmemopt))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        lowmemopt.no_such_name


def _inspect_subprocess(path: Path, pipe: str = "") -> tuple[int, str, str]:
    """``lowmemopt inspect path --params [| pipe]`` in a shell: (the command's status, its stdout, its stderr)."""
    import subprocess
    import sys

    code = "import sys; from lowmemopt.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = f'"{sys.executable}" -c "{code}" inspect "{path}" --params 2>"{path}.err"' + (f" | {pipe}" if pipe else "")
    done = subprocess.run(["bash", "-c", cmd + '; exit "${PIPESTATUS[0]}"'], capture_output=True, text=True)
    return done.returncode, done.stdout, Path(f"{path}.err").read_text()


def test_cli_inspect_into_head_ends_quietly(tmp_path):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3000)]  # --params lists 3000 lines: > a pipe's buffer
    opt = lowmemopt.AdamW(params)
    run(opt, params, 1)
    lowmemopt.save_state(opt, tmp_path / "s.safetensors")
    status, out, err = _inspect_subprocess(tmp_path / "s.safetensors", "head -1")
    assert (status, err) == (0, "") and out.startswith(str(tmp_path / "s.safetensors"))


def _bad_metadata_file(path: Path, raw: str) -> Path:
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(path), metadata={"lowmemopt": raw})
    return path


@pytest.mark.parametrize("what", ["no optimizer and keys", "a list", "deep", "a directory", "a torch file"])
def test_cli_inspect_odd_files_without_a_traceback(tmp_path, what):
    path = tmp_path / "s.safetensors"
    if what == "no optimizer and keys":
        params = [torch.nn.Parameter(torch.zeros(2))]
        lowmemopt.save_state(lowmemopt.AdamW(params), tmp_path / "good.safetensors")
        meta = lowmemopt.checkpoint.read_metadata(tmp_path / "good.safetensors")
        meta = {k: v for k, v in meta.items() if k not in ("optimizer", "keys", "tensors", "algorithm")}
        _bad_metadata_file(path, __import__("json").dumps(meta))
    elif what == "a list":
        _bad_metadata_file(path, "[1, 2]")
    elif what == "deep":
        _bad_metadata_file(path, "[" * 100000 + "]" * 100000)
    elif what == "a directory":
        path.mkdir()
    else:  # a torch.save file named .safetensors (torch.load picks safetensors by the name)
        params = [torch.nn.Parameter(torch.zeros(2))]
        opt = lowmemopt.AdamW(params)
        run(opt, params, 1)
        torch.save(opt.state_dict(), path)
    status, out, err = _inspect_subprocess(path)
    assert "Traceback" not in err, err
    if what == "a torch file":
        assert status == 0 and "saved with torch.save" in out
    else:
        assert status == 1 and err.startswith("lowmemopt inspect: ") and len(err.splitlines()) == 1, err


def test_the_demo_makes_openmp_wait_passively_on_a_busy_machine(monkeypatch):
    """Spinning OpenMP threads cost the demo ~4x its wall time on a busy machine and sleeping ones ~1.7x on an idle one:
    before torch is imported the demo sets OMP_WAIT_POLICY=PASSIVE where other work leaves fewer free cores than its
    threads, and leaves libgomp's default otherwise; a policy the user set is kept; with torch imported nothing
    changes."""
    import lowmemopt.cli as cli

    calls = []

    class Stop(Exception):
        pass

    def record():
        calls.append(1)
        raise Stop

    monkeypatch.setattr(cli, "_openmp_wait_policy", record)
    with pytest.raises(Stop):
        cli_main(["demo", "--steps", "1"])
    assert calls == [1]
    monkeypatch.undo()
    code = (
        "import os, sys, lowmemopt.cli as c; assert 'torch' not in sys.modules; "
        "c._others_running = lambda: float(sys.argv[1]); os.cpu_count = lambda: 4; "
        "print(c._openmp_wait_policy(), os.environ.get('OMP_WAIT_POLICY'))"
    )
    cases = [  # (others running, OMP_NUM_THREADS, a policy set, what the demo runs with)
        (0.0, None, None, "None None"),
        (1.0, None, None, "PASSIVE PASSIVE"),  # 4 threads, 3 free cores
        (1.0, "2", None, "None None"),  # 2 threads, 3 free cores
        (3.0, "2", None, "PASSIVE PASSIVE"),
        (3.0, None, "ACTIVE", "None ACTIVE"),
    ]
    for others, threads, given, expected in cases:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
        env.update({} if threads is None else {"OMP_NUM_THREADS": threads})
        env.update({} if given is None else {"OMP_WAIT_POLICY": given})
        out = subprocess.run(
            [sys.executable, "-c", code, str(others)], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected, (others, threads, given, out)
    assert 0 <= cli._others_running() < 10_000  # (this machine's own count, read)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cli._openmp_wait_policy() is None  # (torch is imported here: too late, nothing changed)
    assert "OMP_WAIT_POLICY" not in os.environ
