"""Kills a server's process group once the process that owns the server has died.

Run as ``python watchdog.py OWNER_PID PGID GRACE_S [DIRECTORY]`` by the owner, in a session of its
own (so signals aimed at the owner's terminal group do not reach it); ``DIRECTORY`` (the server's
socket directory) is removed after the group. ``atexit`` does not run when the
owner is killed with SIGKILL; this process does notice, because it is then re-parented and its
parent pid changes. It exits by itself once the group is gone. Imports nothing from the package
so it starts in milliseconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable

POLL_S = 0.2


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still exists
        return True
    return True


def kill_group(pgid: int, grace_s: float, reap: Callable[[], object] = lambda: None) -> None:
    """SIGTERM (vLLM shuts down cleanly on it), then SIGKILL whatever is left after ``grace_s``.

    ``reap`` is called while waiting: a dead child that is not yet reaped (a zombie) still
    counts as a member of its group.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            reap()
            if not group_alive(pgid):
                return
            time.sleep(POLL_S)


def main(owner: int, pgid: int, grace_s: float, directory: str | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while group_alive(pgid):
        if os.getppid() != owner:
            kill_group(pgid, grace_s)
            if directory:
                shutil.rmtree(directory, ignore_errors=True)
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
