"""HTGN card §9: "compare configurations of r_head / heads to find the best balance".

    python -m zoo_core.study configs/studies/htgn_rank_heads.py --workdir runs/study_htgn_rank_heads
    python -m zoo_core.study configs/studies/htgn_rank_heads.py:heads=4-8,ranks=4 --workdir runs/rank
    python -m zoo_core.study configs/studies/htgn_rank_heads.py:task=digits --workdir runs/rank_digits
    python -m zoo_core.study configs/studies/htgn_rank_heads.py:smoke --workdir /tmp/htgn_rank_smoke

Cells on `task` number_words (En -> De, configs/htgn/number_words.py, tiny-cpu preset, d = 64) or
digits (configs/htgn/digits.py, d = 64 as well): heads h in
`heads` (`--config.model.num_heads`, default 2-4-8, head width 64 / h) x the query/key rank r_head in
`ranks` below the head width (`--config.model.qk_rank`, the card's low-rank W^Q, W^K) plus the full
head width (no override). Metrics: the task's headline (best validation BLEU on number words, best
test accuracy on digits) and the training speed (train/steps_per_second at the last log): the balance
the card asks for. The figure: the headline against r_head, one line per head count. Smoke: 4 heads at full rank,
2-step run, one seed.
"""
from zoo_core import study
from zoo_core.configs import studies

D_MODEL = 64   # the tiny-cpu and digits presets (htgn.md §5.12)


def get_study(arg=None):
    a = studies.args(arg, task="number_words", heads="2-4-8", ranks="4-8")
    config, metrics, evaluate, task = studies.htgn_task(a)
    cells = []
    for h in ([4] if a.smoke else studies.ints(a.heads)):
        if D_MODEL % h:
            raise ValueError(f"study argument heads: {h} does not divide d_model {D_MODEL}")
        width = D_MODEL // h
        heads = [f"--config.model.num_heads={h}"] if h != 4 else []   # 4: the presets' own
        for r in ([] if a.smoke else [r for r in studies.ints(a.ranks) if r < width]):
            cells.append(study.Cell(f"heads={h} r_head={r}", dict(heads=h, r_head=r),
                                    overrides=heads + [f"--config.model.qk_rank={r}"]))
        cells.append(study.Cell(f"heads={h} r_head={width} (full)", dict(heads=h, r_head=width), overrides=heads))
    return study.Study(
        name="htgn_rank_heads", title=f"HTGN card: query/key rank r_head against heads ({task})",
        module="htgn_jax.train", config=config + studies.smoke_arg(a), cells=cells,
        seeds=studies.seeds(a, (0, 1, 2, 3, 4), default=2),
        metrics=[metrics[0], study.Last("train/steps_per_second", label="train steps/s")], evaluate=evaluate,
        plot=study.Curve(x="r_head", series="heads"))
