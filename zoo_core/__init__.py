"""Shared core of the linear-attention zoo: trainer, optimisers, checkpoints, data, sharding.

Shape letters used in every docstring of the zoo:

    B batch, T time (sequence length), H heads, D key/query head width, M value head width
    (or number of random features in FAVOR+), E model width, C chunk length (or channels in
    time series), N graph nodes, K polynomial order / classes, V vocabulary.

The packages: `ops` (the shared maths: linear attention, packing, context parallelism, the NaN guard,
masks, positions), `attention` (the registry) and `baselines`, `run` (the trainer; its public names:
`zoo_core.trainer`), `bench` (the benchmark harness), `data`, `tasks`, `study`. The few leaves: `checks`
(boundary errors), `costs` (XLA's costs), `testing`. This module imports nothing heavy; import the
submodules you need. The public modules and names: docs/api.md; the module paths of 0.1.0 that moved
import from their old place with a DeprecationWarning (`zoo_core.moved`).
"""
from zoo_core import moved as _moved

__version__ = "0.2.0"

_moved.install()
