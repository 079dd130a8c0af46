"""Output of a command that a closed pipe cannot stop: Ctrl-C on `python -m <package>.train ... | tee
out.log` ends `tee` as well, and what the run then prints (the progress bar, the closing summary line,
an `error:` line) must neither raise BrokenPipeError nor end the process on SIGPIPE, before its
checkpoint is saved or after. Standard library only: the command line imports it before JAX.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Iterator, TextIO


def silence(stream: TextIO) -> None:
    """Points `stream`'s file descriptor at /dev/null (its reader is gone), so that later writes, and
    Python's flush of sys.stdout at exit, drop their text instead of raising BrokenPipeError."""
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):   # no descriptor (a test's capture): nothing to point
        return
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def write_line(text: str, stream: TextIO | None = None) -> None:
    """Prints `text` and a newline on `stream` (default sys.stdout) and flushes; a closed pipe drops the
    line (`silence`) instead of raising."""
    stream = sys.stdout if stream is None else stream
    try:
        stream.write(text + "\n")
        stream.flush()
    except BrokenPipeError:
        silence(stream)
    except ValueError:   # a closed file object
        pass


class PipeSafe:
    """`stream` (a progress bar's file) whose writes and flushes are dropped once its pipe is closed
    (`silence`); tqdm's own file wrapper passes BrokenPipeError on, into the training loop."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            silence(self._stream)
        except ValueError:
            pass
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            silence(self._stream)
        except ValueError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    # Equal to its stream: tqdm.write clears the bars drawn on the stream it writes to, found by equality.
    def __eq__(self, other: object) -> bool:
        return self._stream == (other._stream if isinstance(other, PipeSafe) else other)

    def __hash__(self) -> int:
        return hash(self._stream)


@contextlib.contextmanager
def ignore_sigpipe() -> Iterator[None]:
    """SIGPIPE ignored inside the block (a write to a closed pipe then raises BrokenPipeError, which the
    writers above drop), where a program that runs the trainer had restored its default, which ends the
    process at that write: before the checkpoint of a Ctrl-C is saved. Python itself ignores it."""
    previous = None
    if hasattr(signal, "SIGPIPE"):
        try:
            previous = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        except ValueError:   # not the main thread: signals are the main thread's
            previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGPIPE, previous)
