"""Helper processes of `serve` that run this package's own code (the journal's writer,
the reply worker): how they are started and what they ignore.

Each is `python -P -m MODULE ...` with this package first on its path (`child_env`),
in its own session and deaf to SIGINT and SIGTERM (`ignore_interrupts`): a Ctrl-C or a
supervisor's SIGTERM to `serve`'s process group must not end one while `serve` drains
the turns that still need it. It ends when `serve` closes its socket, or with `serve`
(`parent_death.die_with_parent`, armed by the child itself).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

__all__ = ["child_env", "ignore_interrupts", "spawn"]


def child_env() -> dict[str, str]:
    """The child runs this very code: the directory this package was imported from goes
    first on its path, unless it is an installed site directory (already on it, and
    first would put it before the standard library). `-P` keeps the current directory
    off the path."""
    here = str(Path(__file__).resolve().parent.parent)
    paths = sysconfig.get_paths()
    if here in {str(Path(paths["purelib"]).resolve()), str(Path(paths["platlib"]).resolve())}:
        return dict(os.environ)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))}


def spawn(module: str, args: list[str], *, pass_fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
    """`python -P -m module *args` in its own session, keeping `pass_fds` open. Call it
    from the event-loop thread: the child's death signal follows the thread that forked it."""
    return subprocess.Popen([sys.executable, "-P", "-m", module, *args], pass_fds=pass_fds,
                            stdin=subprocess.DEVNULL, env=child_env(), start_new_session=True)


def ignore_interrupts() -> None:
    """In the child: SIGINT and SIGTERM do nothing (the module docstring says why)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
