"""HTGN card §9 ablation (htgn.md §5.13): without the graph convolution, without HRPE, absolute PE.

    python -m zoo_core.study configs/studies/htgn_ablation.py --workdir runs/study_htgn_ablation
    python -m zoo_core.study configs/studies/htgn_ablation.py:task=digits --workdir runs/study_htgn_ablation_digits
    python -m zoo_core.study configs/studies/htgn_ablation.py:smoke --workdir /tmp/htgn_ablation_smoke

Cells on `task` number_words (En -> De, configs/htgn/number_words.py, the tiny-cpu preset) or digits
(configs/htgn/digits.py, the 8x8 image classifier): HTGN as configured;
`ablation=no_graph` (no WinGAT and Cross-Graph: a Performer encoder-decoder); `ablation=no_hrpe` (HRPE
replaced by learned absolute position embeddings: the card's "traditional absolute PE"); the card's
preset (`:card`); and the softmax Transformer
of the same size for reference. The card's other arm, HRPE removed with no position signal at all, has
no switch in the model and is not a cell. Metrics (number words): best validation BLEU and exact match
over the evaluations, and the best validation checkpoint's test BLEU (`--eval_only --eval_split=test`
after each run); (digits) the best and the last test accuracy, digits having no validation split.
Budget: the configs' 2,000 steps at batch 64. Smoke: HTGN and no_graph, 2-step runs, one seed.
"""
from zoo_core import study
from zoo_core.configs import studies

ARMS = {"HTGN": "", "no graph": "ablation=no_graph", "absolute PE (no HRPE)": "ablation=no_hrpe",
        "HTGN card preset": "card", "softmax Transformer": "attention=softmax"}


def get_study(arg=None):
    a = studies.args(arg, task="number_words")
    config, metrics, evaluate, task = studies.htgn_task(a)
    arms = {k: ARMS[k] for k in ("HTGN", "no graph")} if a.smoke else ARMS
    cells = [study.Cell(label, dict(arm=config_args or "none"), config=config + studies.smoke_arg(a, config_args))
             for label, config_args in arms.items()]
    return study.Study(
        name="htgn_ablation", title=f"HTGN card ablation: graph convolution, HRPE, absolute PE ({task})",
        module="htgn_jax.train", config=config, cells=cells,
        seeds=studies.seeds(a, (0, 1, 2, 3, 4), default=3), metrics=metrics, evaluate=evaluate)
