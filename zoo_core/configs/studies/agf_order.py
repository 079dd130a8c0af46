"""AGF Table 3 (agf.md §3.2): sensitivity to the polynomial order K on UEA.

    python -m zoo_core.study configs/studies/agf_order.py --workdir runs/study_agf_order
    python -m zoo_core.study configs/studies/agf_order.py:orders=1-2-4-8,seeds=3 --workdir runs/study_agf_order \
        --set total_steps=340
    python -m zoo_core.study configs/studies/agf_order.py:smoke --workdir /tmp/agf_order_smoke

Cells: K in `orders` (default 1-2-3-4-5-6-8-10) on `dataset` (default JapaneseVowels, which ships in the
package; the others are fetched on first use, docs/data.md), every other setting the reference's best for that data set
(configs/agf/uea.py; JapaneseVowels: Legendre, no fixI, gamma 0.01, tuned K = 4). Metric: the UEA
protocol's best test accuracy over the evaluations, and the last. The figure: accuracy against K.
Budget: 100 epochs (1,700 steps on JapaneseVowels, about 7 min a run on an idle 2-core CPU);
`--set total_steps=N` shortens every run. Seeds: 666 (the reference's), 1, 2, ... Smoke: K in {2, 4},
2-step runs, one seed.
"""
from zoo_core import study
from zoo_core.configs import studies


def get_study(arg=None):
    a = studies.args(arg, dataset="JapaneseVowels", orders="1-2-3-4-5-6-8-10", source_dir="")
    orders = [2, 4] if a.smoke else studies.ints(a.orders)
    config_args = f"dataset={a.dataset}" + (f",source_dir={a.source_dir}" if a.source_dir else "")
    config = "configs/agf/uea.py" + studies.smoke_arg(a, config_args)
    cells = [study.Cell(f"K={k}", dict(K=k), overrides=[f"--config.model.order={k}"]) for k in orders]
    return study.Study(
        name="agf_order", title=f"AGF Table 3: polynomial order K on UEA {a.dataset}",
        module="agf_jax.train", config=config, cells=cells,
        seeds=studies.seeds(a, (666, 1, 2, 3, 4), default=3),
        metrics=[study.Best("eval/accuracy", "max", label="best test accuracy"),
                 study.Last("eval/accuracy", label="last test accuracy")],
        plot=study.Curve(x="K"))
