"""Long Range Arena tasks: dataset facts and the data/task part of a config.

ListOps is generated (`zoo_core.data.listops`), or read from LRA's released files with
--config.data.options.source_dir=DIR (DIR = lra_release/listops-1000); text, retrieval, image and
pathfinder read prepared files from `source_dir` (`zoo_core.data.lra_files` says which files and
formats), given with --config.data.options.source_dir=DIR.
"""
from __future__ import annotations

import ml_collections

from zoo_core.data import listops, lra_files

# task -> dataset name, vocabulary (0 = padding), classes, sequence length of the AGF harness,
# whether the data need user files, and the split used for model selection (the harness's dev split:
# LRA's IMDB text task has none and uses test; the best dev checkpoint is then scored on test with
# --eval_only --eval_split=test).
TASKS = {
    "listops": dict(dataset="lra_listops", vocab_size=listops.VOCAB_SIZE, classes=10, length=2000,
                    needs_files=False, eval_split="validation"),
    # AGF's lra_config.py uses 1024 bytes (the usual LRA setting is 4000, agf.md §3.1).
    "text": dict(dataset="lra_text", vocab_size=lra_files.TEXT_VOCAB_SIZE, classes=2, length=1024,
                 needs_files=True, eval_split="test"),
    "retrieval": dict(dataset="lra_retrieval", vocab_size=lra_files.TEXT_VOCAB_SIZE, classes=2,
                      length=4000, needs_files=True, eval_split="validation"),
    "image": dict(dataset="lra_image", vocab_size=lra_files.PIXEL_VOCAB_SIZE, classes=10,
                  length=1024, needs_files=True, eval_split="validation"),
    "pathfinder": dict(dataset="lra_pathfinder", vocab_size=lra_files.PIXEL_VOCAB_SIZE, classes=2,
                       length=1024, needs_files=True, eval_split="validation"),
}

LISTOPS_OPTIONS = ("max_length", "min_length", "max_depth", "max_args", "num_train", "num_validation",
                   "num_test", "seed", "source_dir")
LISTOPS_DEFAULTS = listops.ListOpsConfig(name="defaults")
# A ListOps setting that generates in well under a second (smoke runs, notebooks).
LISTOPS_SMOKE_OPTIONS = dict(max_length=64, min_length=10, num_train=256, num_validation=32,
                             num_test=32)


def pow2_at_least(n: int) -> int:
    """The position-table size of the AGF LRA harness: max_seq_len rounded up to a power of 2."""
    return 1 << (int(n) - 1).bit_length()


def set_data(c: ml_collections.ConfigDict, task: str, *, smoke: bool = False) -> dict:
    """Fills c.data and c.task for LRA `task`.

    Args:
      c: a config from `common.base_config()`.
      task: a key of TASKS.
      smoke: ListOps: a few hundred short expressions; text: 64-byte documents (the file tasks
        still need their files to run, but the config builds without them).

    Returns:
      The task's facts, with 'length' replaced by the data length actually produced.
    """
    if task not in TASKS:
        raise ValueError(f"unknown LRA task {task!r}; known: {', '.join(TASKS)}")
    facts = dict(TASKS[task])
    c.data.name = facts["dataset"]
    c.data.train_split = "train"
    c.data.eval_split = facts["eval_split"]
    c.task.name = "classification"
    if task == "listops":
        if smoke:
            c.data.options.update(LISTOPS_SMOKE_OPTIONS)
            facts["length"] = LISTOPS_SMOKE_OPTIONS["max_length"]
        else:
            # Every generation option explicitly (the LRA 2K defaults), so that each can be
            # overridden on the command line, e.g. --config.data.options.min_length=20, or
            # source_dir=DIR for LRA's released files.
            c.data.options.update({k: getattr(LISTOPS_DEFAULTS, k) for k in LISTOPS_OPTIONS})
            facts["length"] = c.data.options.max_length
    else:
        c.data.options.source_dir = ""
        if task in ("text", "retrieval"):
            facts["length"] = 64 if smoke else facts["length"]
            c.data.options.max_length = facts["length"]
    return facts
