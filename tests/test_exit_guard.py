"""tests/exit_guard.py: a test process that does not exit after its session says what still runs, and is ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CONFTEST = f"""
import sys
sys.path.insert(0, {HERE!r})
from exit_guard import pytest_unconfigure
"""
#: a session that leaves a non-daemon thread and a child process running: without the guard, the interpreter waits
#: for the thread (5 minutes)
TEST = """
import subprocess, threading, time

def test_leaves_a_thread_and_a_child_running():
    threading.Thread(target=time.sleep, args=(300,), name="stuck-writer").start()
    subprocess.Popen(["sleep", "3007"])
"""


def test_a_process_that_hangs_after_its_session_is_ended_with_its_stacks(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_hang.py").write_text(TEST)
    env = dict(os.environ, LOWMEMOPT_TEST_EXIT_GRACE_S="2")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_hang.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=150)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the child it left (the guard reports children, it does not end them)
    assert time.monotonic() - t0 < 120
    assert "1 passed" in out, out + err
    assert proc.returncode == 1, err  # faulthandler's watchdog ended it
    assert "non-daemon threads ['stuck-writer (threading.Thread)']" in err
    assert "child processes ['" in err and " sleep 3007']" in err
    assert "(most recent call first)" in err and "in _shutdown" in err  # where it hung: joining the thread
