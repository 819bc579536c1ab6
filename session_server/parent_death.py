"""Child processes that die with their parent, however the parent dies.

A `kill -9` of `serve` runs none of its shutdown: its reply-decoder pool would live
on (the multiprocessing forkserver, its worker, the resource tracker: ~120 MB), the
worker blocked for ever on a queue whose write end it holds itself, the forkserver
and the tracker kept alive by the worker's copies of their pipes. Under `cluster`,
every crash and restart would leak another set, and a `kill -9` of `cluster`
itself would leave HAProxy and every worker running. So each child asks the kernel
to kill it when its parent dies (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`, man 2
prctl; elsewhere a thread that watches the parent pid):

* the forkserver: this module is the first of its preload modules, and arms itself
  there when its parent is the pid `ENV` names (`serve` sets it to its own pid);
* each pool worker (a child of the forkserver, where fork clears the setting):
  `arm_pool_worker`, run by the pool's initializer;
* the resource tracker then sees the end of its pipe once they are gone and exits
  by itself (its documented way out: every holder of the pipe has exited);
* `cluster`'s workers and HAProxy: started through `die_with_parent_argv`, a tiny
  interpreter that arms the setting and then execs the command (the setting
  survives `execve` for a program that is not set-uid), so HAProxy, which runs
  no code of ours, is covered too.

The setting follows the *thread* that forked the child: every one of these is
started from the thread that lives as long as its parent needs it (the event-loop
thread for the pool, the main thread for `cluster`). A parent that is already gone
by the time the child arms itself is caught by checking the parent afterwards.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["ENV", "arm_pool_worker", "die_with_parent", "die_with_parent_argv"]

ENV = "TITO_DIE_WITH_PID"  # the pid whose direct children arm themselves on import (the forkserver)
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


def arm_pool_worker(owner_pid: int) -> None:
    """A pool worker's initializer: die with the forkserver that forked it (which dies
    with `owner_pid`, the process that owns the pool); exit now if the owner is gone."""
    die_with_parent(os.getppid())
    try:
        os.kill(owner_pid, 0)
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:  # alive, another user's: not ours to judge
        pass


def die_with_parent_argv(argv: list[str]) -> list[str]:
    """`argv` run so that it dies with this process (see the module docstring)."""
    return [sys.executable, "-S", "-c", _EXEC_SCRIPT, str(os.getpid()), *argv]


def _arm_from_env() -> None:
    """On import in the forkserver (a `python -c` direct child of the process `ENV`
    names, which imports this module as a preload): die with that parent. Anywhere
    else (`serve` itself, or a process that merely inherited the variable): nothing."""
    named = os.environ.get(ENV, "")
    if (named.isdigit() and sys.argv[:1] == ["-c"] and int(named) != os.getpid()
            and int(named) == os.getppid()):
        die_with_parent(int(named))


_arm_from_env()
