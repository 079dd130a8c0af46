"""Orbax checkpoints: abstract restore, last-N plus best, damaged newest checkpoint falls back."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo_core.run.checkpoint import Checkpoints


def _state(v):
    return {"params": {"w": jnp.full((3,), v, jnp.float32)}, "step": jnp.asarray(int(v), jnp.int32)}


def _abstract():
    return jax.eval_shape(lambda: _state(0.0))


def test_save_restore_against_abstract_state(tmp_path):
    ck = Checkpoints(str(tmp_path), keep=2)
    for step in (1, 2, 3):
        ck.save(step, _state(float(step)), {"seed": 0})
    assert ck.last.all_steps() == [2, 3]                      # keep=2
    step, state = ck.restore_latest(_abstract())
    assert step == 3
    np.testing.assert_array_equal(state["params"]["w"], np.full(3, 3.0))
    assert os.path.exists(tmp_path / "checkpoints" / "3" / "config")
    ck.close()


def test_best_checkpoint_is_kept_beside_the_last_n(tmp_path):
    ck = Checkpoints(str(tmp_path), keep=1, best_metric="eval/accuracy", best_mode="max")
    for step, acc in ((1, 0.5), (2, 0.9), (3, 0.7)):
        ck.save(step, _state(float(step)), {})
        ck.maybe_save_best(step, _state(float(step)), {}, {"eval/accuracy": acc})
    assert ck.last.all_steps() == [3] and ck.best.all_steps() == [2]
    ck.close()
    again = Checkpoints(str(tmp_path), keep=1, best_metric="eval/accuracy")
    again.restore_latest(_abstract())
    assert again.best_value == pytest.approx(0.9)              # best tracking survives a restart
    with pytest.raises(ValueError, match="best_metric"):
        again.maybe_save_best(4, _state(4.0), {}, {"eval/loss": 1.0})
    again.close()


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, damage, caplog):
    ck = Checkpoints(str(tmp_path), keep=3)
    for step in (1, 2):
        ck.save(step, _state(float(step)), {})
    ck.close()
    state_dir = tmp_path / "checkpoints" / "2" / "state"
    files = [os.path.join(d, f) for d, _, fs in os.walk(state_dir) for f in fs]
    for f in files:
        if damage == "truncate":
            with open(f, "r+b") as fh:
                fh.truncate(max(os.path.getsize(f) // 3, 0))
        else:
            os.remove(f)
    ck = Checkpoints(str(tmp_path), keep=3)
    with caplog.at_level("WARNING"):
        step, state = ck.restore_latest(_abstract())
    assert step == 1
    np.testing.assert_array_equal(state["params"]["w"], np.full(3, 1.0))
    assert any("damaged" in r.getMessage() for r in caplog.records)
    assert os.listdir(tmp_path / "damaged") == ["2-0"]         # moved aside, not deleted
    ck.save(2, _state(20.0), {})                               # the step can be written again
    assert ck.restore_latest(_abstract())[0] == 2
    ck.close()


def test_restore_params_of_a_missing_run_raises_and_creates_nothing(tmp_path):
    from zoo_core.run import checkpoint
    for which in ("checkpoints", "best"):
        with pytest.raises(FileNotFoundError, match=f"no checkpoint under .*{which}"):
            checkpoint.restore_params(str(tmp_path / "run"), which=which)
    assert not (tmp_path / "run").exists()


def test_a_run_without_a_best_checkpoint_points_to_the_latest(tmp_path):
    from zoo_core.run import checkpoint
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)     # trained with checkpoint.best_metric=''
    with pytest.raises(FileNotFoundError, match="keeps no best checkpoint .* --checkpoint=latest"):
        checkpoint.require_checkpoints(str(tmp_path / "run"), "best")
