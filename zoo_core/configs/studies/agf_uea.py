"""AGF Table 1 (agf.md §3.2): test accuracy on the ten UEA data sets for every self-attention mechanism.

    python -m zoo_core.study configs/studies/agf_uea.py --workdir runs/study_agf_uea
    python -m zoo_core.study configs/studies/agf_uea.py:source_dir=/data/Multivariate_ts --workdir runs/study_agf_uea
    python -m zoo_core.study configs/studies/agf_uea.py:smoke --workdir /tmp/agf_uea_smoke

Cells: the paper's ten data sets (configs/agf/uea.py's REFERENCE less BasicMotions) x every name of
`zoo_core.attention.names("self")` read when the study loads, so mechanisms registered later join the
grid (`:attention=NAME` of configs/agf/uea.py). Data: JapaneseVowels ships in the package; the other nine
are fetched from the UEA archive on first use (`python -m zoo_core.data.download uea` fetches them ahead;
docs/data.md), or read from `source_dir=DIR` (the unpacked Multivariate2018_ts.zip); offline and
uncached, a cell is recorded as failed with the data's one-line error. Metric: the UEA protocol's best
test accuracy over the evaluations (epochs 1, 2, 4, ..., the last) and the last one. Budget: the
reference's 100 epochs (PEMS-SF 400) at batch 16; JapaneseVowels about 7 min a run on an idle 2-core
CPU, the large sets (FaceDetection, PEMS-SF, SpokenArabicDigits) need an accelerator. Seeds: 666 (the
reference's) first. Smoke: JapaneseVowels x {agf, softmax}, 2-step runs, one seed.
"""
from zoo_core import attention, study
from zoo_core.configs import studies
from zoo_core.configs.agf import uea

DATASETS = tuple(d for d in uea.REFERENCE if d != "BasicMotions")   # the paper's ten


def get_study(arg=None):
    a = studies.args(arg, source_dir="")
    datasets = ("JapaneseVowels",) if a.smoke else DATASETS
    mechanisms = ("agf", "softmax") if a.smoke else attention.names("self")
    cells = []
    for dataset in datasets:
        for name in mechanisms:
            config_args = f"dataset={dataset},attention={name}" + (f",source_dir={a.source_dir}" if a.source_dir else "")
            cells.append(study.Cell(f"{dataset} {name}", dict(dataset=dataset, attention=name),
                                    config="configs/agf/uea.py" + studies.smoke_arg(a, config_args)))
    return study.Study(
        name="agf_uea", title="AGF Table 1: UEA test accuracy, every self-attention mechanism",
        module="agf_jax.train", config="configs/agf/uea.py", cells=cells,
        seeds=studies.seeds(a, (666, 1, 2, 3, 4), default=1),
        metrics=[study.Best("eval/accuracy", "max", label="best test accuracy"),
                 study.Last("eval/accuracy", label="last test accuracy")],
        notes=["UEA protocol (agf.md §3.2): the test split is evaluated after epochs 1, 2, 4, ..., the last; "
               "'best' is the maximum over these evaluations, as the reference reports."])
