"""lowmemopt.estimate and `lowmemopt estimate`: the state figure equals what a real optimizer holds after one step."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
import torch

import lowmemopt
from lowmemopt.cli import main as cli_main
from lowmemopt.estimate import (
    cheapest_fits,
    estimate,
    format_bytes,
    model_from_config,
    parse_bytes,
    state_nbytes_after_first_step,
)
from lowmemopt.registry import instantiate, needs_process_group, optimizer_classes

pytest.importorskip("transformers")

# ragged shapes: vocab 301 x 64 = 19264 elements (75.25 blocks of 256), q/k/v/o 64 x 64 = 4096 (min_quant_numel,
# the boundary), MLP 64 x 88 = 5632, norms 64 (fp32 state at every state_bits)
CONFIG = dict(
    model_type="llama",
    vocab_size=301,
    hidden_size=64,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)

# keywords that give an optimizer all of its slots (momentum buffers, Adafactor's first moment, AMSGrad's v_max)
FULL_STATE = {
    "SGD": dict(momentum=0.9),
    "SignSGD": dict(momentum=0.9),
    "LARS": dict(momentum=0.9),
    "Adafactor": dict(beta1=0.9),
    "Adam": dict(amsgrad=True),
}


def real_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    data = dict(CONFIG)
    data.pop("model_type")
    return LlamaForCausalLM(LlamaConfig(**data))


def state_after_one_step(cls, state_bits: int, **kwargs) -> int:
    model = real_model()
    params = model.parameters()
    if getattr(cls, "named_groups", False):  # (Adam-mini: named parameters, the model's heads)
        params, kwargs = model.named_parameters(), {**cls.model_keywords(model.config), "verbose": False, **kwargs}
    opt = instantiate(cls, params, state_bits=state_bits, **kwargs)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt.state_nbytes()


def _base_name(cls) -> str:
    return next(c.__name__ for c in cls.__mro__ if c.__module__.startswith("lowmemopt.optim"))


@pytest.mark.parametrize("state_bits", [32, 16, 8])
def test_estimate_is_exact_for_every_optimizer(state_bits):
    meta = model_from_config(CONFIG)
    assert all(p.is_meta for p in meta.parameters())
    n = sum(p.numel() for p in real_model().parameters())
    for name, cls in optimizer_classes().items():
        if name.lower().startswith("galore"):
            continue  # needs GaLore groups: see the GaLore test
        if needs_process_group(cls):
            continue  # cannot step without a process group: see test_estimate_of_the_onebit_optimizers
        if getattr(cls, "model_param_groups", None) is not None:
            continue  # builds its own groups of a model (Muon): tests/test_muon.py
        named_bits = inspect.signature(cls).parameters["state_bits"].default
        if named_bits not in (32, state_bits):
            continue  # an alias whose name gives its bits refuses others (tests/test_signatures.py)
        kwargs = FULL_STATE.get(_base_name(cls), {})
        got = estimate(meta, name, state_bits, **kwargs)
        assert got.state == state_after_one_step(cls, state_bits, **kwargs), (name, state_bits)
        assert got.params == n and got.weights == 4 * n and got.grads == 4 * n
        assert got.total == got.weights + got.grads + got.state


def test_estimate_of_the_onebit_optimizers(tmp_path):
    """Estimated without a process group: the state one step makes (checked on a 1-rank group, which keeps no error
    buffers) plus fp32 error buffers padded for 2 ranks (a worker error of 2 chunks and a server error of 1 chunk per
    parameter, each chunk a multiple of 8 and of the quantization block)."""
    import torch.distributed as dist

    meta = model_from_config(CONFIG)
    names = ("OnebitAdam", "ZeroOneAdam", "OnebitLAMB")
    got = {(name, bits): estimate(meta, name, bits).state for name in names for bits in (32, 8)}
    budget = estimate(meta, "OnebitAdam", 16).total - 1  # per-layer or paged 16-bit would fit: both are refused
    fits = cheapest_fits(meta, "OnebitAdam", budget, ranks=[8])
    assert fits and all(e.state_bits <= 8 and not (e.paged or e.per_layer or e.galore_rank) for e in fits), fits
    with pytest.raises(RuntimeError, match="meta parameters"):
        lowmemopt.OnebitAdam([torch.nn.Parameter(torch.zeros(2, device="meta"))]).step()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        for (name, bits), state in got.items():
            errors = 0
            for p in meta.parameters():
                align = 256 if bits == 8 and p.numel() >= 4096 else 8
                errors += 4 * 3 * -(-p.numel() // (2 * align)) * align
            assert state == state_after_one_step(getattr(lowmemopt, name), bits) + errors, (name, bits)
    finally:
        dist.destroy_process_group()


def test_estimate_counts_bf16_weights_and_leaves_the_optimizer_alone():
    got = estimate(model_from_config(CONFIG, torch.bfloat16), "adamw8bit", 8)
    n = got.params
    assert got.weights == 2 * n and got.grads == 2 * n
    model = real_model()
    opt = lowmemopt.AdamW8bit(model.parameters())
    assert state_nbytes_after_first_step(opt) == got.state
    assert not opt.state  # laid out on a shadow optimizer on the meta device


@pytest.mark.skipif(not hasattr(lowmemopt, "galore_param_groups"), reason="GaLore has not landed")
@pytest.mark.parametrize("name", ["adamw8bit", "came8bit"])
def test_estimate_is_exact_with_galore(name):
    got = estimate(model_from_config(CONFIG), name, 8, galore_rank=8)
    model = real_model()
    groups = lowmemopt.galore_param_groups(model, target_modules="all-linear", rank=8)
    opt = instantiate(optimizer_classes()[{"adamw8bit": "AdamW8bit", "came8bit": "CAME8bit"}[name]], groups)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert got.state == opt.state_nbytes()
    assert got.state < estimate(model_from_config(CONFIG), name, 8).state


def test_cli_estimate_json_matches_a_real_step(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert (
        cli_main(
            [
                "estimate",
                str(path),
                "--optimizer",
                "came8bit,lion",
                "--state-bits",
                "8",
                "--gpu-memory",
                "1MiB",
                "--margin",
                "0",
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [(r["optimizer"], r["state_bits"]) for r in rows] == [("CAME8bit", 8), ("Lion", 8)]
    assert rows[0]["state"] == state_after_one_step(lowmemopt.CAME8bit, 8)
    assert rows[1]["state"] == state_after_one_step(lowmemopt.Lion, 8)
    total = rows[0]["weights"] + rows[0]["grads"] + rows[0]["state"]
    assert rows[0]["total"] == total and rows[0]["fits"] is (total <= 1024**2) and rows[0]["gpu_memory"] == 1024**2


@pytest.mark.skipif(not hasattr(lowmemopt, "galore_param_groups"), reason="GaLore has not landed")
def test_cli_estimate_galore_rows(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert (
        cli_main(
            [
                "estimate",
                str(path),
                "--optimizer",
                "came8bit",
                "--galore-rank",
                "8",
                "--galore-target",
                "self_attn,mlp",
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [r["galore_rank"] for r in rows] == [None, 8]
    model = real_model()
    opt = lowmemopt.CAME8bit(lowmemopt.galore_param_groups(model, ["self_attn", "mlp"], rank=8), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert rows[1]["state"] == opt.state_nbytes() < rows[0]["state"]


def test_cli_estimate_table(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert cli_main(["estimate", str(path), "--optimizer", "adamw8bit", "--dtype", "bf16", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    state = estimate(model_from_config(CONFIG, torch.bfloat16), "adamw8bit", 8).state
    row = next(line for line in out.splitlines() if line.startswith("| AdamW8bit"))
    assert "| 8-bit | — |" in row and f"| {format_bytes(state)} |" in row and row.endswith("| yes |")
    assert len([line for line in out.splitlines() if line.startswith("| AdamW8bit")]) == 1  # its own 8 bits only


def test_cli_estimate_bad_input(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 8}))
    assert cli_main(["estimate", str(path)]) == 1
    assert "model_type" in capsys.readouterr().err
    path.write_text(json.dumps(CONFIG))
    assert cli_main(["estimate", str(path), "--optimizer", "adamz"]) == 1
    assert "unknown optimizer 'adamz'" in capsys.readouterr().err
    assert cli_main(["estimate", str(path), "--gpu-memory", "lots"]) == 1
    assert "memory size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["estimate", str(path), "--state-bits", "3"])


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 1024**3 and parse_bytes("24G") == 24 * 1024**3
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("1.5 MiB") == 1.5 * 1024**2 and parse_bytes("512") == 512
    assert parse_bytes("24 GB") == 24 * 10**9 and parse_bytes(" 24 gib ") == parse_bytes("24", "GiB") == 24 * 1024**3
    for bad in ("", "GiB", "12 parsecs", "-1GB", "1e9"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


@pytest.mark.parametrize(
    "text,size",
    [
        ("24GiB", 24 * 2**30),
        ("24 GiB", 24 * 2**30),
        ("24", 24 * 2**30),
        ("24 GB", 24 * 10**9),
        ("0.5", 2**29),
        ("24000000000B", 24 * 10**9),
    ],
)
def test_cli_gpu_memory_forms(tmp_path, capsys, text, size):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert cli_main(["estimate", str(path), "--optimizer", "adamw8bit", "--gpu-memory", text, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["gpu_memory"] == size


def test_cli_gpu_memory_refuses_a_byte_count_without_its_unit(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert cli_main(["estimate", str(path), "--gpu-memory", "25769803776"]) == 1
    err = capsys.readouterr().err
    assert "a number without a unit is GiB" in err and "25769803776B" in err


# the published configs' parameter counts (the models' own model cards / safetensors indexes)
PRESET_PARAMS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
}


@pytest.mark.parametrize("name", sorted(PRESET_PARAMS))
def test_presets_have_the_published_models_parameter_counts(name):
    model = model_from_config(name)
    assert sum(p.numel() for p in model.parameters()) == PRESET_PARAMS[name]
    assert all(p.device.type == "meta" for p in model.parameters())


def test_preset_names_short_names_and_hub_ids():
    from lowmemopt.model_presets import PRESETS, preset, preset_names

    assert set(PRESETS) == set(PRESET_PARAMS) and set(PRESETS) <= set(preset_names())
    assert preset("LLaMA-7B")[0] == preset("meta-llama/Llama-2-7b-hf")[0] == preset("llama-2-7b")[0] == "llama-2-7b"
    assert preset("meta-llama/llama-3.1-8b-instruct")[0] == preset("llama-8b")[0] == "llama-3-8b"
    assert preset("meta-llama/Llama-3.3-70B-Instruct")[0] == "llama-3-70b"
    assert preset("llama-70b") is None and preset("meta-llama/Llama-2-7b") is None and preset("") is None
    config = preset("llama-2-13b")[1]
    config["hidden_size"] = 1  # a copy: the preset stays as published
    assert preset("llama-2-13b")[1]["hidden_size"] == 5120


def test_cli_estimate_takes_a_preset_or_its_hub_id(capsys):
    assert cli_main(["estimate", "meta-llama/Llama-2-7b-hf", "--optimizer", "adamw8bit", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["params"] == PRESET_PARAMS["llama-2-7b"] and row["dtype"] == "fp16"  # the published torch_dtype
    assert cli_main(["estimate", "llama-3-8b", "--optimizer", "adamw", "--state-bits", "4", "--gpu-memory", "24"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "LlamaForCausalLM from preset llama-3-8b (the published config of meta-llama/Meta-Llama-3-8B)"
    )
    assert "fits in 24.00 GiB" in out and "1 GiB = 2^30 bytes" in out


def test_cli_estimate_says_what_it_needs_for_a_hub_id_it_does_not_know(capsys):
    assert cli_main(["estimate", "some-org/SomeModel-7B"]) == 1
    err = capsys.readouterr().err
    assert "some-org/SomeModel-7B: no such file, and not a preset" in err and "downloads nothing" in err
    assert "config.json" in err and "llama-2-7b" in err and "llama-3-70b" in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["estimate", "llama-7b", "--optimizer", "adamz"], "unknown optimizer 'adamz' (did you mean 'Adam'?)"),
        (["estimate", "no-such/model", "--optimizer", "adamw"], "no-such/model: no such file, and not a preset"),
    ],
)
def test_cli_estimate_argument_errors_come_before_the_slow_imports(tmp_path, argv, message):
    """A typo in the optimizer name or the config fails without importing torch, transformers or the optimizers."""
    code = (
        "import sys\nfrom lowmemopt.cli import main\n"
        f"status = main({argv!r})\n"
        "print('STATUS', status, sorted(m for m in ('torch', 'transformers', 'lowmemopt.optim') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines()[-1] == "STATUS 1 []", proc.stdout + proc.stderr
    assert message in proc.stderr


def test_cli_estimate_names_a_missing_transformers(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    assert cli_main(["estimate", "llama-7b"]) == 1
    assert "pip install 'lowmemopt[hf]'" in capsys.readouterr().err


def test_declared_optimizer_names_are_the_registrys():
    """The names the command checks without importing torch are exactly the classes the registry resolves."""
    from lowmemopt.registry import declared_class_names, optimizer_names, unknown_names

    assert declared_class_names() == optimizer_names()
    assert unknown_names(["AdamW8bit", "galore_paged_came8bit", "lion-4bit"]) is None
    assert "unknown optimizer 'paged_galore_came'" in str(unknown_names(["adamw", "paged_galore_came"]))


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_cli_estimate_defaults_to_the_configs_dtype(tmp_path, capsys, key):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, key: "bfloat16"}))
    assert cli_main(["estimate", str(path), "--optimizer", "adamw8bit", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["dtype"] == "bf16" and row["weights"] == row["grads"] == 2 * row["params"]
    assert cli_main(["estimate", str(path), "--optimizer", "adamw8bit"]) == 0
    assert "bf16 (the config's torch_dtype) weights and gradients" in capsys.readouterr().out
    assert cli_main(["estimate", str(path), "--optimizer", "adamw8bit", "--dtype", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["weights"] == 4 * row["params"]  # --dtype wins
    path.write_text(json.dumps(CONFIG))  # no dtype named: fp32, and it says so
    assert cli_main(["estimate", str(path), "--optimizer", "adamw8bit"]) == 0
    assert "fp32 (the config names no torch_dtype; see --dtype)" in capsys.readouterr().out


def test_paged_and_per_layer_estimates_count_what_the_device_holds(monkeypatch):
    import lowmemopt.estimate as est

    meta = model_from_config(CONFIG)
    whole = estimate(meta, "adamw", 32)
    assert estimate(meta, "adamw", 32, paged=True).state == whole.state  # a small model: one batch holds it all
    monkeypatch.setattr(est, "PAGE_BUCKET_BYTES", 1)  # batches of one parameter
    lean = estimate(meta, "adamw", 32, paged=True, per_layer=True)
    model = real_model()
    opt = lowmemopt.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    per_param = sorted(sum(v.nbytes for v in st.values() if isinstance(v, torch.Tensor)) for st in opt.state.values())
    assert lean.state == 3 * per_param[-1] < whole.state == sum(per_param)  # in flight: 3 batches of one parameter
    assert lean.grads == max(p.numel() * 4 for p in model.parameters()) < whole.grads  # one gradient at a time
    assert lean.weights == whole.weights and (lean.paged, lean.per_layer) == (True, True)


def test_cli_estimate_lists_the_cheapest_combinations_that_fit(tmp_path, capsys):
    from lowmemopt.estimate import cheapest_fits

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    meta = model_from_config(CONFIG)
    budget = (estimate(meta, "adamw", 4).total // 1024 - 1) * 1024  # below 4-bit AdamW: nothing fits as asked
    fits = cheapest_fits(meta, "adamw", budget, ranks=[16, 8])
    assert fits and all(f.total <= budget for f in fits)
    # brute force: every combination, and which fit
    combos = {
        (b, r, pg, pl): estimate(meta, "adamw", b, galore_rank=r, paged=pg, per_layer=pl)
        for b in (32, 16, 8, 4)
        for r in (None, 16, 8)
        for pg in (False, True)
        for pl in (False, True)
    }
    assert not any(e.total <= budget for (b, r, pg, pl), e in combos.items() if (r, pg, pl) == (None, False, False))

    def changes(e):
        return (e.state_bits != 32) + (e.galore_rank is not None) + e.paged + e.per_layer

    fewest = min(changes(e) for e in combos.values() if e.total <= budget)
    assert changes(fits[0]) == fewest
    for f in fits:  # each is one of the combinations, and none that fits changes less on every count
        assert combos[(f.state_bits, f.galore_rank, f.paged, f.per_layer)] == f
        for e in combos.values():
            if e.total <= budget and e != f:
                assert not (
                    e.state_bits >= f.state_bits
                    and e.paged <= f.paged
                    and e.per_layer <= f.per_layer
                    and (e.galore_rank is None or (f.galore_rank is not None and e.galore_rank >= f.galore_rank))
                )

    assert (
        cli_main(
            ["estimate", str(path), "--optimizer", "adamw", "--gpu-memory", f"{budget // 1024}KiB", "--margin", "0"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        f"AdamW does not fit in {format_bytes(budget)} less a 0 B margin as asked; the cheapest combinations that do"
    ) in out
    listed = [
        line for line in out.split("fewest changes first):")[1].splitlines() if line.startswith("| ") and "-bit" in line
    ]
    assert listed and len(listed) == len(fits)
    first = fits[0]
    assert listed[0] == (
        f"| {first.state_bits}-bit | {first.galore_rank or '—'} | {'yes' if first.paged else 'no'} | "
        f"{'yes' if first.per_layer else 'no'} | {format_bytes(first.weights)} | "
        f"{format_bytes(first.grads)} | {format_bytes(first.state)} | {format_bytes(first.total)} |"
    )
    assert cli_main(["estimate", str(path), "--optimizer", "adamw", "--gpu-memory", "100KiB", "--margin", "0"]) == 0
    assert "does not fit in 100.00 KiB with any combination" in capsys.readouterr().out
    assert cli_main(["estimate", str(path), "--optimizer", "adamw", "--gpu-memory", "80GB"]) == 0
    assert "cheapest combinations" not in capsys.readouterr().out  # it fits: nothing to suggest


def test_estimate_of_ademamix_and_adam_mini(tmp_path, capsys):
    """AdEMAMix 8-bit: ~3 bytes per parameter (three slots); Adam-mini 8-bit: ~1 byte per parameter plus one fp32 value
    per block, its blocks by name and heads from the config (one per q / k head, output neuron, norm): both the
    real optimizer's state after a step, and printed by `lowmemopt estimate`."""
    meta = model_from_config(CONFIG)
    model = real_model()
    n = sum(p.numel() for p in model.parameters())
    got = estimate(meta, "ademamix8bit", 8)
    assert got.state == state_after_one_step(lowmemopt.AdEMAMix8bit, 8) and got.state < 4 * n  # (fp32: 12 n)
    head = torch.nn.Linear(256, 512, bias=False)  # a matrix past min_quant_numel: 3 slots of 1 byte + an absmax per 256
    opt = lowmemopt.AdEMAMix8bit(head.parameters())
    head.weight.grad = torch.randn_like(head.weight)
    opt.step()
    assert opt.state_nbytes() == 3 * (1 + 4 / 256) * head.weight.numel()
    mini = estimate(meta, "adam_mini", 8)
    opt = lowmemopt.AdamMini(model.named_parameters(), state_bits=8, dim=64, n_heads=4, n_kv_heads=2, verbose=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert mini.state == opt.state_nbytes() and mini.state < 1.4 * n  # (small tensors keep fp32 m; AdamW: 8 n)
    # per layer: q's 4 and k's 2 heads, the rows of v (32), o (64), gate and up (88), down (64), two norms; then
    # the embedding's and the head's rows, the final norm
    blocks = 2 * (4 + 2 + 32 + 64 + 88 + 88 + 64 + 2) + 301 + 301 + 1
    codes = sum(
        st["exp_avg.codes"].numel() if "exp_avg.codes" in st else 4 * st["exp_avg"].numel() for st in opt.state.values()
    )
    assert mini.state - codes - 4 * blocks == sum(
        4 * st["exp_avg.absmax"].numel() for st in opt.state.values() if "exp_avg.absmax" in st
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert (
        cli_main(["estimate", str(path), "--optimizer", "ademamix8bit,adam_mini", "--state-bits", "8", "--json"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [(r["optimizer"], r["state"]) for r in rows] == [("AdEMAMix8bit", got.state), ("AdamMini", mini.state)]
