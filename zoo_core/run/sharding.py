"""Data and context parallelism: a 'data' mesh over all devices (default), a 'data' x 'sequence' mesh
(`parallel.sequence` = P > 1), and the legacy pmap layout.

jit mode: parameters and optimiser state are replicated (`P()`), batches are split on their leading axis
(`P('data')`) across every device of every process. Each process passes only its own rows; they are
assembled into one global array with `jax.make_array_from_process_local_data`. With P > 1 the mesh is
`[devices / P, P]` over ('data', 'sequence') and the sequence features (`sequence_features`) are split
along their length too (`P('data', 'sequence')`): each device holds T / P tokens of B / (devices / P) rows.
A layer with `sequence_axis='sequence'` runs its context-parallel form there (docs/specs/context_parallel.md);
any other layer is partitioned by XLA (the same numbers, more bytes moved).
pmap mode (`config.parallel.mode = 'pmap'`): the state is replicated with a leading device axis and
every batch is reshaped to [local_devices, B / local_devices, ...].
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
SEQUENCE_AXIS = "sequence"
# The features split along their length (axis 1) with parallel.sequence > 1, where present; the packed
# features' segmentation and positions follow their feature.
SEQUENCE_FEATURES = ("inputs", "targets", "inputs_segmentation", "inputs_position", "targets_segmentation",
                     "targets_position", "segment_ids", "positions")


def cpu_device_count(requested: int, *, batch_size: int, eval_batch_size: int, accum_steps: int = 1,
                     cores: int | None = None) -> int:
    """How many CPU devices a training command starts JAX with (`config.parallel.cpu_devices`).

    XLA's CPU runtime runs each elementwise fusion on one thread; only its matmuls use every core. A
    step that is mostly elementwise work (narrow layers over long sequences, as AGF on LRA: width 64
    at 2K tokens) therefore leaves the other cores idle for most of its time. As N data-parallel
    devices, the N shards of the batch run their fusions at once. A model whose step is its matmuls
    (the 512-wide UEA model) gains nothing and loses speed that way, hence the default of one device.

    Args:
      requested: >= 1: that many devices; 0: one per core this process may run on, lowered to the
        largest count that divides batch_size into accum_steps micro-batches per device and
        eval_batch_size into equal shards (`validate_config`'s rules).
      batch_size, eval_batch_size, accum_steps: the config's.
      cores: the cores to count (default: `os.sched_getaffinity`, else `os.cpu_count()`).

    Raises:
      ValueError: `requested` is not an int >= 0.
    """
    check_cpu_devices(requested)
    if requested:
        return requested
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for n in range(max(int(cores), 1), 1, -1):
        if batch_size % (n * accum_steps) == 0 and eval_batch_size % n == 0:
            return n
    return 1


def check_cpu_devices(value: Any) -> None:
    """Raises ValueError unless `value` is a valid `parallel.cpu_devices`: an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"parallel.cpu_devices must be an int >= 0 (0: one per core), got {value!r}")


def config_cpu_devices(config, *, requested: int | None = None, cores: int | None = None) -> int:
    """`cpu_device_count` for a config: its `parallel.cpu_devices` (or `requested` instead), batch
    sizes and micro-batches."""
    return cpu_device_count(config.parallel.cpu_devices if requested is None else requested,
                            batch_size=int(config.batch_size), eval_batch_size=int(config.eval_batch_size),
                            accum_steps=max(int(config.optim.grad_accum_steps), 1), cores=cores)


def configure_cpu_devices(config) -> int:
    """Starts JAX's CPU backend with `config.parallel.cpu_devices` devices (`cpu_device_count`),
    overriding XLA_FLAGS' host device count, and returns the count. It takes effect before anything
    initialises a JAX backend (the training commands call it first); in a process where JAX has
    already started (a notebook, a test calling the command's main), the devices stay as they are,
    with a warning when the count differs."""
    n = config_cpu_devices(config)
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:   # JAX has started: its CPU device count is fixed for this process
        have = len(jax.devices("cpu"))
        if have != n:
            logging.warning("parallel.cpu_devices gives %d CPU devices, but JAX has already started with %d "
                            "in this process: running on those", n, have)
        return have
    return n


def check_sequence(sequence: Any, devices: int) -> None:
    """Raises ValueError unless `parallel.sequence` is an int >= 1 that divides the device count."""
    if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 1:
        raise ValueError(f"parallel.sequence must be an int >= 1 (1: no context parallelism), got {sequence!r}")
    if devices % sequence:
        hint = (f" (CPU devices: --config.parallel.cpu_devices={sequence} or a multiple)"
                if jax.default_backend() == "cpu" else "")
        raise ValueError(f"parallel.sequence={sequence} must divide the {devices} devices{hint}")
    if jax.process_count() > 1 and jax.local_device_count() % sequence:
        raise ValueError(f"parallel.sequence={sequence} must divide each process's {jax.local_device_count()} "
                         f"devices (each process reads whole rows)")


def make_mesh(sequence: int = 1) -> Mesh:
    """One 'data' axis over all devices of all processes; with `sequence` = P > 1, ('data', 'sequence')
    of shape [devices / P, P] (a row of P consecutive devices shares a sequence)."""
    devices = np.asarray(jax.devices())
    if sequence == 1:
        return Mesh(devices, (DATA_AXIS,))
    check_sequence(sequence, devices.size)
    return Mesh(devices.reshape(-1, sequence), (DATA_AXIS, SEQUENCE_AXIS))


def config_mesh(config) -> Mesh:
    """`make_mesh` of a config's `parallel.sequence`."""
    return make_mesh(config.parallel.get("sequence", 1))


def mesh_context(mesh: Mesh):
    """`jax.set_mesh(mesh)` on a mesh with a sequence axis (a layer's `jax.shard_map` over 'sequence' reads
    the mesh from it), else nothing: the data-parallel programs stay as they were."""
    return jax.set_mesh(mesh) if SEQUENCE_AXIS in mesh.axis_names else contextlib.nullcontext()


def data_size(mesh: Mesh) -> int:
    """The devices along 'data' (all of them without a sequence axis)."""
    return int(mesh.shape[DATA_AXIS])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA_AXIS))


def feature_sharding(mesh: Mesh, name: str, ndim: int) -> NamedSharding:
    """`P('data', 'sequence')` for a sequence feature (`SEQUENCE_FEATURES`, ndim >= 2) on a mesh with a
    sequence axis, else `P('data')`."""
    if SEQUENCE_AXIS in mesh.axis_names and name in SEQUENCE_FEATURES and ndim >= 2:
        return NamedSharding(mesh, P(DATA_AXIS, SEQUENCE_AXIS))
    return batch_sharding(mesh)


def sequence_padding(model: Any) -> dict[str, Any]:
    """The batch features `model` takes padded at their end along axis 1, each with its pad value (the
    model's `sequence_padding` property: the added steps are masked, e.g. by the pad id, and change no
    output); {} for a model without one."""
    return dict(getattr(model, "sequence_padding", None) or {})


def check_sequence_lengths(example: dict[str, Any], sequence: int, padding: dict[str, Any] | None = None,
                           config: Any = None) -> None:
    """Raises ValueError unless every sequence feature's length (axis 1) is divisible by `sequence` or
    the feature is one the model takes padded (`padding`, `sequence_padding`; `pad_sequences` pads it).
    The line names the config fields that hold the length (`length_fields` of `config`), if any."""
    if sequence == 1:
        return
    for name, x in example.items():
        shape = np.shape(x)
        if name in SEQUENCE_FEATURES and len(shape) >= 2 and shape[1] % sequence and name not in (padding or {}):
            fields = length_fields(config, shape[1]) if config is not None else []
            fix = (f": set {' and '.join(fields)} to a multiple of {sequence}" if fields else
                   f": use a parallel.sequence that divides {shape[1]}")
            raise ValueError(f"parallel.sequence={sequence} must divide the length of every sequence feature the "
                             f"model cannot take padded (no mask covers added steps); {name!r} has {shape[1]}{fix}")


def length_fields(config: Any, length: int) -> list[str]:
    """The int fields of `config.model` and `config.data.options` equal to `length` ('model.max_len', ...):
    where a feature's length is set."""
    out = []
    for prefix, group in (("model", config.get("model")), ("data.options", config.get("data", {}).get("options"))):
        values = group.to_dict() if hasattr(group, "to_dict") else dict(group or {})
        out += [f"{prefix}.{k}" for k, v in sorted(values.items())
                if isinstance(v, int) and not isinstance(v, bool) and v == length]
    return out


def pad_sequences(batch: dict[str, np.ndarray], sequence: int, padding: dict[str, Any]) -> dict[str, np.ndarray]:
    """`batch` with each feature of `padding` (name -> pad value) padded at its end along axis 1 to a
    multiple of `sequence`, where that does not divide its length (host arrays; the others unchanged)."""
    if sequence == 1 or not padding:
        return batch
    out = dict(batch)
    for name, value in padding.items():
        x = batch.get(name)
        if x is None or np.ndim(x) < 2 or np.shape(x)[1] % sequence == 0:
            continue
        widths = [(0, 0)] * np.ndim(x)
        widths[1] = (0, -np.shape(x)[1] % sequence)
        out[name] = np.pad(np.asarray(x), widths, constant_values=value)
    return out


def numeric(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drops host-only features (strings, bytes) that have no place on a device."""
    return {k: v for k, v in batch.items() if np.asarray(v).dtype.kind in "biuf"}


def global_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's rows of a batch -> one global array per feature, split over the 'data' axis (and a
    sequence feature along its length over 'sequence', `feature_sharding`)."""
    return {k: jax.make_array_from_process_local_data(feature_sharding(mesh, k, np.ndim(v)), v)
            for k, v in numeric(batch).items()}


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
