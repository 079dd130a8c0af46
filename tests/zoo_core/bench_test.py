"""Tests of the benchmark harness (the zoo_core.bench package) on tiny functions."""
import gc
import importlib.util
import json
import weakref

import jax
import jax.numpy as jnp
import pytest

from zoo_core import bench
from zoo_core.testing import TESTDATA


def _gram_sum(x):  # [T, D] -> scalar; XLA keeps the [T, T] Gram matrix as a temp buffer
    return jax.nn.softmax(x @ x.T).sum()


def _make_gram(case, n):
    return _gram_sum, (jax.ShapeDtypeStruct((n, 8), jnp.float32),)


def test_time_jitted_repeats_and_positive_times():
    out = bench.time_jitted(_gram_sum, jnp.ones((16, 8)), warmup=1, repeats=4)
    assert len(out["all_s"]) == 4
    assert all(t > 0 for t in out["all_s"])
    assert 0 < out["min_s"] <= out["median_s"] <= max(out["all_s"])
    assert out["compile_s"] > 0


def test_time_jitted_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats"):
        bench.time_jitted(_gram_sum, jnp.ones((16, 8)), repeats=0)


def test_compiled_memory_grows_with_size():
    small = bench.compiled_memory(_gram_sum, jax.ShapeDtypeStruct((64, 8), jnp.float32))
    large = bench.compiled_memory(_gram_sum, jax.ShapeDtypeStruct((256, 8), jnp.float32))
    for mem in (small, large):
        assert all(isinstance(v, int) and v >= 0 for v in mem.values()), mem
    assert large["temp_bytes"] > small["temp_bytes"] >= 64 * 64 * 4
    assert large["argument_bytes"] == 256 * 8 * 4
    assert large["total_bytes"] >= large["temp_bytes"] + large["argument_bytes"]


def test_reference_matmul_and_process_memory():
    assert bench.reference_matmul(64, warmup=0, repeats=2) > 0
    mem = bench.process_memory()
    assert mem["peak_rss_bytes"] >= mem["rss_bytes"] > 0
    device = bench.device_memory()  # None on CPU, which keeps no statistics
    assert device is None or all(isinstance(v, int) for v in device.values())


def test_run_scaling_guard_skips_and_stops_case():
    seen = []

    def make_fn(case, n):
        seen.append((case, n))
        return _make_gram(case, n)

    # 64x64 floats fit in 64 KiB; 512x512 (1 MiB temp) do not, and 1024 must not even be tried.
    records = bench.run_scaling(["a", "b"], [64, 512, 1024], make_fn, repeats=2, max_bytes=2**16,
                                mem_factor=1.0, ref_n=64)
    assert seen == [("a", 64), ("a", 512), ("b", 64), ("b", 512)]
    assert [(r.case, r.n, r.status) for r in records] == [
        ("a", 64, "ok"), ("a", 512, "skipped"), ("b", 64, "ok"), ("b", 512, "skipped")]
    ok, skipped = records[0], records[1]
    assert len(ok.all_s) == 2 and ok.median_s > 0 and ok.est_bytes <= 2**16
    assert ok.flops > 0 and ok.gflops > 0 and ok.ref_gflops > 0 and ok.frac_peak > 0
    assert skipped.est_bytes > 2**16 and "max_bytes" in skipped.reason
    assert skipped.median_s is None and skipped.all_s is None


@pytest.fixture
def unfrozen():
    """A process with no frozen objects, as a user's (the suite's conftest freezes the objects all tests share)."""
    gc.unfreeze()
    yield
    gc.freeze()


def test_run_scaling_records_oom_and_reraises_other_errors(unfrozen):
    def make_fn(case, n):
        if n > 16:
            raise MemoryError("cannot allocate")
        return _make_gram(case, n)

    records = bench.run_scaling(["a"], [16, 32, 64], make_fn, repeats=1, max_bytes=2**30, ref_n=None)
    assert [(r.n, r.status) for r in records] == [(16, "ok"), (32, "oom")]
    assert "cannot allocate" in records[1].reason

    def broken(case, n):
        raise TypeError("a bug, not a benchmark result")

    with pytest.raises(TypeError):
        bench.run_scaling(["a"], [16], broken, max_bytes=2**30, ref_n=None)
    assert gc.get_freeze_count() == 0, "the sweep unfreezes the caller's objects however it ends"
    with pytest.raises(ValueError, match="ascending"):
        bench.run_scaling(["a"], [32, 16], _make_gram, max_bytes=2**30)


class _Cyclic:
    def __init__(self):
        self.me = self          # a reference cycle: only the cyclic collector frees it


def test_run_scaling_collects_each_records_garbage_with_the_callers_objects_frozen(unfrozen):
    made, frozen = [], []

    def make_fn(case, n):
        made.append(weakref.ref(_Cyclic()))
        frozen.append(gc.get_freeze_count())
        return _make_gram(case, n)

    bench.run_scaling(["a"], [16, 32], make_fn, repeats=1, max_bytes=2**30, ref_n=None)
    assert [r() for r in made] == [None, None]
    assert min(frozen) > 0 and gc.get_freeze_count() == 0
    gc.freeze()                 # a caller's own freeze stays
    try:
        bench.run_scaling(["a"], [16], _make_gram, repeats=1, max_bytes=2**30, ref_n=None)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_write_records_and_plot(tmp_path):
    records = bench.run_scaling(["a"], [16, 32, 512], _make_gram, repeats=1, max_bytes=2**16,
                                mem_factor=1.0, ref_n=64)
    path = bench.write_records(tmp_path / "out" / "r.json", records, dict(benchmark="test"))
    data = json.loads(path.read_text())
    assert data["meta"]["benchmark"] == "test" and not list(path.parent.glob("*.tmp"))
    assert data["meta"]["backend"] == "cpu" and data["meta"]["jax"] == jax.__version__
    assert data["meta"]["ref_gflops"] == max(r.ref_gflops for r in records if r.ref_gflops)
    assert [r["status"] for r in data["records"]] == ["ok", "ok", "skipped"]
    png = bench.plot(data["records"], tmp_path / "r.png", title="t", max_bytes=2**16)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "skipped" in bench.format_table(records)
    # Every record skipped: the plot is still written (no log-scale error on an empty panel).
    skipped = [r for r in data["records"] if r["status"] == "skipped"]
    assert bench.plot(skipped, tmp_path / "none.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measured_memory_is_unknown_when_the_rss_did_not_grow():
    row = dict(device_peak_bytes=None, peak_rss_per_record=True, rss_base_bytes=1000)
    assert bench._measured_bytes(dict(row, peak_rss_bytes=1000)) is None
    assert bench._measured_bytes(dict(row, peak_rss_bytes=1500)) == 500
    assert bench._measured_bytes(dict(row, device_peak_bytes=7, peak_rss_bytes=1500)) == 7


def test_softmax_attention_script_runs(tmp_path):
    # benchmarks/ is not an installed package: load the script from the repo by path.
    path = TESTDATA.parent.parent / "benchmarks" / "softmax_attention.py"
    spec = importlib.util.spec_from_file_location("softmax_attention_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    records = module.main(["--lengths", "16,32", "--heads", "2", "--head_dim", "4", "--repeats",
                           "1", "--ref_n", "64", "--mem_factor", "1.5", "--out_dir", str(tmp_path)])
    assert [r.status for r in records] == ["ok", "ok"]
    assert all(r.guard_factor >= 1.5 for r in records)   # the starting factor, raised only by measurement
    with pytest.raises(SystemExit):
        module.parse_args(["--mem_factor", "0"])
    for r in records:   # the roofline bound, from the bandwidth measured once in the same process
        assert r.bound_s > 0 and r.frac_roofline == pytest.approx(r.bound_s / r.median_s)
    assert json.loads((tmp_path / "softmax_attention.json").read_text())["meta"]["peak_gbps"] > 0
    assert (tmp_path / "softmax_attention.png").exists()


def test_cost_of_counts_a_matmul():
    spec = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    cost = bench.cost_of(jnp.matmul, spec, spec)
    assert cost["flops"] == pytest.approx(2 * 64**3, rel=0.05)
    assert cost["bytes_accessed"] >= 3 * 64 * 64 * 4


def test_reference_bandwidth_and_machine_bounds():
    assert bench.reference_bandwidth(2**20, warmup=0, repeats=2) > 0
    bounds = bench.machine_bounds(matmul_n=64, bandwidth_bytes=2**20, repeats=1)
    assert bounds["peak_gflops"] > 0 and bounds["peak_gbps"] > 0
    assert bounds["matmul_n"] == 64 and bounds["matmul_dtype"] == "float32"


def test_best_bounds_takes_each_peak_at_its_best():
    a = dict(peak_gflops=300.0, peak_gbps=40.0, matmul_n=2048)
    b = dict(peak_gflops=280.0, peak_gbps=85.0, matmul_n=2048)
    best = bench.best_bounds([a, b])
    assert best == dict(peak_gflops=300.0, peak_gbps=85.0, matmul_n=2048, samples=2)
    with pytest.raises(ValueError, match="at least one"):
        bench.best_bounds([])


def test_roofline_fractions_and_bound():
    cost = dict(flops=2e9, bytes_accessed=4e9)
    r = bench.roofline(cost, 1.0, dict(peak_gflops=10.0, peak_gbps=8.0))
    assert r["gflops"] == pytest.approx(2.0) and r["gbps"] == pytest.approx(4.0)
    assert r["frac_compute"] == pytest.approx(0.2) and r["frac_memory"] == pytest.approx(0.5)
    # compute bound 0.2 s, memory bound 0.5 s: the memory bound is the roofline.
    assert r["bound"] == "memory" and r["bound_s"] == pytest.approx(0.5)
    assert r["frac_bound"] == pytest.approx(0.5)
    bare = bench.roofline(dict(flops=None, bytes_accessed=None), 2.0)
    assert bare["gflops"] is None and bare["bound_s"] is None
    assert len(bench.format_roofline(r)) == len(bench.ROOFLINE_HEADER)
    with pytest.raises(ValueError):
        bench.roofline(cost, 0.0)


def test_time_state_step_threads_the_state():
    step = jax.jit(lambda s, x: (s + x, s.sum()), donate_argnums=(0,))
    timing, state = bench.time_state_step(step, jnp.zeros(4), jnp.ones(4), warmup=1, repeats=3)
    assert len(timing["all_s"]) == 3 and timing["median_s"] > 0
    assert float(state[0]) == 4.0


def test_run_scaling_deadline_skips_the_rest_and_records_bytes():
    import time

    records = bench.run_scaling(["a", "b"], [16, 32], _make_gram, repeats=1, max_bytes=2**30, ref_n=None,
                                deadline=time.monotonic() - 1)
    assert [(r.case, r.n, r.status, r.reason) for r in records] == [
        (c, n, "skipped", "time budget spent") for c in "ab" for n in (16, 32)]
    ok = bench.run_scaling(["a"], [16], _make_gram, repeats=1, max_bytes=2**30, ref_n=None)[0]
    assert ok.bytes_accessed > 0 and ok.gbps > 0
    assert "GB/s" in bench.format_table([ok])


def test_train_step_setup_costs_the_whole_step_with_micro_batches(tmp_path):
    """XLA's cost analysis counts the micro-batch loop's body once; the step's cost is that of the
    same step on the whole batch."""
    from zoo_core import mlp_classifier
    from zoo_core.configs.core import synthetic

    def cost(accum):
        c = synthetic.get_config("smoke")
        with c.unlocked():
            c.data.data_dir = str(tmp_path)
            c.batch_size = 8
            c.optim.grad_accum_steps = accum
        return bench.train_step_setup(c, mlp_classifier.Model)["cost"]

    whole, micro = cost(1), cost(4)
    assert whole["flops"] > 0 and micro == whole


def test_train_step_setup_times_the_step_the_trainer_runs(tmp_path, monkeypatch):
    """The benchmark's step comes from the trainer's own setup (`run_setup.compile_steps`), and it lowers
    to the very program that `train_and_evaluate` compiles and runs for the same config."""
    from zoo_core import mlp_classifier, trainer
    from zoo_core.configs.core import synthetic
    from zoo_core.run import loop
    from zoo_core.run import setup as run_setup

    c = synthetic.get_config("smoke")
    with c.unlocked():
        c.data.data_dir = str(tmp_path / "data")
        c.total_steps, c.eval_every_steps, c.checkpoint_every_steps = 1, 0, 0
    made = []

    def recording(compile_steps):
        def compile_and_record(*args, **kwargs):
            made.append(compile_steps(*args, **kwargs))
            return made[-1]
        return compile_and_record

    monkeypatch.setattr(run_setup, "compile_steps", recording(run_setup.compile_steps))
    timed = bench.train_step_setup(c, mlp_classifier.Model)
    assert len(made) == 1 and timed["step"] is made[0].train
    monkeypatch.setattr(loop, "compile_steps", recording(loop.compile_steps))
    trainer.train_and_evaluate(c, str(tmp_path / "run"), mlp_classifier.Model)
    assert len(made) == 2
    state, batch = timed["state"], timed["batch"]
    assert made[1].train.lower(state, batch).as_text() == timed["step"].lower(state, batch).as_text()
