"""The table of optimizers the common suite runs on (in the spirit of torch's ``OptimizerInfo``).

Each entry names the lowmemopt class, the hyper-parameter variants checked for 32-bit parity, how to build the
reference optimizer for a variant (and the reference class, whose signature it matches), the 8-bit error bound
against the 32-bit twin, and bad inputs with their errors. A new optimizer joins the whole suite (parity, 8-bit
bounds, state bytes, resume, bad inputs: tests/test_optimizers.py; the torch.optim contract: tests/test_contract.py) by
adding an entry here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

import lowmemopt
from grouped_optimizers import MuonReference, SuiteAPOLLO, SuiteMuon, apollo_reference


def _colossalai_module(name: str):
    """Load ColossalAI's pure-PyTorch optimizer file ``name`` (lamb, lars) without importing the heavy package."""
    try:
        dist = importlib.metadata.distribution("colossalai")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("colossalai is not installed (test dependency; .ci/run installs it with --no-deps)")
    files = [f for f in dist.files or [] if str(f).replace("\\", "/").endswith(f"colossalai/nn/optimizer/{name}.py")]
    if not files:
        pytest.skip(f"colossalai/nn/optimizer/{name}.py not found")
    spec = importlib.util.spec_from_file_location(f"_colossalai_{name}", dist.locate_file(files[0]))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lion_reference(params, **kw):
    lion_pytorch = pytest.importorskip("lion_pytorch")
    return lion_pytorch.Lion(params, **kw)


def _adafactor_reference(params, **kw):
    transformers_optimization = pytest.importorskip("transformers.optimization")
    return transformers_optimization.Adafactor(params, **kw)


def _came_reference(params, **kw):
    came_pytorch = pytest.importorskip("came_pytorch")
    return came_pytorch.CAME(params, **kw)


def _galore_adamw_reference(params, **kw):
    galore_torch = pytest.importorskip("galore_torch")  # unprojected params: transformers' legacy AdamW
    return galore_torch.GaLoreAdamW(params, no_deprecation_warning=True, **kw)


def _galore_adafactor_reference(params, **kw):
    galore_torch = pytest.importorskip("galore_torch")  # unprojected params: transformers' Adafactor
    return galore_torch.GaLoreAdafactor(params, **kw)


def _lamb_reference(params, **kw):
    return _colossalai_module("lamb").Lamb(params, **kw)


def _lars_reference(params, **kw):
    return _colossalai_module("lars").Lars(params, **kw)


class SignSGDReference(torch.optim.SGD):
    """mlbench-core's ``SignSGD`` rule (``mlbench_core/optim/pytorch/optim.py``; the package itself needs apex), written
    out here: a ``torch.optim.SGD`` (its signature) whose step takes torch SGD's direction ``d`` (L2 weight decay,
    momentum buffer, dampening after the first step, Nesterov; ``maximize`` negates the gradient) and then
    ``p.add_(torch.sign(d), alpha=-lr)``. mlbench adds the decay into ``p.grad`` in place; here the gradient is left
    alone (the next step sets a new one either way)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            mu, dampening = group["momentum"], group["dampening"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = -p.grad if group["maximize"] else p.grad
                if group["weight_decay"] != 0:
                    d = d.add(p, alpha=group["weight_decay"])
                if mu != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:  # mlbench: zeros * mu + d, i.e. d
                        buf = state["momentum_buffer"] = torch.zeros_like(p).mul_(mu).add_(d)
                    else:
                        buf = state["momentum_buffer"].mul_(mu).add_(d, alpha=1 - dampening)
                    d = d.add(buf, alpha=mu) if group["nesterov"] else buf
                p.add_(torch.sign(d), alpha=-group["lr"])
        return loss


def _torch_adam_for(decoupled_key: str, dropped: tuple[str, ...] = ()) -> Callable[..., torch.optim.Optimizer]:
    """torch's AdamW (``decoupled_key`` True, the default) or Adam with a seed's flags where they coincide with it."""

    def make(params, **kw):
        decoupled = kw.pop(decoupled_key, True)
        for key in dropped:
            kw.pop(key, None)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(params, foreach=False, **{"weight_decay": 0.0, **kw})

    return make


class ApexSGDReference(torch.optim.Optimizer):
    """Apex's ``multi_tensor_sgd`` step written out (per tensor, fp32; the first step sets the momentum buffer to the
    direction): ``g += wd p`` unless ``wd_after_momentum``; ``b = g`` (first step) or ``mu b + (1 - dampening) g``;
    ``g = g + mu b`` (nesterov) or ``b``; ``g += wd p`` if ``wd_after_momentum``; ``p -= lr g``."""

    def __init__(
        self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                dampening=dampening,
                weight_decay=weight_decay,
                nesterov=nesterov,
                wd_after_momentum=wd_after_momentum,
            ),
        )

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            wd, mu, after = group["weight_decay"], group["momentum"], group["wd_after_momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.clone()
                if wd != 0 and not after:
                    g.add_(p, alpha=wd)
                if mu != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        buf = state["momentum_buffer"] = g.clone()
                    else:
                        buf = state["momentum_buffer"].mul_(mu).add_(g, alpha=1 - group["dampening"])
                    g = g.add(buf, alpha=mu) if group["nesterov"] else buf.clone()
                if wd != 0 and after:
                    g.add_(p, alpha=wd)
                p.add_(g, alpha=-group["lr"])


class ApexLAMBReference(torch.optim.Optimizer):
    """Apex's ``multi_tensor_lamb`` written out per tensor in fp32 (tests/test_fused_seeds.py checks it in float64):
    ``c = max(1, ||all g|| / max_grad_norm)``; ``g / c`` (+ ``wd p`` in L2 mode); the moments (``beta3 = 1 - beta1``
    or 1); ``r = (m / bc1) / (sqrt(v / bc2) + eps)`` (+ ``wd p`` decoupled); the trust ratio where ``wd != 0`` or
    ``use_nvlamb``."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        amsgrad=False,
        adam_w_mode=True,
        grad_averaging=True,
        set_grad_none=True,
        max_grad_norm=1.0,
        use_nvlamb=False,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                bias_correction=bias_correction,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                adam_w_mode=adam_w_mode,
                grad_averaging=grad_averaging,
                max_grad_norm=max_grad_norm,
                use_nvlamb=use_nvlamb,
            ),
        )

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        wide = [g if g.dtype == torch.float64 else g.float() for g in grads]  # fp32 (float64 gradients: float64)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in wide]))
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            wd, maxn = group["weight_decay"], group["max_grad_norm"]
            clip = torch.clamp(norm / maxn, min=1.0) if maxn else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                st["step"] += 1
                t = st["step"]
                bc1, bc2 = (1 - beta1**t, 1 - beta2**t) if group["bias_correction"] else (1.0, 1.0)
                g = p.grad / clip
                if wd != 0 and not group["adam_w_mode"]:
                    g = g.add(p, alpha=wd)
                st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1 if group["grad_averaging"] else 1.0)
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                r = (st["exp_avg"] / bc1) / (st["exp_avg_sq"] / bc2).sqrt().add(group["eps"])
                if wd != 0 and group["adam_w_mode"]:
                    r.add_(p, alpha=wd)
                trust = 1.0
                if wd != 0 or group["use_nvlamb"]:
                    pn, rn = p.norm(), r.norm()
                    trust = torch.where((pn > 0) & (rn > 0), pn / rn, 1.0)
                p.add_(r * (trust * -group["lr"]))


def _fused_sgd_reference(params, **kw):
    if kw.get("wd_after_momentum"):
        return ApexSGDReference(params, **kw)
    return torch.optim.SGD(params, foreach=False, **kw)


def _apollo_bytes(shape, bits, kw):
    if len(shape) != 2:
        return 2 * slot_bytes(math.prod(shape), bits)
    apollo = {**lowmemopt.optim.apollo.GROUP_DEFAULTS, "rank": 4, **kw.get("apollo", {})}
    m, n = shape
    low = apollo["rank"] * (m if m >= n else n)  # proj_type "std": the longer side kept
    return 2 * (4 * low if low < 4096 else slot_bytes(low, bits)) + 4  # + the limiter's last norm


def _reference_class(module: str, name: str) -> Callable[[], type]:
    """The reference class ``module.name`` (skips the test where its library is not installed)."""
    return lambda: getattr(pytest.importorskip(module), name)


#: the parameter dtypes torch.optim steps, so every optimizer here steps them too (float64: its math and its
#: full-precision state are float64, and a float64 run equals its reference's to float64 rounding)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def slot_bytes(numel: int, bits: int, block_size: int = 256) -> int:
    """Bytes of one full-size slot of ``numel`` elements (>= min_quant_numel) at ``bits``: 4, 2, 1 + 4/block or
    (4 bits, block 128 by default) 1/2 + 4/128."""
    if bits == 4:
        return (numel + 1) // 2 + 4 * -(-numel // 128)
    return {32: 4 * numel, 16: 2 * numel, 8: numel + 4 * -(-numel // block_size)}[bits]


def factored_bytes(shape: tuple[int, ...], pairs: int) -> int:
    """Bytes of ``pairs`` fp32 (row, column) statistics of a parameter factored over its last two dims."""
    batch = math.prod(shape[:-2])
    return 4 * pairs * batch * (shape[-2] + shape[-1])


@dataclass
class OptimizerInfo:
    name: str
    cls: type
    reference: Callable[..., torch.optim.Optimizer]
    variants: list[dict[str, Any]]  # hyper-parameters; each is checked for 32-bit parity
    slots: Callable[[dict[str, Any]], int] | None  # number of full-size state slots for a variant (None: see below)
    bound8: float  # 8-bit: max relative error of the 50-step trajectory vs the 32-bit twin
    bad_inputs: list[tuple[dict[str, Any], type, str]] = field(default_factory=list)
    grad_scale: float = 1.0
    #: exact state bytes of one large parameter: (shape, bits, kwargs) -> bytes. Default: slots x full-slot bytes.
    state_bytes: Callable[[tuple[int, ...], int, dict[str, Any]], int] | None = None
    #: the reference class (its signature: positional names, order and defaults, keyword-only names accepted)
    reference_cls: Callable[[], type] | None = None
    #: the reference steps complex parameters as their ``torch.view_as_real`` views (torch's Adam, AdamW, SGD)
    complex_as_real: bool = False
    #: the parameter dtypes the common suite steps (every one torch.optim steps; float64 also against the reference)
    dtypes: tuple[torch.dtype, ...] = DTYPES

    def lr_variant(self) -> dict[str, Any]:
        """The first variant that gives a learning rate (Adafactor's relative step takes none)."""
        return next(v for v in self.variants if v.get("lr") is not None)

    def expected_state_bytes(self, shape: tuple[int, ...], bits: int, kwargs: dict[str, Any]) -> int:
        if self.state_bytes is not None:
            return self.state_bytes(tuple(shape), bits, kwargs)
        return self.slots(kwargs) * slot_bytes(math.prod(shape), bits)

    def __repr__(self) -> str:
        return self.name


def _adafactor_bytes(shape, bits, kw):
    first = slot_bytes(math.prod(shape), bits) if kw.get("beta1") is not None else 0
    if len(shape) >= 2:
        return first + factored_bytes(shape, 1)
    return first + slot_bytes(math.prod(shape), bits)


def _came_bytes(shape, bits, kw):
    if len(shape) >= 2:
        return slot_bytes(math.prod(shape), bits) + factored_bytes(shape, 2)
    return 2 * slot_bytes(math.prod(shape), bits)


def _adafactor_torch_bytes(shape, bits, kw):
    return factored_bytes(shape, 1) if len(shape) >= 2 else slot_bytes(math.prod(shape), bits)


_COMMON_BAD = [
    (dict(lr=-1e-3), ValueError, "Invalid learning rate"),
    (dict(lr=torch.tensor(-1e-3)), ValueError, "Invalid learning rate"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element"),  # torch's message
    # torch.optim's implementation keywords (accepted on every optimizer; see LowMemOptimizer's docstring)
    (dict(differentiable=True), ValueError, "differentiable=True is not supported"),
    (dict(differentiable=None), TypeError, "Invalid differentiable"),
    (dict(fused=True, foreach=True), RuntimeError, "`fused` and `foreach` cannot be `True` together"),  # torch's
    (dict(foreach="yes"), TypeError, "Invalid foreach"),
    (dict(fused=1), TypeError, "Invalid fused"),
    (dict(state_bits=7), ValueError, "Invalid state_bits"),
    (dict(state_bits=True), ValueError, "Invalid state_bits"),
    (dict(block_size=100), ValueError, "Invalid block_size"),
    (dict(min_quant_numel=-1), ValueError, "Invalid min_quant_numel"),
    (dict(paged="gpu"), ValueError, "Invalid paged"),
    (dict(paged="disk"), ValueError, "needs offload_dir"),
]
_BAD_BETAS = [
    (dict(betas=(1.0, 0.999)), ValueError, "Invalid beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), ValueError, "Invalid beta parameter at index 1"),
    (dict(betas=(0.9,)), ValueError, "Invalid betas"),
    (dict(betas=(1.0, 0.0)), ValueError, "Invalid beta parameter at index 0: 1.0"),  # torch's
    (dict(betas=(torch.tensor([0.9, 0.9]), torch.tensor(0.999))), ValueError, r"Tensor betas\[0\] must be 1-element"),
    (dict(betas=(torch.tensor(0.9), torch.tensor([1.0]))), ValueError, "Invalid beta parameter at index 1"),
    (dict(betas=(0.9, torch.tensor(0.99))), ValueError, "betas must be either both floats or both Tensors"),  # torch's
    (dict(betas=(torch.tensor(0.9), 0.99)), ValueError, "betas must be either both floats or both Tensors"),
]

OPTIMIZERS: list[OptimizerInfo] = [
    OptimizerInfo(
        "AdamW",
        lowmemopt.AdamW,
        torch.optim.AdamW,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
            dict(lr=1e-2, amsgrad=True, weight_decay=0.05),
            dict(lr=1e-2, maximize=True),
        ],
        slots=lambda kw: 3 if kw.get("amsgrad") else 2,
        bound8=0.03,
        bad_inputs=_COMMON_BAD
        + _BAD_BETAS
        + [
            (dict(eps=-1.0), ValueError, "Invalid epsilon"),
            (dict(weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),  # torch's
        ],
        reference_cls=lambda: torch.optim.AdamW,
        complex_as_real=True,
    ),
    OptimizerInfo(
        "Adam",
        lowmemopt.Adam,
        torch.optim.Adam,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, weight_decay=0.1),
            dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
            dict(lr=1e-2, amsgrad=True),
        ],
        slots=lambda kw: 3 if kw.get("amsgrad") else 2,
        bound8=0.03,
        bad_inputs=_COMMON_BAD + _BAD_BETAS + [(dict(weight_decay=-1), ValueError, "Invalid weight_decay value: -1")],
        reference_cls=lambda: torch.optim.Adam,
        complex_as_real=True,
    ),
    OptimizerInfo(  # bias_correction=False, the DeepSpeed comparison: tests/test_fused_seeds.py
        "FusedAdam",
        lowmemopt.FusedAdam,
        _torch_adam_for("adam_w_mode"),
        [dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False)],
        slots=lambda kw: 3 if kw.get("amsgrad") else 2,
        bound8=0.03,
        bad_inputs=_COMMON_BAD + [(dict(adam_w_mode=1), TypeError, "Invalid adam_w_mode")],
        reference_cls=_reference_class("deepspeed.ops.adam", "FusedAdam"),
    ),
    OptimizerInfo(  # against DeepSpeed's own CPU Adam: tests/test_fused_seeds.py
        "CPUAdam",
        lowmemopt.CPUAdam,
        _torch_adam_for("adamw_mode", ("fp32_optimizer_states",)),
        [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1, adamw_mode=False)],
        slots=lambda kw: 2,
        bound8=0.03,
        bad_inputs=_COMMON_BAD
        + [(dict(fp32_optimizer_states=False, state_bits=8), ValueError, "fp32_optimizer_states=False")],
        reference_cls=_reference_class("deepspeed.ops.adam", "DeepSpeedCPUAdam"),
    ),
    OptimizerInfo(
        "SGD",
        lowmemopt.SGD,
        torch.optim.SGD,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, momentum=0.9),
            dict(lr=1e-2, momentum=0.9, dampening=0.3, weight_decay=0.01),
            dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
            dict(lr=1e-2, momentum=0.9, maximize=True),
        ],
        slots=lambda kw: 1 if kw.get("momentum", 0) else 0,
        bound8=0.01,
        bad_inputs=_COMMON_BAD
        + [
            (dict(momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),  # torch's
            (dict(nesterov=True), ValueError, "Nesterov momentum requires"),
            (dict(weight_decay=torch.tensor([0.1, 0.1])), ValueError, "Tensor weight_decay must be 1-element"),
        ],
        reference_cls=lambda: torch.optim.SGD,
        complex_as_real=True,
    ),
    OptimizerInfo(
        "SignSGD",
        lowmemopt.SignSGD,
        SignSGDReference,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, momentum=0.9, dampening=0.3, weight_decay=0.01),
            dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
            dict(lr=1e-2, momentum=0.9, maximize=True),
        ],
        slots=lambda kw: 1 if kw.get("momentum", 0) else 0,
        bound8=0.025,  # measured 0.0099 (8-bit), 0.0028 (16-bit): a sign flips where the momentum is near 0
        bad_inputs=_COMMON_BAD
        + [
            (dict(momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
            (dict(nesterov=True), ValueError, "Nesterov momentum requires"),
            (dict(dampening=-0.1), ValueError, "Invalid dampening value"),
        ],
        reference_cls=lambda: SignSGDReference,
    ),
    OptimizerInfo(
        "FusedSGD",
        lowmemopt.FusedSGD,
        _fused_sgd_reference,
        [
            dict(lr=1e-2, momentum=0.9, weight_decay=0.01, wd_after_momentum=True),
            dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, wd_after_momentum=True),
            dict(lr=1e-2, momentum=0.9, dampening=0.3, weight_decay=0.01),
        ],
        slots=lambda kw: 1 if kw.get("momentum", 0) else 0,
        bound8=0.01,
        bad_inputs=_COMMON_BAD + [(dict(wd_after_momentum=None), TypeError, "Invalid wd_after_momentum")],
        reference_cls=lambda: _colossalai_module("fused_sgd").FusedSGD,
    ),
    OptimizerInfo(
        "Lion",
        lowmemopt.Lion,
        _lion_reference,
        [
            dict(lr=1e-3),
            dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=0.1),
            dict(lr=1e-3, weight_decay=1e-4, decoupled_weight_decay=True),
        ],
        slots=lambda kw: 1,
        bound8=0.03,
        bad_inputs=_COMMON_BAD + _BAD_BETAS + [(dict(use_triton=None), TypeError, "Invalid use_triton")],
        reference_cls=_reference_class("lion_pytorch", "Lion"),
    ),
    OptimizerInfo(
        "LAMB",
        lowmemopt.LAMB,
        _lamb_reference,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, weight_decay=0.1, bias_correction=True),
            dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, adam=True),
        ],
        slots=lambda kw: 2,
        bound8=0.04,
        bad_inputs=_COMMON_BAD + _BAD_BETAS,
        reference_cls=lambda: _colossalai_module("lamb").Lamb,
    ),
    OptimizerInfo(  # the float64 Apex algorithm, ColossalAI's Lamb, the host-sync check: tests/test_fused_seeds.py
        "FusedLAMB",
        lowmemopt.FusedLAMB,
        ApexLAMBReference,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, weight_decay=0.0, use_nvlamb=True, max_grad_norm=0.5),
            dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False, grad_averaging=False, bias_correction=False),
        ],
        slots=lambda kw: 2,
        bound8=0.04,
        bad_inputs=_COMMON_BAD + _BAD_BETAS + [(dict(max_grad_norm=-1.0), ValueError, "Invalid max_grad_norm")],
        reference_cls=lambda: _colossalai_module("fused_lamb").FusedLAMB,
    ),
    OptimizerInfo(
        "LARS",
        lowmemopt.LARS,
        _lars_reference,
        [
            dict(lr=1e-1),
            dict(lr=1e-1, momentum=0.9),
            dict(lr=1e-1, momentum=0.9, weight_decay=1e-2, eeta=1e-2, epsilon=1e-8),
        ],
        slots=lambda kw: 1 if kw.get("momentum", 0) else 0,
        bound8=0.025,
        bad_inputs=_COMMON_BAD
        + [
            (dict(eeta=0.0), ValueError, "Invalid eeta"),
            (dict(momentum=-1.0), ValueError, "Invalid momentum"),
        ],
        reference_cls=lambda: _colossalai_module("lars").Lars,
    ),
    OptimizerInfo(
        "Adafactor",
        lowmemopt.Adafactor,
        _adafactor_reference,
        [  # every flag combination on 1-D..4-D shapes: tests/test_adafactor.py
            dict(lr=1e-2, relative_step=False, scale_parameter=False),
            dict(),
            dict(beta1=0.9, weight_decay=0.01),
            dict(warmup_init=True, beta1=0.9, clip_threshold=0.5),
            dict(lr=3e-2, relative_step=False, beta1=0.8, weight_decay=0.1, decay_rate=-0.5, eps=(1e-20, 1e-2)),
        ],
        slots=None,
        state_bytes=_adafactor_bytes,
        bound8=0.02,
        bad_inputs=_COMMON_BAD
        + [
            (dict(relative_step=True), ValueError, "Cannot combine manual `lr` and `relative_step=True`"),
            (dict(warmup_init=True), ValueError, "`warmup_init=True` requires `relative_step=True`"),
            (dict(lr=None), ValueError, "`relative_step=False` needs a manual `lr`"),
            (dict(beta1=1.0), ValueError, "Invalid beta1"),
            (dict(decay_rate=0.5), ValueError, "Invalid decay_rate"),
            (dict(eps=(1e-30,)), ValueError, "Invalid eps"),
            (dict(clip_threshold=0.0), ValueError, "Invalid clip_threshold"),
            (dict(weight_decay=-0.1), ValueError, "Invalid weight_decay"),
        ],
        reference_cls=_reference_class("transformers.optimization", "Adafactor"),
    ),
    OptimizerInfo(
        "AdafactorTorch",
        lowmemopt.AdafactorTorch,
        torch.optim.Adafactor,
        [
            dict(lr=1e-2),
            dict(lr=3e-2, weight_decay=0.1, beta2_decay=-0.5, d=2.0),
            dict(lr=1e-2, eps=(1e-3, 1e-2), maximize=True),
        ],
        slots=None,
        state_bytes=_adafactor_torch_bytes,
        bound8=0.008,
        bad_inputs=_COMMON_BAD
        + [
            (dict(beta2_decay=0.5), ValueError, "Invalid beta2_decay"),
            (dict(d=0.5), ValueError, "Invalid d"),
            (dict(eps=(-1.0, 1e-3)), ValueError, "Invalid eps"),
            # torch's messages (common_optimizers.optim_error_inputs_func_adafactor)
            (dict(eps=(-1e-30, 1e-3)), ValueError, "epsilon1 should be >= 0"),
            (dict(d=0.0), ValueError, "Clipping threshold d should be >= 1"),
            (dict(beta2_decay=0.8), ValueError, "beta2_decay should be <= 0"),
            (dict(capturable=True), ValueError, "does not support capturable=True"),
        ],
        reference_cls=lambda: torch.optim.Adafactor,
    ),
    OptimizerInfo(  # GaLore projection itself (param groups with rank): tests/test_galore.py
        "GaLoreAdamW",
        lowmemopt.GaLoreAdamW,
        _galore_adamw_reference,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1),
            dict(lr=1e-2, weight_decay=0.05, correct_bias=False),
        ],
        slots=lambda kw: 2,
        bound8=0.03,
        bad_inputs=_COMMON_BAD + _BAD_BETAS + [(dict(eps=-1.0), ValueError, "Invalid epsilon")],
        reference_cls=_reference_class("galore_torch", "GaLoreAdamW"),
    ),
    OptimizerInfo(
        "GaLoreAdafactor",
        lowmemopt.GaLoreAdafactor,
        _galore_adafactor_reference,
        [dict(), dict(lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.1)],
        slots=None,
        state_bytes=_adafactor_bytes,
        bound8=0.02,
        bad_inputs=_COMMON_BAD,
        reference_cls=_reference_class("galore_torch", "GaLoreAdafactor"),
    ),
    OptimizerInfo(
        "CAME",
        lowmemopt.CAME,
        _came_reference,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99, 0.999)),
            dict(lr=3e-2, clip_threshold=0.5, eps=(1e-20, 1e-10)),
        ],
        slots=None,
        state_bytes=_came_bytes,
        bound8=0.01,
        bad_inputs=_COMMON_BAD
        + [
            (dict(lr=None), TypeError, "CAME: lr is required"),
            (dict(betas=(0.9, 0.999)), ValueError, "Invalid betas"),
            (dict(betas=(0.9, 1.0, 0.9999)), ValueError, "Invalid beta parameter at index 1"),
            (dict(eps=(1e-30, -1.0)), ValueError, "Invalid eps"),
            (dict(clip_threshold=-1.0), ValueError, "Invalid clip_threshold"),
            (
                dict(betas=(torch.tensor(0.9), torch.tensor([0.9, 0.9]), torch.tensor(0.9))),
                ValueError,
                r"Tensor betas\[1\] must be 1-element",
            ),
            (dict(betas=(0.9, torch.tensor(0.9), 0.9)), ValueError, "betas must be either all floats or all Tensors"),
        ],
        reference_cls=_reference_class("came_pytorch", "CAME"),
    ),
    OptimizerInfo(  # 2-D tensors in Muon groups, the rest AdamW (SuiteMuon); batching, FSDP2: tests/test_muon.py
        "Muon",
        SuiteMuon,
        MuonReference,
        [
            dict(lr=0.02),
            dict(lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"),
            dict(
                lr=0.01,
                ns_steps=3,
                ns_coefficients=(2.0, -1.5, 0.5),
                adjust_lr_fn="original",
                adamw_lr=3e-3,
                adamw_betas=(0.8, 0.99),
                adamw_eps=1e-8,
                adamw_weight_decay=0.0,
            ),
        ],
        slots=None,
        state_bytes=lambda shape, bits, kw: (1 if len(shape) == 2 else 2) * slot_bytes(math.prod(shape), bits),
        bound8=0.025,  # measured 0.0106 (8-bit), 0.0017 (16-bit)
        bad_inputs=_COMMON_BAD
        + [
            (dict(momentum=-0.5), ValueError, "Invalid momentum"),
            (dict(weight_decay=-0.1), ValueError, "Invalid weight_decay"),
            (dict(adjust_lr_fn="rms"), ValueError, "Adjust learning rate function rms is not supported"),
            (dict(ns_steps=100), ValueError, "Invalid ns_steps"),
            (dict(ns_coefficients=(3.0, -4.0)), ValueError, "Invalid ns_coefficients"),
            (dict(nesterov=1), TypeError, "Invalid nesterov"),
            (dict(adamw_betas=(1.0, 0.9)), ValueError, "Invalid beta parameter at index 0"),
            (dict(adamw_eps=-1.0), ValueError, "Invalid adamw_eps"),
        ],
        reference_cls=lambda: torch.optim.Muon,
    ),
    OptimizerInfo(  # 2-D tensors projected (SuiteAPOLLO, rank 4 unless ``apollo=``); more: tests/test_apollo.py
        "APOLLOAdamW",
        SuiteAPOLLO,
        apollo_reference,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, weight_decay=0.1, scale_front=True, apollo=dict(rank=1, scale_type="tensor", scale=128.0)),
            dict(lr=1e-2, disable_nl=True, correct_bias=False, apollo=dict(rank=3, proj="svd", update_proj_gap=5)),
            dict(lr=1e-2, eps=1e-8, apollo=dict(rank=4, proj_type="left", scale_type="tensor", update_proj_gap=3)),
        ],
        slots=None,
        state_bytes=_apollo_bytes,
        bound8=0.025,  # measured 0.0108 (8-bit), 0.0017 (16-bit); rank 64 (quantized low-rank moments): 0.0078
        bad_inputs=_COMMON_BAD
        + _BAD_BETAS
        + [
            (dict(eps=-1.0), ValueError, "Invalid epsilon"),
            (dict(scale_front=1), TypeError, "Invalid scale_front"),
        ],
        reference_cls=_reference_class("apollo_torch", "APOLLOAdamW"),
    ),
]


class _AdEMAMixFloat64(torch.optim.Optimizer):
    """AdEMAMix as bitsandbytes' 32-bit step writes it (its schedules and its decoupled decay before the update), in
    the parameter's dtype: the float64 reference. bitsandbytes keeps fp32 state for a float64 parameter, so its run
    is not a float64 one (``test_parity_float64``); its fp32 run is the reference at every other dtype."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        t_alpha=None,
        t_beta3=None,
        eps=1e-8,
        weight_decay=1e-2,
    ):
        super().__init__(
            params,
            dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps, weight_decay=weight_decay),
        )

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2, b3), alpha, lr = group["betas"], group["alpha"], group["lr"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=0, m1=torch.zeros_like(p), m2=torch.zeros_like(p), nu=torch.zeros_like(p))
                st["step"] += 1
                t = st["step"]
                alpha_t = min(t * alpha / group["t_alpha"], alpha) if group["t_alpha"] else alpha
                beta3_t = b3
                if group["t_beta3"]:
                    s_ = t / group["t_beta3"]
                    ln1, ln3 = math.log(b1), math.log(b3)
                    beta3_t = min(math.exp(ln1 * ln3 / ((1 - s_) * ln3 + s_ * ln1)), b3)
                g = p.grad
                st["m1"].mul_(b1).add_(g, alpha=1 - b1)
                st["m2"].mul_(beta3_t).add_(g, alpha=1 - beta3_t)
                st["nu"].mul_(b2).addcmul_(g, g, value=1 - b2)
                p.mul_(1 - lr * group["weight_decay"])
                denom = st["nu"].sqrt() / math.sqrt(1 - b2**t) + group["eps"]
                p.add_((st["m1"] / (1 - b1**t) + alpha_t * st["m2"]) / denom, alpha=-lr)


def _ademamix_reference(params, **kw):
    params = list(params)
    if params and params[0].dtype == torch.float64:
        return _AdEMAMixFloat64(params, **kw)
    bnb_optim = pytest.importorskip("bitsandbytes.optim")
    return bnb_optim.AdEMAMix(params, **kw)


OPTIMIZERS.append(
    OptimizerInfo(
        "AdEMAMix",
        lowmemopt.AdEMAMix,
        _ademamix_reference,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, betas=(0.8, 0.99, 0.6), alpha=2.0, eps=1e-6, weight_decay=0.1),  # (a slow EMA that moves)
            dict(lr=1e-2, t_alpha=4, t_beta3=3, weight_decay=0.0),
        ],
        slots=lambda kw: 3,
        bound8=0.03,
        bad_inputs=_COMMON_BAD
        + [
            (dict(betas=(0.9, 0.999)), ValueError, "Invalid betas"),
            (dict(betas=(0.9, 0.999, 1.0)), ValueError, "Invalid beta parameter at index 2"),
            (dict(eps=-1.0), ValueError, "Invalid epsilon"),
            (dict(weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),
            (dict(alpha=-1.0), ValueError, "Invalid alpha"),
            (dict(t_alpha=-5), ValueError, "Invalid t_alpha"),
            (dict(t_beta3=2.5), TypeError, "Invalid t_beta3"),
            (dict(betas=(0.0, 0.999, 0.9999), t_beta3=10), ValueError, "beta3 warm-up"),
            (dict(optim_bits=8, state_bits=4), ValueError, "optim_bits=8 and state_bits=4 disagree"),
        ],
        reference_cls=_reference_class("bitsandbytes.optim", "AdEMAMix"),
    )
)


def _adam_mini_reference(params, **kw):
    """adam-mini's Adam_mini on the table's unnamed tensors, named so that none matches a name rule: one block per
    tensor in both (the name rules and every block kind: tests/test_adam_mini.py)."""
    adam_mini = pytest.importorskip("adam_mini")
    return adam_mini.Adam_mini([(f"t{i}", p) for i, p in enumerate(params)], verbose=False, **kw)


OPTIMIZERS.append(
    OptimizerInfo(
        "AdamMini",
        lowmemopt.AdamMini,
        _adam_mini_reference,
        [
            dict(lr=1e-2),
            dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        ],
        slots=None,
        state_bytes=lambda shape, bits, kw: slot_bytes(math.prod(shape), bits) + 4,  # m, and one fp32 v per tensor
        bound8=0.03,
        bad_inputs=_COMMON_BAD
        + _BAD_BETAS
        + [
            (dict(eps=-1.0), ValueError, "Invalid epsilon"),
            (dict(weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),
            (dict(dim=0), ValueError, "Invalid dim value"),
            (dict(n_heads=32, n_kv_heads=5), ValueError, "Invalid n_kv_heads value"),
            (dict(dim=10, n_heads=3), ValueError, "is not a whole number"),
        ],
        reference_cls=_reference_class("adam_mini", "Adam_mini"),
    )
)

#: the variant each optimizer uses in the storage-format tests (resume, 8-bit bounds): one with state slots.
STATEFUL = {
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "Adam": dict(lr=1e-2, amsgrad=True),
    "FusedAdam": dict(lr=1e-2, weight_decay=0.1, bias_correction=False, betas=(0.9, 0.99)),  # |update| <= lr
    "CPUAdam": dict(lr=1e-2, weight_decay=0.1),
    "SGD": dict(lr=1e-2, momentum=0.9, nesterov=True),
    "SignSGD": dict(lr=1e-2, momentum=0.9, nesterov=True),
    "FusedSGD": dict(lr=1e-2, momentum=0.9, weight_decay=0.01, wd_after_momentum=True),
    "Lion": dict(lr=1e-3, weight_decay=0.1),
    "LAMB": dict(lr=1e-2, weight_decay=0.01, bias_correction=True),
    "FusedLAMB": dict(lr=1e-2, weight_decay=0.01),
    "LARS": dict(lr=1e-1, momentum=0.9, weight_decay=1e-3, eeta=1e-2),
    "Adafactor": dict(beta1=0.9, weight_decay=0.01),
    "AdafactorTorch": dict(lr=1e-2, weight_decay=0.01),
    "CAME": dict(lr=1e-2, weight_decay=0.01),
    "GaLoreAdamW": dict(lr=1e-2, weight_decay=0.1),
    "GaLoreAdafactor": dict(beta1=0.9, weight_decay=0.01),
    "Muon": dict(lr=0.02, weight_decay=0.1),
    "APOLLOAdamW": dict(lr=1e-2, weight_decay=0.1),
}
STATEFUL["AdEMAMix"] = dict(lr=1e-3, weight_decay=0.1, t_alpha=5, t_beta3=5)  # (bitsandbytes' default lr)
STATEFUL["AdamMini"] = dict(lr=1e-2, weight_decay=0.1)

BY_NAME = {info.name: info for info in OPTIMIZERS}

#: odd shapes: 1-D, 2-D, 3-D; sizes not multiples of the block size; two of them above min_quant_numel (4096).
SHAPES = [(300,), (37, 53), (5, 7, 129), (70, 91)]
