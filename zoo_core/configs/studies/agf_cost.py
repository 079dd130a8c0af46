"""AGF Table 5 (seed 000 §5): time and peak memory of training against sequence length, every mechanism.

    python -m zoo_core.study configs/studies/agf_cost.py --workdir runs/study_agf_cost
    python -m zoo_core.study configs/studies/agf_cost.py:lengths=1024-4096-16384-65536 --workdir runs/cost_gpu
    python -m zoo_core.study configs/studies/agf_cost.py:smoke --workdir /tmp/agf_cost_smoke

Benchmark cells, not training runs: forward + backward of the attention core at batch 1 against the
length N (our reading of Table 5, whose training-phase time and memory the paper reports per LRA task;
here the mechanism alone, the rest of the model being the same for all). Cells:
* every `zoo_core.attention.names("self")` mechanism, read at load time, through the registry-wide
  benchmark `benchmarks.attention_scaling --cases NAME`;
* AGF and softmax through `benchmarks.agf_scaling` (AGF's own kernel with its orthogonality term, the
  reference's ListOps filter).
Metrics per (cell, N): the median time of a step (s) and XLA's compiled memory (MiB; the peak on an
accelerator is the benchmark's device_peak_bytes). Lengths whose compiled estimate exceeds the memory
guard are skipped by the benchmark (softmax stops there). The figure: time against N, log-log. Heads:
`setting` lra (2 x 32) or uea (8 x 64). CPU: 1K..16K in minutes; 64K needs an accelerator. Smoke: the
agf_scaling cells at N = 64, 128, one repeat.
"""
from zoo_core import attention, study
from zoo_core.configs import studies

SETTINGS = {"lra": (2, 32), "uea": (8, 64)}   # heads, head width: benchmarks/agf_scaling.py's settings


def get_study(arg=None):
    a = studies.args(arg, lengths="1024-2048-4096-8192-16384", setting="lra", budget_s=600.0)
    if a.setting not in SETTINGS:
        raise ValueError(f"study argument setting={a.setting!r}; choose one of {', '.join(SETTINGS)}")
    heads, head_dim = SETTINGS[a.setting]
    lengths = "64,128" if a.smoke else ",".join(str(n) for n in studies.ints(a.lengths))
    common = ["--lengths", lengths, "--repeats", "1" if a.smoke else "3", "--budget_s", f"{a.budget_s:g}",
              "--out_dir", "{run_dir}", "--name", "bench"]
    cells = [study.Cell(f"{case} (agf_scaling)", dict(mechanism=case, benchmark="agf_scaling"),
                        command=["-m", "benchmarks.agf_scaling", "--cases", case, "--setting", a.setting, *common])
             for case in ("agf", "softmax")]
    if not a.smoke:
        cells += [study.Cell(f"{name}", dict(mechanism=name, benchmark="attention_scaling"),
                             command=["-m", "benchmarks.attention_scaling", "--cases", name, "--heads", str(heads),
                                      "--head_dim", str(head_dim), *common])
                  for name in attention.names("self")]
    return study.Study(
        name="agf_cost", title="AGF Table 5: attention fwd+bwd time and memory against length",
        module="agf_jax.train", config="configs/agf/lra_listops.py", cells=cells,
        metrics=[study.BenchRecords("median_s", "time (s)"),
                 study.BenchRecords("memory.total_bytes", "XLA memory (MiB)", scale=2.0 ** -20),
                 study.BenchRecords("device_peak_bytes", "device peak (MiB)", scale=2.0 ** -20)],
        plot=study.Curve(x="n", series="cell", log_x=True, log_y=True))
