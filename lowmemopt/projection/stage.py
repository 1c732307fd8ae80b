"""GaLore as the pipeline's projection stage: :class:`GaLoreStage` implements
:class:`lowmemopt.pipeline.plan.ProjectionStage` with the functions of :mod:`.checks`, :mod:`.state`,
:mod:`.gather`, :mod:`.refresh`, :mod:`.update`, :mod:`.batched` and :mod:`.apply`. How a projected step runs and why:
docs/galore.md."""

from __future__ import annotations

from typing import Any

import torch

from ..pipeline.plan import Plan
from .apply import finish
from .batched import finish_many, give_back, project_gradients, stand_ins
from .checks import check_group, check_group_values, check_low_rank_state, group_values_valid
from .gather import gather, regather
from .refresh import refresh_due
from .state import init_projected_state, projected_slots
from .update import (
    device_may_check,
    native_takes_stand_in,
    param_free,
    runs_on_stand_in,
    takes_fused,
    update_per_tensor,
    weight_statistics,
)

__all__ = ["GaLoreStage", "GALORE"]


class GaLoreStage:
    """The projection stage (:class:`~lowmemopt.pipeline.plan.ProjectionStage`; its docstrings say what each
    operation does), plus what the optimizer asks of a GaLore group: :meth:`check_group`, :meth:`projected_slots`
    and :meth:`init_projected_state`. Holds nothing: one instance (:data:`GALORE`) serves every optimizer."""

    check_group_values = staticmethod(check_group_values)
    group_values_valid = staticmethod(group_values_valid)
    check_low_rank_state = staticmethod(check_low_rank_state)
    takes_fused = staticmethod(takes_fused)
    device_may_check = staticmethod(device_may_check)
    gather = staticmethod(gather)
    regather = staticmethod(regather)
    refresh_due = staticmethod(refresh_due)
    project_gradients = staticmethod(project_gradients)
    runs_on_stand_in = staticmethod(runs_on_stand_in)
    make_stand_ins = staticmethod(stand_ins)
    weight_statistics = staticmethod(weight_statistics)
    update_per_tensor = staticmethod(update_per_tensor)
    apply_back = staticmethod(finish_many)
    release_buffers = staticmethod(give_back)

    check_group = staticmethod(check_group)
    projected_slots = staticmethod(projected_slots)
    init_projected_state = staticmethod(init_projected_state)

    def step_one(self, plan: Plan, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """One GaLore step of ``p``, alone: the stages for one item, the update through the per-tensor backends
        (:meth:`update_per_tensor`). Called by :func:`lowmemopt.pipeline.step_param`."""
        it = self.gather(plan, p, grad, group)
        if it is None:
            return
        self.project_gradients([it])
        if self.runs_on_stand_in(plan, it) and (param_free(plan) or native_takes_stand_in(plan, it)):
            self.make_stand_ins([it])
            self.weight_statistics(plan, [it])
        if self.update_per_tensor(plan, it):
            finish(plan, it)


#: the stage every optimizer's plan holds where a param group may be projected
GALORE = GaLoreStage()
