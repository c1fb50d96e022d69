"""``python -m tandem.parent_death PARENT_PID PROGRAM ARGS...``: exec PROGRAM so that it
gets SIGKILL when process PARENT_PID dies (Linux PR_SET_PDEATHSIG, which survives exec).

A launcher rather than a ``preexec_fn``: forking a process whose gRPC threads are busy
runs gRPC's fork handlers there; spawning this launcher stays a plain posix_spawn/vfork.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def guarded(argv: list[str], parent_pid: int | None = None) -> list[str]:
    """``argv`` wrapped in this launcher, tied to ``parent_pid`` (default: this process)."""
    return [sys.executable, "-m", "tandem.parent_death", str(parent_pid or os.getpid()), *argv]


def main(args: list[str]) -> None:
    parent = int(args[0])
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)  # the parent died before the signal was armed
    os.execv(args[1], args[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
