"""Deterministic problems shared by the tests: parameters, gradients, and runs of an optimizer over them."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

import torch


def make_params(shapes: Sequence[tuple[int, ...]], dtype=torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def clone_params(params: Sequence[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_grads(params: Sequence[torch.Tensor], step: int, seed: int = 1, noise: float = 0.5) -> None:
    """Gradient of a quadratic pulling each parameter towards a fixed random target, plus step-seeded noise. Depends
    only on (parameter value, step, seed), so a resumed run sees the same gradients as an uninterrupted one."""
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(seed * 1000003 + i)
        target = torch.randn(p.shape, generator=gen)
        gen.manual_seed(seed * 7919 + step * 104729 + i)
        eps = torch.randn(p.shape, generator=gen)
        p.grad = ((p.detach().float() - target) + noise * eps).to(p.dtype)


def run(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], steps: int, start: int = 0, seed: int = 1) -> None:
    for t in range(start, start + steps):
        set_grads(params, t, seed)
        opt.step()


def run_with_reference(
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    ref: torch.optim.Optimizer,
    ref_params: Sequence[torch.Tensor],
    steps: int,
    seed: int = 1,
) -> None:
    """Step ``opt`` and a reference optimizer side by side; the reference gets copies of ``opt``'s gradients."""
    for t in range(steps):
        set_grads(params, t, seed)
        for p, r in zip(params, ref_params):
            r.grad = p.grad.clone()
        opt.step()
        ref.step()


def trajectory_error(
    params: Sequence[torch.Tensor], twin: Sequence[torch.Tensor], start: Sequence[torch.Tensor]
) -> float:
    """||p - p_twin|| / ||p_twin - p_0|| over all parameters: the error relative to the distance travelled."""
    num = sum(float((a.detach().float() - b.detach().float()).pow(2).sum()) for a, b in zip(params, twin))
    den = sum(float((b.detach().float() - s.detach().float()).pow(2).sum()) for b, s in zip(twin, start))
    return (num / den) ** 0.5


def build(cls: Callable, params, **kwargs) -> torch.optim.Optimizer:
    return cls(params, **kwargs)


#: bf16 state's absolute slack, as a fraction of the slot's largest value: 16 fp32 ulps (2^-24 relative each). A value
#: that cancels (``b1 m + (1-b1) u`` with ``|m'| << |u|``) keeps the absolute error of its terms, so its relative error
#: has no bound; one bf16 step of the largest values (2^-8) is still 4096 times this.
BF16_CANCEL = 2.0**-20


def assert_state_close(ours: dict, ref: dict, what: str, before: dict | None = None) -> None:
    """A fused backend's state against the reference's: 8- and 4-bit codes within one step (at most 2% of them off),
    bf16 within one rounding (or a few fp32 ulps of the terms of a cancelling sum), fp32 within fp32 rounding of a few
    operations. ``before``: the state the step started from (its scale bounds the terms of a cancelling sum)."""
    assert ours.keys() == ref.keys(), what
    for key, r in ref.items():
        o = ours[key]
        if not isinstance(r, torch.Tensor):
            assert o == r, (what, key)
            continue
        assert o.dtype == r.dtype and o.shape == r.shape, (what, key)
        if key.endswith((".codes", ".nibbles")):
            if key.endswith(".nibbles"):  # 4-bit codes, two per byte (an odd numel's padding nibble compares too)
                o, r = torch.stack((o & 15, o >> 4), 1), torch.stack((r & 15, r >> 4), 1)
            diff = (o.int() - r.int()).abs()
            assert int(diff.max()) <= 1, f"{what} {key}: codes differ by {int(diff.max())} steps"
            assert float((diff > 0).float().mean()) <= 0.02, f"{what} {key}: {int((diff > 0).sum())} codes differ"
        elif r.dtype == torch.bfloat16:  # one bf16 rounding step, or a few fp32 ulps of the terms of a cancelling sum
            scale = float(r.float().abs().max()) if r.numel() else 0.0
            if before is not None and isinstance(before.get(key), torch.Tensor):
                scale = max(scale, float(before[key].float().abs().max()))
            torch.testing.assert_close(
                o.float(), r.float(), rtol=2**-7, atol=max(BF16_CANCEL * scale, 1e-30), msg=f"{what} {key}"
            )
        else:
            torch.testing.assert_close(o, r, rtol=2e-5, atol=1e-7, msg=f"{what} {key}")


def assert_params_close(ours, ref, lr: float, lowbit: bool, what: str) -> None:
    """Parameters after fused steps against the reference's (``lowbit``: 8-bit state, whose code steps move them)."""
    for i, (o, r) in enumerate(zip(ours, ref)):
        if o.dtype != torch.float32:
            torch.testing.assert_close(o.float(), r.float(), rtol=2**-7, atol=0.05 * lr, msg=f"{what} param {i}")
        else:
            torch.testing.assert_close(o, r, rtol=1e-5, atol=(0.05 if lowbit else 1e-4) * lr, msg=f"{what} param {i}")


def assert_runs_same(a, opt_a, b, opt_b) -> None:
    """Two runs ended alike, bit for bit: every parameter, and its state (keys, tensors, step count)."""
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb), tuple(pa.shape)
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sorted(sa) == sorted(sb)
        for k in sa:
            assert torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k], k


def spy_native_steps(monkeypatch) -> list:
    """A list that receives, per parameter the native elementwise CPU kernels set up for a step, how many leading
    elements the kernel takes (0: declined): ``prepare`` for a parameter new to the kernels (and every one-parameter
    call), ``refresh`` for one whose arguments are kept from its last step (:mod:`lowmemopt.pipeline.native`)."""
    from lowmemopt.cpu import elementwise

    done: list = []
    prepare, refresh = elementwise.prepare, elementwise.refresh

    def spy_prepare(*args, **kwargs):
        out = prepare(*args, **kwargs)
        done.append(out[1])
        return out

    def spy_refresh(args, *rest, **kwargs):
        ok = refresh(args, *rest, **kwargs)
        if ok:
            done.append(args.nrows * args.bs + args.tail)
        return ok

    monkeypatch.setattr(elementwise, "prepare", spy_prepare)
    monkeypatch.setattr(elementwise, "refresh", spy_refresh)
    return done


def count_device_checks(monkeypatch) -> list:
    """A list that gets one entry per device-side non-finite check made from now on: a
    ``lowmemopt.pipeline.finite.DeviceFlags`` (the pipeline's), or a step program's check
    (``lowmemopt.kernels.check.GradCheck.flags``)."""
    from lowmemopt.pipeline import finite

    made: list = []
    real = finite.DeviceFlags.__init__
    monkeypatch.setattr(finite.DeviceFlags, "__init__", lambda self, *a: made.append(1) or real(self, *a))
    try:
        from lowmemopt.kernels import check
    except ImportError:  # (no Triton: no programs)
        return made
    real_flags = check.GradCheck.flags
    monkeypatch.setattr(check.GradCheck, "flags", lambda self, *a: made.append(1) or real_flags(self, *a))
    return made


BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module, loaded once (registered in ``sys.modules`` as ``bench_<name>`` before it runs:
    its dataclasses look their module up), with ``bench/`` on the path while it imports (``common``)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        sys.modules[key] = module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(BENCH))
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
        finally:
            if str(BENCH) in sys.path:  # (a script may take its own folder off the path)
                sys.path.remove(str(BENCH))
    return sys.modules[key]


def version_of(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``3.6.0``, ``3.10.0rc1`` or ``2.4.6+git1234``."""
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else (0, 0)


@functools.lru_cache(maxsize=None)
def interpreter_fma_rounds_once() -> bool:
    """Does the Triton interpreter's ``tl.fma`` round once, as a GPU's does? Triton 3.9's does; older interpreters
    compute ``x * y + z`` with two roundings, so interpreted kernels then differ in the last bit from IEEE arithmetic
    (and from a GPU) wherever an fma's product is inexact. Tests that compare interpreted kernels bit for bit with
    IEEE arithmetic skip on those (what they check holds on a GPU). Probed once: ``(1 + 2^-12)^2 - (1 + 2^-11)`` is
    ``2^-24`` rounded once and 0 rounded twice. True where kernels are compiled (no interpreter)."""
    from lowmemopt.kernels import runtime

    if not (runtime.HAS_TRITON and runtime.INTERPRET):
        return True
    import triton
    import triton.language as tl

    @triton.jit
    def fma_kernel(out):
        one = tl.full([1], 1.0 + 2.0**-12, tl.float32)
        tl.store(out + tl.arange(0, 1), tl.fma(one, one, tl.full([1], -(1.0 + 2.0**-11), tl.float32)))

    out = torch.zeros(1)
    fma_kernel[(1,)](out)
    return float(out) == 2.0**-24


def tiny_trainer(out, spec, resume=None):
    """A HuggingFace Trainer run (4 steps, checkpoints every 2) of a tiny LLaMA built from a config (vocabulary 96,
    hidden 32, 2 layers) on fixed random tokens, with ``optimizer_cls_and_kwargs=spec``; returns (trainer, the
    train() output)."""
    import transformers

    class Tokens(torch.utils.data.Dataset):
        data = torch.randint(0, 96, (16, 12), generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            return {"input_ids": self.data[i], "labels": self.data[i]}

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            tie_word_embeddings=False,
        )
    )
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        weight_decay=0.1,
        adam_beta1=0.8,
        adam_beta2=0.9,
        adam_epsilon=1e-9,
        save_steps=2,
        save_strategy="steps",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), optimizer_cls_and_kwargs=spec)
    return trainer, trainer.train(resume_from_checkpoint=resume)


@contextlib.contextmanager
def one_thread():
    """torch on one thread while the block runs (a training run on a busy 2-core machine: no waits for a second
    core that another process holds; seconds instead of minutes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def lowbit_gaps(name: str, bits: int, steps: int, seeds) -> list[float]:
    """``bench/lowbit_training.py``'s runs of optimizer ``name``: the held-out loss of ``bits`` relative to 32 bits,
    ``(low - l32) / l32``, per seed (on one torch thread)."""
    bench = load_bench("lowbit_training")
    gaps = []
    with one_thread():
        for seed in seeds:
            l32, low = (bench.train(name, b, steps, seed)["heldout"] for b in (32, bits))
            gaps.append((low - l32) / l32)
    return gaps


def per_layer_and_step(model: torch.nn.Module, make_opt: Callable, steps: int, x: torch.Tensor):
    """``model`` trained ``steps`` times on ``x`` with ``step_in_backward(model, make_opt(model))``, and a copy of it
    with ``make_opt(copy)``'s ``step()``: (the model's parameters, the copy's), to compare."""
    import copy

    import lowmemopt

    twin = copy.deepcopy(model)
    lowmemopt.step_in_backward(model, make_opt(model))
    ref = make_opt(twin)
    for _ in range(steps):
        model(x).square().mean().backward()
        twin(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
    return list(model.parameters()), list(twin.parameters())
