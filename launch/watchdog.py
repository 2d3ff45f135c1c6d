"""A deadline for work that can stall where no exception reaches it: a weight sync blocked inside a C call or an
engine that never returns leaves the main thread unable to run a signal handler or raise. Past the deadline a timer
thread prints what stalled (phase, step, rank), the stack of every thread, and ends the process with EXIT_STALLED;
under torchrun the other ranks then fail at their next collective and the group ends (or restarts).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Callable

EXIT_STALLED = 124  # as coreutils' timeout(1)


def _expire(what: Callable[[], str], limit: str) -> None:
    print(f"error: {what()} did not finish within {limit}: ending the run (exit code {EXIT_STALLED}); the stack "
          "of every thread follows", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_STALLED)  # the stalled thread cannot be unwound; checkpoints already written stay complete


def with_deadline(function: Callable, seconds: float, limit: str, what: Callable[[], str]) -> Callable:
    """`function` with a deadline: a call that runs longer than `seconds` ends the process as described above.

    limit: how the deadline is named in the message (e.g. "rollout.sync_timeout_s=60 s"); what(): the work
    and where it stood, asked only when the deadline passes (e.g. "weight sync at step 3 on rank 1").
    """
    def guarded(*args, **kwargs):
        timer = threading.Timer(seconds, _expire, args=(what, limit))
        timer.daemon = True
        timer.start()
        try:
            return function(*args, **kwargs)
        finally:
            timer.cancel()
            # Joined so the timer thread is gone before the caller goes on: a daemon thread left to wind down
            # could drop the last reference to `what`'s closure (and through it the run's tensors) while the
            # interpreter finalizes, which ends the process in std::terminate (SIGABRT) after a finished run.
            timer.join()

    return guarded
