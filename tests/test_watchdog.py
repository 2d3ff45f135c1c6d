"""grpo.trainer.sync_deadline: a weight sync that ends in time leaves no timer thread behind (a daemon thread still
winding down while the interpreter finalizes can free the run's tensors there and abort the finished process), and
one past its deadline ends the process with EXIT_STALLED naming what stalled."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from grpo.trainer import EXIT_STALLED, sync_deadline

ROOT = Path(__file__).resolve().parents[1]


def test_work_in_time_goes_on_and_leaves_no_timer_thread():
    for value in range(20):
        with sync_deadline(60.0, step=value, rank=0):
            result = value + 1
        assert result == value + 1
        assert [thread for thread in threading.enumerate() if isinstance(thread, threading.Timer)] == []


def test_a_call_past_its_deadline_ends_the_process_naming_it():
    code = ("import time\nfrom grpo.trainer import sync_deadline\n"
            "with sync_deadline(0.5, step=3, rank=0):\n"
            "    time.sleep(30)\n")
    finished = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert finished.returncode == EXIT_STALLED
    assert ("weight sync (phase: sync) at step 3 on rank 0 did not finish within rollout.sync_timeout_s=0.5 s"
            in finished.stderr)
