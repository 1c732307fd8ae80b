"""The Hugging Face ``Trainer`` with lowmemopt optimizers: one argument switches a Trainer script to any of them::

    trainer = Trainer(model=model, args=training_args, train_dataset=data,
                      optimizer_cls_and_kwargs=optimizer("came", state_bits=8,
                                                         galore=dict(target_modules="all-linear", rank=64)))

How the factory builds the param groups (``TrainingArguments``, no-decay rule, embeddings, GaLore, APOLLO, Muon) and
why checkpoints resume exactly: docs/trainer.md.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ..registry import check_process_group, instantiate, model_params, needs_process_group, resolve_optimizer

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = ["TrainerOptimizerFactory", "optimizer", "param_groups"]


def optimizer(
    name: str,
    *,
    state_bits: int | None = None,
    galore: Mapping[str, Any] | None = None,
    embedding_state_bits: int | None = 32,
    step_in_backward: bool | Mapping[str, Any] = False,
    args: TrainingArguments | None = None,
    apollo: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[type, dict[str, Any]]:
    """What ``Trainer(..., optimizer_cls_and_kwargs=...)`` takes to train with lowmemopt optimizer ``name``.

    Args:
        name: any lowmemopt optimizer, case-insensitive (``"adamw"``, ``"AdamW8bit"``, ``"came"``, ``"lion8bit"``,
            ``"galore_adamw_8bit"``...; see :mod:`lowmemopt.registry`).
        state_bits: 32, 16, 8 or 4; None keeps the name's default (``"adamw4bit"``: 4, ``"adamw"``: 32).
        galore: ``target_modules``, ``rank`` and the other keywords of :func:`lowmemopt.galore_param_groups`
            (required for ``galore_*`` names).
        embedding_state_bits: state bits for embedding weights (default 32); None: like every other parameter.
        step_in_backward: per-layer updates inside ``backward()`` (:func:`lowmemopt.step_in_backward`; needs
            ``TrainingArguments(max_grad_norm=0)``); a mapping gives its options (``dict(bucket_bytes=32 << 20)``).
        args: the ``TrainingArguments`` to read hyper-parameters from; default: those of the calling Trainer.
        apollo: for ``"apollo_adamw"``: ``target_modules``, ``rank`` and the other keywords of
            :func:`lowmemopt.apollo_param_groups` (APOLLO-Mini: ``rank=1, scale_type="tensor", scale=128``).
        **kwargs: any other keyword of the optimizer (``lr``, ``betas``, ``block_size``, ``paged``...); these win over
            ``TrainingArguments``.

    The name, bits and keywords are checked now (ValueError / TypeError), so a typo fails before training starts.
    """
    resolved = resolve_optimizer(name)
    if galore is None and resolved.galore:
        raise ValueError(
            f"optimizer {name!r} runs in GaLore groups: pass galore=dict(target_modules=..., rank=...) "
            "(target_modules as in TrainingArguments.optim_target_modules, e.g. 'all-linear')"
        )
    if galore is not None:
        galore = _check_galore(galore)
    if apollo is not None:
        apollo = _check_apollo(resolved.cls, apollo)
    if embedding_state_bits is not None and embedding_state_bits not in (32, 16, 8, 4):
        raise ValueError(f"embedding_state_bits must be 32, 16, 8, 4 or None, got {embedding_state_bits!r}")
    step_in_backward = _check_step_in_backward(step_in_backward)
    ctor = {**resolved.kwargs, **kwargs}
    if _relative_step_capable(resolved.cls):  # as the Trainer's optim="adafactor": an external, scheduled lr
        ctor.setdefault("relative_step", False)
        ctor.setdefault("scale_parameter", False)
    if state_bits is not None:
        ctor["state_bits"] = state_bits
    _probe(resolved.cls, ctor)  # validates the keywords now
    config = dict(
        name=name,
        optimizer_kwargs=ctor,
        galore=galore,
        embedding_state_bits=embedding_state_bits,
        step_in_backward=step_in_backward,
        training_args=args,
        apollo=apollo,
    )
    return TrainerOptimizerFactory, config


class TrainerOptimizerFactory:
    """The first element of :func:`optimizer`'s result, which the Trainer calls with the model."""

    def __new__(cls, params: Any = None, **config: Any) -> Any:
        if params is None:
            return super().__new__(cls)
        trainer, model = _calling_trainer()
        if model is None:
            raise TypeError(
                "TrainerOptimizerFactory(params, ...) builds its groups from a model: call it as "
                "TrainerOptimizerFactory()(model, **config), or from inside a transformers Trainer"
            )
        return build(model, trainer=trainer, **config)

    def __call__(self, model: torch.nn.Module, **config: Any) -> torch.optim.Optimizer:
        trainer, _ = _calling_trainer()
        return build(model, trainer=trainer, **config)


def build(
    model: torch.nn.Module,
    *,
    name: str,
    optimizer_kwargs: dict[str, Any],
    galore: dict[str, Any] | None,
    embedding_state_bits: int | None,
    step_in_backward: bool | dict[str, Any] | None,
    training_args: TrainingArguments | None,
    trainer: Any = None,
    apollo: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Make the optimizer for ``model`` (docs/trainer.md)."""
    args = training_args if training_args is not None else getattr(trainer, "args", None)
    if args is None:
        raise TypeError(
            "lowmemopt optimizer factory called outside a transformers Trainer: pass args=TrainingArguments(...) "
            "to lowmemopt.integrations.transformers.optimizer()"
        )
    cls = resolve_optimizer(name).cls
    ctor = {**from_training_args(cls, args, optimizer_kwargs), **optimizer_kwargs}
    weight_decay = ctor.pop("weight_decay", args.weight_decay)
    groups = param_groups(
        model,
        weight_decay=weight_decay,
        decay_names=_decay_names(trainer, model),
        galore=galore,
        embedding_state_bits=embedding_state_bits,
        base=_base_groups(cls, model, galore, apollo),
    )
    if getattr(cls, "named_groups", False):  # (Adam-mini: a group per parameter, its blocks by the parameter's name)
        groups = _named_groups(model, groups)
        for key, value in cls.model_keywords(getattr(model, "config", None)).items():
            ctor.setdefault(key, value)
    opt = cls(groups, **ctor)
    if step_in_backward is not None and step_in_backward is not False:  # ({} and True: on, default options)
        opt = _step_in_backward(model, opt, args, {} if step_in_backward is True else step_in_backward)
    return opt


def _check_step_in_backward(value: Any) -> dict[str, Any] | None:
    """:func:`optimizer`'s ``step_in_backward``: None (off), or the options for :func:`lowmemopt.step_in_backward`."""
    if isinstance(value, bool):
        return {} if value else None
    if not isinstance(value, Mapping):
        raise TypeError(f"step_in_backward must be a bool or a dict of options, got {type(value).__name__}")
    unknown = sorted(set(value) - {"bucket_bytes"})
    if unknown:
        raise TypeError(
            f"step_in_backward: unknown options {unknown} (known: 'bucket_bytes'; accumulation_steps and "
            "max_grad_norm come from the TrainingArguments)"
        )
    from ..per_layer import check_bucket_bytes

    check_bucket_bytes(value.get("bucket_bytes", 0))
    return dict(value)


def from_training_args(cls: type, args: Any, explicit: Mapping[str, Any] = ()) -> dict[str, Any]:
    """The keywords of ``cls`` that ``TrainingArguments`` set (docs/trainer.md)."""
    out: dict[str, Any] = {"weight_decay": args.weight_decay}
    if not explicit.get("relative_step", False):
        out["lr"] = args.learning_rate
    renamed = getattr(cls, "adam_keywords", None)  # Adam settings under other names (Muon's AdamW groups)
    if renamed is not None:
        out.update({renamed["betas"]: (args.adam_beta1, args.adam_beta2), renamed["eps"]: args.adam_epsilon})
        return out
    defaults = _probe(cls, {**out, **explicit}).defaults
    betas = defaults.get("betas")
    if isinstance(betas, (tuple, list)) and len(betas) >= 2:
        out["betas"] = (args.adam_beta1, args.adam_beta2, *betas[2:])
    eps = defaults.get("eps")
    if isinstance(eps, (int, float)) and not isinstance(eps, bool):
        out["eps"] = args.adam_epsilon
    return out


def param_groups(
    model: torch.nn.Module,
    *,
    weight_decay: float,
    decay_names: set[str] | list[str] | None = None,
    galore: Mapping[str, Any] | None = None,
    embedding_state_bits: int | None = 32,
    base: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """``model``'s trainable parameters as param groups: GaLore groups first, then split by decay and embedding bits."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters")
    names = {id(p): n for n, p in named}
    decay = set(names.values()) if decay_names is None else set(decay_names)
    embedding = {
        id(p)
        for m in model.modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
        for p in m.parameters(recurse=False)
    }
    if galore is not None:
        base = _galore_groups(model, dict(galore))
    elif base is None:
        base = [{"params": [p for _, p in named]}]
    groups: list[dict[str, Any]] = []
    for group in base:
        buckets: dict[tuple[bool, bool], list[torch.Tensor]] = {}
        for p in group["params"]:
            if id(p) not in names:
                continue  # frozen
            is_embedding = embedding_state_bits is not None and id(p) in embedding
            buckets.setdefault((names[id(p)] in decay, is_embedding), []).append(p)
        for (decays, is_embedding), params in buckets.items():
            sub = {k: v for k, v in group.items() if k != "params"}
            sub["params"] = params
            sub["weight_decay"] = weight_decay if decays else 0.0
            if is_embedding:
                sub["state_bits"] = embedding_state_bits
            groups.append(sub)
    return groups


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def _projection_settings(kind: str, settings: Any, example_rank: int) -> dict[str, Any]:
    """``settings`` as a dict with ``target_modules`` and ``rank``, else an error naming ``kind``."""
    if not isinstance(settings, Mapping):
        raise TypeError(f"{kind} must be a dict of {kind} settings, got {type(settings).__name__}")
    missing = [k for k in ("target_modules", "rank") if k not in settings]
    if missing:
        raise ValueError(
            f"{kind} needs {' and '.join(missing)}, e.g. {kind}=dict(target_modules='all-linear', "
            f"rank={example_rank}) (target_modules as in TrainingArguments.optim_target_modules)"
        )
    return dict(settings)


def _named_groups(model: torch.nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` split into one group per parameter with its ``name`` in ``model`` (the other keys kept)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [p], "name": names[id(p)]}
        for g in groups
        for p in g["params"]
    ]


def _check_galore(galore: Mapping[str, Any]) -> dict[str, Any]:
    galore = _projection_settings("galore", galore, 128)
    _galore_groups(torch.nn.Sequential(torch.nn.Linear(4, 4)), {**galore, "target_modules": "all-linear"})
    return galore


def _base_groups(
    cls: type, model: torch.nn.Module, galore: dict[str, Any] | None, apollo: dict[str, Any] | None
) -> list[dict[str, Any]] | None:
    """The groups :func:`param_groups` splits (APOLLO's, Muon's), or None."""
    if apollo is not None:
        return _apollo_groups(model, apollo)
    if galore is None and hasattr(cls, "model_param_groups"):
        return model_params(cls, model)
    return None


def _check_apollo(cls: type, apollo: Mapping[str, Any]) -> dict[str, Any]:
    import lowmemopt

    if not (isinstance(cls, type) and issubclass(cls, lowmemopt.APOLLOAdamW)):
        raise ValueError(f"apollo=... is for APOLLOAdamW (optimizer 'apollo_adamw'), not {cls.__name__}")
    apollo = _projection_settings("apollo", apollo, 256)
    groups = _apollo_groups(torch.nn.Sequential(torch.nn.Linear(4, 4)), {**apollo, "target_modules": "all-linear"})
    cls(groups)  # the optimizer's own checks of the group keys
    return apollo


def _apollo_groups(model: torch.nn.Module, apollo: dict[str, Any]) -> list[dict[str, Any]]:
    import lowmemopt

    return lowmemopt.apollo_param_groups(model, **apollo)


def _galore_groups(model: torch.nn.Module, galore: dict[str, Any]) -> list[dict[str, Any]]:
    import lowmemopt

    make = getattr(lowmemopt, "galore_param_groups", None)
    if make is None:
        raise NotImplementedError("GaLore is not available in this version of lowmemopt (no galore_param_groups)")
    return make(model, **galore)


def _step_in_backward(
    model: torch.nn.Module, opt: torch.optim.Optimizer, args: Any, options: Mapping[str, Any] = ()
) -> torch.optim.Optimizer:
    """Attach :func:`lowmemopt.step_in_backward` and save its position in ``opt.state_dict()``."""
    import lowmemopt

    attach = getattr(lowmemopt, "step_in_backward", None)
    if attach is None:
        raise NotImplementedError("per-layer stepping (step_in_backward) is not available in this version of lowmemopt")
    try:
        stepper = attach(
            model,
            opt,
            accumulation_steps=args.gradient_accumulation_steps,
            max_grad_norm=args.max_grad_norm,
            **dict(options),
        )
    except ValueError as e:
        if args.max_grad_norm:
            raise ValueError(f"step_in_backward=True needs TrainingArguments(max_grad_norm=0): {e}") from e
        raise

    def save(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict["step_in_backward"] = stepper.state_dict()
        return state_dict

    def load(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = dict(state_dict)
        saved = state_dict.pop("step_in_backward", None)
        if saved is not None:
            stepper.load_state_dict(saved)
        return state_dict

    opt.register_state_dict_post_hook(save)
    opt.register_load_state_dict_pre_hook(load, prepend=True)
    opt.backward_stepper = stepper  # keep it reachable (and alive) with the optimizer
    return opt


def _probe(cls: type, kwargs: Mapping[str, Any]) -> torch.optim.Optimizer:
    """A throw-away instance on one dummy parameter: validates ``kwargs`` and exposes the defaults they give."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("paged", "offload_dir")}
    if needs_process_group(cls):  # (the 1-bit optimizers) a meta parameter: nothing broadcast by the probe
        check_process_group(cls)
        return instantiate(cls, [torch.nn.Parameter(torch.zeros(1, device="meta"))], **kwargs)
    return instantiate(cls, [torch.nn.Parameter(torch.zeros(1))], **kwargs)


def _relative_step_capable(cls: type) -> bool:
    from ..optim import Adafactor

    return issubclass(cls, Adafactor)


def _calling_trainer() -> tuple[Any, torch.nn.Module | None]:
    """The ``transformers.Trainer`` on the call stack and the model it builds an optimizer for; (None, None) outside."""
    try:
        from transformers import Trainer
    except ImportError:
        return None, None
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj, frame.f_locals.get("opt_model", getattr(obj, "model", None))
        frame = frame.f_back
    return None, None


def _decay_names(trainer: Any, model: torch.nn.Module) -> list[str]:
    """The Trainer's no-decay rule: its ``get_decay_parameter_names`` (a subclass's override included)."""
    if trainer is not None:
        return trainer.get_decay_parameter_names(model)
    from transformers import Trainer

    return Trainer.get_decay_parameter_names(None, model)  # does not use ``self``
