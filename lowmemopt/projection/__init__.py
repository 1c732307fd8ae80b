"""GaLore: optimization in a low-rank projection of each weight matrix's gradient, for every lowmemopt optimizer.

A param group with ``rank`` is projected by the pipeline's projection stage, :class:`.stage.GaLoreStage`: the
optimizer's own algorithm runs on the projected gradient with state shaped for it, so 16/8-bit state applies to it as
to any state. The stage's parts: :mod:`.checks` (group keys, state fits), :mod:`.state` (low-rank slots, first state),
:mod:`.gather`, :mod:`.refresh` (basis refresh), :mod:`.update` (stand-in or reference core), :mod:`.batched` and
:mod:`.apply` (project back, apply). :mod:`.projector` holds the projection, the stored side and the refresh schedule;
:mod:`.basis` the exact and randomized SVD; :mod:`.groups` the helper that builds the param groups from a model. How a
projected step runs, and why: docs/galore.md.
"""

from .basis import captured_energy, principal_angles, randomized_svd_basis, svd_basis
from .groups import galore_param_groups

__all__ = ["galore_param_groups", "svd_basis", "randomized_svd_basis", "principal_angles", "captured_energy"]
