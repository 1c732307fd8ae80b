import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py, tests/optim_info.py

from exit_guard import pytest_unconfigure  # noqa: E402,F401  (a bound on the exit after the session, on CUDA machines)

# Triton picks compiled or interpreted kernels when a kernel is decorated, i.e. when lowmemopt.kernels' modules are
# first imported: without CUDA, default to the interpreter (as CI does) before any test module imports them.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config):
    torch.manual_seed(0)


def pytest_report_header(config):
    """The Triton the kernels run on, and what an older interpreter cannot do (docs/kernels.md, "Triton versions")."""
    from lowmemopt.kernels import runtime

    if not runtime.HAS_TRITON:
        return "triton: not installed (the Triton kernel tests skip)"
    import numpy
    import triton
    from helpers import interpreter_fma_rounds_once, version_of

    lines = [f"triton {triton.__version__} ({'interpreted' if runtime.INTERPRET else 'compiled'} kernels)"]
    if runtime.INTERPRET and not interpreter_fma_rounds_once():
        lines.append(
            "  its interpreter rounds tl.fma twice: the bit-for-bit comparisons of interpreted kernels with "
            "IEEE arithmetic skip (Triton 3.9 rounds once, as a GPU)"
        )
    if runtime.INTERPRET and runtime._triton_before(3, 7) and version_of(numpy.__version__) >= (2, 4):
        lines.append(
            f"  with numpy {numpy.__version__}, this interpreter fails on loops whose bounds a kernel loads "
            "(the factored passes): use triton >= 3.7 or numpy < 2.4"
        )
    return lines


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def correctly_rounded_sqrt(monkeypatch):
    """torch's CPU ``Tensor.sqrt`` is MKL's VML sqrt, within 1 ulp but not correctly rounded (on ~16% of values here);
    the kernels use IEEE sqrt, as ``torch.optim.AdamW(fused=True)`` and inductor do. For bit-exact comparisons the
    eager reference gets a correctly rounded sqrt (fp64 sqrt rounded to fp32 is)."""
    real = torch.Tensor.sqrt

    def sqrt(self):
        return self.double().sqrt().to(self.dtype) if self.dtype == torch.float32 else real(self)

    monkeypatch.setattr(torch.Tensor, "sqrt", sqrt)
