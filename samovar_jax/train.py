"""Training entry point for SAMoVAR (Lu & Yang, ICML 2025) and its baselines on the shared zoo trainer.

    python -m samovar_jax.train --config configs/samovar/synthetic_var.py --workdir runs/samovar_var
    python -m samovar_jax.train --config configs/samovar/forecasting.py:kind=dlinear --workdir runs/dlinear_vic

`config.model.kind` selects the model (`samovar_jax.model.Model`): 'samovar' | 'lintrans' | 'fixedvar'
or 'dlinear'. Configs with a `test_split` also evaluate it at every eval (`samovar_jax.evaluation`).
See zoo_core.run.main for the flags.
"""
from samovar_jax import evaluation, model
from zoo_core.run import allocator, main

if __name__ == "__main__":
    allocator.restart_with_huge_pages()   # before any work: see zoo_core.run.allocator
    main.run(model.Model, evaluators_fn=evaluation.evaluators_for)
