"""The keys a param group may hold, and the check that refuses the others (a typo such as ``state_bit`` would
otherwise silently give 32-bit state): the optimizer's own, GaLore's, :data:`ALLOWED_GROUP_KEYS` (other libraries'),
and :func:`allow_group_keys`. The rule: docs/torch_optim.md#what-differs-and-why.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable

from .projection.checks import GROUP_DEFAULTS

__all__ = [
    "ALLOWED_GROUP_KEYS",
    "allow_group_keys",
    "known_group_keys",
    "check_group_keys",
    "GroupKeyWatch",
    "known_keys_of",
    "check_new_group",
    "group_keys_pre_hook",
    "group_keys_loaded",
]

#: keys other libraries put in param groups (docs/torch_optim.md); :func:`allow_group_keys` adds to it
ALLOWED_GROUP_KEYS: set[str] = {
    "param_names",
    "foreach",
    "fused",
    "differentiable",  # torch.optim
    "initial_lr",
    "max_lr",
    "min_lr",
    "base_momentum",
    "max_momentum",
    "swa_lr",  # torch.optim.lr_scheduler, swa_utils
    "name",
    "moe",  # a group's label (PyTorch Lightning, DeepSpeed's MoE groups)
    "lr_scale",  # timm's layer-wise lr decay groups (its schedulers read it)
}
#: keys every lowmemopt param group may hold besides its optimizer's defaults: ``params`` and GaLore's
BASE_GROUP_KEYS = frozenset({"params", "rank", *GROUP_DEFAULTS})


def allow_group_keys(*keys: str) -> None:
    """Allow ``keys`` in every lowmemopt optimizer's param groups: ``allow_group_keys("my_tag")``."""
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"allow_group_keys: a param group key is a str, got {type(key).__name__} {key!r}")
    ALLOWED_GROUP_KEYS.update(keys)


def known_group_keys(defaults: Iterable[str], extra: Iterable[str] = ()) -> set[str]:
    """The keys a param group of an optimizer with ``defaults`` (and its class's ``extra`` keys) may hold."""
    return set(defaults) | BASE_GROUP_KEYS | set(extra) | ALLOWED_GROUP_KEYS


def check_group_keys(keys: Iterable[Any], known: set[str], owner: str) -> None:
    """Raise ValueError for the first of ``keys`` not in ``known``, naming the closest known key."""
    for key in keys:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
        hint = (
            f"did you mean {close[0]!r}?"
            if close
            else f"{owner}'s param groups take {', '.join(sorted(known - ALLOWED_GROUP_KEYS))}."
        )
        raise ValueError(
            f"{owner}: unknown param group key {key!r}: {hint} If another library puts {key!r} in param "
            f"groups, allow it with lowmemopt.allow_group_keys({key!r})"
        )


class GroupKeyWatch:
    """The key sets of an optimizer's groups as last checked, so a step rechecks only on change."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.seen = [frozenset(group) for group in groups]
        self.total = sum(map(len, groups))

    def add(self, group: dict[str, Any]) -> None:
        """A group checked as it was added (``add_param_group``)."""
        self.seen.append(frozenset(group))
        self.total += len(group)

    def check(self, groups: list[dict[str, Any]], known: Any, owner: str) -> None:
        """Check the keys groups gained since they were seen; ``known`` is called only when something changed."""
        seen = self.seen
        if len(seen) == len(groups) and sum(map(len, groups)) == self.total:  # (200 groups: ~5 us)
            return
        keys = known()
        for i, group in enumerate(groups):
            old = seen[i] if i < len(seen) else frozenset()
            check_group_keys((k for k in group if k not in old), keys, owner)
        self.__init__(groups)


def known_keys_of(optimizer: Any) -> set[str]:
    """The keys ``optimizer``'s param groups may hold."""
    return known_group_keys(optimizer.defaults, getattr(type(optimizer), "_extra_group_keys", ()))


def check_new_group(optimizer: Any, group: dict[str, Any]) -> None:
    """Check a group being added to ``optimizer`` (raise ValueError for an unknown key)."""
    check_group_keys(group, known_keys_of(optimizer), type(optimizer).__name__)


def group_keys_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Before each ``step()``: check the keys added to a group since it was checked."""
    optimizer._group_keys.check(optimizer.param_groups, lambda: known_keys_of(optimizer), type(optimizer).__name__)


def group_keys_loaded(optimizer: Any) -> None:
    """After ``load_state_dict``: the loaded groups' keys are taken as they are (another library's state dict)."""
    optimizer._group_keys = GroupKeyWatch(optimizer.param_groups)
