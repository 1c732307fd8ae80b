"""A steady step, resolved once and launched step after step: :class:`StepProgram` keeps the buckets, their launch
tables and the non-finite check's tables, and checks at each step that they still apply (identity and value
comparisons only). What it covers, checks and rebuilds on:
``docs/pipeline.md#steady-steps-a-kept-program-nothing-read-back``.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Any, Sequence

import torch

from ..work.items import Item, Update
from ..work.record import group_values
from .finite import PendingSkip
from .per_param import step_param
from .plan import Plan

__all__ = ["StepProgram", "Kept", "StateDict", "update_for"]

_is = operator.is_
_data_ptr = torch.Tensor.data_ptr
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")


@dataclass
class Kept:
    """What a step the kernels took whole leaves for a program (:func:`lowmemopt.pipeline.step_buckets`): its
    buckets, and the GaLore items among their members (their stand-ins, products and apply are made at every step)."""

    planned: list = field(default_factory=list)
    projected: list[Item] = field(default_factory=list)


class StateDict(defaultdict):
    """An optimizer's ``state`` (``defaultdict(dict)``) that counts parameter state dicts set, replaced or removed
    (:attr:`version`), so a program sees such a change with one comparison.
    """

    version = 0

    def __setitem__(self, key: Any, value: Any) -> None:
        self.version += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.version += 1
        super().__delitem__(key)

    def _changed(name: str):  # noqa: N805 (builds the methods below)
        def method(self, *args, **kwargs):
            self.version += 1
            return getattr(defaultdict, name)(self, *args, **kwargs)

        method.__name__ = name
        return method

    pop = _changed("pop")
    popitem = _changed("popitem")
    clear = _changed("clear")
    update = _changed("update")
    setdefault = _changed("setdefault")
    __ior__ = _changed("__ior__")
    del _changed


def update_for(plan: Plan, name: str, it: Item, step: Any, device_steps: bool = False) -> Update:
    """The hyper-parameters of ``it``'s bucket for the step it takes (``step``: an int; a capturable step's fp64
    steps on the device, and its ``lr`` read there)."""
    algorithm, record = plan.algorithm, it.record
    hyper = record.hyper  # (a live view of the group: a scheduler's lr of this step)
    if device_steps:
        from ..work import capture

        hyper = dict(hyper, lr=capture.device_value(hyper["lr"], it.target.device))
    decay = 1.0 if it.projected else algorithm.decay_factor(hyper)
    return Update(
        name,
        algorithm.math_kwargs(hyper, step),
        record,
        decay,
        0 if device_steps else step,
        record.block_size,
        step if device_steps else None,
    )


class StepProgram:
    """The buckets of a step of ``work`` as a step the kernels took whole planned them; what :meth:`matches` checks:
    docs/pipeline.md ("Steady steps").
    """

    def __init__(self, plan: Plan, work: Sequence[tuple[torch.Tensor, dict]], kept: Kept) -> None:
        from ..kernels.check import GradCheck

        self.name = plan.kernels.name  # (a program's step took the kernels)
        self.state = plan.state
        self.version = getattr(plan.state, "version", None)
        self.params = [p for p, _ in work]
        self.param_ptrs = list(map(_data_ptr, self.params))  # (a parameter whose .data was replaced moved)
        self.param_dtypes = list(map(_dtype, self.params))
        self.param_shapes = list(map(_shape, self.params))  # (``p.data = p.data[:n]`` keeps its address)
        self.groups = [g for _, g in work]
        self.group_list = list({id(g): g for g in self.groups}.values())
        self.values = [group_values(g) for g in self.group_list]
        # the buckets in the order of their gradients' dtype (the full-size gradient's, for a GaLore item): the check
        # launches once per run of one dtype
        self.planned = sorted(kept.planned, key=lambda pl: str(pl.members[0].param.grad.dtype))
        position = {id(p): i for i, p in enumerate(self.params)}
        order = [position[id(it.param)] for pl in self.planned for it in pl.members]
        if sorted(order) != list(range(len(self.params))):
            raise ValueError("a step program must cover every parameter of its step once")
        self._pick = operator.itemgetter(*order) if len(order) > 1 else (lambda seq: (seq[order[0]],))
        self.ranges: list[range] = []
        self.states: list[list[dict]] = []
        self.getters = []
        self.kept: list[list[torch.Tensor]] = []
        row = 0
        for pl in self.planned:
            members = pl.members
            pl.flag_rows = range(row, row + len(members))
            for k, it in enumerate(members):
                it.flag = row + k
            row += len(members)
            states = [it.state for it in members]
            keys = sorted(k for k, v in states[0].items() if isinstance(v, torch.Tensor))
            if any(sorted(k for k, v in st.items() if isinstance(v, torch.Tensor)) != keys for st in states):
                raise ValueError("the members of a bucket hold different state keys")
            getter = (
                operator.itemgetter(*keys)
                if len(keys) > 1
                else (lambda st, k=keys[0]: (st[k],))
                if keys
                else (lambda st: ())
            )
            self.ranges.append(pl.flag_rows)
            self.states.append(states)
            self.getters.append(getter)
            self.kept.append(list(chain.from_iterable(map(getter, states))))
        self.check = GradCheck(self._pick([p.grad for p in self.params]))
        # GaLore: the projected items (their rows in the program's order), gathered, projected and finished anew
        self.galore = plan.galore
        self.projected = [it for pl in self.planned for it in pl.members if it.projected]
        self.projected_rows = [it.flag for it in self.projected]
        self.projected_states = [it.state for it in self.projected]
        self.layouts: list[Any] = [None, None, None]  # GaLore's project, stand-in and finish layouts (kept)
        self._bases: tuple[int, int] | None = None  # the last step's stand-in and low-rank gradient buffers
        self._given_back = False  # the kept layouts' buffers were given back after a step (:func:`give_back`)

    def matches(
        self, state: Any, params: Sequence[torch.Tensor], groups: Sequence[dict], grads: Sequence[torch.Tensor]
    ) -> bool:
        """Does this program step ``params`` (with gradients ``grads``, in order) of ``groups`` (their param groups),
        with the optimizer's ``state``, as it stands (module docstring)? Identity and value comparisons only."""
        if (
            state is not self.state
            or self.version is None
            or state.version != self.version
            or len(params) != len(self.params)
        ):
            return False
        if not (all(map(_is, params, self.params)) and all(map(_is, groups, self.groups))):
            return False
        if (
            list(map(_data_ptr, params)) != self.param_ptrs
            or list(map(_dtype, params)) != self.param_dtypes
            or list(map(_shape, params)) != self.param_shapes
        ):
            return False  # (p.data replaced: the kept tables hold the old storage's address and size)
        if list(map(_shape, grads)) != self.param_shapes:  # (step() refused a gradient of another dtype)
            return False  # (a gradient's .data replaced: the step's fit check refuses it)
        if not self._groups_match():
            return False
        step_of = operator.itemgetter("step")
        try:
            for pl, states, getter, kept in zip(self.planned, self.states, self.getters, self.kept):
                steps = list(map(step_of, states))
                if steps.count(pl.step) != len(steps) or not all(
                    map(_is, chain.from_iterable(map(getter, states)), kept)
                ):
                    return False
        except KeyError:  # (a state dict emptied: a skipped first step undone)
            return False
        if self.projected and self.galore.refresh_due(self.projected_states):  # (the SVD reads the gradient)
            return False
        return all(map(torch.Tensor.is_contiguous, grads))

    def _groups_match(self) -> bool:
        """Are the param groups' values those the buckets were made for, or changed only in numbers that leave the
        groups of each bucket equal (they reach the kernels as arguments)?"""
        values = [group_values(g) for g in self.group_list]
        if values == self.values:
            return True
        for old, new in zip(self.values, values):
            if len(old) != len(new) or not all(map(_same_kind, old, new)):
                return False
        # the groups that shared a bucket (equal values) must still be equal, and no others newly so
        if _partition(values) != _partition(self.values):
            return False
        if self.galore is not None and not all(
            self.galore.group_values_valid(g) for g in self.group_list if g.get("rank") is not None
        ):
            return False  # (a GaLore scale made 0 or NaN: the checked step says what is wrong)
        self.values = values
        return True

    def step(self, plan: Plan, grads: Sequence[torch.Tensor]) -> PendingSkip:
        """Launch one step with ``grads`` (:meth:`matches` said yes): the check, every bucket, the step counts;
        returns the skips to settle at the next step. Reads nothing back.
        """
        from ..kernels.dispatch import launch_buckets

        grads = self._pick(grads)
        ptrs = list(map(_data_ptr, grads))
        n = len(grads)
        if plan.found_inf is not None:  # the scaler checked every gradient: its one flag for all
            found = plan.found_inf.to(grads[0].device, non_blocking=True)
            flags = (found.reshape(1) == 0).view(torch.uint8).expand(n)
        else:
            flags = self.check.flags(grads, ptrs)
        galore = self.galore
        layouts = self.layouts
        if self.projected:  # this step's low-rank gradients and stand-ins (new tensors, in buffers of one layout)
            galore.regather(plan, self.projected, [grads[r] for r in self.projected_rows])
            layouts[0] = galore.project_gradients(self.projected, layouts[0])
            layouts[1] = galore.make_stand_ins(self.projected, layouts[1])
            galore.weight_statistics(plan, self.projected)
        moved = self._moved(layouts)
        for pl, rows in zip(self.planned, self.ranges):
            members = pl.members
            if not members[0].projected:
                pl.bucket.set_grads(grads[rows.start : rows.stop], ptrs[rows.start : rows.stop])
            elif moved is None:  # (the first time; or buffers of several dtypes, given back after each step)
                (pl.bucket.reset_tensors if self._given_back else pl.bucket.set_tensors)(
                    [it.target for it in members], [it.grad for it in members]
                )
            else:  # carved from buffers of the kept layouts: the tables move with them
                pl.bucket.move_tensors([it.target for it in members], [it.grad for it in members], *moved)
        mult = None if plan.grad_mult is None else plan.mult
        name = self.name
        left = launch_buckets(self.planned, partial(update_for, plan, name), flags, False, mult)
        launched = self.planned
        if left:  # the kernels were turned off by a failure that wrote nothing: the rest takes the per-tensor path
            launched = self._step_left(plan, left, flags)
        if self.projected and launched is self.planned:
            layouts[2] = galore.apply_back(plan, self.projected, flags, layouts[2], layouts[0], layouts[1])
        elif self.projected:
            finished = {id(it) for pl in launched for it in pl.members}
            galore.apply_back(plan, [it for it in self.projected if id(it) in finished], flags)
        if self.projected:  # (the low-rank gradients and stand-ins: memory only while the step runs)
            galore.release_buffers(layouts[0], layouts[1])
            self._given_back = True
        if plan.found_inf is not None:  # one flag: the whole step
            return PendingSkip(flags[:1], lambda rows: self._undo(range(n), launched))
        return PendingSkip(flags, lambda rows: self._undo(rows, launched), counted=True)

    def _step_left(self, plan: Plan, left: list[Item], flags: torch.Tensor) -> list:
        """Step the items no kernel took (their buckets' launches failed before writing anything) through the
        per-tensor backends, which need the flags on the host (a synchronization); returns the buckets launched."""
        ok = flags.tolist()
        for it in left:
            if ok[it.flag]:
                step_param(plan, it.param, it.param.grad, it.group)
        done = {id(it) for it in left}
        return [pl for pl in self.planned if id(pl.members[0]) not in done]

    def _moved(self, layouts: list) -> tuple[int, int] | None:
        """How far this step's GaLore buffers lie from the last step's (bytes: targets, gradients); None at first."""
        if not self.projected or len(layouts[1].bases) != 1:
            return None
        now = (layouts[1].bases[0], layouts[0].base)
        before, self._bases = self._bases, now
        return None if before is None else (now[0] - before[0], now[1] - before[1])

    def _undo(self, rows: Sequence[int], launched: list) -> None:
        """The skipped rows' step counts back to what they were (their kernels wrote nothing); rows of buckets
        that were not launched stay (the per-tensor path stepped only their finite ones)."""
        for pl, states, rng in zip(self.planned, self.states, self.ranges):
            if not any(pl is x for x in launched):
                continue
            for r in rows:
                if r in rng:
                    states[r - rng.start]["step"] = pl.step - 1


def _same_kind(old: Any, new: Any) -> bool:
    """May a group value change from ``old`` to ``new`` keeping the buckets (a float for a float, a tuple of floats
    of one length: the kernels read them at every launch)? Anything else is a structural change.
    """
    if old == new or (_is_float(old) and _is_float(new)):
        return True
    if (
        type(old) is tuple
        and type(new) is tuple
        and len(old) == len(new)
        and old
        and old[0] == new[0]
        and old[0] in ("tuple", "list")
    ):
        return all(map(_same_kind, old[1:], new[1:]))
    return False


def _is_float(v: Any) -> bool:
    """A float as :func:`group_values` holds it: itself, or ``("float", hex)`` for 0.0, -0.0 and NaN."""
    return type(v) is float or (type(v) is tuple and len(v) == 2 and v[0] == "float")


def _partition(values: list[tuple]) -> list[int]:
    """Which groups have equal values: each group's number, the first group with its values."""
    first: dict[tuple, int] = {}
    return [first.setdefault(v, i) for i, v in enumerate(values)]
