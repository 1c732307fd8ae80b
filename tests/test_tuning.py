"""Per-GPU launch shapes (lowmemopt.kernels.tuning, ``lowmemopt tune``): the measurement loop runs every candidate
(under the interpreter here), the fastest is kept in the cache per GPU model and Triton version, and the runtime takes
it with the documented precedence; bad caches are ignored with a warning. The GPU timing itself needs a GPU."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from lowmemopt import cli
from lowmemopt.kernels import adamw, dispatch, launch, runtime, tuning
from lowmemopt.optimizer import LowMemOptimizer

pytestmark = pytest.mark.skipif(not (runtime.HAS_TRITON and runtime.INTERPRET), reason="needs TRITON_INTERPRET=1")

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A CUDA device 0 as far as the tuning lookups ask ("Fake GPU", sm_90), and an empty cache directory."""
    monkeypatch.setenv("LOWMEMOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LOWMEMOPT_TUNING", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(runtime, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(runtime, "TILE_SHAPES", {})
    monkeypatch.setattr(runtime, "Q8_DECODE", None)
    tuning.forget()
    yield tmp_path
    tuning.forget()


def _records(best_tile=4096, best_warps=8, best_decode="arithmetic"):
    out = []
    for decode in tuning.DECODES:
        for tile in tuning.TILES:
            for warps in tuning.WARPS:
                fast = (tile, warps, decode) == (best_tile, best_warps, best_decode)
                out.append(
                    dict(tile=tile, num_warps=warps, decode=decode, seconds=1e-3 if fast else 2e-3, bytes_per_s=1e12)
                )
    out[0] = dict(out[0], error="RuntimeError: out of resources")  # a configuration that failed is skipped
    del out[0]["seconds"]
    return out


def test_the_measurement_runs_every_candidate(monkeypatch):
    """Under the interpreter on the CPU: every (tile, warps, decode) launches the 8-bit AdamW kernel with that tile and
    decode, through the kernels' own launcher (no optimizer: a step of one would fail here), two steps each."""
    seen = []
    real = launch.Bucket.launch

    def spy(self, kernel, rows, counts, args, *, writes, **meta):
        assert kernel is adamw._adam_kernel and self.fmt == "q8" and len(self.params) == 8
        assert all(
            p.dtype == torch.bfloat16
            and set(st) == {"step", "exp_avg.codes", "exp_avg.absmax", "exp_avg_sq.codes", "exp_avg_sq.absmax"}
            for p, st in zip(self.params, self.states)
        )
        seen.append(
            (
                meta["ROWS"] * meta["BLOCK"],
                runtime.tile_shape(self.device)[1],
                runtime.q8_decode(self.device),
                self.states[0]["step"],
            )
        )
        return real(self, kernel, rows, counts, args, writes=writes, **meta)

    def no_optimizer(*args, **kwargs):
        raise AssertionError("the tuner stepped an optimizer")

    monkeypatch.setattr(launch.Bucket, "launch", spy)
    monkeypatch.setattr(LowMemOptimizer, "step", no_optimizer)
    with runtime.cpu_interpreter():
        records = tuning.measure(torch.device("cpu"), numel=4096, steps=1)
    assert len(records) == len(tuning.TILES) * len(tuning.WARPS) * len(tuning.DECODES)
    assert all(r["seconds"] > 0 and r["bytes_per_s"] > 0 for r in records), records
    # per candidate, the warm-up step (step 0 -> 1) and the timed one (1 -> 2): fresh state for each candidate
    assert seen == [(t, w, d, s) for d in tuning.DECODES for t in tuning.TILES for w in tuning.WARPS for s in (0, 1)]
    assert runtime._forced is None  # restored


def test_the_measured_step_is_the_optimizers():
    """The tuner's launched step is ``lowmemopt.AdamW(lr=1e-4, weight_decay=0, state_bits=8)``'s fused step: after two
    steps the same parameters and 8-bit state, bit for bit, so it times the kernel work of a real step."""
    from lowmemopt import AdamW

    params, grads = tuning._problem(4096, torch.device("cpu"), torch.bfloat16)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    with runtime.cpu_interpreter():
        states = tuning.adamw_q8_state(params)
        step = tuning.adamw_q8_step(params, grads, states)
        step()
        step()
        opt = AdamW(ps, lr=tuning.GROUP["lr"], weight_decay=0.0, state_bits=8, min_quant_numel=0)
        before = dispatch.stats.get(("adam", "q8"), 0)
        opt.step()
        opt.step()
    assert dispatch.stats.get(("adam", "q8"), 0) == before + 2  # (the optimizer took the fused kernel too)
    for p, q, mine in zip(params, ps, states):
        theirs = opt.state[q]
        assert torch.equal(p, q.detach()) and mine["step"] == theirs["step"] == 2
        assert set(mine) == set(theirs)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine if k != "step")


def test_tune_keeps_the_fastest_and_the_runtime_takes_it(fake_gpu, monkeypatch):
    monkeypatch.setattr(tuning, "measure", lambda device, numel, steps, progress=None: _records())
    assert runtime.tile_shape(CUDA0) == (runtime.TILE, runtime.NUM_WARPS) and runtime.q8_decode(CUDA0) == "table"
    entry, records = tuning.tune(CUDA0, numel=1 << 20, steps=3)
    assert (entry["tile"], entry["num_warps"], entry["decode"]) == (4096, 8, "arithmetic")
    data = json.loads((fake_gpu / "tuning.json").read_text())
    key = tuning.device_key(0)
    assert key.startswith("Fake GPU|sm_90|triton ") and data["devices"][key]["tile"] == 4096
    assert runtime.tile_shape(CUDA0) == (4096, 8) and runtime.q8_decode(CUDA0) == "arithmetic"
    assert runtime.tile_shape(torch.device("cpu")) == (runtime.TILE, runtime.NUM_WARPS)  # CUDA devices only

    # precedence: a TILE_SHAPES entry and an explicit decode win; LOWMEMOPT_TUNING=0 ignores the cache
    monkeypatch.setattr(runtime, "TILE_SHAPES", {(9, 0): (1024, 4)})
    monkeypatch.setattr(runtime, "Q8_DECODE", "table")
    assert runtime.tile_shape(CUDA0) == (1024, 4) and runtime.q8_decode(CUDA0) == "table"
    monkeypatch.setattr(runtime, "TILE_SHAPES", {})
    monkeypatch.setattr(runtime, "Q8_DECODE", None)
    monkeypatch.setenv("LOWMEMOPT_TUNING", "0")
    tuning.forget()
    assert runtime.tile_shape(CUDA0) == (runtime.TILE, runtime.NUM_WARPS)
    monkeypatch.delenv("LOWMEMOPT_TUNING")
    tuning.forget()

    # another GPU's measurement is kept beside this one; another Triton version's does not apply
    tuning.save("Other GPU|sm_80|triton 0.0", dict(tile=1024, num_warps=4, decode="table"))
    data = json.loads((fake_gpu / "tuning.json").read_text())
    assert set(data["devices"]) == {key, "Other GPU|sm_80|triton 0.0"}
    assert runtime.tile_shape(CUDA0) == (4096, 8)


def test_tune_with_nothing_that_ran(fake_gpu, monkeypatch):
    failed = [dict(tile=2048, num_warps=4, decode="table", error="RuntimeError: boom")]
    monkeypatch.setattr(tuning, "measure", lambda device, numel, steps, progress=None: failed)
    with pytest.raises(ValueError, match="no configuration ran"):
        tuning.tune(CUDA0)
    assert not (fake_gpu / "tuning.json").exists()
    with pytest.raises(ValueError, match="CUDA device"):
        tuning.tune(torch.device("cpu"))


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "ignoring the tuning cache"),
        (json.dumps({"version": 99, "devices": {}}), "not a version 1 cache"),
        (None, "malformed tuning entry"),
    ],
)
def test_a_bad_cache_is_ignored_with_a_warning(fake_gpu, content, match):
    path = fake_gpu / "tuning.json"
    if content is None:  # an entry whose shape is not a candidate
        content = json.dumps(
            {"version": 1, "devices": {tuning.device_key(0): {"tile": 3, "num_warps": 4, "decode": "table"}}}
        )
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match=match):
        assert runtime.tile_shape(CUDA0) == (runtime.TILE, runtime.NUM_WARPS)
    assert runtime.q8_decode(CUDA0) == "table"  # (asked once: no second warning)
    tuning.save(tuning.device_key(0), dict(tile=2048, num_warps=8, decode="table"))  # replaces the bad file whole
    assert runtime.tile_shape(CUDA0) == (2048, 8)


def test_launch_shape_checks_the_decode():
    with pytest.raises(ValueError, match="decode"):
        runtime.launch_shape((2048, 4), "fast")


def test_the_command_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_the_command_prints_and_keeps(fake_gpu, monkeypatch, capsys):
    """The command's table, its choice and the cache (the measurement mocked: no GPU here)."""

    def fake_tune(device, numel, steps, write=True, progress=None):
        records = _records(2048, 4, "table")
        for r in records:
            progress(r)
        return dict(tile=2048, num_warps=4, decode="table"), records

    monkeypatch.setattr(runtime, "INTERPRET", False)
    monkeypatch.setattr(tuning, "tune", fake_tune)
    assert (
        cli.main(
            [
                "tune",
                "--device",
                "cuda:0",
                "--steps",
                "2",
                "--numel",
                "8192",
                "--no-save",
                "--json",
                str(fake_gpu / "t.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| 2048 | 4 | table |" in out and "failed: RuntimeError" in out
    assert "fastest: 2048 elements x 4 warps, table decode (1.00x the default's speed)" in out
    assert "not saved (--no-save)" in out
    assert json.loads((fake_gpu / "t.json").read_text())["best"]["tile"] == 2048


def _imports(module) -> set[str]:
    """Every module ``module``'s source imports (at the top, in functions, under TYPE_CHECKING), relative imports
    resolved against ``lowmemopt.kernels``."""
    out = set()
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "lowmemopt.kernels" if node.level == 1 else node.module if node.level == 0 else "?"
            if node.level and node.module:
                base += "." + node.module
            out.add(base)
            if node.level == 1 and not node.module:  # from . import x
                out.update(f"{base}.{a.name}" for a in node.names)
    return out


def test_the_tuner_and_its_cache_import_nothing_above_the_kernels():
    """The tuner, the runtime and the cache between them import no optimizer, pipeline stage or the lowmemopt package
    (only ``lowmemopt.quant``, ``lowmemopt.kernels`` and the bucket record ``lowmemopt.work.record``, which lie below
    the kernels), and the runtime reads the cache without importing the tuner: no cycle."""
    from lowmemopt.kernels import tuning_cache

    for module in (tuning, runtime, tuning_cache):
        mine = {m for m in _imports(module) if m == "lowmemopt" or m.startswith("lowmemopt.")}
        assert all(
            m.startswith(("lowmemopt.quant", "lowmemopt.kernels")) or m == "lowmemopt.work.record" for m in mine
        ), (module.__name__, mine)
    assert "lowmemopt.kernels.tuning" not in _imports(runtime) | _imports(tuning_cache)
    assert {"lowmemopt.kernels.runtime", "lowmemopt.kernels.tuning"}.isdisjoint(_imports(tuning_cache))
