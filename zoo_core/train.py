"""Self-test entry of the shared trainer: an MLP on the synthetic task (see configs/core/synthetic.py)."""
from zoo_core import mlp_classifier
from zoo_core.run import allocator, main

if __name__ == "__main__":
    allocator.restart_with_huge_pages()   # before any work: see zoo_core.run.allocator
    main.run(mlp_classifier.Model)
