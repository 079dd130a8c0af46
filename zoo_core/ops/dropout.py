"""Cheap dropout: one threefry word per 16 elements, a 32-bit hash lane per element.

`jax.random.bernoulli` (what `flax.linen.Dropout` uses) runs the threefry-2x32 block cipher once
per element and then builds a float uniform from it; on a CPU that dominated the AGF ListOps
training step (27% of it). Here the dropout key draws one threefry word `w` per 16 elements
(`jax.random.bits`, so the key's own implementation and its splits/folds are unchanged) and every
element gets its own 32-bit lane `h_i = fmix32(w + (i + 1) * 0x9E3779B9)`, i = 0..15, where fmix32 is
MurmurHash3's finaliser, a bijection of uint32 with full avalanche. Each lane is therefore exactly
uniform on [0, 2^32) and an element is kept iff `h_i < round(keep * 2^32)`.

Keep probability: exactly `round(keep * 2^32) / 2^32`, i.e. `keep` to within 2^-33 (absolute);
`jax.random.bernoulli` on float32 is quantised to 2^-23 (its uniforms have 23 random bits), so this
is at least as exact as before. The sixteen lanes of one word are deterministic functions of it
(2^32 joint outcomes, not 2^512); their masks are empirically uncorrelated (tests/zoo_core/
dropout_test.py checks the pair frequencies) but they are not independent in the strict sense.

Why 16 lanes: threefry is most of the cost, and fewer random words make it cheaper.

Kept elements are scaled as flax's `Dropout`: `x / keep`, computed in x's dtype from float32 up
(the same values as flax) and in float32 then rounded once for 16-bit x (flax divides by `keep`
rounded to 16 bits, a bias of up to 0.4%: 0.9 is 0.8984375 in bfloat16); dropped ones are 0
(`jnp.where`, so a dropped NaN becomes 0 as in flax). The masks differ from flax's for the same
key (a different bit stream), so training runs are reproducible per key, but not equal to runs
made with `nn.Dropout`.
"""
from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array

LANES = 16
_GOLDEN = 0x9E3779B9


def _fmix32(h: Array) -> Array:
    """MurmurHash3's 32-bit finaliser (a bijection of uint32)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def keep_threshold(keep: float) -> int:
    """The uint32 threshold t with P(h < t) = t / 2^32 = keep to within 2^-33 (clamped to
    [0, 2^32 - 1])."""
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"keep must be in [0, 1], got {keep}")
    return min(int(round(keep * 2.0 ** 32)), 2 ** 32 - 1)


def random_bits(rng: Array, shape: tuple[int, ...], *, position_axis: Optional[int] = None) -> Array:
    """uint32 `shape`, each element uniform on [0, 2^32): one `jax.random.bits` word per `LANES`
    elements hashed into `LANES` lanes (see the module docstring).

    position_axis: an axis of `shape` (a sequence's positions): the bits at index t along it are
    `random_bits(fold_in(rng, t), the other axes)`, a function of t and never of the axis' length, so
    a sequence padded at its end (context parallelism's multiple of the shard count) keeps every real
    position's bits. None: one stream over the whole array.
    """
    shape = tuple(int(s) for s in shape)
    if position_axis is not None:
        axis = position_axis % len(shape)
        rest = shape[:axis] + shape[axis + 1:]
        keys = jax.vmap(lambda t: jax.random.fold_in(rng, t))(jnp.arange(shape[axis], dtype=jnp.uint32))
        return jnp.moveaxis(jax.vmap(lambda key: random_bits(key, rest))(keys), 0, axis)
    size = 1
    for s in shape:
        size *= s
    lanes = jnp.uint32(_GOLDEN) * jnp.arange(1, LANES + 1, dtype=jnp.uint32)
    if shape and shape[-1] % LANES == 0:
        # Lanes along the minor axis: the reshape back is free (no slice, no copy).
        words = jax.random.bits(rng, shape[:-1] + (shape[-1] // LANES,), jnp.uint32)
        return _fmix32(words[..., None] + lanes).reshape(shape)
    words = jax.random.bits(rng, (-(-size // LANES),), jnp.uint32)
    return _fmix32(words[:, None] + lanes).reshape(-1)[:size].reshape(shape)


def keep_mask(rng: Array, keep: float, shape: tuple[int, ...], *, position_axis: Optional[int] = None) -> Array:
    """bool `shape`, True with probability `keep_threshold(keep) / 2^32` (`keep` within 2^-33);
    `position_axis` as in `random_bits`."""
    return random_bits(rng, shape, position_axis=position_axis) < jnp.uint32(keep_threshold(keep))


def dropout(x: Array, rate: float, rng: Optional[Array], *, deterministic: bool = False,
            position_axis: Optional[int] = None) -> Array:
    """Inverted dropout of `x` at `rate` (kept elements `x / (1 - rate)`, dropped ones 0).

    Args:
        x: any shape and float dtype.
        rate: drop probability in [0, 1]; 0 (or deterministic) returns x unchanged, 1 zeros.
        rng: a PRNG key (typed or raw uint32[2]); unused when nothing is dropped.
        deterministic: True returns x unchanged.
        position_axis: x's sequence axis, whose padding at the end leaves the other positions'
          masks unchanged (`random_bits`); None: one stream over x.
    """
    if deterministic or rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep = 1.0 - rate
    if jnp.finfo(x.dtype).bits < 32:
        # `keep` itself is not representable in 16 bits (0.9 is 0.8984375 in bfloat16, a 0.17%
        # bias of every kept activation): scale in float32 and round the result once.
        scaled = (x.astype(jnp.float32) / keep).astype(x.dtype)
    else:
        scaled = x / jnp.asarray(keep, x.dtype)
    return jnp.where(keep_mask(rng, keep, jnp.shape(x), position_axis=position_axis), scaled, 0.0).astype(x.dtype)


class Dropout(nn.Module):
    """Drop-in for `flax.linen.Dropout(rate)` (same call: `(inputs, deterministic=None, rng=None)`,
    the 'dropout' rng collection, no parameters) with the cheap bits of `random_bits`.

    Attributes:
        rate: drop probability.
        deterministic: default for the call's `deterministic`.
        rng_collection: the rng stream (default 'dropout').
        position_axis: the inputs' sequence axis, e.g. 1 for [B, T, E]: a mask is a function of the
          position, so padding the sequence at its end (the trainer's `parallel.sequence`) changes no
          real position's mask (`random_bits`); None: one stream over the inputs.
    """
    rate: float
    deterministic: Optional[bool] = None
    rng_collection: str = "dropout"
    position_axis: Optional[int] = None

    @nn.compact
    def __call__(self, inputs: Array, deterministic: Optional[bool] = None,
                 rng: Optional[Array] = None) -> Array:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.rate == 0.0:
            return inputs
        if self.rate == 1.0:
            return jnp.zeros_like(inputs)
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        return dropout(inputs, self.rate, rng, position_axis=self.position_axis)
