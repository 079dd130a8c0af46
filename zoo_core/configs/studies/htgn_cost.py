"""HTGN card §9's efficiency claims (memory -20%, training speed +30% against the Transformer), measured.

    python -m zoo_core.study configs/studies/htgn_cost.py --workdir runs/study_htgn_cost
    python -m zoo_core.study configs/studies/htgn_cost.py:lengths=1024-4096-16384-65536 --workdir runs/cost_gpu
    python -m zoo_core.study configs/studies/htgn_cost.py:smoke --workdir /tmp/htgn_cost_smoke

Two kinds of cells at the same width (H = 8 heads of D = 64, base-mt):
* benchmark cells (`benchmarks.htgn_scaling`): fwd+bwd time and XLA memory of HTGN's kernels (FAVOR+,
  causal FAVOR+, the windowed GAT) and of softmax attention (plain and causal) against the length N;
  the ratio HTGN / softmax at each N is the claim's test at the kernel level;
* training cells: number-words HTGN against the softmax Transformer of the same size
  (configs/htgn/number_words.py, `:attention=softmax`), the training speed (train/steps_per_second at
  the last log) end to end, with the short sequences of that task.
The card's claim is for WMT14-length sequences on an accelerator; on a CPU the kernel cells up to 16K
take minutes. The figure: time against N, log-log. Smoke: favor and softmax at N = 64, 128 and 2-step
training runs of both models.
"""
from zoo_core import study
from zoo_core.configs import studies

CASES = ("favor", "favor_causal", "gat", "softmax", "softmax_causal")


def get_study(arg=None):
    a = studies.args(arg, lengths="256-1024-4096-16384", budget_s=600.0)
    lengths = "64,128" if a.smoke else ",".join(str(n) for n in studies.ints(a.lengths))
    bench = ["--lengths", lengths, "--repeats", "1" if a.smoke else "3", "--budget_s", f"{a.budget_s:g}",
             "--out_dir", "{run_dir}", "--name", "bench"]
    cases = ("favor", "softmax") if a.smoke else CASES
    cells = [study.Cell(f"{case} kernel", dict(mechanism=case),
                        command=["-m", "benchmarks.htgn_scaling", "--cases", case, *bench]) for case in cases]
    for label, config_args in (("HTGN model", ""), ("softmax model", "attention=softmax")):
        cells.append(study.Cell(label, dict(mechanism=label),
                                config="configs/htgn/number_words.py" + studies.smoke_arg(a, config_args)))
    return study.Study(
        name="htgn_cost", title="HTGN card: memory and speed against softmax attention at the same width",
        module="htgn_jax.train", config="configs/htgn/number_words.py", cells=cells,
        seeds=studies.seeds(a, (0, 1, 2), default=1),
        metrics=[study.BenchRecords("median_s", "time (s)"),
                 study.BenchRecords("memory.total_bytes", "XLA memory (MiB)", scale=2.0 ** -20),
                 study.Last("train/steps_per_second", label="train steps/s"),
                 study.Best("eval/bleu", "max", label="best validation BLEU")],
        plot=study.Curve(x="n", series="cell", log_x=True, log_y=True))
