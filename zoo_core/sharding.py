"""Data parallelism: a 1-D 'data' mesh over all devices (default) and the legacy pmap layout.

jit mode: parameters and optimiser state are replicated (`P()`), batches are split on their leading axis
(`P('data')`) across every device of every process. Each process passes only its own rows; they are
assembled into one global array with `jax.make_array_from_process_local_data`.
pmap mode (`config.parallel.mode = 'pmap'`): the state is replicated with a leading device axis and
every batch is reshaped to [local_devices, B / local_devices, ...].
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def make_mesh() -> Mesh:
    """One 'data' axis over all devices of all processes."""
    return Mesh(np.asarray(jax.devices()), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA_AXIS))


def numeric(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drops host-only features (strings, bytes) that have no place on a device."""
    return {k: v for k, v in batch.items() if np.asarray(v).dtype.kind in "biuf"}


def global_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's rows of a batch -> one global array per feature, split over the 'data' axis."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in numeric(batch).items()}


def pmap_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """[B, ...] -> [local_devices, B / local_devices, ...] for pmap."""
    n = jax.local_device_count()
    return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in numeric(batch).items()}


def replicate_for_pmap(tree: Any) -> Any:
    """Adds a leading local-device axis to every leaf, one copy per local device."""
    from flax import jax_utils  # flax's helper survives the removal of jax.device_put_replicated
    return jax_utils.replicate(tree)


def unreplicate(tree: Any) -> Any:
    """Takes device 0's copy of a pmap-replicated tree."""
    return jax.tree_util.tree_map(lambda x: x[0], tree)
