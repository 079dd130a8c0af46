"""Forms of common operations chosen for how XLA compiles them, with the same values.

`add_to_each(x, table)` is `x + table[None]` (a table of learned position embeddings added to every
sequence of a batch). Its gradient with respect to the table is a sum over the batch axis, which
autodiff emits as a reduce over the major axis of a rank-3 array; XLA's CPU backend runs that reduce
about 100x slower than a dot with a ones vector computes the same sum (measured: `jnp.sum(g, 0)` of
a float32 `[32, 2000, 64]` 63 ms, `einsum('b,bte->te', ones, g)` 0.6 ms, 2 cores; the same sum to
the last bit there). So the backward here is that dot; the forward stays the plain broadcast add.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.custom_vjp
def add_to_each(x: Array, table: Array) -> Array:
    """`x + table` broadcast over the leading (batch) axis: x `[B, ...]`, table `x.shape[1:]`.

    Same value, dtype promotion and gradient as `x + table[None]`; only the table's gradient is
    computed differently (see the module docstring): summed in float32 (at least) and rounded once,
    so for a bfloat16 table it is the float32 sum rounded, not a bfloat16 running sum.
    """
    if jnp.shape(table) != jnp.shape(x)[1:]:
        raise ValueError(f"table shape {jnp.shape(table)} must be x's shape without the batch axis, "
                         f"{jnp.shape(x)[1:]}")
    return x + table[None]


def _fwd(x, table):
    # Residuals: only the two dtypes (as zero scalars); g carries the shapes.
    return add_to_each(x, table), (jnp.zeros((), x.dtype), jnp.zeros((), table.dtype))


def _bwd(res, g):
    x_zero, table_zero = res
    # Accumulated in float32 at least (float64 stays float64), rounded once to the table's dtype;
    # HIGHEST: on TPUs a float32 dot otherwise rounds its operands to bfloat16.
    total = jnp.einsum("b,b...->...", jnp.ones(g.shape[:1], g.dtype), g,
                       precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.promote_types(g.dtype, jnp.float32))
    return g.astype(x_zero.dtype), total.astype(table_zero.dtype)


add_to_each.defvjp(_fwd, _bwd)
