"""The trainer, one concern a module, in the order a training command walks them:

    <package>.train -> run.main.run -> run.setup.check_setup -> run.loop.train_and_evaluate
                                                               -> run.setup.compile_steps -> run.steps

* `main`: the command line of every `python -m <package>.train` (flags, `--eval_only`, one `error:` line
  per mistake); `flag_errors` words absl's and ml_collections' parse errors as one line.
* `setup_checks`: checks that need no compile (`validate_config`, `check_workdir`, the model's
  constructor, the eval metrics).
* `setup`: the run's setup, each piece built once and checked as it is built (`check_setup`,
  `RunSetup`), the state restored or initialised (`restore_or_init`), the compiled steps
  (`compile_steps`), which the benchmarks share (`zoo_core.bench.train_step`).
* `prepare`: `prepare_data`, the dataset built on first use.
* `resume`: which config changes a resumed run may make (`check_resume`, `SAFE_ON_RESUME`).
* `loop`: `train_and_evaluate` and the hooks after every step (log, eval with the best checkpoint and
  early stopping, checkpoint, signal), and the run's closing summary line.
* `steps`: `TrainState` and the pure `train_step` / `eval_step`.
* `evaluation`: `evaluate_params`, `evaluate_checkpoint` (`--eval_only`), `load_params`.
* `guard` (SIGTERM / Ctrl-C, the workdir lock), `output` (prints that a closed pipe cannot stop), `log`
  (what a run logs), `errors` (`ConfigError`, `NonFiniteError`).

This package's `__init__` imports nothing: `zoo_core.trainer` is the public facade that re-exports the
names a user calls (`train_and_evaluate`, `evaluate_checkpoint`, `load_params`, ...).
"""
