"""Merging the aux dicts that layers, blocks and encoders return beside their outputs.

Every layer of the zoo returns `(y, aux)`: `aux['loss/<name>']` scalars that the shared trainer adds
to the task loss (`zoo_core.run.steps`), and diagnostics under other keys. A stack of layers merges
its layers' aux in one of two ways, each with its own name:

* `sum_aux(*auxes)`: every key summed over the dicts that have it, for terms that a model forms once
  from totals (HTGN's 'kl_sum' / 'kl_count', htgn.md §5.7) and for `loss/*` terms;
* `stack_aux(auxes)`: a stack's per-layer diagnostics, `loss/*` summed as in `sum_aux` and every
  other key stacked along a new leading layer axis `[L, ...]` (AGF's per-layer regulariser and
  filter coefficients, agf.md §2.5).
"""
from __future__ import annotations

import functools
import operator
from typing import Sequence

import jax.numpy as jnp

LOSS_PREFIX = "loss/"


def sum_aux(*auxes: dict) -> dict:
    """One aux from several: the values of each key summed over the dicts that hold it.

    Args:
      *auxes: aux dicts (any keys; a key missing from some dicts is summed over the others).

    Returns:
      {key: sum of its values}, keys in order of first appearance; {} for no dicts.
    """
    out: dict = {}
    for aux in auxes:
        for k, v in aux.items():
            out[k] = out[k] + v if k in out else v
    return out


def stack_aux(auxes: Sequence[dict]) -> dict:
    """The aux of a stack of L layers with the same keys: `loss/*` summed, other keys stacked.

    Args:
      auxes: the L layers' aux dicts, in layer order, each with the keys of the first.

    Returns:
      {'loss/...': the scalar sum over layers, other key: `[L, ...]` the layers' values stacked};
      {} for no layers.
    """
    keys = auxes[0].keys() if auxes else ()
    return {k: functools.reduce(operator.add, [a[k] for a in auxes]) if k.startswith(LOSS_PREFIX)
            else jnp.stack([a[k] for a in auxes]) for k in keys}
