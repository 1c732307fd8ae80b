"""Subprocess half of the paging memory test: peak RSS growth during AdamW8bit steps, in a fresh process.

    python paging_rss_worker.py PAGED NPARAMS NUMEL DIR STEPS   PAGED: disk | cpu | none. Prints JSON: state bytes,
                                                               the largest parameter's state bytes, peak RSS growth
                                                               over the steps, seconds per step.

Parameters and gradients are made resident first (random values), then the optimizer is built and a warm-up runs the
same code on a small optimizer (code pages, codec tables: a few MB that do not grow with the state). The baseline is
VmRSS after that (and a malloc_trim); VmHWM is reset (``/proc/self/clear_refs``, Linux) and the steps run: the first
one creates the state, so the peak covers the state's creation, its write-back and a full step from the home. One
thread: OpenMP threads waiting for each other on a shared machine only blur the timing.
"""

import ctypes
import gc
import json
import os
import sys
import tempfile
import time

import torch

import lowmemopt
from lowmemopt.memory import proc_status_bytes, reset_peak_rss


def _build(params, paged: str, directory: str):
    kwargs = {} if paged == "none" else dict(paged=paged, offload_dir=directory)
    return lowmemopt.AdamW(params, lr=1e-3, state_bits=8, **kwargs)


def main(paged: str, nparams: int, numel: int, directory: str, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(nparams)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen).mul_(1e-3)
    opt = _build(params, paged, directory)
    with tempfile.TemporaryDirectory(dir=directory) as warm_dir:  # warm-up: same code, small tensors
        warm = [torch.nn.Parameter(torch.randn(1 << 16)) for _ in range(2)]
        for w in warm:
            w.grad = torch.randn_like(w)
        warm_opt = _build(warm, paged, warm_dir)
        warm_opt.step()
        warm_opt.step()
        warm_opt.close()
        del warm_opt, warm
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    base = proc_status_bytes("VmRSS")
    reset_peak_rss()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    peak = proc_status_bytes("VmHWM")
    state_bytes = opt.state_nbytes()
    largest = max(sum(v.nbytes for v in st.values() if isinstance(v, torch.Tensor)) for st in opt.state.values())
    files = sum(len(fs) for _, _, fs in os.walk(directory))
    opt.close()
    print(
        json.dumps(
            dict(state_bytes=state_bytes, param_state_bytes=largest, peak_growth=peak - base, step_s=times, files=files)
        )
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
