"""lowmemopt.integrations.transformers: the HuggingFace Trainer builds lowmemopt optimizers from one argument, with
TrainingArguments' hyper-parameters, and resume_from_checkpoint restores their exact state."""

from __future__ import annotations

import pytest
import torch

import lowmemopt
from lowmemopt.integrations.transformers import TrainerOptimizerFactory, optimizer, param_groups

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

# small tensors quantized too: 8-bit state on every matrix of the tiny model, 64-element blocks
SMALL_BLOCKS = dict(min_quant_numel=256, block_size=64)
HAS_GALORE = hasattr(lowmemopt, "galore_param_groups")
HAS_PAGED = hasattr(lowmemopt, "PagedAdamW")
HAS_PER_LAYER = hasattr(lowmemopt, "step_in_backward")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 24, seq: int = 16):
        gen = torch.Generator().manual_seed(123)
        self.data = torch.randint(0, 128, (n, seq), generator=gen)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def training_args(out, **overrides) -> TrainingArguments:
    kw = dict(
        output_dir=str(out),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        weight_decay=0.1,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-7,
        save_strategy="steps",
        save_steps=3,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        lr_scheduler_type="linear",
    )
    kw.update(overrides)
    return TrainingArguments(**kw)


def train(out, spec, resume=None, **overrides) -> tuple[Trainer, dict[str, torch.Tensor]]:
    trainer = Trainer(
        model=tiny_llama(), args=training_args(out, **overrides), train_dataset=Tokens(), optimizer_cls_and_kwargs=spec
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


# ---------------------------------------------------------------------------------------------------------------------
# resume


RESUME_CASES = {
    "came8bit": lambda: optimizer("came8bit", **SMALL_BLOCKS),
    "galore_adamw8bit": pytest.param(
        lambda: optimizer(
            "galore_adamw_8bit", galore=dict(target_modules="all-linear", rank=8, update_proj_gap=2), **SMALL_BLOCKS
        ),
        marks=pytest.mark.skipif(not HAS_GALORE, reason="GaLore (lowmemopt.galore_param_groups) has not landed"),
    ),
    "paged_adamw": pytest.param(
        lambda: optimizer("paged_adamw", **SMALL_BLOCKS),
        marks=pytest.mark.skipif(not HAS_PAGED, reason="paged state (lowmemopt.PagedAdamW) has not landed"),
    ),
    "came8bit_per_layer": pytest.param(
        lambda: optimizer("came8bit", step_in_backward=True, **SMALL_BLOCKS),
        marks=pytest.mark.skipif(not HAS_PER_LAYER, reason="lowmemopt.step_in_backward has not landed"),
    ),
}
RESUME_CASES["ademamix_8bit"] = lambda: optimizer("ademamix_8bit", t_alpha=4, t_beta3=4, **SMALL_BLOCKS)
RESUME_CASES["adam_mini_8bit"] = lambda: optimizer("adam_mini", state_bits=8, verbose=False, **SMALL_BLOCKS)
NO_CLIPPING = {"came8bit_per_layer"}  # per-layer updates cannot clip by global norm


@pytest.mark.parametrize("make_spec", list(RESUME_CASES.values()), ids=list(RESUME_CASES))
def test_resume_from_checkpoint_is_exact(tmp_path, make_spec, request):
    """6 steps straight == 3 steps, save, a fresh Trainer resuming from step 3 for the other 3: identical parameters
    (and identical optimizer state, so every later step matches too)."""
    overrides = dict(max_grad_norm=0.0) if request.node.callspec.id in NO_CLIPPING else {}
    full, want = train(tmp_path / "full", make_spec(), **overrides)
    assert full.state.global_step == 6
    ckpt = tmp_path / "full" / "checkpoint-3"
    assert (ckpt / "optimizer.pt").is_file()

    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)  # what the Trainer's resume does
    codes = [v for st in saved["state"].values() for k, v in st.items() if k.endswith(".codes")]
    assert all(c.dtype == torch.uint8 for c in codes)
    assert bool(codes) == ("8bit" in request.node.callspec.id)  # the 8-bit runs really hold 8-bit state

    resumed, got = train(tmp_path / "resumed", make_spec(), resume=str(ckpt), **overrides)
    assert resumed.state.global_step == 6
    for name in want:
        assert torch.equal(got[name], want[name]), name
    inner = resumed.optimizer.optimizer  # accelerate's wrapper -> the lowmemopt optimizer
    for p, st in inner.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                ref = full.optimizer.optimizer.state[_same_param(full, resumed, p)][k]
                assert v.dtype == ref.dtype and torch.equal(v, ref), k


@pytest.mark.skipif(not HAS_PER_LAYER, reason="lowmemopt.step_in_backward has not landed")
def test_per_layer_mode_in_the_trainer(tmp_path):
    """step_in_backward=True: the same parameters as ordinary stepping (no clipping in either), the stepper's position
    saved in optimizer.pt, gradient accumulation honoured, and clipping refused with a clear message."""
    _, plain = train(tmp_path / "plain", optimizer("adamw8bit", **SMALL_BLOCKS), max_grad_norm=0.0, save_steps=6)
    trainer, per_layer = train(
        tmp_path / "per_layer",
        optimizer("adamw8bit", step_in_backward=True, **SMALL_BLOCKS),
        max_grad_norm=0.0,
        save_steps=6,
    )
    for name in plain:
        assert torch.equal(per_layer[name], plain[name]), name
    assert all(p.grad is None for p in trainer.model.parameters())  # freed inside backward
    trainer, bucketed = train(
        tmp_path / "bucketed",
        optimizer("adamw8bit", step_in_backward=dict(bucket_bytes=1 << 14), **SMALL_BLOCKS),
        max_grad_norm=0.0,
        save_steps=6,
    )
    for name in plain:  # held in buckets of 16 KiB of gradients, stepped together: the same parameters
        assert torch.equal(bucketed[name], plain[name]), name
    assert trainer.optimizer.optimizer.backward_stepper._updates.bucket_bytes == 1 << 14
    saved = torch.load(tmp_path / "per_layer" / "checkpoint-6" / "optimizer.pt", weights_only=True)
    assert saved["step_in_backward"]["steps"] == 6 and saved["step_in_backward"]["micro_step"] == 0

    _, acc_plain = train(
        tmp_path / "acc_plain",
        optimizer("adamw8bit", **SMALL_BLOCKS),
        max_grad_norm=0.0,
        save_steps=6,
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    _, acc = train(
        tmp_path / "acc",
        optimizer("adamw8bit", step_in_backward=True, **SMALL_BLOCKS),
        max_grad_norm=0.0,
        save_steps=6,
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    for name in acc_plain:
        torch.testing.assert_close(acc[name], acc_plain[name], rtol=1e-5, atol=1e-7)  # loss scaling order may differ

    with pytest.raises(ValueError, match="max_grad_norm=0"):
        train(tmp_path / "clip", optimizer("adamw8bit", step_in_backward=True))  # default max_grad_norm=1.0


def _same_param(full: Trainer, resumed: Trainer, p: torch.Tensor) -> torch.Tensor:
    name = next(n for n, q in resumed.model.named_parameters() if q is p)
    return dict(full.model.named_parameters())[name]


# ---------------------------------------------------------------------------------------------------------------------
# what the factory builds


def build_in_trainer(tmp_path, spec, **overrides) -> tuple[torch.optim.Optimizer, dict[str, dict]]:
    """The optimizer a Trainer makes from ``spec``, and each parameter's group by parameter name."""
    trainer = Trainer(
        model=tiny_llama(),
        args=training_args(tmp_path, **overrides),
        train_dataset=Tokens(),
        optimizer_cls_and_kwargs=spec,
    )
    opt = trainer.create_optimizer()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    by_name = {names[id(p)]: g for g in opt.param_groups for p in g["params"]}
    assert sorted(by_name) == sorted(names.values())  # every trainable parameter, once
    return opt, by_name


def test_training_arguments_and_trainer_rules_are_honoured(tmp_path):
    opt, by_name = build_in_trainer(tmp_path, optimizer("adamw8bit", **SMALL_BLOCKS))
    assert type(opt) is lowmemopt.AdamW8bit
    for g in opt.param_groups:
        assert g["lr"] == 3e-3 and g["betas"] == (0.8, 0.95) and g["eps"] == 1e-7
        assert g["block_size"] == 64 and g["min_quant_numel"] == 256
    # the Trainer's no-decay rule (get_decay_parameter_names): norm weights get weight_decay 0
    assert by_name["model.layers.0.input_layernorm.weight"]["weight_decay"] == 0.0
    assert by_name["model.norm.weight"]["weight_decay"] == 0.0
    assert by_name["model.layers.1.self_attn.q_proj.weight"]["weight_decay"] == 0.1
    assert by_name["lm_head.weight"]["weight_decay"] == 0.1
    # embeddings keep 32-bit state, as the Trainer does for bitsandbytes' 8-bit optimizers; the rest is 8-bit
    assert by_name["model.embed_tokens.weight"]["state_bits"] == 32
    assert by_name["model.layers.0.mlp.up_proj.weight"]["state_bits"] == 8


def test_hyper_parameters_apply_only_where_the_optimizer_has_them(tmp_path):
    _, came = build_in_trainer(tmp_path, optimizer("CAME", state_bits=16))
    g = came["lm_head.weight"]
    assert g["lr"] == 3e-3 and g["state_bits"] == 16 and g["weight_decay"] == 0.1
    assert g["betas"] == (0.8, 0.95, 0.9999)  # CAME's third beta keeps its default
    assert g["eps"] == (1e-30, 1e-16)  # CAME's eps pair is not Adam's epsilon
    _, ada = build_in_trainer(tmp_path, optimizer("adafactor", embedding_state_bits=None))
    g = ada["model.embed_tokens.weight"]
    assert g["lr"] == 3e-3 and g["beta1"] is None and g["eps"] == (1e-30, 1e-3) and "betas" not in g
    assert g["state_bits"] == 32 and g["weight_decay"] == 0.1
    assert not g["relative_step"] and not g["scale_parameter"]  # the Trainer's own Adafactor settings
    _, rel = build_in_trainer(tmp_path, optimizer("adafactor", relative_step=True))
    assert rel["lm_head.weight"]["lr"] is None  # Adafactor's own relative step size: no lr to take
    _, lion = build_in_trainer(tmp_path, optimizer("lion_8bit", betas=(0.9, 0.99), lr=1e-4))
    g = lion["lm_head.weight"]
    assert g["betas"] == (0.9, 0.99) and g["lr"] == 1e-4  # explicit keywords win over TrainingArguments
    _, sgd = build_in_trainer(tmp_path, optimizer("sgd", momentum=0.9), weight_decay=0.0)
    assert all(g["weight_decay"] == 0.0 and "betas" not in g for g in sgd.values())


def test_decay_rule_follows_a_trainer_subclass(tmp_path):
    class NoDecayOnHead(Trainer):
        def get_decay_parameter_names(self, model):
            return [n for n in super().get_decay_parameter_names(model) if not n.startswith("lm_head")]

    trainer = NoDecayOnHead(
        model=tiny_llama(),
        args=training_args(tmp_path),
        train_dataset=Tokens(),
        optimizer_cls_and_kwargs=optimizer("adamw"),
    )
    opt = trainer.create_optimizer()
    head = trainer.model.lm_head.weight
    assert next(g for g in opt.param_groups if any(p is head for p in g["params"]))["weight_decay"] == 0.0


def test_class_call_path_of_older_transformers(tmp_path, monkeypatch):
    """transformers < 5.3 has no factory path: it calls optimizer_cls(param_groups, **kwargs). Same optimizer."""
    import transformers.trainer

    asked = []
    monkeypatch.setattr(
        transformers.trainer, "is_optimizer_factory", lambda cls: asked.append(cls) and False, raising=False
    )
    opt, by_name = build_in_trainer(tmp_path, optimizer("came8bit", **SMALL_BLOCKS))
    assert asked == [TrainerOptimizerFactory]
    assert type(opt) is lowmemopt.CAME8bit
    assert by_name["model.embed_tokens.weight"]["state_bits"] == 32
    assert by_name["model.norm.weight"]["weight_decay"] == 0.0 and by_name["lm_head.weight"]["lr"] == 3e-3


def test_factory_outside_a_trainer_needs_args(tmp_path):
    model = tiny_llama()
    cls, config = optimizer("adamw", lr=1e-3)
    with pytest.raises(TypeError, match="outside a transformers Trainer"):
        cls()(model, **config)
    cls, config = optimizer("adamw", args=training_args(tmp_path))
    opt = cls()(model, **config)
    assert opt.param_groups[0]["lr"] == 3e-3
    with pytest.raises(TypeError, match="builds its groups from a model"):
        TrainerOptimizerFactory(list(model.parameters()), **config)


def test_every_optimizer_is_reachable_by_name(tmp_path):
    from lowmemopt.registry import needs_process_group, optimizer_classes

    model = tiny_llama()
    args = training_args(tmp_path)
    for class_name, cls in optimizer_classes().items():
        if class_name.lower().startswith("galore") and not HAS_GALORE:
            continue
        if needs_process_group(cls):
            continue  # see test_onebit_optimizers_need_a_process_group
        for name in (class_name, class_name.lower(), class_name.upper()):
            factory, config = optimizer(
                name,
                args=args,
                **(
                    {"galore": dict(target_modules="all-linear", rank=4)}
                    if class_name.lower().startswith("galore")
                    else {}
                ),
            )
            assert type(factory()(model, **config)) is cls, name


def test_onebit_optimizers_need_a_process_group(tmp_path):
    import torch.distributed as dist

    import lowmemopt

    args = training_args(tmp_path)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="OnebitAdam needs torch.distributed initialized.*torchrun"):
        optimizer("onebit_adam", args=args)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)  # as torchrun does
    try:
        for name, cls in (
            ("onebit_adam", lowmemopt.OnebitAdam),
            ("ZeroOneAdam", lowmemopt.ZeroOneAdam),
            ("onebit-lamb", lowmemopt.OnebitLAMB),
        ):
            factory, config = (
                optimizer(name, args=args, freeze_step=5)
                if cls is not lowmemopt.ZeroOneAdam
                else optimizer(name, args=args)
            )
            opt = factory()(tiny_llama(), **config)
            assert type(opt) is cls and opt.defaults["lr"] == args.learning_rate
    finally:
        dist.destroy_process_group()


def test_bad_input_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="unknown optimizer 'adamz'.*AdamW"):
        optimizer("adamz")
    with pytest.raises(ValueError, match="state_bits"):
        optimizer("adamw", state_bits=3)
    with pytest.raises(TypeError):
        optimizer("adamw", betass=(0.9, 0.99))
    with pytest.raises(ValueError, match="galore needs target_modules"):
        optimizer("came", galore=dict(rank=8))
    with pytest.raises(ValueError, match="galore needs rank"):
        optimizer("came", galore=dict(target_modules="all-linear"))
    with pytest.raises(ValueError, match="runs in GaLore groups"):
        optimizer("galore_adamw")
    with pytest.raises(ValueError, match="embedding_state_bits"):
        optimizer("came", embedding_state_bits=3)
    with pytest.raises(TypeError, match="step_in_backward must be a bool or a dict"):
        optimizer("adamw", step_in_backward="yes")
    with pytest.raises(TypeError, match="unknown options \\['bucket'\\]"):
        optimizer("adamw", step_in_backward=dict(bucket=1 << 20))
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 0"):
        optimizer("adamw", step_in_backward=dict(bucket_bytes=-1))
    if HAS_GALORE:
        with pytest.raises(TypeError, match="rnak"):
            optimizer("came", galore=dict(target_modules="all-linear", rank=8, rnak=8))
    else:
        with pytest.raises(NotImplementedError, match="GaLore"):
            optimizer("came", galore=dict(target_modules="all-linear", rank=8))


def test_param_groups_for_a_plain_loop():
    model = tiny_llama()
    model.model.layers[1].requires_grad_(False)
    groups = param_groups(model, weight_decay=0.05, decay_names=["lm_head.weight"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(len(g["params"]) for g in groups) == len(trainable)
    assert [(len(g["params"]), g["weight_decay"], g.get("state_bits")) for g in groups] == [
        (1, 0.0, 32),  # embedding
        (len(trainable) - 2, 0.0, None),  # everything else but the head
        (1, 0.05, None),  # the head
    ]


def test_adam_mini_groups_and_model_shape_from_the_trainer(tmp_path):
    """optimizer("adam_mini"): one named group per parameter (its blocks by name: q / k per head), the Trainer's
    decay rule and embedding bits kept, dim and heads from the model's config."""
    opt, by_name = build_in_trainer(tmp_path, optimizer("adam_mini", verbose=False))
    assert type(opt) is lowmemopt.AdamMini and (opt.dim, opt.n_heads, opt.n_kv_heads) == (64, 4, 2)
    blocks = {g["name"]: g["block"] for g in opt.param_groups}
    assert blocks["model.layers.0.self_attn.k_proj.weight"] == "head" and blocks["lm_head.weight"] == "neuron"
    assert by_name["model.norm.weight"]["weight_decay"] == 0.0 and by_name["lm_head.weight"]["weight_decay"] == 0.1
    assert by_name["model.embed_tokens.weight"]["state_bits"] == 32
