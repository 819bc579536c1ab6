"""Child processes that die with their parent, however the parent dies.

A `kill -9` of `serve` runs none of its shutdown: its helper processes (the reply
worker, the journal's writer) would live on, each ~100 MB, ignoring the SIGINT and
SIGTERM meant for `serve`'s group (child_process.py says why they do). Under
`cluster`, every crash and restart would leak another set, and a `kill -9` of
`cluster` itself would leave HAProxy and every worker running. So each child asks
the kernel to kill it when its parent dies (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`,
man 2 prctl; elsewhere a thread that watches the parent pid):

* `serve`'s helpers run `die_with_parent` first thing, with `serve`'s pid;
* `cluster`'s workers and HAProxy: started through `die_with_parent_argv`, a tiny
  interpreter that arms the setting and then execs the command (the setting
  survives `execve` for a program that is not set-uid), so HAProxy, which runs
  no code of ours, is covered too.

The setting follows the *thread* that forked the child: every one of these is
started from the thread that lives as long as its parent needs it (the event-loop
thread for `serve`'s helpers, the main thread for `cluster`). A parent that is
already gone by the time the child arms itself is caught by checking the parent
afterwards.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent", "die_with_parent_argv"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h

# what `die_with_parent_argv` runs before the real command: no imports but the stdlib's
# (no site either: it starts in ~10 ms), then the command replaces it, keeping its pid
_EXEC_SCRIPT = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _prctl_pdeathsig() -> bool:
    """Linux: SIGKILL this process when its parent (the forking thread) exits."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int, interval_s: float = 0.5) -> None:
    """Without prctl: exit as soon as the parent is no longer the parent."""
    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=run, name="tito-parent-watch", daemon=True).start()


def die_with_parent(parent_pid: int) -> None:
    """Die (SIGKILL) when the parent `parent_pid` dies; exit now if it already has."""
    if not _prctl_pdeathsig():
        _watch(parent_pid)
    if os.getppid() != parent_pid:
        os._exit(1)


def die_with_parent_argv(argv: list[str]) -> list[str]:
    """`argv` run so that it dies with this process (see the module docstring)."""
    return [sys.executable, "-S", "-c", _EXEC_SCRIPT, str(os.getpid()), *argv]

