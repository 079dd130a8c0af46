"""Self-test entry of the shared trainer: an MLP on the synthetic task (see configs/core/synthetic.py)."""
from zoo_core import main, models

if __name__ == "__main__":
    main.run(models.MLPClassifier)
