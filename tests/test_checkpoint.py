"""lowmemopt.save_state / load_state (safetensors), format conversion on load (file and load_state_dict, from
torch.optim and bitsandbytes), validation errors, atomic writes, file size and load memory."""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from helpers import clone_params, make_params, run, trajectory_error
from optim_info import OPTIMIZERS, STATEFUL
from safetensors import safe_open
from safetensors.torch import save_file

import lowmemopt
import lowmemopt.checkpoint as checkpoint
from lowmemopt.checkpoint import CheckpointError, load_state, save_state
from lowmemopt.quant import convert
from lowmemopt.quant import code_book, dequantize_blockwise, format_of, quantize_blockwise
from lowmemopt.quant.formats import legacy_map_for, map_for

SHAPES = [(70, 91), (4099,), (300,), (5, 7, 129)]  # 2 quantized at 8 bits (one ragged), 1 small (fp32), 1 3-D


class Net(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(64, 80)  # 5120 elements: quantized at 8 bits
        self.proj = torch.nn.Linear(80, 72)  # 5760 + 72
        self.head = torch.nn.Linear(72, 10, bias=False)  # 720: fp32 state

    def params(self) -> list[torch.nn.Parameter]:
        return list(self.parameters())


def _snapshot(opt) -> list[dict]:
    """A copy of every param's state, in param order (to check that a failed load changed nothing)."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            out.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()})
    return out


def _same_state(opt, snapshot) -> bool:
    now = _snapshot(opt)
    if len(now) != len(snapshot):
        return False
    for a, b in zip(now, snapshot):
        if a.keys() != b.keys():
            return False
        for k in a:
            if isinstance(a[k], torch.Tensor):
                if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]):
                    return False
            elif a[k] != b[k]:
                return False
    return True


def _decode(opt, p, slot: str) -> torch.Tensor:
    """A slot's values as fp32 (the storage format decoded), in the param's shape."""
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    signed = opt._slots(group, p)[slot].signed
    state = opt.state[p]
    return format_of(state, slot).decode(state, slot, 0, p.numel(), signed, group["block_size"]).clone().view(p.shape)


def _stepped(bits: int, shapes=SHAPES, steps: int = 5, cls=lowmemopt.AdamW, **kw):
    params = make_params(shapes)
    opt = cls(params, state_bits=bits, **kw)
    run(opt, params, steps)
    return opt, params


# ---------------------------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("bits", [32, 16, 8])
@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_save_load_same_format_is_bit_exact_and_resumes_exactly(tmp_path, info, bits):
    kwargs = STATEFUL[info.name]
    start = make_params(SHAPES)
    full = clone_params(start)
    run(info.cls(full, state_bits=bits, **kwargs), full, 8)
    half = clone_params(start)
    opt = info.cls(half, state_bits=bits, **kwargs)
    run(opt, half, 4)
    save_state(opt, tmp_path / "s.safetensors")
    resumed = clone_params(half)
    fresh = info.cls(resumed, state_bits=bits, **kwargs)
    report = load_state(fresh, tmp_path / "s.safetensors")
    assert report.converted == [] and report.hyperparameters_restored
    for p, q in zip(half, resumed):
        a, b = opt.state[p], fresh.state[q]
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert b[k].dtype == a[k].dtype and torch.equal(a[k], b[k]), k
            else:
                assert type(b[k]) is int and a[k] == b[k]
    run(fresh, resumed, 4, start=4)
    for a, b in zip(resumed, full):
        assert torch.equal(a, b)


def test_hyperparameters_restored_when_group_layout_matches(tmp_path):
    opt, params = _stepped(8, lr=0.05, betas=(0.8, 0.95), weight_decay=0.2)
    opt.param_groups[0]["lr"] = 0.0125  # as a scheduler would leave it
    opt.param_groups[0]["initial_lr"] = 0.05
    save_state(opt, tmp_path / "s.safetensors")
    fresh = lowmemopt.AdamW(clone_params(params), state_bits=8)
    assert load_state(fresh, tmp_path / "s.safetensors").hyperparameters_restored
    group = fresh.param_groups[0]
    assert group["lr"] == 0.0125 and group["initial_lr"] == 0.05 and group["weight_decay"] == 0.2
    assert group["betas"] == (0.8, 0.95) and isinstance(group["betas"], tuple)


def test_tensor_lr_is_restored_as_a_tensor(tmp_path):
    opt, params = _stepped(32, lr=torch.tensor(0.02))
    save_state(opt, tmp_path / "s.safetensors")
    fresh = lowmemopt.AdamW(clone_params(params), lr=torch.tensor(0.5))
    load_state(fresh, tmp_path / "s.safetensors")
    lr = fresh.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and float(lr) == pytest.approx(0.02)


def test_names_survive_param_order_and_group_layout_change(tmp_path):
    net = Net()
    opt = lowmemopt.AdamW(net.parameters(), lr=1e-2, state_bits=8)
    run(opt, net.params(), 3)
    save_state(opt, tmp_path / "s.safetensors", model=net)
    with safe_open(str(tmp_path / "s.safetensors"), "pt") as f:
        assert "proj.weight/exp_avg.codes" in f.keys() and "head.weight/exp_avg_sq" in f.keys()

    other = Net(seed=1)
    other.load_state_dict(net.state_dict())
    groups = [  # reversed order, split into two groups with their own hyper-parameters
        {"params": [other.head.weight, other.proj.bias], "weight_decay": 0.0},
        {"params": [other.proj.weight, other.embed.weight], "lr": 3e-3},
    ]
    fresh = lowmemopt.AdamW(groups, lr=1e-2, state_bits=8)
    report = load_state(fresh, tmp_path / "s.safetensors", model=other)
    assert report == checkpoint.LoadReport([], [], {}, [], False)
    assert fresh.param_groups[0]["weight_decay"] == 0.0 and fresh.param_groups[1]["lr"] == 3e-3  # kept: layout changed
    names = dict(other.named_parameters())
    for name, p in net.named_parameters():
        a, b = opt.state[p], fresh.state[names[name]]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a), name


def test_params_without_state_round_trip(tmp_path):
    params = make_params(SHAPES)
    opt = lowmemopt.AdamW(params, state_bits=8)
    save_state(opt, tmp_path / "empty.safetensors")  # before any step: no tensors at all
    params[0].grad = torch.ones_like(params[0])
    opt.step()  # state for params[0] only
    save_state(opt, tmp_path / "one.safetensors")
    fresh = lowmemopt.AdamW(clone_params(params), state_bits=8)
    load_state(fresh, tmp_path / "one.safetensors")
    got = [fresh.state.get(p, {}) for p in fresh.param_groups[0]["params"]]
    assert got[0]["step"] == 1 and all(st == {} for st in got[1:])
    load_state(fresh, tmp_path / "empty.safetensors")  # a file state replaces the optimizer's, as torch's load does
    assert all(not fresh.state.get(p) for p in fresh.param_groups[0]["params"])


# ---------------------------------------------------------------------------------------------------------------------
# conversion between formats


def _reference_conversion(src_values: torch.Tensor, bits: int, signed: bool, numel: int, block_size: int = 256):
    """What a slot holding ``src_values`` (fp32) must become at ``bits``: the format's own encoder, applied once."""
    if bits == 32 or numel < 4096:
        return {"": src_values}
    if bits == 16:
        return {"": src_values.to(torch.bfloat16)}
    codes, absmax = quantize_blockwise(src_values, map_for(signed), block_size)
    return {".codes": codes, ".absmax": absmax}


def _check_converted(src_opt, src_params, dst_opt, dst_params, bits):
    """dst's state equals the reference conversion of src's decoded state, slot by slot, step included."""
    for p, q in zip(src_params, dst_params):
        group = src_opt.param_groups[0]
        assert dst_opt.state[q]["step"] == src_opt.state[p]["step"]
        for slot, spec in src_opt._slots(group, p).items():
            want = _reference_conversion(_decode(src_opt, p, slot).reshape(-1), bits, spec.signed, p.numel())
            for suffix, value in want.items():
                got = dst_opt.state[q][slot + suffix]
                assert got.dtype == value.dtype, (slot + suffix, bits)
                assert torch.equal(got.reshape(-1), value.reshape(-1)), (slot + suffix, bits)


CONVERSIONS = [(s, d) for s in (32, 16, 8) for d in (32, 16, 8) if s != d]


@pytest.mark.parametrize("src,dst", CONVERSIONS, ids=[f"{s}to{d}" for s, d in CONVERSIONS])
@pytest.mark.parametrize("path", ["file", "state_dict"])
def test_conversion_on_load_equals_the_formats_codec(tmp_path, src, dst, path):
    src_opt, params = _stepped(src, lr=1e-2, amsgrad=True)  # three slots: exp_avg (signed) and two unsigned
    dst_params = clone_params(params)
    dst_opt = lowmemopt.AdamW(dst_params, lr=1e-2, state_bits=dst)
    if path == "file":
        save_state(src_opt, tmp_path / "s.safetensors")
        report = load_state(dst_opt, tmp_path / "s.safetensors")
        fmt = {32: "fp32", 16: "bf16", 8: "q8"}
        assert len(report.converted) == 3 * 3  # 3 slots of the 3 params above min_quant_numel; (300,) stays fp32
        assert {c.split(": ")[1] for c in report.converted} == {f"{fmt[src]} -> {fmt[dst]}"}
    else:
        dst_opt.load_state_dict(src_opt.state_dict())
    assert dst_opt.param_groups[0]["state_bits"] == dst
    _check_converted(src_opt, params, dst_opt, dst_params, dst)
    run(dst_opt, dst_params, 2, start=5)  # the converted state is usable


def _legacy(opt):
    """Rewrite ``opt``'s 8-bit state as lowmemopt format 1 held it: codes in bitsandbytes' dynamic maps (each slot's
    decoded values encoded once more). Returns the fp32 values the legacy codes decode to, per (param, slot)."""
    values = {}
    for p in opt.param_groups[0]["params"]:
        for slot, spec in opt._slots(opt.param_groups[0], p).items():
            state = opt.state[p]
            if slot + ".codes" in state:
                name = legacy_map_for(spec.signed)
                codes, absmax = quantize_blockwise(_decode(opt, p, slot), name, 256)
                state[slot + ".codes"].copy_(codes)
                state[slot + ".absmax"].copy_(absmax)
                values[(p, slot)] = dequantize_blockwise(codes, absmax, name, 256)
    return values


@pytest.mark.parametrize("path", ["file", "state_dict"])
def test_format_1_state_in_the_dynamic_maps_is_re_encoded(tmp_path, path, monkeypatch):
    """8-bit state saved before the pow2 maps (state dicts with lowmemopt_format 1, files whose slots say map
    'dynamic' / 'udynamic') loads: each slot decoded in its old map and encoded once into the pow2 maps."""
    src_opt, params = _stepped(8, lr=1e-2, amsgrad=True)
    legacy = _legacy(src_opt)
    dst_params = clone_params(params)
    dst_opt = lowmemopt.AdamW(dst_params, lr=1e-2, state_bits=8, amsgrad=True)
    if path == "file":
        monkeypatch.setattr(convert, "map_for", legacy_map_for)  # what an older lowmemopt wrote
        monkeypatch.setattr(checkpoint.save, "FILE_VERSION", 1)
        save_state(src_opt, tmp_path / "old.safetensors")
        monkeypatch.undo()
        report = load_state(dst_opt, tmp_path / "old.safetensors")
        assert len(report.converted) == 3 * 3 and all("map) -> q8" in c for c in report.converted)
    else:
        sd = src_opt.state_dict()
        sd["lowmemopt_format"] = 1
        dst_opt.load_state_dict(sd)
    for (p, slot), value in legacy.items():
        q = dst_params[next(i for i, x in enumerate(params) if x is p)]
        signed = slot == "exp_avg"
        codes, absmax = quantize_blockwise(value, map_for(signed), 256)
        assert torch.equal(dst_opt.state[q][slot + ".codes"], codes), slot
        assert torch.equal(dst_opt.state[q][slot + ".absmax"], absmax), slot
    run(dst_opt, dst_params, 2, start=5)


@pytest.mark.parametrize("slot,signed", [("exp_avg", True), ("exp_avg_sq", False)])
def test_fp32_to_8bit_to_fp32_round_trip_error(tmp_path, slot, signed):
    """The one lossy step is the 8-bit encoding: each value ends within half a code gap (times its block's scale)."""
    src_opt, params = _stepped(32, shapes=[(96, 128), (4099,)], lr=1e-2)
    mid = lowmemopt.AdamW(clone_params(params), lr=1e-2, state_bits=8)
    save_state(src_opt, tmp_path / "a.safetensors")
    load_state(mid, tmp_path / "a.safetensors")
    back = lowmemopt.AdamW(clone_params(params), lr=1e-2)
    save_state(mid, tmp_path / "b.safetensors")
    load_state(back, tmp_path / "b.safetensors")
    half_gap = float(code_book(map_for(signed)).diff().max()) / 2
    for p, m, q in zip(params, mid.param_groups[0]["params"], back.param_groups[0]["params"]):
        x, y = _decode(src_opt, p, slot).reshape(-1), back.state[q][slot].reshape(-1)
        scale = mid.state[m][slot + ".absmax"]
        bound = (scale.repeat_interleave(256)[: x.numel()] * half_gap) * (1 + 1e-6) + 1e-30
        assert ((y - x).abs() <= bound).all()
        rel = float((y - x).norm() / x.norm())
        assert 0 < rel < (0.02 if signed else 0.01), rel


# ---------------------------------------------------------------------------------------------------------------------
# from torch.optim and bitsandbytes


@pytest.mark.parametrize("bits", [32, 16, 8])
def test_torch_adamw_state_dict_loads_at_any_state_bits(bits):
    start = make_params(SHAPES)
    ref = clone_params(start)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    run(torch_opt, ref, 5)
    ours = clone_params(ref)
    opt = lowmemopt.AdamW(ours, state_bits=bits)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # in-process loads share tensors, as in torch
    group = opt.param_groups[0]
    assert group["state_bits"] == bits and group["lr"] == 1e-2 and group["weight_decay"] == 0.1
    for p, q in zip(ref, ours):
        assert opt.state[q]["step"] == 5 and type(opt.state[q]["step"]) is int
        for slot, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            want = _reference_conversion(torch_opt.state[p][slot].reshape(-1), bits, signed, p.numel())
            for suffix, value in want.items():
                assert torch.equal(opt.state[q][slot + suffix].reshape(-1), value.reshape(-1))
    run(torch_opt, ref, 10, start=5)
    run(opt, ours, 10, start=5)
    err = trajectory_error(ours, ref, start)
    assert err < {32: 1e-6, 16: 0.01, 8: 0.03}[bits], err


def test_torch_adamw_bf16_params_state_is_upcast_exactly():
    params = make_params(SHAPES, dtype=torch.bfloat16)
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    run(torch_opt, params, 3)
    opt = lowmemopt.AdamW(clone_params(params))  # 32-bit state
    opt.load_state_dict(torch_opt.state_dict())
    for p, q in zip(params, opt.param_groups[0]["params"]):
        assert torch_opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert opt.state[q]["exp_avg"].dtype == torch.float32
        assert torch.equal(opt.state[q]["exp_avg"], torch_opt.state[p]["exp_avg"].float())


def _bnb_adamw8bit(shapes=SHAPES, steps=5):
    bnb = pytest.importorskip("bitsandbytes")
    params = make_params(shapes)
    opt = bnb.optim.AdamW8bit(params, lr=1e-2, weight_decay=0.1)
    run(opt, params, steps)
    return bnb, opt, params


@pytest.mark.parametrize("bits", [8, 32])
def test_bitsandbytes_adamw8bit_state_loads(bits):
    """bitsandbytes' codes index its dynamic maps, which lowmemopt knows value for value: its state1/state2 + absmax
    decode to the identical fp32 values (32-bit: stored as they are), and at 8 bits they are re-encoded once into the
    pow2 maps, exactly as the codec encodes those values."""
    bnb, bnb_opt, params = _bnb_adamw8bit()
    ours = clone_params(params)
    opt = lowmemopt.AdamW(ours, state_bits=bits)
    opt.load_state_dict(bnb_opt.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1
    quantized = 0
    for p, q in zip(params, ours):
        theirs = bnb_opt.state[p]
        assert opt.state[q]["step"] == theirs["step"] == 5
        for i, (slot, signed) in enumerate((("exp_avg", True), ("exp_avg_sq", False)), start=1):
            t = theirs[f"state{i}"]
            if t.dtype == torch.uint8:
                quantized += 1
                absmax, code = theirs[f"absmax{i}"], theirs[f"qmap{i}"]
                want = bnb.functional.dequantize_blockwise(t, absmax=absmax, code=code, blocksize=256)
                assert torch.equal(
                    want.reshape(-1),
                    dequantize_blockwise(t.reshape(-1), absmax, "dynamic" if signed else "udynamic", 256),
                )
                if bits == 8:
                    codes, scale = quantize_blockwise(want, map_for(signed), 256)
                    assert torch.equal(opt.state[q][slot + ".codes"], codes)
                    assert torch.equal(opt.state[q][slot + ".absmax"], scale)
                    want = dequantize_blockwise(codes, scale, map_for(signed), 256)
            else:
                want = t
            assert torch.equal(_decode(opt, q, slot), want.view(p.shape)), (slot, p.shape)
    assert quantized == 6  # bitsandbytes quantizes params of >= 4096 elements, as we do; (300,) stays fp32


def test_bitsandbytes_state_continues_like_bitsandbytes():
    bnb, bnb_opt, params = _bnb_adamw8bit(shapes=[(96, 128), (4099,), (300,)], steps=10)
    ours = clone_params(params)
    opt = lowmemopt.AdamW8bit(ours, lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(copy.deepcopy(bnb_opt.state_dict()))
    start = clone_params(params)
    run(bnb_opt, params, 10, start=10)
    run(opt, ours, 10, start=10)
    assert trajectory_error(ours, params, start) < 0.05


def test_bitsandbytes_state_with_a_foreign_code_book_is_refused():
    bnb, bnb_opt, params = _bnb_adamw8bit()
    sd = bnb_opt.state_dict()
    quant = sd["state"][0]["__bnb_optimizer_quant_state__"]
    quant["qmap1"] = torch.linspace(-1, 1, 256)
    opt = lowmemopt.AdamW8bit(clone_params(params))
    with pytest.raises(
        CheckpointError, match=r"parameter 0 of param group 0: bitsandbytes 'qmap1' is not bitsandbytes' dynamic map"
    ):
        opt.load_state_dict(sd)
    assert not opt.state


# ---------------------------------------------------------------------------------------------------------------------
# validation: clear errors, optimizer unchanged


def _rewrite(path: Path, edit_meta=None, edit_tensors=None) -> None:
    """Rewrite a state file with edited metadata and/or tensors (CRCs of edited tensors left stale on purpose; the
    metadata's own CRC-32 recomputed, so that the checks behind it are what is tested)."""
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["lowmemopt"])
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    raw = json.dumps(meta)
    save_file(tensors, str(path), metadata={"lowmemopt": raw, "lowmemopt.crc32": str(zlib.crc32(raw.encode()))})


def _flip_one_code(tensors):
    tensors["0/0/exp_avg.codes"][100] ^= 1


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


BAD_FILES = {
    "truncated": (_truncate, r"truncated or corrupt state file"),
    "corrupt-data": (
        lambda p: _rewrite(p, edit_tensors=_flip_one_code),
        r"parameter '0/0': tensor 'exp_avg.codes' fails its CRC-32",
    ),
    "garbage": (lambda p: p.write_bytes(b"\x00" * 7), r"truncated or corrupt state file"),
    "unknown-version": (
        lambda p: _rewrite(p, lambda m: m.update(format_version=99)),
        r"format_version 99.*newer: upgrade",
    ),
    "not-lowmemopt": (lambda p: save_file({"w": torch.zeros(3)}, str(p)), r"not a lowmemopt state file"),
    "absmax-vs-block-size": (
        lambda p: _rewrite(p, lambda m: m["params"]["0/0"]["slots"]["exp_avg"].update(block_size=512)),
        r"parameter '0/0': tensor 'exp_avg.absmax' is F32 \[25\].*needs F32 \[13\] \(block-size mismatch\)",
    ),
    "missing-tensor": (
        lambda p: _rewrite(p, edit_tensors=lambda t: t.pop("0/1/exp_avg_sq.absmax")),
        r"tensors missing \['0/1/exp_avg_sq.absmax'\]",
    ),
    "bad-metadata": (lambda p: _rewrite(p, lambda m: m["params"]["0/2"].pop("shape")), r"corrupt metadata \(KeyError"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
@pytest.mark.parametrize("strict", [True, False])
def test_bad_file_raises_and_leaves_optimizer_unchanged(tmp_path, case, strict):
    opt, params = _stepped(8)
    path = tmp_path / "s.safetensors"
    save_state(opt, path)
    corrupt, message = BAD_FILES[case]
    corrupt(path)
    target, _ = _stepped(8, steps=2)  # an optimizer with state of its own, different from the file's
    before = _snapshot(target)
    groups_before = [dict(g) for g in target.param_groups]
    with pytest.raises(CheckpointError, match=message):
        load_state(target, path, strict=strict)
    assert _same_state(target, before)
    assert [dict(g) for g in target.param_groups] == groups_before


def _mismatch_case(kind):
    """(saved optimizer, loading optimizer, model or None, expected messages)."""
    if kind == "missing":
        net = Net()
        saved = lowmemopt.AdamW([net.embed.weight, net.proj.weight], state_bits=8)
        run(saved, [net.embed.weight, net.proj.weight], 2)
        target = lowmemopt.AdamW(net.parameters(), state_bits=8)
        return saved, target, net, [r"missing from the file: 'proj.bias', 'head.weight'"]
    if kind == "unexpected":
        net = Net()
        saved = lowmemopt.AdamW(net.parameters(), state_bits=8)
        run(saved, net.params(), 2)
        target = lowmemopt.AdamW([net.proj.weight], state_bits=8)
        return saved, target, net, [r"in the file but not in the optimizer: 'embed.weight', 'proj.bias', 'head.weight'"]
    if kind == "shape":
        saved, _ = _stepped(8)
        target = lowmemopt.AdamW(make_params([(70, 91), (4099,), (301,), (5, 7, 129)]), state_bits=8)
        return saved, target, None, [r"'0/2': shape \(300,\) in the file, \(301,\) in the optimizer"]
    if kind == "block-size":
        saved, params = _stepped(8, block_size=128)
        target = lowmemopt.AdamW(clone_params(params), state_bits=8, block_size=256)
        return (
            saved,
            target,
            None,
            [
                r"'0/0': block-size mismatch: slot 'exp_avg' is 8-bit at block_size 128 in the file, the optimizer "
                r"uses block_size 256"
            ],
        )
    if kind == "slots":  # new group layout, so the file's amsgrad=True is not restored over the groups' False
        net = Net()
        saved = lowmemopt.AdamW(net.parameters(), state_bits=8, amsgrad=True)
        run(saved, net.params(), 2)
        target = lowmemopt.AdamW([{"params": [net.embed.weight]}, {"params": net.params()[1:]}], state_bits=8)
        return (
            saved,
            target,
            net,
            [
                r"'embed.weight': state slots \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'\] in the file, AdamW needs "
                r"\['exp_avg', 'exp_avg_sq'\]"
            ],
        )
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape", "block-size", "slots"])
def test_strict_mismatch_raises_naming_the_param_and_changes_nothing(tmp_path, kind):
    saved, target, model, messages = _mismatch_case(kind)
    save_state(saved, tmp_path / "s.safetensors", model=model)
    for p in (p for g in target.param_groups for p in g["params"]):  # give the target state of its own
        p.grad = torch.ones_like(p)
    target.step()
    before = _snapshot(target)
    with pytest.raises(CheckpointError) as err:
        load_state(target, tmp_path / "s.safetensors", model=model)
    for message in messages:
        assert re.search(message, str(err.value)), str(err.value)
    assert "the optimizer is unchanged" in str(err.value)
    assert _same_state(target, before)


def test_non_strict_loads_what_matches_and_reports_the_rest(tmp_path):
    net = Net()
    saved = lowmemopt.AdamW([net.embed.weight, net.proj.weight, net.proj.bias], state_bits=8, block_size=128)
    run(saved, [net.embed.weight, net.proj.weight, net.proj.bias], 3)
    save_state(saved, tmp_path / "s.safetensors", model=net)
    other = Net(seed=1)
    other.embed = torch.nn.Embedding(65, 80)  # a shape change
    target = lowmemopt.AdamW(
        [
            {"params": [other.embed.weight, other.head.weight]},
            {"params": [other.proj.weight], "block_size": 256},
            {"params": [other.proj.bias], "state_bits": 32},
        ],
        state_bits=8,
        block_size=128,
    )
    report = load_state(target, tmp_path / "s.safetensors", model=other, strict=False)
    assert report.missing == ["head.weight"]
    assert report.unexpected == []
    assert set(report.mismatched) == {"embed.weight", "proj.weight"}
    assert "shape (64, 80) in the file, (65, 80)" in report.mismatched["embed.weight"]
    assert "block-size mismatch" in report.mismatched["proj.weight"]
    assert report.converted == []  # proj.bias is small: fp32 in both
    assert not report.hyperparameters_restored
    assert target.state[other.proj.bias]["step"] == 3
    assert torch.equal(target.state[other.proj.bias]["exp_avg"], saved.state[net.proj.bias]["exp_avg"])
    assert not target.state.get(other.embed.weight) and not target.state.get(other.proj.weight)


def test_keys_by_name_need_a_model(tmp_path):
    net = Net()
    opt = lowmemopt.AdamW(net.parameters(), state_bits=8)
    run(opt, net.params(), 1)
    save_state(opt, tmp_path / "s.safetensors", model=net)
    with pytest.raises(CheckpointError, match="keyed by parameter names: pass model="):
        load_state(lowmemopt.AdamW(net.parameters(), state_bits=8), tmp_path / "s.safetensors")
    with pytest.raises(CheckpointError, match=r"parameter 0 of param group 0 \(shape \(3,\)\) is not in model"):
        save_state(lowmemopt.AdamW([torch.nn.Parameter(torch.zeros(3))]), tmp_path / "t.safetensors", model=net)


def test_load_state_dict_conversion_error_changes_nothing():
    saved, params = _stepped(8, block_size=128)
    target, _ = _stepped(8, steps=2)
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match=r"parameter 0 of param group 0: 'exp_avg' is 8-bit at block_size 128"):
        target.load_state_dict(saved.state_dict())
    assert _same_state(target, before) and target.param_groups[0]["block_size"] == 256


@pytest.mark.parametrize("bits", [8, 32])
def test_load_state_dict_of_another_model_names_the_shapes(bits):
    saved, _ = _stepped(bits, shapes=[(128, 96)], steps=1)
    target, _ = _stepped(bits, shapes=[(64, 96)], steps=1)
    before = _snapshot(target)
    theirs = (
        "has 12,288 elements in the state dict (8-bit codes, stored flat)"
        if bits == 8
        else "has shape (128, 96) in the state dict"
    )
    ours = "the optimizer's parameter has shape (64, 96)" + (" (6,144 elements)" if bits == 8 else "")
    with pytest.raises(CheckpointError) as e:
        target.load_state_dict(saved.state_dict())
    assert str(e.value).startswith(f"load_state_dict: parameter 0 of param group 0: 'exp_avg' {theirs}; {ours}; ")
    assert "another model" in str(e.value) and _same_state(target, before)
    # a slot shaped otherwise than its parameter (Adafactor's factored rows): both shapes
    saved, _ = _stepped(bits, shapes=[(128, 96)], steps=1, cls=lowmemopt.Adafactor)
    target, _ = _stepped(bits, shapes=[(64, 96)], steps=1, cls=lowmemopt.Adafactor)
    with pytest.raises(CheckpointError, match=r"parameter has shape \(64, 96\) and its 'exp_avg_sq_row' \(64,\)"):
        target.load_state_dict(saved.state_dict())


def test_only_lowmemopt_optimizers_are_saved(tmp_path):
    opt = torch.optim.AdamW(make_params([(3,)]))
    with pytest.raises(TypeError, match="load its state_dict"):
        save_state(opt, tmp_path / "s.safetensors")
    assert not (tmp_path / "s.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------------------
# writing: atomic, no pickle, size


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    opt, params = _stepped(8)
    path = tmp_path / "s.safetensors"
    save_state(opt, path)
    good = path.read_bytes()
    run(opt, params, 1, start=5)

    def broken_write(path, tensors, metadata):
        with open(path, "wb") as fh:
            fh.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.layout, "write_safetensors", broken_write)
    with pytest.raises(OSError, match="No space left"):
        save_state(opt, path)
    monkeypatch.undo()

    def broken_replace(src, dst):
        raise OSError("interrupted")

    monkeypatch.setattr(checkpoint.layout.os, "replace", broken_replace)
    with pytest.raises(OSError, match="interrupted"):
        save_state(opt, path)
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["s.safetensors"]  # no temporary file left behind
    load_state(lowmemopt.AdamW(clone_params(params), state_bits=8), path)  # and it still loads


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_saved_file_mode_follows_the_umask_like_torch_save(tmp_path, umask):
    opt, _ = _stepped(8)
    old = os.umask(umask)
    try:
        save_state(opt, tmp_path / "s.safetensors")
        save_state(opt, tmp_path / "s.safetensors")  # replacing a file: the same mode again
        torch.save(opt.state_dict(), tmp_path / "s.pt")
    finally:
        os.umask(old)
    mode = (tmp_path / "s.safetensors").stat().st_mode & 0o777
    assert mode == 0o666 & ~umask == (tmp_path / "s.pt").stat().st_mode & 0o777


def test_no_pickle_anywhere(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used")

    for name in ("dump", "dumps", "load", "loads", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "save", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    net = Net()
    opt = lowmemopt.AdamW(net.parameters(), state_bits=8)
    run(opt, net.params(), 2)
    save_state(opt, tmp_path / "s.safetensors", model=net)
    load_state(lowmemopt.AdamW(net.parameters(), state_bits=8), tmp_path / "s.safetensors", model=net)
    header_len = int.from_bytes((tmp_path / "s.safetensors").read_bytes()[:8], "little")
    header = json.loads((tmp_path / "s.safetensors").read_bytes()[8 : 8 + header_len])
    assert json.loads(header["__metadata__"]["lowmemopt"])["format_version"] == checkpoint.FILE_VERSION


def test_8bit_file_is_at_most_1_02x_the_state_bytes(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = lowmemopt.AdamW8bit(model.parameters())
    run(opt, list(model.parameters()), 1)
    save_state(opt, tmp_path / "s.safetensors", model=model)
    ratio = os.path.getsize(tmp_path / "s.safetensors") / opt.state_nbytes()
    assert 1.0 < ratio <= 1.02, ratio


# ---------------------------------------------------------------------------------------------------------------------
# load memory (subprocesses: a fresh process per half, so freed memory cannot hide the peak)

WORKER = os.path.join(os.path.dirname(__file__), "load_rss_worker.py")


def _worker(cwd, *args) -> dict:
    # LOWMEMOPT_COMPILE=0: measure the data path. The compiled codec's first use imports and runs inductor (~100 MB
    # resident, a one-time cost that does not grow with the state), which would swamp a bound of 1.2x on ~100 MB.
    env = dict(os.environ, LOWMEMOPT_COMPILE="0")
    proc = subprocess.run(
        [sys.executable, WORKER, *map(str, args)], capture_output=True, text=True, cwd=str(cwd), env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize(
    "numel,src,dst",
    [
        (100_000_000, 8, 8),  # ~9 s; measured 1.02x
        (40_000_000, 32, 8),  # a 320 MB fp32 file quantized on load; measured 1.11x
        pytest.param(25_000_000, 8, 32, marks=pytest.mark.slow),  # measured 1.03x
    ],
    ids=["100M-8to8", "40M-32to8", "25M-8to32"],
)
def test_load_peak_rss_stays_near_the_state_size(tmp_path, numel, src, dst):
    """The loader memory-maps the file and drops the pages it has read, so the load's peak RSS growth stays near the
    size of the new state, not file + state. (What is left: ~5-10 MB of chunk temporaries and mapped window.)"""
    path = tmp_path / "s.safetensors"
    _worker(tmp_path, "save", numel, src, path)
    got = _worker(tmp_path, "load", numel, dst, path)
    assert got["peak_growth"] <= 1.2 * got["state_bytes"], got


# ---------------------------------------------------------------------------------------------------------------------
# on a GPU


@pytest.mark.gpu
def test_cuda_state_saves_and_loads_onto_the_params_device(tmp_path):
    cpu_opt, cpu_params = _stepped(8)
    params = [torch.nn.Parameter(p.detach().cuda()) for p in cpu_params]
    opt = lowmemopt.AdamW(params, state_bits=8)
    opt.load_state_dict(cpu_opt.state_dict())  # moved to the params' device
    save_state(opt, tmp_path / "s.safetensors")
    for bits in (8, 32):
        fresh = lowmemopt.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], state_bits=bits)
        load_state(fresh, tmp_path / "s.safetensors")
        for p, q in zip(cpu_params, fresh.param_groups[0]["params"]):
            assert all(t.device == q.device for t in fresh.state[q].values() if isinstance(t, torch.Tensor))
            for slot in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_decode(fresh, q, slot).cpu(), _decode(cpu_opt, p, slot))
