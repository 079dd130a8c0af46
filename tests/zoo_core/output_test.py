"""zoo_core.run.output: writes to a pipe whose reader is gone are dropped, not raised; a progress bar on a
`PipeSafe` stream is still cleared by tqdm.write before a log line (the training command's subprocess
test, Ctrl-C through a closed pipe: tests/zoo_core/reliability_test.py)."""
import io
import os
import sys

from zoo_core.run import output


def _closed_pipe():
    read, write = os.pipe()
    os.close(read)   # the reader (tee) is gone
    return io.TextIOWrapper(io.FileIO(write, "w"), write_through=False)


def test_writes_to_a_closed_pipe_are_dropped_and_the_stream_closes_quietly():
    stream = _closed_pipe()
    output.write_line("end of run: 2 of 2 steps", stream)
    output.write_line("again", stream)              # its descriptor now writes to /dev/null
    stream.close()                                  # the flush at exit: no BrokenPipeError
    safe = output.PipeSafe(_closed_pipe())
    assert safe.write("train: 10%") == len("train: 10%")
    safe.flush()
    safe.close()


def test_a_bar_on_a_pipe_safe_stream_is_cleared_before_a_log_line(monkeypatch):
    from tqdm import tqdm
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    bar = tqdm(total=10, file=output.PipeSafe(sys.stderr), mininterval=0)
    bar.update(1)
    tqdm.write("LOG LINE", file=sys.stderr)
    bar.close()
    text = stderr.getvalue()
    assert "\rLOG LINE\n" in text and "it/s]LOG LINE" not in text, repr(text)
