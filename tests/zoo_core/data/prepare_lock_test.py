"""Two runs sharing an unprepared data set: the data set is prepared once, under its lock, and both runs
read it (the second built it beside the first and failed renaming its folder into place)."""
import os
import subprocess
import sys
import time

from tests.environment import ROOT, command_env
from zoo_core.data import base

# One run's data preparation (`trainer.prepare_data`, as the training command calls it) of the synthetic
# smoke data set, started when the file `gate` appears; generating its splits appends this process's id to
# `marks` and takes 2 s more, so that two runs started together overlap.
PREPARE = """
import os, sys, time
from absl import logging
from zoo_core import trainer
from zoo_core.configs.core import synthetic as synthetic_config
from zoo_core.data import synthetic

data_dir, ready, gate, marks = sys.argv[1:5]
generate = synthetic.SyntheticLinear._split_generators

def slow(self, dl_manager):
    with open(marks, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(2)
    return generate(self, dl_manager)

synthetic.SyntheticLinear._split_generators = slow
logging.set_verbosity(logging.INFO)
config = synthetic_config.get_config("smoke")
config.unlock()
config.data.data_dir = data_dir
open(ready, "w").close()
while not os.path.exists(gate):
    time.sleep(0.01)
train, test = trainer.prepare_data(config)
print(len(train), len(test))
"""


def test_two_runs_on_one_fresh_data_set_both_finish_and_prepare_it_once(tmp_path):
    data, gate, marks = tmp_path / "data", tmp_path / "gate", tmp_path / "marks"
    procs = [subprocess.Popen([sys.executable, "-c", PREPARE, str(data), str(tmp_path / f"ready{i}"), str(gate),
                               str(marks)], cwd=ROOT, env=command_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    t0 = time.time()
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        assert time.time() - t0 < 300, "the processes did not start"
        time.sleep(0.05)
    gate.touch()
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and out.split() == ["512", "128"], err[-3000:]
    assert len(marks.read_text().split()) == 1, "prepared more than once"
    waiting = [line for _, err in results for line in err.splitlines() if "waiting for " in line]
    assert len(waiting) == 1 and "to finish preparing synthetic_linear in" in waiting[0], waiting
    assert not [n for n in os.listdir(data) if n.endswith(".lock")]   # the lock's file goes with it


def test_a_waiter_locks_the_file_now_there_and_a_killed_holder_releases_the_lock(tmp_path):
    """The holder removes the lock's file on release (so does a failed preparation removing its folders):
    a waiter that had opened the old file locks the one at the path, so a third process waits for it;
    a killed holder's lock goes with its process."""
    import fcntl
    import threading

    path = str(tmp_path / "d" / ".x.lock")
    held, got = threading.Event(), []

    def second():
        with base.preparation_lock(path, "x") as waited:
            got.append(waited)
            held.set()
            time.sleep(1.0)

    with base.preparation_lock(path, "x") as waited:
        assert not waited and open(path).read().startswith(f"pid {os.getpid()} on ")
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.5)   # the second is waiting on this file
    assert held.wait(30) and got == [True]
    fd = os.open(path, os.O_RDWR)   # the file now at the path is the second's, and locked
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("a third process would have taken the lock the second holds")
        except BlockingIOError:
            pass
    finally:
        os.close(fd)
    thread.join()
    assert not os.path.exists(path)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print(flush=True); "
                               "time.sleep(60)", path], stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    t0 = time.time()
    threading.Timer(1.0, holder.kill).start()
    with base.preparation_lock(path, "x") as waited:
        assert waited and time.time() - t0 >= 0.9
    holder.wait()
