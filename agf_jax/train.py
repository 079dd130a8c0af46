"""Training entry point for AGF (Wi, Choi, Park, IJCAI 2025) on the shared zoo trainer.

    python -m agf_jax.train --config configs/agf/uea.py:dataset=JapaneseVowels --workdir runs/agf_jv
    python -m agf_jax.train --config configs/agf/lra_listops.py:smoke --workdir /tmp/agf_listops

The configs in configs/agf/ hold the reference's best hyperparameters per task; see zoo_core.run.main for
the flags.
"""
from agf_jax import model
from zoo_core.run import allocator, main

if __name__ == "__main__":
    allocator.restart_with_huge_pages()   # before any work: see zoo_core.run.allocator
    main.run(model.Model)
