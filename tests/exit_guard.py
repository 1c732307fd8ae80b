"""A bound on how long a test process may take to exit after its session, on a CUDA machine (a pytest hook that
``conftest.py`` takes in).

On a GPU run with pytest-xdist, pytest once printed its summary and did not exit until it was killed. What can keep a
process, or the pipe its output goes to, alive after the tests: threads that are not daemons (the interpreter joins
them before it exits), exit handlers that wait (a compile-worker pool's shutdown, a CUDA stream's synchronize in a
finalizer), and child processes still running (they hold the output pipe open after pytest itself has gone). At
``pytest_unconfigure`` (in each xdist worker and in the controller) this hook writes the non-daemon threads and the
child processes still alive to stderr, and arms ``faulthandler``'s watchdog: if the process has not exited
:func:`grace_s` seconds later, every thread's Python stack is written to stderr (where the exit hangs) and the
process exits with status 1. A normal exit cancels the watchdog.

On by default only where CUDA is available; ``LOWMEMOPT_TEST_EXIT_GRACE_S`` sets the seconds anywhere (0: off).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading

import pytest
import torch

ENV = "LOWMEMOPT_TEST_EXIT_GRACE_S"
#: seconds a test process on a CUDA machine gets to exit after its session
DEFAULT_GRACE_S = 60.0


def grace_s() -> float | None:
    """The seconds a process gets to exit after its session (None: no bound)."""
    value = os.environ.get(ENV)
    if value is not None:
        seconds = float(value)
        return seconds if seconds > 0 else None
    return DEFAULT_GRACE_S if torch.cuda.is_available() else None


def child_processes() -> list[str]:
    """``"pid command"`` of this process's children still alive (from ``/proc``; none where there is no ``/proc``)."""
    me, found = str(os.getpid()), []
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
            if stat.rsplit(")", 1)[1].split()[1] != me:  # the field after the state: the parent's pid
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):  # gone meanwhile
            continue
        found.append(f"{pid} {command[:200]}")
    return found


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    seconds = grace_s()
    if seconds is None:
        return
    threads = [
        f"{t.name} ({type(t).__module__}.{type(t).__qualname__})"
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    children = child_processes()
    if threads or children:
        print(
            f"lowmemopt tests: process {os.getpid()} still runs, at the end of its session: non-daemon threads "
            f"{threads or 'none'}; child processes {children or 'none'}. It gets {seconds:g} s to exit.",
            file=sys.__stderr__,
            flush=True,
        )
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
