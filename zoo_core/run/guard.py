"""What guards a run while it trains: SIGTERM and Ctrl-C turned into a clean stop (`Terminate`), and the
workdir's lock against a second run (`lock_workdir`).
"""
from __future__ import annotations

import os
import signal
import socket
import time

import jax
import numpy as np
from absl import logging

from zoo_core.run.errors import ConfigError


class Terminate:
    """Turns SIGTERM and Ctrl-C (SIGINT) into a flag the loop polls, so the run can save and exit cleanly.

    A second Ctrl-C stops at once (KeyboardInterrupt, the previous checkpoint is kept). A SIGINT that the
    process was started to ignore (a background job of a non-interactive shell) stays ignored.
    """

    def __init__(self):
        self.requested = None      # the name of the first signal received
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            if sig == signal.SIGINT and signal.getsignal(sig) is not signal.default_int_handler:
                continue
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:   # not the main thread (e.g. inside a notebook worker): no handler
                pass
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        logging.warning("%s received: saving a checkpoint and exiting%s", name,
                        " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else "")
        self.requested = self.requested or name

    def any_requested(self) -> bool:
        """Whether any process got SIGTERM or Ctrl-C. All processes must leave the loop at the same step (the
        save is collective), so with several processes they agree on the flag every step."""
        if jax.process_count() == 1:
            return bool(self.requested)
        from jax.experimental import multihost_utils
        return bool(np.max(multihost_utils.process_allgather(np.int32(bool(self.requested)))))

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def lock_workdir(workdir: str):
    """An exclusive lock on `workdir`/.lock held by process 0 while it trains there, or None (another
    process of a multi-host run, or a system without fcntl). Two runs writing one workdir interleave
    their checkpoints and metrics; the second is refused instead. The lock goes with its process
    (a killed run leaves none behind).

    Raises:
      ConfigError: another process holds it.
    """
    if jax.process_index() != 0:
        return None
    try:
        import fcntl
    except ImportError:   # Windows: no advisory locks; nothing checked
        return None
    path = os.path.join(workdir, ".lock")
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"workdir {workdir!r} is in use by a run still going ({holder}); wait for it to end "
                          "or use another --workdir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f
