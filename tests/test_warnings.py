"""User-facing warnings point at the user's line (here: this file), not at torch's wrappers or lowmemopt's insides."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import make_params, set_grads

import lowmemopt
from lowmemopt._stacklevel import external_stacklevel, internal_prefixes


def _caught(record: list[warnings.WarningMessage], text: str) -> warnings.WarningMessage:
    (w,) = [w for w in record if text in str(w.message)]
    return w


def _here() -> int:
    """The line number of the caller's next line."""
    return sys._getframe(1).f_lineno + 1


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(state_bits=8), dict(state_bits=8, paged="cpu"), dict(state_bits=8, rank=8)],
    ids=["fp32", "q8", "paged", "galore"],
)
def test_nonfinite_skip_warning_points_at_the_step_call(kwargs):
    params = make_params([(80, 64), (64,)])
    rank = kwargs.pop("rank", None)
    groups = [{"params": params[:1], **({"rank": rank} if rank else {})}, {"params": params[1:]}]
    opt = lowmemopt.AdamW(groups, lr=1e-3, **kwargs)
    set_grads(params, 0)
    params[0].grad[1, 2] = float("nan")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _here()
        opt.step()
    w = _caught(record, "NaN/Inf")
    assert (w.filename, w.lineno) == (__file__, line)
    assert opt.nonfinite_skips == 1


def test_step_in_backward_warnings_point_at_the_users_lines():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _here()
        lowmemopt.step_in_backward(model, lowmemopt.AdamW(model[0].parameters())).remove()
    w = _caught(record, "not in the optimizer")
    assert (w.filename, w.lineno) == (__file__, line)

    opt = lowmemopt.AdamW(model.parameters(), lr=1e-2)
    lowmemopt.step_in_backward(model, opt)
    model[2].weight.register_hook(lambda g: g * float("nan"))
    loss = model(torch.randn(3, 8)).pow(2).sum()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _here()
        loss.backward()
    w = _caught(record, "NaN/Inf")
    assert (w.filename, w.lineno) == (__file__, line)


def test_galore_refresh_failure_warning_points_at_the_step_call(monkeypatch):
    p = make_params([(40, 24)])[0]
    opt = lowmemopt.AdamW([{"params": [p], "rank": 4, "update_proj_gap": 1}], lr=1e-2)
    set_grads([p], 0)
    opt.step()

    def failing_svd(*args, **kwargs):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "svd", failing_svd)
    set_grads([p], 1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _here()
        opt.step()
    w = _caught(record, "refresh failed")
    assert (w.filename, w.lineno) == (__file__, line)


def test_external_stacklevel_counts_internal_frames_only():
    assert external_stacklevel() == 1  # called from outside torch and lowmemopt: this very line
    assert not any(__file__.startswith(prefix) for prefix in internal_prefixes())
    assert any(os.path.realpath(torch.__file__).startswith(prefix) for prefix in internal_prefixes())
    assert any(os.path.realpath(lowmemopt.__file__).startswith(prefix) for prefix in internal_prefixes())


LINKED_USER = """import sys, warnings, torch, lowmemopt
assert lowmemopt.__file__.startswith(sys.argv[1]), lowmemopt.__file__  # (the package through the links)
p = torch.nn.Parameter(torch.randn(300))
p.grad = torch.full((300,), float("nan"))
opt = lowmemopt.AdamW([p], lr=1e-3, state_bits=8, min_quant_numel=0)
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    opt.step()
(w,) = [w for w in record if "NaN/Inf" in str(w.message)]
print(w.filename, w.lineno)
"""


def test_warnings_point_at_the_user_through_a_folder_of_links(tmp_path):
    """lowmemopt reached through a folder of links to its files (as ``scripts/gpu-check`` uses a source tree): its
    frames are still its own, so a warning names the user's line (line 8 of the script), not lowmemopt's."""
    package = os.path.dirname(os.path.realpath(lowmemopt.__file__))
    links = tmp_path / "links" / "lowmemopt"
    links.mkdir(parents=True)
    for name in os.listdir(package):
        (links / name).symlink_to(os.path.join(package, name))
    if not (links / "kernels").exists():  # an editable install: the kernels folder lives beside the package
        (links / "kernels").symlink_to(importlib.util.find_spec("lowmemopt.kernels").submodule_search_locations[0])
    script = tmp_path / "user.py"
    script.write_text(LINKED_USER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(links.parent), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run(
        [sys.executable, str(script), str(links)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(script), "8"]
