"""State files and state dicts that lie, and the clear errors they must get (issue 36, items 1-8): metadata bit flips,
another optimizer's file, values that would poison the next step, odd files, racing replaces, file modes and stale
temporary files, a float state_bits. Every refused load leaves the optimizer exactly as it was."""

from __future__ import annotations

import copy
import math
import os
import stat
import struct
import subprocess
import sys

import pytest
import torch
from helpers import clone_params, make_params, run

import lowmemopt
import lowmemopt.checkpoint as checkpoint
from lowmemopt.checkpoint import CheckpointError, load_state, save_state

SHAPES = [(70, 91), (300,)]  # one quantized at 8 bits, one fp32


def _stepped(bits=8, cls=lowmemopt.AdamW, steps=3, **kw):
    params = make_params(SHAPES)
    opt = cls(params, state_bits=bits, **kw)
    run(opt, params, steps)
    return opt, params


def _snapshot(opt):
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state.get(p, {}).items()}
        for g in opt.param_groups
        for p in g["params"]
    ]
    return groups, state


def _unchanged(opt, snapshot) -> bool:
    groups, state = _snapshot(opt)
    same = lambda a, b: torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b  # noqa: E731
    return repr(groups) == repr(snapshot[0]) and all(
        a.keys() == b.keys() and all(same(a[k], b[k]) for k in a) for a, b in zip(state, snapshot[1])
    )


def _header(path) -> tuple[int, bytes]:
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    return n, data


# ---------------------------------------------------------------------------------------------------------------------
# item 1: the metadata is covered by a checksum


def test_every_single_bit_flip_in_the_header_is_refused(tmp_path):
    opt, params = _stepped(8)
    path = tmp_path / "s.safetensors"
    save_state(opt, path)
    n, data = _header(path)
    fresh = lowmemopt.AdamW(clone_params(params), state_bits=8)
    before = _snapshot(fresh)
    bad = tmp_path / "bad.safetensors"
    positions = sorted(set(range(0, 16)) | set(range(16, 8 + n, max(1, n // 400))))  # ~400 spread over the header
    passed = []
    for pos in positions:
        for bit in (0, 3, 6):  # 3 of 8 bits per byte keep the test short; any bit of ASCII is covered by these
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            bad.write_bytes(bytes(flipped))
            try:
                load_state(fresh, bad)
            except (CheckpointError, OSError):
                continue
            passed.append((pos, bit))
            break
        if len(passed) > 3:
            break
    assert not passed, f"bit flips at (byte, bit) {passed} loaded silently"
    assert _unchanged(fresh, before)


def test_metadata_checksum_mismatch_names_the_metadata(tmp_path):
    opt, params = _stepped(8)
    path = tmp_path / "s.safetensors"
    save_state(opt, path)
    n, data = _header(path)
    header = data[8 : 8 + n]
    i = header.index(b'\\"step\\": 3')
    bad = data[: 8 + i] + b'\\"step\\": 7' + data[8 + i + 11 :]
    path.write_bytes(bad)
    with pytest.raises(CheckpointError, match="metadata fails its CRC-32"):
        load_state(lowmemopt.AdamW(clone_params(params), state_bits=8), path)


# ---------------------------------------------------------------------------------------------------------------------
# item 2: another optimizer's file


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize(
    "saved, loading",
    [
        (lambda p: lowmemopt.AdamW(p, lr=5e-2, weight_decay=0.3), lambda p: lowmemopt.Lion(p, lr=1e-4)),
        (lambda p: lowmemopt.LAMB(p), lambda p: lowmemopt.AdamW(p)),
        (lambda p: lowmemopt.SGD(p, lr=0.1, momentum=0.9), lambda p: lowmemopt.LARS(p, lr=0.1, momentum=0.9)),
        (lambda p: lowmemopt.AdamW(p), lambda p: lowmemopt.CAME(p, lr=1e-3)),
    ],
    ids=["AdamW->Lion", "LAMB->AdamW", "SGD->LARS", "AdamW->CAME"],
)
def test_a_file_of_another_optimizer_is_refused_naming_both(tmp_path, saved, loading, strict):
    params = make_params(SHAPES)
    src = saved(params)
    run(src, params, 2)
    save_state(src, tmp_path / "s.safetensors")
    dst = loading(clone_params(params))
    before = _snapshot(dst)
    with pytest.raises(CheckpointError, match=f"{type(src).__name__}.*{type(dst).__name__}"):
        load_state(dst, tmp_path / "s.safetensors", strict=strict)
    assert _unchanged(dst, before)


def test_an_alias_loads_its_base_optimizers_file_and_back(tmp_path):
    opt, params = _stepped(8, cls=lowmemopt.AdamW8bit)
    save_state(opt, tmp_path / "s.safetensors")
    assert load_state(lowmemopt.AdamW(clone_params(params)), tmp_path / "s.safetensors").hyperparameters_restored


def test_a_deliberate_conversion_takes_the_state_not_the_hyperparameters(tmp_path):
    src, params = _stepped(32, cls=lowmemopt.LAMB, lr=5e-2)
    save_state(src, tmp_path / "s.safetensors")
    dst = lowmemopt.AdamW(clone_params(params), lr=1e-3)
    report = load_state(dst, tmp_path / "s.safetensors", from_optimizer="LAMB")
    assert not report.hyperparameters_restored and dst.param_groups[0]["lr"] == 1e-3
    assert "adam" not in dst.param_groups[0] and "bias_correction" not in dst.param_groups[0]
    p, q = params[0], dst.param_groups[0]["params"][0]
    assert torch.equal(dst.state[q]["exp_avg"], src.state[p]["exp_avg"]) and dst.state[q]["step"] == 3
    with pytest.raises(CheckpointError, match="holds 'LAMB' state, not 'SGD'"):
        load_state(dst, tmp_path / "s.safetensors", from_optimizer="SGD")


# ---------------------------------------------------------------------------------------------------------------------
# item 3: values that would poison the next step


def _poison_absmax(value):
    def f(sd):
        sd["state"][0]["exp_avg.absmax"][1] = value

    return f


def _set_state(key, value):
    def f(sd):
        sd["state"][0][key] = value

    return f


def _set_group(key, value):
    def f(sd):
        sd["param_groups"][0][key] = value

    return f


def _set_fp32(key, index, value):
    def f(sd):
        sd["state"][1][key][index] = value

    return f


POISON = {
    "NaN absmax": (_poison_absmax(float("nan")), r"parameter 0 .*exp_avg\.absmax.*NaN"),
    "Inf absmax": (_poison_absmax(float("inf")), r"parameter 0 .*exp_avg\.absmax.*Inf"),
    "negative absmax": (_poison_absmax(-1.0), r"parameter 0 .*exp_avg\.absmax.*negative"),
    "NaN fp32 slot": (_set_fp32("exp_avg", 5, float("nan")), r"parameter 1 .*'exp_avg'.*NaN"),
    "negative exp_avg_sq": (_set_fp32("exp_avg_sq", 5, -1e-3), r"parameter 1 .*'exp_avg_sq'.*negative"),
    "negative step": (_set_state("step", -2), r"parameter 0 .*step -2"),
    "non-integer step": (_set_state("step", 2.5), r"parameter 0 .*step 2\.5"),
    "tensor step 2.5": (_set_state("step", torch.tensor(2.5)), r"parameter 0 .*step 2\.5"),
    "NaN lr": (_set_group("lr", float("nan")), r"param group 0.*learning rate: nan"),
    "NaN weight_decay": (_set_group("weight_decay", float("nan")), r"param group 0.*weight_decay value: nan"),
    "beta 1.0": (_set_group("betas", (0.9, 1.0)), r"param group 0.*beta parameter at index 1"),
    "string lr": (_set_group("lr", "0.001"), r"param group 0.*learning rate: expected a number, got str"),
    "bare tensor state": (lambda sd: sd["state"].__setitem__(0, torch.zeros(3)), r"parameter 0 .*Tensor"),
    "block_size 0": (_set_group("block_size", 0), r"parameter 0 .*block_size"),
}


@pytest.mark.parametrize("case", list(POISON))
def test_load_state_dict_refuses_state_that_poisons_the_next_step(case):
    opt, params = _stepped(8)
    sd = copy.deepcopy(opt.state_dict())
    poison, message = POISON[case]
    poison(sd)
    before = _snapshot(opt)
    with pytest.raises(CheckpointError, match=message):
        opt.load_state_dict(sd)
    assert _unchanged(opt, before)
    run(opt, params, 1, start=3)  # and it still steps
    assert all(torch.isfinite(p).all() for p in params)


IN_MEMORY_ONLY = ("bare tensor state", "tensor step 2.5", "block_size 0")  # a file cannot hold these


@pytest.mark.parametrize("case", [c for c in POISON if c not in IN_MEMORY_ONLY])
def test_load_state_refuses_state_that_poisons_the_next_step(tmp_path, case):
    """The same values through a file: save_state writes what is in memory (the poison put there first), load_state
    refuses it by name. The CRC of NaN is valid: the check is on the values."""
    opt, params = _stepped(8)
    sd = copy.deepcopy(opt.state_dict())
    poison, message = POISON[case]
    poison(sd)
    victim = lowmemopt.AdamW(clone_params(params), state_bits=8)
    for p, (i, st) in zip(victim.param_groups[0]["params"], sorted(sd["state"].items())):
        victim.state[p] = st
    victim.param_groups[0].update({k: v for k, v in sd["param_groups"][0].items() if k != "params"})
    try:
        save_state(victim, tmp_path / "s.safetensors")
    except (CheckpointError, ValueError, TypeError):
        return  # refused already when saving: it never reaches a file
    fresh = lowmemopt.AdamW(clone_params(params), state_bits=8)
    before = _snapshot(fresh)
    message = message.replace("parameter 0 ", "parameter '0/0'").replace("parameter 1 ", "parameter '0/1'")
    with pytest.raises(CheckpointError, match=message):
        load_state(fresh, tmp_path / "s.safetensors")
    assert _unchanged(fresh, before)


# ---------------------------------------------------------------------------------------------------------------------
# item 4: clear errors for odd files


def _write_with_meta(path, raw: str):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(path), metadata={"lowmemopt": raw})


@pytest.mark.parametrize("raw", ["[1, 2]", '"text"', "42", "[" * 100000 + "]" * 100000, '{"format": 3}'])
def test_metadata_of_the_wrong_shape_is_a_checkpoint_error(tmp_path, raw):
    path = tmp_path / "s.safetensors"
    _write_with_meta(path, raw)
    opt, _ = _stepped(8)
    with pytest.raises(CheckpointError, match="not a lowmemopt state file|corrupt metadata"):
        load_state(opt, path)
    with pytest.raises(CheckpointError):
        checkpoint.read_metadata(path)


def test_a_directory_is_named_as_one(tmp_path):
    opt, _ = _stepped(8)
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(IsADirectoryError, match="(?i)is a directory"):
        load_state(opt, tmp_path / "d.safetensors")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="POSIX permissions, not as root")
def test_an_unreadable_file_is_a_permission_error(tmp_path):
    opt, _ = _stepped(8)
    path = tmp_path / "s.safetensors"
    save_state(opt, path)
    path.chmod(0)
    with pytest.raises(PermissionError, match="s.safetensors"):
        load_state(opt, path)


# ---------------------------------------------------------------------------------------------------------------------
# item 6: one open file for header and data


def test_a_replace_after_the_open_is_not_seen(tmp_path, monkeypatch):
    """save_state replacing the file while load_state reads it (here: right after the open, before the header is
    read): the load reads header and data from the file it opened, whole, and loads it; never old checksums with new
    data."""
    a, params = _stepped(8, steps=2)
    b, _ = _stepped(8, steps=4)
    path = tmp_path / "s.safetensors"
    save_state(a, path)
    layout = checkpoint.layout

    class Racing(layout.StateFile):
        def __init__(self, fh, where):
            save_state(b, path)  # an atomic replace lands now
            super().__init__(fh, where)

    monkeypatch.setattr(layout, "StateFile", Racing)
    fresh = lowmemopt.AdamW(clone_params(params), state_bits=8)
    load_state(fresh, path)
    for p, q in zip(params, fresh.param_groups[0]["params"]):
        assert fresh.state[q]["step"] == 2
        for k, v in a.state[p].items():
            assert torch.equal(fresh.state[q][k], v) if isinstance(v, torch.Tensor) else fresh.state[q][k] == v
    monkeypatch.undo()
    assert load_state(fresh, path) and fresh.state[fresh.param_groups[0]["params"][0]]["step"] == 4


# ---------------------------------------------------------------------------------------------------------------------
# item 7: the mode of a replaced file, stale temporary files


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_replacing_a_checkpoint_keeps_its_mode(tmp_path):
    opt, _ = _stepped(8)
    path = tmp_path / "s.safetensors"
    save_state(opt, path)
    path.chmod(0o600)
    save_state(opt, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


KILLED_SAVE = """
import os, signal, sys
import lowmemopt.checkpoint.layout as layout
real = layout.write_safetensors
def write_then_die(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
layout.write_safetensors = write_then_die
import torch, lowmemopt
p = torch.nn.Parameter(torch.zeros(5000))
opt = lowmemopt.AdamW([p], state_bits=8)
p.grad = torch.ones(5000)
opt.step()
lowmemopt.save_state(opt, sys.argv[1])
"""


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_temporary_files_of_killed_saves_are_cleaned_by_the_next_save(tmp_path):
    path = tmp_path / "s.safetensors"
    left = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(path)], capture_output=True)
        assert done.returncode == -9, done.stderr.decode()[-2000:]
        left.append(os.listdir(tmp_path))
    assert len(left[0]) == 1 and len(left[1]) == 1 and left[0] != left[1]  # the 2nd save removed the 1st's file
    assert os.path.getsize(tmp_path / left[1][0] / "s.safetensors") > 5000  # a full file, killed before its rename
    alive = tmp_path / left[1][0].replace(left[1][0].split("-")[-2], str(os.getpid()))  # a save in progress here
    alive.write_bytes(b"")
    opt, _ = _stepped(8)
    save_state(opt, path)
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, "s.safetensors"])


# ---------------------------------------------------------------------------------------------------------------------
# item 8


@pytest.mark.parametrize("bits", [8.0, "8", True])
def test_a_state_bits_that_is_not_an_int_names_state_bits(bits):
    with pytest.raises(ValueError, match=r"Invalid state_bits: " + repr(bits).replace(".", r"\.")):
        lowmemopt.AdamW(make_params(SHAPES), state_bits=bits)


def test_finite_state_still_loads_both_ways(tmp_path):
    """The checks refuse only poison: a normal 8-bit and a torch.optim state load as before."""
    opt, params = _stepped(8)
    fresh = lowmemopt.AdamW(clone_params(params), state_bits=8)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    save_state(opt, tmp_path / "s.safetensors")
    load_state(fresh, tmp_path / "s.safetensors")
    ref = clone_params(params)
    torch_opt = torch.optim.AdamW(ref)
    run(torch_opt, ref, 2)
    lowmemopt.AdamW(clone_params(ref)).load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert math.isfinite(float(fresh.state[fresh.param_groups[0]["params"][0]]["exp_avg.absmax"].sum()))


def test_the_writer_writes_what_safetensors_writes(tmp_path):
    """save_state writes through safetensors' own writer (then fsynced, mode kept): byte for byte what safetensors'
    save_file writes, and any safetensors reader opens lowmemopt's files."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {
        "b/x.codes": torch.arange(7, dtype=torch.uint8),
        "a/y": torch.randn(3, 2),
        "z": torch.zeros(0),
        "c": torch.ones(1, dtype=torch.bfloat16),
        "\u00e9/w": torch.randn(5),
    }
    meta = {"lowmemopt": '{"a": "\u00e9\\n\\"", "b": [1]}'}
    save_file(tensors, str(tmp_path / "ref"), metadata=meta)
    checkpoint.layout.write_safetensors(str(tmp_path / "ours"), tensors, meta)
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "ref").read_bytes()
    opt, _ = _stepped(8)
    save_state(opt, tmp_path / "s.safetensors")
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        assert set(f.metadata()) == {"lowmemopt", "lowmemopt.crc32"} and len(f.keys()) == 6
        codes = opt.state[opt.param_groups[0]["params"][0]]["exp_avg.codes"]
        assert torch.equal(f.get_tensor("0/0/exp_avg.codes"), codes)


def test_the_writers_io_errors_are_os_errors(tmp_path):
    """A write that fails in safetensors' writer (here: no such directory; a full disk likewise) is the OSError that
    names it, not a safetensors error."""
    with pytest.raises(FileNotFoundError, match="missing"):
        checkpoint.layout.write_safetensors(str(tmp_path / "missing" / "s.safetensors"), {"x": torch.zeros(3)}, {})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="drops pages on Linux only")
def test_releasing_pages_touches_the_files_mapping_only(tmp_path):
    """load_state drops the pages it has read (StateFile.release); an address range outside the file's mapping (here a
    tensor of the heap) is left alone, and the file's own pages read back the same after being dropped."""
    opt, _ = _stepped(8)
    save_state(opt, tmp_path / "s.safetensors")
    heap = torch.ones(1 << 18)
    with checkpoint.layout.open_state_file(str(tmp_path / "s.safetensors")) as f:
        codes = f.get_tensor("0/0/exp_avg.codes")
        before = codes.clone()
        f.release(heap.data_ptr(), heap.data_ptr() + heap.numel() * 4)
        f.release(codes.data_ptr(), codes.data_ptr() + codes.numel())
        assert torch.equal(codes, before)
    assert bool((heap == 1).all())
