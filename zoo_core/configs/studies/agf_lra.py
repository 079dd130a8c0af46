"""AGF Table 2 (agf.md §3.1): LRA test accuracy of the five tasks for every self-attention mechanism.

    python -m zoo_core.study configs/studies/agf_lra.py --workdir runs/study_agf_lra
    python -m zoo_core.study configs/studies/agf_lra.py:source_dir=$HOME/lra --workdir runs/study_agf_lra
    python -m zoo_core.study configs/studies/agf_lra.py:smoke --workdir /tmp/agf_lra_smoke

Cells: listops, text, retrieval, image, pathfinder (configs/agf/lra_<task>.py) x every name of
`zoo_core.attention.names("self")` read at load time (`:attention=NAME`). Protocol: model selection on validation (the best checkpoint by eval/accuracy),
then that checkpoint on test (`--eval_only --eval_split=test`, run after each training run). Data:
ListOps is generated on first use; text, retrieval, image and pathfinder read the files that
`python -m zoo_core.data.lra_prepare --out DIR ...` writes (docs/data.md; `source_dir=DIR` gives --config.data.options.source_dir=DIR/<task> to those cells; without it they fail
with the data's one-line error). Budget: the harness's steps (ListOps 5,000, ~100 min a run on an idle
2-core CPU; the others need an accelerator). Smoke: ListOps x {agf, softmax}, 2-step runs, one seed.
"""
from zoo_core import attention, study
from zoo_core.configs import studies

TASKS = ("listops", "text", "retrieval", "image", "pathfinder")


def get_study(arg=None):
    a = studies.args(arg, source_dir="")
    tasks = ("listops",) if a.smoke else TASKS
    mechanisms = ("agf", "softmax") if a.smoke else attention.names("self")
    cells = []
    for task in tasks:
        data = [f"--config.data.options.source_dir={a.source_dir}/{task}"] if a.source_dir and task != "listops" else []
        for name in mechanisms:
            cells.append(study.Cell(f"{task} {name}", dict(task=task, attention=name), overrides=data,
                                    config=f"configs/agf/lra_{task}.py" + studies.smoke_arg(a, f"attention={name}")))
    return study.Study(
        name="agf_lra", title="AGF Table 2: LRA test accuracy, every self-attention mechanism",
        module="agf_jax.train", config="configs/agf/lra_listops.py", cells=cells,
        seeds=studies.seeds(a, (0, 1, 2, 3, 4), default=1),
        metrics=[study.EvalFile("eval_best_test.json", "eval/accuracy", label="test accuracy (best val ckpt)"),
                 study.Best("eval/accuracy", "max", label="best validation accuracy")],
        evaluate=("--eval_only", "--eval_split=test"),
        notes=["LRA protocol (agf.md §3.1): select the checkpoint on validation, report it on test."])
