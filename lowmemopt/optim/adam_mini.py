"""Adam-mini (Zhang et al. 2024) matching ``adam_mini.Adam_mini`` 1.1.1: Adam with one second moment per *block* of
a parameter (a head, an output neuron, a whole tensor, chosen by the parameter's name); the block second moments stay
unquantized (fp32; float64 for float64 parameters). The blocks, the state and the measurements: docs/adam_mini.md.

    v_b = beta2 v_b + (1 - beta2) mean_{i in b}(g_i^2);   m = lerp(m, g, 1 - beta1)
    p <- p (1 - lr wd)  -  lr m / (1 - beta1^t) / (sqrt(v_b) / sqrt(1 - beta2^t) + eps)
"""

from __future__ import annotations

import math
import struct
import sys
import warnings
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..checks import check_adam_group
from ..distributed.reduction import LOCAL, Reduction
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm
from ..quant.formats import Slot

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["AdamMini", "AdamMiniAlgorithm", "BLOCKS", "adam_mini_math"]

#: the block kinds: per element (Adam), per head (q, k), per output neuron, one per tensor
BLOCKS = ("element", "head", "neuron", "tensor")


def _head_mean_sq(g: torch.Tensor, head_numel: int, reduce: Reduction) -> torch.Tensor:
    """``mean(g^2)`` per run of ``head_numel`` elements of the whole parameter, ``[heads, 1]`` (a shard's summed over
    the processes by element index)."""
    if not reduce.distributed:
        gv = g.view(-1, head_numel)
        return torch.mean(gv * gv, dim=1, keepdim=True)
    heads = reduce.numel(g) // head_numel
    index = reduce.element_index(0, g.numel(), g.device)
    if isinstance(index, int):
        index = torch.arange(index, index + g.numel(), device=g.device)
    sums = torch.zeros(heads, dtype=torch.float32, device=g.device)
    sums.index_add_(0, index // head_numel, (g * g).reshape(-1))
    return reduce.total(sums).div_(head_numel).view(heads, 1)


def adam_mini_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    block: str,
    head_numel: int,
    bias_correction1: float,
    bias_correction2_sqrt: float,
    reduce: Reduction = LOCAL,
) -> torch.Tensor:
    """fp32 Adam-mini on a whole tensor of kind ``block``: returns the delta (decay: the caller's)."""
    beta1, beta2 = betas
    m = state["exp_avg"]
    if block == "element":  # the reference's Adam branch: p.addcdiv_(m, h, value=-lr / bc1)
        v = state["exp_avg_sq"]
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        m.lerp_(g, 1 - beta1)
        h = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        return torch.mul(m, -(lr / bias_correction1)).div_(h)
    vmean = state["exp_avg_sq_mean"]
    if block == "tensor":
        numel = struct.unpack("f", struct.pack("f", reduce.numel(g)))[0]  # (the reference's count, rounded to fp32)
        tmp = reduce.total(torch.sum(g * g)) / numel
        m.lerp_(g, 1 - beta1)
        vmean.mul_(beta2).add_(tmp, alpha=1 - beta2)
        h = (vmean.sqrt() / bias_correction2_sqrt).add_(eps)
        return (m * ((1 / bias_correction1) / h)).mul_(lr).neg_()
    if block == "head":
        tmp = _head_mean_sq(g, head_numel, reduce)
        rows = g.reshape(-1, head_numel) if not reduce.distributed else None
    elif g.dim() == 1:  # (a 1-D tensor in a per-neuron category: each element is a neuron)
        tmp = g * g
        rows = g
    else:
        tmp = reduce.mean(g * g, dim=1, pdim=1, keepdim=True)
        rows = g
    vmean.mul_(beta2).add_(tmp, alpha=1 - beta2)
    m.lerp_(g, 1 - beta1)
    h = (vmean.sqrt() / bias_correction2_sqrt).add_(eps)
    stepsize = (1 / bias_correction1) / h
    if rows is None:  # a shard of a q / k matrix: each element takes its head's step size
        index = reduce.element_index(0, g.numel(), g.device)
        if isinstance(index, int):
            index = torch.arange(index, index + g.numel(), device=g.device)
        update = (m.reshape(-1) * stepsize.view(-1)[index // head_numel]).view(p.shape)
    else:
        update = (m.view(rows.shape) * stepsize).view(p.shape)
    return update.mul_(lr).neg_()


def _block_shape(block: str, param: torch.Tensor, head_numel: int, whole_numel: int) -> tuple[tuple[int, ...], tuple]:
    if block == "head":
        return (whole_numel // head_numel, 1), (None, None)
    if block == "tensor":
        return (), ()
    if param.dim() == 1:
        return tuple(param.shape), (0,)
    shape = list(param.shape)
    shape[1] = 1
    return tuple(shape), tuple(None if d == 1 else d for d in range(param.dim()))


class AdamMiniAlgorithm(Algorithm):
    """Adam-mini for the step pipeline: its slots by block kind (the group's ``block``), math and decay rule."""

    elementwise = False  # the block means reduce over heads, rows and whole tensors
    batched_reductions = True  # (its math communicates through reduce only)
    math = staticmethod(adam_mini_math)
    hyper = ("lr", "betas", "eps", "block", "head_numel")

    def slots(self, group, param):
        slots = {"exp_avg": Slot(signed=True)}
        if group["block"] == "element":
            slots["exp_avg_sq"] = Slot(signed=False, quantize=False)
            return slots
        whole = group.get("whole_numel") or param.numel()
        shape, dims = _block_shape(group["block"], param, group["head_numel"], whole)
        slots["exp_avg_sq_mean"] = Slot(signed=False, quantize=False, shape=shape, dims=dims)
        return slots

    def step_scalars(self, group, step):
        beta1, beta2 = group["betas"]
        return dict(bias_correction1=1 - beta1**step, bias_correction2_sqrt=math.sqrt(1 - beta2**step))

    def decay_factor(self, group):
        wd = group["weight_decay"]
        return 1 - group["lr"] * wd if wd > 0 else 1.0  # (the reference decays only for wd > 0)


def _check_int(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"Invalid {name} value: {value!r} (a positive int)")


def _groups_of(named_parameters: Any, weight_decay: float) -> list[dict[str, Any]]:
    """One param group per entry of ``named_parameters``, with torch's errors and warnings."""
    if isinstance(named_parameters, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
            + torch.typename(named_parameters)
        )
    groups, seen, forms = [], set(), set()
    for item in named_parameters:
        if not isinstance(item, dict):
            forms.add(isinstance(item, (tuple, list)))
        if len(forms) > 1:
            raise ValueError("all optimizer params should be with/without names. Some param names are missing")
        group = _group_of(item, weight_decay)
        if group is None:
            continue
        if isinstance(item, dict):  # (torch's own check: a parameter in two groups is an error)
            groups.append(group)
            continue
        params = group["params"]
        if any(id(p) in seen for p in params):
            warnings.warn(
                "optimizer contains a parameter group with duplicate parameters; the repeated one is left "
                "out (each parameter of AdamMini is its own group)",
                stacklevel=3,
            )
            continue
        seen.update(id(p) for p in params)
        groups.append(group)
    return groups


def _group_of(item: Any, weight_decay: float) -> dict[str, Any] | None:
    """The param group of one entry: a ``(name, parameter)`` pair (None without a gradient), a dict, or an unnamed
    tensor (one block); no decay where the name has ``norm``, ``ln`` or ``bias`` unless a dict sets its own."""
    if isinstance(item, dict):
        group = dict(item)
        params = group.get("params")
        if "name" not in group and isinstance(params, list) and len(params) == 1 and isinstance(params[0], tuple):
            group["name"] = params[0][0]  # (torch reads the pair's name into param_names)
        name = group.setdefault("name", "")
    elif isinstance(item, torch.Tensor):
        group, name = {"params": [item], "name": ""}, ""
    elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
        name, param = item
        if not param.requires_grad:
            return None
        group = {"params": [param], "name": name, "param_names": [name]}
    else:
        raise TypeError(
            "AdamMini takes named parameters, (name, parameter) pairs such as model.named_parameters() "
            f"(its block partition reads the names), or param group dicts: got {type(item).__name__}"
        )
    if not isinstance(name, str):
        raise TypeError(f"Invalid name: expected the parameter's name (a str), got {type(name).__name__}")
    group["name"] = name = name.lower()
    if "weight_decay" not in group:
        group["weight_decay"] = 0.0 if "norm" in name or "ln" in name or "bias" in name else weight_decay
    return group


class AdamMini(LowMemOptimizer):
    """Adam-mini with 32/16/8/4-bit ``m``: the signature, defaults, blocks and 32-bit results of ``Adam_mini``.

    Args:
        named_parameters: ``model.named_parameters()`` (a named group each), dict groups with ``name``, or tensors.
        dim, n_heads, n_kv_heads: the model's hidden size and heads (a query / key head is ``dim * dim / n_heads``).
        verbose: print at the first step how many blocks each name rule found. model_sharding: accepted, ignored.
        state_bits, ...: the storage options; ``state_bits`` is ``m``'s (the block second moments stay fp32).

    The name rules are the sets :attr:`embd_names`, :attr:`wqk_names`, ... (docs/adam_mini.md#the-blocks); add keywords
    before the first step (``opt.wqk_names.add("attn.qkv")``)."""

    algorithm = AdamMiniAlgorithm()
    #: its param groups are one per parameter, named (the Trainer integration builds them so)
    named_groups = True

    @staticmethod
    def model_keywords(config: Any) -> dict[str, int]:
        """``dim``, ``n_heads``, ``n_kv_heads`` from a transformers config, those it has."""
        keys = dict(dim="hidden_size", n_heads="num_attention_heads", n_kv_heads="num_key_value_heads")
        return {
            ours: getattr(config, theirs)
            for ours, theirs in keys.items()
            if isinstance(getattr(config, theirs, None), int)
        }

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        model_sharding: bool | None = None,
        dim: int = 2048,
        n_heads: int = 32,
        n_kv_heads: int | None = None,
        verbose: bool = True,
        **storage: Unpack[StorageOptions],
    ) -> None:
        _check_int("dim", dim)
        _check_int("n_heads", n_heads)
        _check_int("n_kv_heads", n_kv_heads, optional=True)
        if n_kv_heads is not None and n_heads % n_kv_heads:
            raise ValueError(f"Invalid n_kv_heads value: {n_kv_heads} (n_heads={n_heads} must be a multiple of it)")
        if (dim * dim) % n_heads:
            raise ValueError(
                f"Invalid dim / n_heads: a head of dim * dim / n_heads = {dim * dim} / {n_heads} "
                "elements is not a whole number"
            )
        self.dim, self.n_heads = dim, n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.head_numel = dim * dim // n_heads
        self.verbose = verbose
        self.embd_names = {"embed", "embd", "wte"}
        self.output_names = {"lm_head", "output", "final_layer"}
        self.wqk_names = {"k_proj", "q_proj", "wq", "wk", "query", "key"}
        self.wv_names = {"v_proj", "wv", "value"}
        self.attn_proj_names = {"o_proj", "wo", "attn.proj"}
        self.mlp_names = {"feed_forward", "linear", "mlp"}
        self.adam_block_names = {"bias"}
        self._partition: tuple | None = None
        self._counted = False
        groups = _groups_of(named_parameters, weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            name="",
            block="tensor",
            head_numel=self.head_numel,
            whole_numel=None,
        )
        super().__init__(groups, defaults, **storage)
        self._place_blocks()

    def _check_group(self, group):
        check_adam_group(group)
        if not isinstance(group["name"], str):
            raise TypeError(f"Invalid name: expected the parameter's name (a str), got {type(group['name']).__name__}")
        if group.get("rank") is not None:
            raise ValueError(
                "AdamMini does not take GaLore groups (a group with 'rank'): its second-moment blocks are "
                "the weight's heads and rows, which a low-rank gradient does not have"
            )
        if group["block"] not in BLOCKS:
            raise ValueError(f"Invalid block: {group['block']!r} (one of {', '.join(BLOCKS)})")

    # -- the block partition ----------------------------------------------------------------------------------------

    def _rules(self) -> tuple[frozenset, ...]:
        return tuple(
            frozenset(s)
            for s in (
                self.adam_block_names,
                self.wqk_names,
                self.embd_names,
                self.output_names,
                self.wv_names,
                self.mlp_names,
                self.attn_proj_names,
            )
        )

    def block_of(self, name: str) -> str:
        """The block kind the name rules give ``name`` (lower-cased), in the reference's order."""
        adam, wqk, *neuron = self._rules()
        if any(k in name for k in adam):
            return "element"
        if any(k in name for k in wqk):
            return "head"
        if any(any(k in name for k in keys) for keys in neuron):
            return "neuron"
        return "tensor"

    def _place_blocks(self) -> None:
        """Set each group's ``block`` from the name rules, unless its state exists."""
        rules = self._rules()
        if rules == self._partition:
            return
        for group in self.param_groups:
            block = self.block_of(group["name"])
            if block != group["block"] and not any(self.state.get(p) for p in group["params"]):
                group["block"] = block
            if block == "head":
                for p in group["params"]:
                    if p.numel() % group["head_numel"]:
                        raise ValueError(
                            f"AdamMini: {group['name']!r} {tuple(p.shape)} is a query / key block but "
                            f"its {p.numel()} elements are not whole heads of dim * dim / n_heads = "
                            f"{group['head_numel']}; check dim and n_heads"
                        )
            group["whole_numel"] = group["params"][0].numel() if len(group["params"]) == 1 else None
        self._partition = rules

    def count_block(self) -> dict[str, int]:
        """How many parameters each name rule found (biases aside); printed with ``verbose``."""
        counts = dict(embedding=0, output=0, query_key=0, value=0, attn_proj=0, mlp=0)
        keys = dict(
            embedding=self.embd_names,
            output=self.output_names,
            query_key=self.wqk_names,
            value=self.wv_names,
            attn_proj=self.attn_proj_names,
            mlp=self.mlp_names,
        )
        for group in self.param_groups:
            name = group["name"]
            if "bias" in name:
                continue
            for kind, names in keys.items():
                counts[kind] += any(k in name for k in names)
        if self.verbose:
            print("Adam-mini found " + ", ".join(f"{n} {k}" for k, n in counts.items()), file=sys.stderr)
            attrs = dict(
                embedding="embd_names",
                output="output_names",
                query_key="wqk_names",
                value="wv_names",
                attn_proj="attn_proj_names",
                mlp="mlp_names",
            )
            for kind, n in counts.items():
                if n == 0:
                    print(
                        f"Adam-mini: no {kind} parameter found by name; if the model has one, add a keyword of its "
                        f"name to optimizer.{attrs[kind]}",
                        file=sys.stderr,
                    )
        return counts

    _OWN = (
        "dim",
        "n_heads",
        "n_kv_heads",
        "head_numel",
        "verbose",
        "embd_names",
        "output_names",
        "wqk_names",
        "wv_names",
        "attn_proj_names",
        "mlp_names",
        "adam_block_names",
        "_partition",
        "_counted",
    )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # (pickling, deepcopy: torch's keys and the base class's)
        state.update({k: getattr(self, k) for k in self._OWN})
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if not self._counted:
            self.count_block()
            self._counted = True
        self._place_blocks()
        return super().step(closure)
