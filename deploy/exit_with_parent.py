"""`python -m deploy.exit_with_parent PARENT_PID CMD...`: exec CMD so that it gets SIGTERM when PARENT_PID dies.

The launcher starts its children through this instead of a `preexec_fn`: a `preexec_fn` forces a plain fork() of a
process whose gRPC threads are running, and gRPC's fork handlers can deadlock there. PR_SET_PDEATHSIG survives the
exec; the parent-pid check closes the race where the parent died before the signal was armed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m deploy.exit_with_parent PARENT_PID CMD [ARGS...]")
    parent, command = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        raise SystemExit(f"parent {parent} is gone; not starting {command[0]}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
