"""AGF Table 6 (agf.md; seed 000 §5): the graph filter against its ablations H_UV^T and H_SVD.

    python -m zoo_core.study configs/studies/agf_filter.py --workdir runs/study_agf_filter
    python -m zoo_core.study configs/studies/agf_filter.py:seeds=3 --workdir runs/study_agf_filter \
        --set total_steps=340
    python -m zoo_core.study configs/studies/agf_filter.py:smoke --workdir /tmp/agf_filter_smoke

Cells: the config argument `graph_filter` in uvt (H_UV^T: singular vectors only, singular values fixed
at one), svd (H_SVD: learnable singular values initialised at one), agf (the polynomial filter) on UEA
`dataset` (default JapaneseVowels) with the reference's other settings; the smoke variant runs H_UV^T and
AGF. Metric: the UEA protocol's best test accuracy, and the last. Budget and seeds as agf_order.
"""
from zoo_core import study
from zoo_core.configs import studies

FILTERS = ("uvt", "svd", "agf")


def get_study(arg=None):
    a = studies.args(arg, dataset="JapaneseVowels", source_dir="")
    config_args = f"dataset={a.dataset}" + (f",source_dir={a.source_dir}" if a.source_dir else "")
    names = {"uvt": "H_UV^T", "svd": "H_SVD", "agf": "AGF"}
    # The filter is a config argument, not a field override: the config then drops the polynomial's
    # settings (basis, order, learn_c0) that H_UV^T and H_SVD do not have.
    filters = ("uvt", "agf") if a.smoke else FILTERS
    base = "configs/agf/uea.py"
    cells = [study.Cell(names[f], dict(graph_filter=f),
                        config=base + studies.smoke_arg(a, f"{config_args},graph_filter={f}"))
             for f in filters]
    return study.Study(
        name="agf_filter", title=f"AGF Table 6: graph filter ablation on UEA {a.dataset}",
        module="agf_jax.train", config=base + studies.smoke_arg(a, config_args), cells=cells,
        seeds=studies.seeds(a, (666, 1, 2, 3, 4), default=3),
        metrics=[study.Best("eval/accuracy", "max", label="best test accuracy"),
                 study.Last("eval/accuracy", label="last test accuracy")])
