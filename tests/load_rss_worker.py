"""Subprocess halves of the load-memory test (each in a fresh process, so freed memory cannot hide a peak).

    python load_rss_worker.py save NUMEL BITS PATH    AdamW state of NUMEL elements at BITS (random, no step) -> PATH
    python load_rss_worker.py load NUMEL BITS PATH    load PATH into a fresh AdamW at BITS; print JSON: state bytes,
                                                      peak RSS growth during load_state, seconds

Peak RSS growth is VmHWM after resetting it (``/proc/self/clear_refs``, Linux) just before the load, minus VmRSS at that
point, after a warm-up (the same load on a small file: code pages and codec tables, a few tens of MB that do not grow
with the state) and a malloc_trim. Parameters are zeros (calloc: never touched, so never resident). One thread: on a
shared machine OpenMP threads that wait for each other make small ops 100x slower, which would only blur the timing.
"""

import ctypes
import gc
import json
import os
import sys
import time

import torch

import lowmemopt
from lowmemopt.checkpoint import read_metadata
from lowmemopt.memory import proc_status_bytes, reset_peak_rss

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench"))
from checkpoint_io import random_state  # noqa: E402  (the same state as the checkpoint benchmark's)


def save(numel: int, bits: int, path: str) -> None:
    opt = random_state(numel, bits, fill=True)
    t0 = time.perf_counter()
    lowmemopt.save_state(opt, path)
    print(json.dumps(dict(state_bytes=opt.state_nbytes(), save_s=time.perf_counter() - t0)))


def load(numel: int, bits: int, path: str) -> None:
    # warm-up: the same conversion on a small file (code pages of the kernels it runs, codec tables: a few tens of MB
    # that do not grow with the state)
    src_bits = read_metadata(path)["param_groups"][0]["state_bits"]
    warm = path + ".warm"
    lowmemopt.save_state(random_state(1 << 16, src_bits, fill=True), warm)
    lowmemopt.load_state(random_state(1 << 16, bits, fill=False), warm)
    os.unlink(warm)
    fresh = random_state(numel, bits, fill=False)
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # hand freed heap memory back, so reusing it cannot hide part of the peak
    base = proc_status_bytes("VmRSS")
    reset_peak_rss()
    t0 = time.perf_counter()
    lowmemopt.load_state(fresh, path)
    load_s = time.perf_counter() - t0
    peak = proc_status_bytes("VmHWM")
    print(json.dumps(dict(state_bytes=fresh.state_nbytes(), peak_growth=peak - base, load_s=load_s)))


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"save": save, "load": load}[sys.argv[1]](int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
