"""The HuggingFace ``Trainer`` under FSDP2 on CPU ranks (gloo), and Muon under FSDP2 CPU offload; run by
``tests/test_trainer_fsdp.py``.

    python tests/trainer_fsdp_worker.py --world-size 2 --out DIR --cases train,... [--accelerate CONFIG]

Starts ``--world-size`` processes of this script as ``torchrun`` does (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment; accelerate's state sets up the process group from them), or
through ``accelerate launch --config_file CONFIG``. Each rank runs the named cases and writes ``DIR/rank<r>.json``:
``{case: "ok" | traceback}``. The runs of one optimizer share ``DIR/<run>/`` across jobs: ``train`` leaves the
checkpoint of step 3 and the parameters of step 6 there, ``resume`` continues from that checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys

import torch

from spawn import free_port, run_cases

STEPS, SAVE_AT = 6, 3
GLOBAL_BATCH, MICRO_BATCH = 8, 4  # one rank accumulates the micro-batches that two ranks take side by side
LR = 3e-3
RTOL = 1e-6  # (8 fp32 ulps)
#: 8-bit state on every matrix of the tiny model; 64-element blocks tile the shards of 1 and 2 ranks alike
SMALL_BLOCKS = dict(min_quant_numel=64, block_size=64)
SHARDED, FULL = "SHARDED_STATE_DICT", "FULL_STATE_DICT"


def runs() -> dict[str, tuple[tuple, str, float | None]]:
    """{run: (``optimizer(...)``'s result, the FSDP state dict type of its checkpoints, the absolute slack a resume
    on one rank may show beside ``RTOL``; None: bit for bit)}. Where the step sums over the shards (CAME's factored
    statistics, GaLore's and APOLLO's projections) one rank adds in another order: fp32 rounding, which GaLore's
    Adam-normalized low-rank coordinates can magnify (docs/distributed.md). Both slacks lie far below one step's
    movement (about ``LR`` per element), so a resume that loses or misplaces state fails."""
    from lowmemopt.integrations.transformers import optimizer

    linear = dict(target_modules="all-linear", update_proj_gap=2)
    came = optimizer("came8bit", **SMALL_BLOCKS)
    return {
        "adamw8bit": (optimizer("adamw8bit", **SMALL_BLOCKS), SHARDED, None),
        "galore_adamw_8bit": (
            optimizer("galore_adamw_8bit", galore=dict(linear, rank=4), **SMALL_BLOCKS),
            SHARDED,
            1e-2 * LR,
        ),
        "came8bit": (came, SHARDED, 1e-4 * LR),
        "muon_8bit": (optimizer("muon_8bit", adjust_lr_fn="match_rms_adamw", **SMALL_BLOCKS), SHARDED, None),
        "apollo_mini_8bit": (
            optimizer(
                "apollo_adamw",
                state_bits=8,
                apollo=dict(linear, rank=1, scale_type="tensor", scale=128),
                min_quant_numel=16,  # its rank-1 state: 32 or 64 elements per matrix
                block_size=16,
            ),
            SHARDED,
            1e-4 * LR,
        ),
        "came8bit_full": (came, FULL, 1e-4 * LR),
    }


def tiny_llama():
    """A LLaMA of 23k parameters (hidden 32, 2 layers, vocabulary 32), the same weights on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 12):
        self.data = torch.randint(0, 32, (n, seq), generator=torch.Generator().manual_seed(123))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Ctx:
    def __init__(self, rank: int, world: int, out: str, accelerate: str | None):
        self.rank, self.world, self.out, self.accelerate = rank, world, out, accelerate


def training_args(ctx: Ctx, out: str, state_dict_type: str):
    """The Trainer's arguments; FSDP2 from them, or (SHARDED runs under ``accelerate launch``) from the config file."""
    from transformers import TrainingArguments

    fsdp = {}
    if state_dict_type == FULL:  # (the newer spelling of the same FSDP2 setup)
        fsdp = dict(fsdp=True, fsdp_config={"fsdp_version": 2, "state_dict_type": state_dict_type})
    elif ctx.accelerate is None:
        fsdp = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "state_dict_type": state_dict_type})
    return TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=GLOBAL_BATCH // (MICRO_BATCH * ctx.world),
        learning_rate=LR,
        weight_decay=0.1,
        adam_beta1=0.8,
        adam_beta2=0.95,
        save_strategy="steps",
        save_steps=SAVE_AT,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        lr_scheduler_type="linear",
        **fsdp,
    )


def save_at(step: int | None):
    """A Trainer callback: the checkpoint of step ``step`` only (None: none), whatever ``save_steps`` asks."""
    from transformers import TrainerCallback

    class SaveAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = state.global_step == step

    return SaveAt()


def run_trainer(ctx: Ctx, name: str, resume: bool):
    """Train run ``name`` to step 6 (from its step-3 checkpoint if ``resume``); checks that FSDP2 was in effect."""
    from torch.distributed.tensor import DTensor
    from transformers import Trainer

    spec, sd_type, _ = runs()[name]
    out = os.path.join(ctx.out, name)
    trainer = Trainer(
        model=tiny_llama(),
        args=training_args(ctx, out, sd_type),
        train_dataset=Tokens(),
        optimizer_cls_and_kwargs=spec,
        callbacks=[save_at(None if resume else SAVE_AT)],
    )
    trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE_AT}") if resume else None)
    plugin = trainer.accelerator.state.fsdp_plugin
    check(trainer.is_fsdp_enabled and plugin.fsdp_version == 2, f"{name}: FSDP2 not in effect")
    check(sd_type in str(plugin.state_dict_type), f"{name}: state dict type {plugin.state_dict_type}, not {sd_type}")
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    check(all(isinstance(p, DTensor) for p in params), f"{name}: the optimizer steps parameters that are not DTensors")
    quantized = [k for p in params for k in trainer.optimizer.state[p] if k.endswith(".codes")]
    check(quantized, f"{name}: no 8-bit state")
    if ctx.accelerate is not None and sd_type == SHARDED:  # FSDP2 from the config file alone
        check(trainer.args.fsdp_plugin_args is None, f"{name}: the Trainer's arguments configure FSDP themselves")
        check(
            os.environ.get("FSDP_VERSION") == "2",
            f"accelerate launch set FSDP_VERSION={os.environ.get('FSDP_VERSION')}",
        )
    return trainer


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def train(ctx):
    """Every run uninterrupted for 6 steps, the Trainer saving its checkpoint at step 3."""
    for name in runs():
        params = full_params(run_trainer(ctx, name, resume=False).model)
        if ctx.rank == 0:
            torch.save(params, os.path.join(ctx.out, name, "final.pt"))


@case
def resume(ctx):
    """Every run resumed from its step-3 checkpoint in this fresh job, continued to step 6: the parameters equal the
    uninterrupted run's, bit for bit at the same world size, within ``runs()``' bound on one rank."""
    failures = []
    for name, (_, _, bound) in runs().items():
        got = full_params(run_trainer(ctx, name, resume=True).model)
        want = torch.load(os.path.join(ctx.out, name, "final.pt"))
        exact = ctx.world == 2 or bound is None
        largest = 0.0
        for n, w in want.items():
            d = (got[n] - w).abs()
            largest = max(largest, float(d.max()))
            over = d > (0.0 if exact else RTOL * w.abs() + bound)
            if over.any():
                j = int(over.flatten().nonzero()[0])
                failures.append(
                    f"{name} {n}: {int(over.sum())} of {w.numel()} elements {'differ' if exact else 'beyond bounds'}, "
                    f"at flat index {j}: {float(got[n].flatten()[j])!r} vs {float(w.flatten()[j])!r}"
                )
        if ctx.rank == 0:
            print(f"resumed on {ctx.world} rank(s): {name}: max |difference| {largest:.3g}", file=sys.stderr)
    check(not failures, "\n".join(failures))


def _muon_model() -> torch.nn.Sequential:
    """Three Linear layers of distinct shapes whose rows shard unevenly over 2 ranks (37 = 19 + 18, 11 = 6 + 5); every
    weight shard holds a multiple of 16 elements (19 x 16, 16 x 37, 6 x 32...), so 16-element blocks tile it as one
    process's blocks tile the whole weight."""
    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(16, 37),
        torch.nn.Tanh(),
        torch.nn.Linear(37, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 11),
    ]
    return torch.nn.Sequential(*layers)


def _muon_train(ctx, model, opt, sharded: bool) -> None:
    """3 steps, each step's batch in 2 slices: on 2 ranks of FSDP2 rank r takes slice r (FSDP2 averages the ranks'
    gradients); otherwise the process accumulates both and halves the sum: the same gradients, bit for bit
    (x / 2 + y / 2 == (x + y) / 2)."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 11, generator=gen)
        opt.zero_grad()
        mine = [ctx.rank] if sharded and ctx.world == 2 else [0, 1]
        for r in mine:
            lo, hi = 4 * r, 4 * r + 4
            torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        if len(mine) > 1:
            for p in model.parameters():
                p.grad.div_(len(mine))
        opt.step()


@case
def muon_cpu_offload(ctx):
    """Muon under ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` (``pin_memory=False``: no accelerator here)
    equals Muon under FSDP2 without offload and Muon in one process without FSDP: parameters and momentum bit for bit,
    32- and 8-bit momentum; the biases in AdamW groups at 32 bits (37 and 11 elements split into other blocks over
    2 ranks than in one process)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    import lowmemopt

    import dist_worker

    mesh = init_device_mesh("cpu", (ctx.world,))
    for bits in (32, 8):
        kw = dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-2, state_bits=bits, min_quant_numel=0, block_size=16)
        runs = {}
        for what, policy in (
            ("offload", CPUOffloadPolicy(pin_memory=False)),
            ("fsdp2", OffloadPolicy()),
            ("one", None),
        ):
            model = _muon_model()
            if policy is not None:
                for layer in model[::2]:
                    fully_shard(layer, mesh=mesh, offload_policy=policy)
                fully_shard(model, mesh=mesh, offload_policy=policy)
            opt = lowmemopt.Muon(lowmemopt.muon_param_groups(model, adamw=dict(state_bits=32)), **kw)
            _muon_train(ctx, model, opt, sharded=policy is not None)
            runs[what] = (model, opt)
        states = [
            fp for layer in runs["offload"][0][::2] for fp in layer._get_fsdp_state()._fsdp_param_group.fsdp_params
        ]
        check(len(states) == 6 and all(fp.offload_to_cpu for fp in states), f"{bits}-bit: CPU offload not in effect")
        (off, off_opt), (base, base_opt), (one, one_opt) = runs["offload"], runs["fsdp2"], runs["one"]
        for p, q in zip(off.parameters(), base.parameters()):  # the same local shards and state tensors
            check(torch.equal(p.to_local(), q.to_local()), f"{bits}-bit: offloaded parameter {tuple(p.shape)} differs")
            for key, v in base_opt.state[q].items():
                u = off_opt.state[p][key]
                same = torch.equal(u, v) if isinstance(v, torch.Tensor) else u == v
                check(same, f"{bits}-bit: offloaded state {key} of {tuple(p.shape)} differs")
        params, one_params = list(off.parameters()), list(one.parameters())
        dist_worker.compare(params, one_params, f"Muon {bits}-bit, CPU offload vs one process", exact=True)
        dist_worker.compare_state(off_opt, params, one_opt, one_params, f"Muon {bits}-bit state", exact=True)


def fsdp_on_cpu() -> None:
    """The shim: accelerate turns its FSDP plugin on only for accelerator devices (a CPU job runs as ``MULTI_CPU``,
    DDP-style, and drops the plugin). After ``AcceleratorState`` is set up, a CPU job given an FSDP plugin is
    switched to ``DistributedType.FSDP``, as a GPU job is; everything after is accelerate's and the Trainer's code."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = patched


def _rank_main(args) -> None:
    import torch.distributed as dist
    from accelerate import PartialState

    import transformers.trainer  # noqa: F401 - (imported before gc.freeze)

    torch.set_num_threads(1)
    fsdp_on_cpu()
    PartialState(cpu=True)  # the process group, from the launcher's environment (as TrainingArguments do)
    gc.freeze()  # the imported modules' objects: the Trainer's gc.collect() on each run skips them
    ctx = Ctx(dist.get_rank(), dist.get_world_size(), args.out, args.accelerate)
    run_cases(CASES, [n for n in args.cases.split(",") if n], ctx, args.out, ctx.rank)
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="train")
    ap.add_argument("--accelerate", default=None, help="an accelerate config file: start the ranks with it")
    args = ap.parse_args(argv)
    if "RANK" in os.environ:  # a rank, started by the code below or by a launcher
        return _rank_main(args)
    os.makedirs(args.out, exist_ok=True)
    rest = ["--out", args.out, "--cases", args.cases]
    port = str(free_port())
    env = dict(os.environ, LOWMEMOPT_COMPILE="0", OMP_NUM_THREADS="1")
    if args.accelerate is not None:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate]
        cmd += ["--num_processes", str(args.world_size), "--main_process_port", port]
        raise SystemExit(subprocess.call([*cmd, __file__, *rest, "--accelerate", args.accelerate], env=env))
    procs = []
    for rank in range(args.world_size):
        world = str(args.world_size)
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
        rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, __file__, *rest], env=rank_env))
    raise SystemExit(max((p.wait() for p in procs), key=abs))


if __name__ == "__main__":
    main()
