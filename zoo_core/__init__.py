"""Shared core of the linear-attention zoo: trainer, optimisers, checkpoints, data, sharding.

Shape letters used in every docstring of the zoo:

    B batch, T time (sequence length), H heads, D key/query head width, M value head width
    (or number of random features in FAVOR+), E model width, C chunk length (or channels in
    time series), N graph nodes, K polynomial order / classes, V vocabulary.

The trainer is the package `zoo_core.run` (its public names: `zoo_core.trainer`), the benchmark harness
the package `zoo_core.bench`; the rest are leaf modules both use (optim, checkpoint, sharding, tasks,
costs, data, ...). This module imports nothing heavy; import the submodules you need.
"""

__version__ = "0.1.0"
