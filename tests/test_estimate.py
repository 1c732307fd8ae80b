"""lowmemopt.estimate and `lowmemopt estimate`: the state figure equals what a real optimizer holds after one step."""

from __future__ import annotations

import json

import pytest
import torch

import lowmemopt
from lowmemopt.cli import main as cli_main
from lowmemopt.estimate import cheapest_fits, estimate, format_bytes, model_from_config, parse_bytes, state_nbytes_after_first_step
from lowmemopt.registry import instantiate, needs_process_group, optimizer_classes

pytest.importorskip("transformers")

# ragged shapes: vocab 301 x 64 = 19264 elements (75.25 blocks of 256), q/k/v/o 64 x 64 = 4096 (min_quant_numel,
# the boundary), MLP 64 x 88 = 5632, norms 64 (fp32 state at every state_bits)
CONFIG = dict(model_type="llama", vocab_size=301, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)

# keywords that give an optimizer all of its slots (momentum buffers, Adafactor's first moment, AMSGrad's v_max)
FULL_STATE = {"SGD": dict(momentum=0.9), "SignSGD": dict(momentum=0.9), "LARS": dict(momentum=0.9), "Adafactor": dict(beta1=0.9),
              "Adam": dict(amsgrad=True)}


def real_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    data = dict(CONFIG)
    data.pop("model_type")
    return LlamaForCausalLM(LlamaConfig(**data))


def state_after_one_step(cls, state_bits: int, **kwargs) -> int:
    model = real_model()
    opt = instantiate(cls, model.parameters(), state_bits=state_bits, **kwargs)
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
    assert cli_main(["estimate", str(path), "--optimizer", "came8bit,lion", "--state-bits", "8",
                     "--gpu-memory", "1MiB", "--json"]) == 0
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
    assert cli_main(["estimate", str(path), "--optimizer", "came8bit", "--galore-rank", "8", "--galore-target",
                     "self_attn,mlp", "--json"]) == 0
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
    assert cli_main(["estimate", str(path), "--optimizer", "adamw8bit", "--dtype", "bf16",
                     "--gpu-memory", "80GB"]) == 0
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
    for bad in ("", "GiB", "12 parsecs", "-1GB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


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
    combos = {(b, r, pg, pl): estimate(meta, "adamw", b, galore_rank=r, paged=pg, per_layer=pl)
              for b in (32, 16, 8, 4) for r in (None, 16, 8) for pg in (False, True) for pl in (False, True)}
    assert not any(e.total <= budget for (b, r, pg, pl), e in combos.items() if (r, pg, pl) == (None, False, False))

    def changes(e):
        return (e.state_bits != 32) + (e.galore_rank is not None) + e.paged + e.per_layer

    fewest = min(changes(e) for e in combos.values() if e.total <= budget)
    assert changes(fits[0]) == fewest
    for f in fits:  # each is one of the combinations, and none that fits changes less on every count
        assert combos[(f.state_bits, f.galore_rank, f.paged, f.per_layer)] == f
        for e in combos.values():
            if e.total <= budget and e != f:
                assert not (e.state_bits >= f.state_bits and e.paged <= f.paged and e.per_layer <= f.per_layer and
                            (e.galore_rank is None or (f.galore_rank is not None and e.galore_rank >= f.galore_rank)))

    assert cli_main(["estimate", str(path), "--optimizer", "adamw", "--gpu-memory", f"{budget // 1024}KiB"]) == 0
    out = capsys.readouterr().out
    assert f"AdamW does not fit in {format_bytes(budget)} as asked; the cheapest combinations that do" in out
    listed = [line for line in out.split("fewest changes first):")[1].splitlines() if line.startswith("| ") and "-bit" in line]
    assert listed and len(listed) == len(fits)
    first = fits[0]
    assert listed[0] == (f"| {first.state_bits}-bit | {first.galore_rank or '—'} | {'yes' if first.paged else 'no'} | "
                         f"{'yes' if first.per_layer else 'no'} | {format_bytes(first.weights)} | "
                         f"{format_bytes(first.grads)} | {format_bytes(first.state)} | {format_bytes(first.total)} |")
    assert cli_main(["estimate", str(path), "--optimizer", "adamw", "--gpu-memory", "100KiB"]) == 0
    assert "does not fit in 100.00 KiB with any combination" in capsys.readouterr().out
    assert cli_main(["estimate", str(path), "--optimizer", "adamw", "--gpu-memory", "80GB"]) == 0
    assert "cheapest combinations" not in capsys.readouterr().out  # it fits: nothing to suggest
