"""lowmemopt.traced_step: the traced peak of a training step (fake tensors) against the same step run for real on the
CPU and counted the same way (torch's storages, exact bytes), within 5%, on small LLaMA configs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lowmemopt.estimate import estimate, model_from_config  # noqa: E402
from lowmemopt.memtrace import LiveMemory  # noqa: E402
from lowmemopt.traced_step import build_optimizer, measure_step, real_model, step_workspace, trace_step  # noqa: E402


def _llama(hidden: int, intermediate: int, layers: int, heads: int, vocab: int) -> dict:
    return dict(
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


#: name -> (config, batch, seq); the parameter counts are what the names say, roughly
CONFIGS = {
    "10m": (_llama(256, 688, 4, 4, 8000), 2, 128),
    "40m": (_llama(512, 1376, 6, 8, 16000), 4, 256),
    "150m": (_llama(768, 2048, 12, 12, 32000), 2, 256),
}
#: (registry name, state_bits, GaLore rank, per-layer updates)
OPTIMIZERS = {
    "adamw32": ("adamw", 32, None, False),
    "adamw8": ("adamw", 8, None, False),
    "galore_adamw8_per_layer": ("galore_adamw_8bit", 8, 32, True),
    "came8": ("came", 8, None, False),
}
CELLS = [
    pytest.param(c, o, ck, id=f"{c}-{o}-{'ckpt' if ck else 'full'}", marks=[pytest.mark.slow] if c != "10m" else [])
    for c in CONFIGS
    for o in OPTIMIZERS
    for ck in (False, True)
]


@pytest.mark.parametrize("config,opt,checkpointing", CELLS)
def test_traced_peak_matches_the_real_step(config, opt, checkpointing):
    cfg, batch, seq = CONFIGS[config]
    name, bits, rank, per_layer = OPTIMIZERS[opt]
    kw = dict(batch=batch, seq=seq, galore_rank=rank, checkpointing=checkpointing, per_layer=per_layer)
    traced = trace_step(cfg, name, bits, device="cpu", refresh=False, **kw)  # (the measured step: between refreshes)
    real = measure_step(real_model(cfg), name, bits, **kw)
    assert abs(traced.peak / real.peak - 1) <= 0.05, (traced, real)
    # the parts that are laid out, not traced, are exact
    for part in ("weights", "optimizer state"):
        assert traced.at_peak[part] == real.at_peak[part], part
    assert traced.params == real.params


def test_the_trace_counts_what_the_layout_estimate_counts():
    """Weights and optimizer state at the traced peak are the meta layout's (exact, :func:`estimate`), the parts add
    up to the peak, and what the batch brings grows with it."""
    cfg, batch, seq = CONFIGS["10m"]
    meta = model_from_config(cfg)
    layout = estimate(meta, "adamw", 8)
    buffers = sum(b.numel() * b.element_size() for b in meta.buffers())  # (the rotary frequencies)
    small = trace_step(cfg, "adamw", 8, batch=1, seq=seq, device="cpu")
    large = trace_step(cfg, "adamw", 8, batch=4, seq=seq, device="cpu")
    for t in (small, large):
        assert t.at_peak["weights"] == layout.weights + buffers and t.at_peak["optimizer state"] == layout.state
        assert sum(t.at_peak.values()) == t.peak
    # batch 4: the peak is at the loss (the fp32 logits); batch 1: in backward (most of the gradients)
    assert large.at_peak["activations"] + large.at_peak["temporaries"] > 4 * small.at_peak["temporaries"]
    assert 0 < small.at_peak["gradients"] <= layout.grads and large.peak > small.peak


def test_checkpointing_and_per_layer_updates_lower_the_traced_peak():
    cfg = _llama(256, 688, 8, 4, 2000)
    plain = trace_step(cfg, "adamw", 32, batch=8, seq=128, device="cpu")
    ckpt = trace_step(cfg, "adamw", 32, batch=8, seq=128, checkpointing=True, device="cpu")
    both = trace_step(cfg, "adamw", 32, batch=8, seq=128, checkpointing=True, per_layer=True, device="cpu")
    assert ckpt.at_peak["activations"] < plain.at_peak["activations"] / 2
    assert both.peak < ckpt.peak
    assert both.at_peak["gradients"] < ckpt.at_peak["gradients"] or ckpt.at_peak["gradients"] == 0


def test_galore_step_workspace_by_construction():
    """A GaLore matrix's update holds its low-rank gradient and update, the full-size update and, at a basis
    refresh, the SVD's factors; a per-layer step holds one matrix's, a whole step all the low-rank gradients."""
    cfg = _llama(128, 256, 2, 4, 500)
    model = model_from_config(cfg, torch.bfloat16)
    opt = build_optimizer(model, "galore_adamw_8bit", 8, 16, ["mlp"])
    each = step_workspace(opt, "cuda", per_layer=True)
    whole = step_workspace(opt, "cuda")
    gate = model.model.layers[0].mlp.gate_proj.weight  # 256 x 128, bf16: projected on the right (256 x 16)
    low = 256 * 16
    steady = 2 * low * 4 + low * 2 + 256 * 128 * (4 + 2) + 256 * 128 * 4  # low-rank, full-size, fp32 weight
    refresh = 256 * 128 * 4 + (256 * 128 + 128 * 128 + 128) * 4  # fp32 copy of the bf16 gradient, U, Vh, S
    assert each[gate] == max(steady, refresh) == steady
    assert len(each) == 2 * 3 and whole[None] == 6 * (2 * low * 4 + low * 2) + steady - (2 * low * 4 + low * 2)
    cpu = step_workspace(opt, "cpu", per_layer=True)  # the CPU's row chunks hold no more than the whole matrix
    assert cpu[gate] == each[gate]  # (256 rows of 128 fit one chunk)
    assert step_workspace(build_optimizer(model, "adamw", 8), "cuda") == {}


def test_live_memory_counts_a_storage_once_and_forgets_it_when_freed():
    tracker = LiveMemory()
    with tracker:
        a = torch.empty(1000)
        b = a.view(10, 100)  # the same storage
        assert tracker.total == 4000
        c = torch.empty(10, dtype=torch.float64)
        assert tracker.total == 4080 and tracker.peak == 4080
        del a, b
        assert tracker.total == 80
    tracker.hold(100)
    assert tracker.peak == 4080 and tracker.total == 80
    tracker.hold(5000)
    assert tracker.peak == 5080 and tracker.at_peak["step workspace"] == 5000 and tracker.total == 80
    rounded = LiveMemory(round_to=512)
    with rounded:
        d = torch.empty(3)
    assert rounded.total == 512
    del c, d


# -- lowmemopt estimate --batch B --seq S ------------------------------------------------------------------------------

SMALL = _llama(64, 88, 2, 4, 301)


def _config_file(tmp_path, config=SMALL):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_cli_traced_step_json_is_trace_step(tmp_path, capsys):
    import json

    from lowmemopt.cli import main

    path = _config_file(tmp_path)
    assert (
        main(
            [
                "estimate",
                path,
                "--optimizer",
                "adamw8bit",
                "--batch",
                "2",
                "--seq",
                "16",
                "--checkpointing",
                "--per-layer",
                "--gpu-memory",
                "1GiB",
                "--margin",
                "0",
                "--json",
            ]
        )
        == 0
    )
    (row,) = json.loads(capsys.readouterr().out)
    want = trace_step(SMALL, "adamw8bit", 8, batch=2, seq=16, checkpointing=True, per_layer=True)
    assert row["peak"] == want.peak == sum(row["at_peak"].values()) and row["at_peak"] == want.at_peak
    assert row["fits"] is True and row["cheapest_fits"] == [] and row["batch"] == 2 and row["per_layer"] is True
    assert main(["estimate", path, "--optimizer", "adamw8bit", "--batch", "2", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "One training step, batch 2 x 16 tokens, no checkpointing; traced on fake tensors" in out
    assert "| AdamW8bit | 8-bit | — |" in out and "README" not in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--batch", "0", "--seq", "16"], "--batch must be >= 1, got 0"),
        (["--batch", "2", "--seq", "-1"], "--seq must be >= 1, got -1"),
        (["--batch", "2"], "tracing a step needs both --batch B and --seq S"),
        (["--measure"], "tracing a step needs both --batch B and --seq S"),
    ],
)
def test_cli_traced_step_bad_input(tmp_path, capsys, argv, message):
    from lowmemopt.cli import main

    assert main(["estimate", _config_file(tmp_path), *argv]) == 1
    assert message in capsys.readouterr().err
    assert main(["estimate", "llama-9z", "--batch", "1", "--seq", "8"]) == 1
    assert "not a preset" in capsys.readouterr().err


def test_cli_traced_step_suggests_changes_that_fit_with_the_margin(tmp_path, capsys):
    """A budget between the checkpointed and the plain peak: the suggestions fit less the margin, and say so."""
    import json

    from lowmemopt.cli import main

    config = _llama(64, 88, 4, 4, 301)
    path = _config_file(tmp_path, config)
    kw = dict(batch=8, seq=64)
    plain = trace_step(config, "adamw", 32, **kw)
    ckpt = trace_step(config, "adamw", 32, checkpointing=True, **kw)
    assert ckpt.peak < plain.peak
    margin = 4096
    budget = (ckpt.peak + plain.peak) // 2 + margin
    argv = [
        "estimate",
        path,
        "--optimizer",
        "adamw",
        "--batch",
        "8",
        "--seq",
        "64",
        "--gpu-memory",
        f"{budget}B",
        "--margin",
        f"{margin}B",
    ]
    assert main([*argv, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["fits"] is False and row["margin"] == margin
    fits = row["cheapest_fits"]
    assert fits and all(f["peak"] <= budget - margin for f in fits)
    assert fits[0]["checkpointing"] is True and fits[0]["peak"] == ckpt.peak  # one change: checkpointing
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "AdamW does not fit in" in out and "as asked; changes that do (fewest first):" in out
    assert "pydoc" in out and "README" not in out


def test_cli_layout_suggestions_keep_the_margin(tmp_path, capsys):
    """Without --batch: the cheapest combinations fit the budget less the margin, and --json lists them."""
    import json

    from lowmemopt.cli import main

    path = _config_file(tmp_path)
    meta = model_from_config(SMALL)
    asked = estimate(meta, "adamw", 32).total
    margin = asked // 4
    budget = asked  # fits exactly without the margin, not with it
    assert (
        main(
            [
                "estimate",
                path,
                "--optimizer",
                "adamw",
                "--state-bits",
                "32",
                "--gpu-memory",
                f"{budget}B",
                "--margin",
                f"{margin}B",
                "--json",
            ]
        )
        == 0
    )
    (row,) = json.loads(capsys.readouterr().out)
    assert row["fits"] is False and row["cheapest_fits"]
    assert all(f["total"] <= budget - margin for f in row["cheapest_fits"])


def test_gpu_check_part_compares_the_e2e_rows(tmp_path, capsys):
    """bench/fits.py --e2e-json (scripts/gpu-check's fits_e2e): each lowmemopt e2e row's traced peak against its
    measured device peak, PASS within 5%, FAIL outside, process RSS and other libraries' rows not compared."""
    import json

    from helpers import load_bench

    fits = load_bench("fits")
    args = dict(
        vocab=301, hidden=64, intermediate=88, layers=2, heads=4, kv_heads=2, seq=16, batch=2, rank=8, dtype="bf16"
    )
    config = dict(
        model_type="llama",
        vocab_size=301,
        hidden_size=64,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    galore = trace_step(
        config,
        "adamw",
        8,
        batch=2,
        seq=16,
        dtype=torch.bfloat16,
        galore_rank=8,
        galore_target_modules=["attn", "mlp"],
        per_layer=True,
    ).peak
    came = trace_step(config, "came", 8, batch=2, seq=16, dtype=torch.bfloat16).peak
    rows = [
        dict(name="torch-adamw-fused", peak_bytes=1, peak_kind="device"),
        dict(name="lowmemopt-galore-adamw-8bit-per-layer", peak_bytes=int(galore * 1.03), peak_kind="device"),
        dict(name="lowmemopt-came-8bit", peak_bytes=int(came * 1.2), peak_kind="device"),
        dict(name="lowmemopt-adamw-8bit", peak_bytes=10**9, peak_kind="rss"),
    ]
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(dict(args=args, rows=rows)))
    lines, ok = fits.compare_e2e([str(path), str(tmp_path / "absent.json")])
    table = "\n".join(lines)
    assert not ok and "torch-adamw-fused" not in table
    row = (
        f"| lowmemopt-galore-adamw-8bit-per-layer | {galore * 1.03 / 2**30:.2f} | {galore / 2**30:.2f} | 0.971 | PASS |"
    )
    assert row in table
    assert "| lowmemopt-came-8bit |" in table and "| 0.833 | FAIL |" in table
    assert "| lowmemopt-adamw-8bit | 0.93 (process RSS, not a device peak) |" in table
    rows[2]["peak_bytes"] = came
    path.write_text(json.dumps(dict(args=args, rows=rows)))
    assert fits.compare_e2e([str(path)])[1]
    assert fits.main(["--e2e-json", str(path)]) == 0
    assert "Target (traced within 5% of the measured peak on every row): PASS" in capsys.readouterr().out


def test_trace_refuses_paged_state_and_models_without_a_loss(tmp_path, capsys):
    from lowmemopt.cli import main

    with pytest.raises(NotImplementedError, match="paged state is not traced"):
        trace_step(SMALL, "paged_adamw8bit", 8, batch=1, seq=8)
    assert (
        main(["estimate", _config_file(tmp_path), "--optimizer", "paged_adamw8bit", "--batch", "1", "--seq", "8"]) == 1
    )
    assert "paged state is not traced" in capsys.readouterr().err
    vit = dict(
        model_type="vit",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=16,
    )  # (no causal LM: built as AutoModel)
    with pytest.raises(ValueError, match="needs a causal language model"):
        trace_step(vit, "adamw", 32, batch=1, seq=8)
