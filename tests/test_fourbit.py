"""4-bit optimizer state (``state_bits=4``): the maps and their codec against a brute-force search, the packed layout,
every optimizer's state bytes and bit-exact resume, conversions 32/16/8 <-> 4 (state dicts and files), paging, GaLore,
the Trainer factory, ``lowmemopt estimate``, and a short real training run against 32 bits."""

from __future__ import annotations

import io
import math

import pytest
import torch
from helpers import clone_params, make_params, run, set_grads
from optim_info import OPTIMIZERS

import lowmemopt
from lowmemopt.quant import q4
from lowmemopt.quant.formats import BF16, FP32, Q4, Q8, choose_format, format_of

MAPS = ("pow2x4", "upow2x4")


def _neighbours(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` moved by ``k`` ulps (fp32, all finite)."""
    out = t.clone()
    toward = torch.full_like(t, math.inf if k > 0 else -math.inf)
    for _ in range(abs(k)):
        out = torch.nextafter(out, toward)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# maps and codec


def test_maps_are_16_sorted_codes_with_one_and_the_unsigned_map_has_no_zero():
    signed, unsigned = q4.code_book("pow2x4"), q4.code_book("upow2x4")
    for book in (signed, unsigned):
        assert book.numel() == 16 and book[-1] == 1.0 and bool((book[1:] > book[:-1]).all())
    assert 0.0 in signed.tolist() and signed[0] == -0.75
    assert bool((unsigned > 0).all()), "the second-moment map must be zero-free"
    assert q4.map4_for(True) == "pow2x4" and q4.map4_for(False) == "upow2x4"


@pytest.mark.parametrize("name", MAPS)
def test_thresholds_match_the_brute_force_rule_on_every_decision_float(name):
    thr = q4.thresholds(name)
    near = torch.cat([_neighbours(thr, k) for k in range(-3, 4)] + [q4.code_book(name)])
    gen = torch.Generator().manual_seed(0)
    rand = torch.cat(
        [
            torch.rand(20000, generator=gen) * 2.2 - 1.1,
            torch.rand(2000, generator=gen) * 1e-3,
            torch.tensor([0.0, -0.0, 1.0, -1.0, 5.0, -5.0, 1e-30, -1e-30]),
        ]
    )
    y = torch.cat([near, rand])
    got = torch.bucketize(y, thr, right=True)
    assert torch.equal(got, q4.nearest_code4_reference(y, name))
    # just below each threshold: code j; at it: code j + 1
    assert torch.equal(torch.bucketize(thr, thr, right=True), torch.arange(1, 16))
    assert torch.equal(torch.bucketize(_neighbours(thr, -1), thr, right=True), torch.arange(0, 15))


def _blocky(n: int, seed: int = 0, unsigned: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(3 * torch.randn(n, generator=gen))  # wide dynamic range
    if unsigned:
        x = x.square()
    x[: min(n, 128)] = 0  # an all-zero block
    if n > 300:
        x[200] = 1e6 if unsigned else -1e6  # an outlier
        x[201] = 1e-9  # a small value beside it
    return x


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("n,block", [(1, 128), (17, 16), (128, 128), (3 * 128 + 5, 128), (1001, 64), (4097, 256)])
def test_codec_matches_brute_force_code_for_code(name, n, block):
    x = _blocky(n, seed=n, unsigned=name.startswith("u"))
    nibbles, absmax = q4.quantize(x, name, block)
    assert nibbles.dtype == torch.uint8 and nibbles.numel() == (n + 1) // 2
    assert absmax.numel() == -(-n // block)
    ref_codes, ref_absmax = q4.quantize_reference(x, name, block)
    assert torch.equal(absmax, ref_absmax)
    codes = torch.stack((nibbles & 15, nibbles >> 4), 1).view(-1)
    assert torch.equal(codes[:n].long(), ref_codes)
    if n % 2:
        assert int(nibbles[-1]) >> 4 == 0  # the odd element count's padding nibble
    out = q4.dequantize(nibbles, absmax, n, name, block)
    book = q4.code_book(name)
    assert torch.equal(out, book[ref_codes] * absmax.repeat_interleave(block)[:n])


@pytest.mark.parametrize("name", MAPS)
def test_round_trip_error_is_within_half_a_code_gap(name):
    """|x - decode(encode(x))| <= half the gap between the two codes around x / absmax (times absmax); below the
    unsigned map's smallest code, at most that code."""
    signed = name == "pow2x4"
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(128 * 64, generator=gen) * torch.exp(2 * torch.randn(128 * 64, generator=gen))
    x = x if signed else x.square()
    nibbles, absmax = q4.quantize(x, name, 128)
    out = q4.dequantize(nibbles, absmax, x.numel(), name, 128)
    scale = absmax.repeat_interleave(128)
    y = x / scale
    book = q4.code_book(name)
    hi = torch.searchsorted(book, y).clamp(1, 15)
    gap = book[hi] - book[hi - 1]
    bound = torch.where(y < book[0], book[0] - y, gap / 2) * scale
    assert bool(((out - x).abs() <= bound * (1 + 1e-6) + 1e-6 * scale).all())  # + fp32 rounding of the product
    err = float((out - x).norm() / x.norm())
    assert err < (0.09 if signed else 0.025), err  # measured 0.074 / 0.019 on this input


def test_unsigned_map_never_decodes_a_positive_value_to_zero():
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(128 * 40, generator=gen).pow(8) * 10.0 ** torch.randint(-30, 30, (128 * 40,), generator=gen)
    x[::128] = 1e30  # an outlier in every block: the rest is ~1e-30..1e-60 of the block scale
    x[5] = 1e-45  # the smallest subnormal
    nibbles, absmax = q4.quantize(x, "upow2x4", 128)
    out = q4.dequantize(nibbles, absmax, x.numel(), "upow2x4", 128)
    assert bool((out[x > 0] > 0).all())
    assert bool((out >= x.clamp_max(0)).all())
    zeros = torch.zeros(300)  # all-zero blocks stay exactly zero
    assert torch.equal(q4.dequantize(*q4.quantize(zeros, "upow2x4", 128), 300, "upow2x4", 128), zeros)


def test_codec_rejects_bad_layouts():
    with pytest.raises(ValueError, match="even int"):
        q4.quantize(torch.ones(10), "pow2x4", 15)
    nib, am = q4.quantize(torch.ones(10), "pow2x4", 16)
    with pytest.raises(ValueError, match="5 bytes for 10 elements"):
        q4.dequantize(nib[:4], am, 10, "pow2x4", 16)
    with pytest.raises(ValueError, match="unknown 4-bit map"):
        q4.quantize(torch.ones(10), "nf4", 16)


def test_state_format_q4_chunks_cut_bytes_where_they_cut_blocks():
    x = _blocky(1000, seed=3)
    whole, parts = {}, {}
    Q4.init(whole, "m", torch.Size([1000]), torch.device("cpu"), 64)
    Q4.init(parts, "m", torch.Size([1000]), torch.device("cpu"), 64)
    Q4.encode(whole, "m", 0, 1000, x, True, 64)
    for lo in range(0, 1000, 256):
        Q4.encode(parts, "m", lo, min(1000, lo + 256), x[lo : lo + 256].contiguous(), True, 64)
    assert all(torch.equal(whole[k], parts[k]) for k in whole)
    assert torch.equal(Q4.decode(whole, "m", 256, 1000, True, 64), Q4.decode(whole, "m", 0, 1000, True, 64)[256:])
    assert Q4.nbytes(1000, 64) == 500 + 4 * 16 == sum(t.numel() * t.element_size() for t in whole.values())
    assert format_of(whole, "m") is Q4 and choose_format(4, 5000, 4096) is Q4 and choose_format(4, 100, 4096) is FP32
    assert (choose_format(8, 5000, 4096), choose_format(16, 5000, 4096)) == (Q8, BF16)


# ---------------------------------------------------------------------------------------------------------------------
# optimizers


def test_state_bits_and_block_size_options():
    p = make_params([(64, 64)])
    with pytest.raises(ValueError, match=r"Invalid state_bits: 3 \(supported: 32, 16, 8, 4\)"):
        lowmemopt.AdamW(p, state_bits=3)
    assert lowmemopt.AdamW(p, state_bits=4).defaults["block_size"] == 128
    assert lowmemopt.AdamW(p, state_bits=8).defaults["block_size"] == 256
    assert lowmemopt.AdamW(p, state_bits=4, block_size=64).defaults["block_size"] == 64
    a, b, c = make_params([(8,), (8,), (8,)])
    opt = lowmemopt.AdamW(
        [{"params": [a]}, {"params": [b], "state_bits": 4}, {"params": [c], "state_bits": 4, "block_size": 32}],
        state_bits=8,
    )
    assert [g["block_size"] for g in opt.param_groups] == [256, 128, 32]
    opt = lowmemopt.AdamW([{"params": [a]}, {"params": [b], "state_bits": 4}], state_bits=8, block_size=512)
    assert [g["block_size"] for g in opt.param_groups] == [512, 512]  # an explicit block size stays
    with pytest.raises(ValueError, match="Invalid block_size"):
        lowmemopt.AdamW(p, state_bits=4, block_size=24)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_state_bytes_per_param_exact(info):
    shape = (96, 130)  # 12480 elements: a ragged last block of 64
    params = make_params([shape])
    kw = dict(info.variants[0])
    opt = info.cls(params, state_bits=4, **kw)
    run(opt, params, 1)
    assert opt.state_nbytes() == info.expected_state_bytes(shape, 4, kw)
    if info.name in ("AdamW", "Adam", "LAMB"):
        assert sum(1 for k in opt.state[params[0]] if k.endswith(".nibbles")) == 2


def test_adamw_is_1_0625_bytes_per_param():
    params = make_params([(1024, 1024)])
    opt = lowmemopt.AdamW4bit(params)
    run(opt, params, 1)
    assert opt.state_nbytes() / params[0].numel() == 1.0625  # 2 x (1/2 + 4/128)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_resume_is_bit_exact(info):
    shapes = [(40, 103), (4097,), (7,)]
    kw = dict(info.variants[-1] if info.name not in ("GaLoreAdamW", "GaLoreAdafactor") else info.variants[0])
    kw.update(state_bits=4, min_quant_numel=64)
    params = make_params(shapes)
    opt = info.cls(params, **kw)
    run(opt, params, 3)
    assert any(k.endswith(".nibbles") for st in opt.state.values() for k in st) or info.name == "SGD"
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    resumed_params = clone_params(params)
    resumed = info.cls(resumed_params, **kw)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    run(opt, params, 3, start=3)
    run(resumed, resumed_params, 3, start=3)
    for p, r in zip(params, resumed_params):
        assert torch.equal(p, r)
        for k, v in opt.state[p].items():
            w = resumed.state[r][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, k


def _decoded(opt, p, slot):
    st = opt.state[p]
    fmt = format_of(st, slot)
    n = p.numel()
    return fmt.decode(st, slot, 0, n, slot != "exp_avg_sq", opt.param_groups[0]["block_size"])


@pytest.mark.parametrize("src_bits", [32, 16, 8])
def test_conversion_to_and_from_4_bits_on_load(src_bits, tmp_path):
    shapes = [(33, 129)]
    params = make_params(shapes)
    src = lowmemopt.AdamW(params, state_bits=src_bits, min_quant_numel=0, weight_decay=0.1)
    run(src, params, 4)
    values = {s: _decoded(src, params[0], s).clone() for s in ("exp_avg", "exp_avg_sq")}
    lowmemopt.save_state(src, tmp_path / "src.safetensors")
    for how in ("state_dict", "file"):
        dst_params = clone_params(params)
        dst = lowmemopt.AdamW(dst_params, state_bits=4, min_quant_numel=0, weight_decay=0.1)
        if how == "file":
            report = lowmemopt.load_state(dst, tmp_path / "src.safetensors")
            assert sorted(report.converted) == [
                f"0/0/exp_avg: {_name(src_bits)} -> q4",
                f"0/0/exp_avg_sq: {_name(src_bits)} -> q4",
            ]
        else:
            dst.load_state_dict(src.state_dict())
        st = dst.state[dst_params[0]]
        for slot, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            nib, am = q4.quantize(values[slot], q4.map4_for(signed), 128)  # one rounding of the source's values
            assert torch.equal(st[slot + ".nibbles"], nib) and torch.equal(st[slot + ".absmax"], am), (how, slot)
        # and back: 4 -> src_bits decodes the 4-bit values exactly (fp32) or rounds them once
        back_params = clone_params(params)
        back = lowmemopt.AdamW(back_params, state_bits=src_bits, min_quant_numel=0, weight_decay=0.1)
        lowmemopt.save_state(dst, tmp_path / "q4.safetensors")
        lowmemopt.load_state(back, tmp_path / "q4.safetensors")
        for slot in ("exp_avg", "exp_avg_sq"):
            exact = _decoded(dst, dst_params[0], slot)
            got = _decoded(back, back_params[0], slot)
            if src_bits == 32:
                assert torch.equal(got, exact)
            else:
                assert float((got - exact).norm() / exact.norm()) < 0.02
        run(back, back_params, 1, start=4)  # and it steps


def _name(bits):
    return {32: "fp32", 16: "bf16", 8: "q8"}[bits]


def test_file_checks_of_4bit_slots(tmp_path):
    params = make_params([(40, 103)])
    opt = lowmemopt.AdamW(params, state_bits=4, min_quant_numel=0)
    run(opt, params, 2)
    lowmemopt.save_state(opt, tmp_path / "a.safetensors")
    meta = lowmemopt.checkpoint.read_metadata(tmp_path / "a.safetensors")
    info = meta["params"]["0/0"]["slots"]
    assert info["exp_avg"] == {"format": "q4", "shape": [40, 103], "block_size": 128, "map": "pow2x4"}
    assert info["exp_avg_sq"]["map"] == "upow2x4"
    assert meta["tensors"]["0/0/exp_avg.nibbles"] == ("U8", [2060])
    other = lowmemopt.AdamW(clone_params(params), state_bits=4, block_size=64, min_quant_numel=0)
    with pytest.raises(lowmemopt.checkpoint.CheckpointError, match="4-bit at block_size 128 in the file"):
        lowmemopt.load_state(other, tmp_path / "a.safetensors")
    with pytest.raises(lowmemopt.checkpoint.CheckpointError, match="is 4-bit at block_size 128"):
        other.load_state_dict(opt.state_dict())


def test_paged_4bit_equals_unpaged(tmp_path):
    params = make_params([(64, 100), (300,)])
    twin = clone_params(params)
    paged = lowmemopt.AdamW(params, state_bits=4, min_quant_numel=0, paged="disk", offload_dir=tmp_path)
    plain = lowmemopt.AdamW(twin, state_bits=4, min_quant_numel=0)
    run(paged, params, 4)
    run(plain, twin, 4)
    for p, q in zip(params, twin):
        assert torch.equal(p, q)
    sd = paged.state_dict()
    for k, v in plain.state_dict()["state"][0].items():
        assert torch.equal(v, sd["state"][0][k]) if isinstance(v, torch.Tensor) else v == sd["state"][0][k]
    paged.close()


def test_galore_low_rank_state_at_4_bits(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.Linear(128, 64))
    groups = lowmemopt.galore_param_groups(model, target_modules=["0", "1"], rank=16, update_proj_gap=2)
    opt = lowmemopt.AdamW(groups, lr=1e-2, state_bits=4, min_quant_numel=0)
    x = torch.randn(32, 96)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    st = opt.state[model[0].weight]
    assert "galore.proj" in st and st["exp_avg.nibbles"].numel() == 128 * 16 // 2  # (128, rank 16), packed
    lowmemopt.save_state(opt, tmp_path / "g.safetensors", model=model)
    again = lowmemopt.AdamW(
        lowmemopt.galore_param_groups(model, target_modules=["0", "1"], rank=16, update_proj_gap=2),
        lr=1e-2,
        state_bits=4,
        min_quant_numel=0,
    )
    assert not lowmemopt.load_state(again, tmp_path / "g.safetensors", model=model).converted
    assert torch.equal(again.state[model[0].weight]["exp_avg.nibbles"], st["exp_avg.nibbles"])


def test_triton_interpreter_steps_4bit_params_with_the_kernels():
    """4-bit state takes the fused Triton kernels (tests/test_kernels_q4.py checks them step by step); over two steps
    they stay within the kernel bounds of the eager 4-bit path."""
    runtime = pytest.importorskip("lowmemopt.kernels.runtime")
    if not (runtime.HAS_TRITON and runtime.INTERPRET):
        pytest.skip("needs TRITON_INTERPRET=1 (conftest sets it without CUDA)")
    from helpers import assert_params_close, assert_state_close

    from lowmemopt.kernels import dispatch

    for cls, kw, algorithm in ((lowmemopt.AdamW, dict(lr=1e-2), "adam"), (lowmemopt.CAME, dict(lr=1e-3), "came")):
        params = make_params([(48, 96), (300,)])
        twin = clone_params(params)
        opt = cls(params, state_bits=4, min_quant_numel=0, **kw)
        ref = cls(twin, state_bits=4, min_quant_numel=0, **kw)
        before = dispatch.stats.get((algorithm, "q4"), 0)
        for t in range(2):
            set_grads(params, t)
            set_grads(twin, t)
            with runtime.cpu_interpreter():
                opt.step()
            ref.step()
        assert dispatch.stats.get((algorithm, "q4"), 0) > before
        for p, q in zip(params, twin):
            assert_state_close(opt.state[p], ref.state[q], cls.__name__)
        assert_params_close(params, twin, kw["lr"], True, cls.__name__)


def test_trainer_factory_and_aliases():
    pytest.importorskip("transformers")
    from lowmemopt.integrations.transformers import optimizer
    from lowmemopt.registry import resolve_optimizer

    assert (
        resolve_optimizer("adamw4bit").cls is lowmemopt.AdamW4bit
        and resolve_optimizer("came_4bit").cls is lowmemopt.CAME4bit
    )
    assert resolve_optimizer("paged_lion4bit").kwargs == {"paged": True}
    p = make_params([(8, 8)])
    assert lowmemopt.PagedAdamW4bit(p).defaults["paged"] is True
    for alias in (
        "Adam4bit",
        "AdamW4bit",
        "LAMB4bit",
        "LARS4bit",
        "Lion4bit",
        "Adafactor4bit",
        "CAME4bit",
        "GaLoreAdamW4bit",
    ):
        opt = getattr(lowmemopt, alias)(p, **({"lr": 1e-3} if alias == "CAME4bit" else {}))
        assert opt.defaults["state_bits"] == 4 and opt.defaults["block_size"] == 128
    cls, kwargs = optimizer("adamw4bit", embedding_state_bits=4)
    assert cls is not None and kwargs is not None


def test_estimate_at_4_bits():
    from lowmemopt.estimate import estimate

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False))
    r4, r8 = estimate(model, "adamw", 4), estimate(model, "adamw", 8)
    assert r4.state == 1024 * 1024 * 2 * (0.5 + 4 / 128) and r8.state == 1024 * 1024 * 2 * (1 + 4 / 256)
    assert estimate(model, "adamw4bit", 4).state == r4.state


def test_cli_estimate_state_bits_4(tmp_path, capsys):
    pytest.importorskip("transformers")
    import json

    from test_estimate import CONFIG, model_from_config

    from lowmemopt.cli import main
    from lowmemopt.estimate import estimate

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert main(["estimate", str(path), "--optimizer", "adamw,came", "--state-bits", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["optimizer"], r["state_bits"]) for r in rows] == [("AdamW", 4), ("CAME", 4)]
    assert rows[0]["state"] == estimate(model_from_config(CONFIG), "adamw", 4).state
    assert rows[0]["state"] < estimate(model_from_config(CONFIG), "adamw", 8).state


# ---------------------------------------------------------------------------------------------------------------------
# training


@pytest.mark.parametrize("name", ["AdamW", "CAME"])
def test_4bit_training_matches_32bit(name):
    """The byte MLP of lowmemopt.demo, 60 steps: the 4-bit run's held-out loss within 2% of the 32-bit run's
    (measured: AdamW -0.4%, CAME -0.8%; bench/fourbit.py has the LLaMA and torchao's AdamW4bit)."""
    from lowmemopt.demo import train_bytes

    kw = {"AdamW": dict(lr=3e-3, weight_decay=0.01), "CAME": dict(lr=1e-3, weight_decay=0.01)}[name]
    cls = getattr(lowmemopt, name)
    runs = {bits: train_bytes(lambda p: cls(p, state_bits=bits, **kw), 60) for bits in (32, 4)}
    l32, l4 = runs[32]["heldout"], runs[4]["heldout"]
    assert runs[4]["state_bytes"] < runs[32]["state_bytes"] / 3.5
    assert runs[32]["losses"][-1] < 0.6 * runs[32]["losses"][0]  # it trains: 5.61 -> 2.41 (AdamW), 2.51 (CAME)
    assert abs(l4 - l32) / l32 < 0.02, (l4, l32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["AdamW", "CAME"])
def test_4bit_training_matches_32bit_llama(name):
    """The full version (bench/fourbit.py's LLaMA rows): the demo LLaMA, 300 steps, seeds 0-2; the 4-bit held-out loss
    within 2% of the 32-bit one on average over the seeds, and within 4% on each. One seed's gap is mostly the run's
    chaos, not 4 bits: 32-bit CAME with the native kernels against the eager path (the same math, sums rounded
    differently) ends +0.85%, +2.67%, +0.54% apart on seeds 0-2. Measured (`bench/fourbit.py --seeds 0,1,2`):
    AdamW -0.58%, +0.53%, +2.82% (mean +0.92%); CAME +3.68%, +1.17%, -3.85% (mean +0.33%)."""
    pytest.importorskip("transformers")
    from lowmemopt.demo import train_llama_bytes

    kw = {"AdamW": dict(lr=1e-3, weight_decay=0.01), "CAME": dict(lr=2e-4, weight_decay=0.01)}[name]
    cls = getattr(lowmemopt, name)
    rel = []
    for seed in range(3):
        runs = {bits: train_llama_bytes(lambda p: cls(p, state_bits=bits, **kw), 300, seed=seed) for bits in (32, 4)}
        l32, l4 = runs[32]["heldout"], runs[4]["heldout"]
        rel.append((l4 - l32) / l32)
        print(
            f"{name} LLaMA seed {seed}: held-out 32-bit {l32:.4f}, 4-bit {l4:.4f} ({100 * rel[-1]:+.2f}%), "
            f"state {runs[32]['state_bytes']} -> {runs[4]['state_bytes']} B"
        )
        assert runs[4]["state_bytes"] < runs[32]["state_bytes"] / 3
    assert abs(sum(rel) / len(rel)) < 0.02 and max(map(abs, rel)) < 0.04, rel


def test_another_models_4bit_state_is_refused_naming_the_shapes():
    """4-bit state of another model: the error names the optimizer's parameter shape and both sizes (as at 8 bits),
    and the optimizer is left as it was."""
    a = [torch.nn.Parameter(torch.randn(64, 96))]
    b = [torch.nn.Parameter(torch.randn(32, 48))]
    src, dst = lowmemopt.AdamW(a, state_bits=4), lowmemopt.AdamW(b, state_bits=4)
    for opt, params in ((src, a), (dst, b)):
        params[0].grad = torch.randn_like(params[0])
        opt.step()
    before = {k: v.clone() for k, v in dst.state[b[0]].items() if isinstance(v, torch.Tensor)}
    with pytest.raises(
        ValueError,
        match=r"'exp_avg' has 3,072 bytes in the state dict \(4-bit codes, two per byte, "
        r"stored flat\); the optimizer's parameter has shape \(32, 48\) \(1,536 "
        r"elements, 768 bytes\)",
    ):
        dst.load_state_dict(src.state_dict())
    assert all(torch.equal(dst.state[b[0]][k], v) for k, v in before.items())
