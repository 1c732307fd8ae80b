"""The shared benchmark pieces now live in the package, :mod:`lowmemopt.benchmark` (so that ``lowmemopt bench`` runs
from any install); this module re-exports them for scripts in this folder::

    from common import OPTIMIZERS, build_llama, fixed_grads, run_benchmark, print_table

Run the scripts from outside the repository root: the repo's top-level ``kernels/`` folder would otherwise shadow the
unrelated ``kernels`` package that bitsandbytes imports.
"""

from lowmemopt.benchmark import (
    BASELINE,
    FACTORED,
    LLAMA_PRESETS,
    OPTIMIZERS,
    Result,
    build_llama,
    drop_from_page_cache,
    fixed_grads,
    fresh_params,
    machine_info,
    parse_bench_args,
    print_table,
    run_benchmark,
    run_rows,
    run_suite,
    state_bytes,
    time_steps,
)

__all__ = [
    "BASELINE",
    "FACTORED",
    "LLAMA_PRESETS",
    "OPTIMIZERS",
    "Result",
    "build_llama",
    "drop_from_page_cache",
    "fixed_grads",
    "fresh_params",
    "machine_info",
    "parse_bench_args",
    "print_table",
    "run_benchmark",
    "run_rows",
    "run_suite",
    "state_bytes",
    "time_steps",
]
