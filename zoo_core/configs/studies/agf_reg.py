"""AGF Table 4 (agf.md §3.1): sensitivity to the orthogonality weight gamma on LRA ListOps.

    python -m zoo_core.study configs/studies/agf_reg.py --workdir runs/study_agf_reg
    python -m zoo_core.study configs/studies/agf_reg.py:gammas=0_1e-3_1e-2_1e-1 --workdir runs/study_agf_reg
    python -m zoo_core.study configs/studies/agf_reg.py:smoke --workdir /tmp/agf_reg_smoke

Cells: gamma (`--config.model.ortho_weight`, the reference's --reg) in `gammas` (default 0, 1e-4, 1e-3,
1e-2 (the reference's ListOps value), 1e-1, 1), on configs/agf/lra_listops.py (data generated on first
use). Protocol: the best validation checkpoint on test (`--eval_only --eval_split=test` after each run).
The figure: test accuracy against gamma (0 is drawn at the left end of a linear axis). Budget: 5,000
steps, about 100 min a run on an idle 2-core CPU: an accelerator study (a shorter schedule does not
inform: through 1,200 steps the model still predicts the majority class, benchmarks/RESULTS.md). Smoke:
gamma in {0, 1e-2}, 2-step runs, one seed.
"""
from zoo_core import study
from zoo_core.configs import studies


def get_study(arg=None):
    a = studies.args(arg, gammas="0_1e-4_1e-3_1e-2_1e-1_1")
    gammas = [0.0, 1e-2] if a.smoke else studies.floats(a.gammas)
    cells = [study.Cell(f"gamma={g:g}", dict(gamma=g), overrides=[f"--config.model.ortho_weight={g!r}"])
             for g in gammas]
    return study.Study(
        name="agf_reg", title="AGF Table 4: orthogonality weight gamma on LRA ListOps",
        module="agf_jax.train", config="configs/agf/lra_listops.py" + studies.smoke_arg(a), cells=cells,
        seeds=studies.seeds(a, (0, 1, 2, 3, 4), default=1),
        metrics=[study.EvalFile("eval_best_test.json", "eval/accuracy", label="test accuracy (best val ckpt)"),
                 study.Best("eval/accuracy", "max", label="best validation accuracy")],
        evaluate=("--eval_only", "--eval_split=test"),
        plot=study.Curve(x="gamma"))
