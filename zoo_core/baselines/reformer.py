"""Reformer's shared-QK LSH attention (Kitaev, Kaiser, Levskaya, "Reformer: The Efficient
Transformer", ICLR 2020, arXiv 2001.04451, §2 and §2.4; /work/shared/specs/baselines.md "Reformer").

Per head, with queries Q `[T, D]` and values V `[T, M]`:

* Shared-QK: the keys are the normalised queries, k_j = q_j / ||q_j||; logits q_i . k_j / sqrt(D).
* Hashing by random rotations (§2): h(x) = argmax([x R ; -x R]) with R `[D, b/2]` (b = `num_buckets`,
  even; b = 1 puts every token in one bucket). R is drawn from `hash_seed`, one per head and round
  (as HuggingFace's port of the official code), and is not a trained parameter. `num_hashes`
  independent rounds.
* Each round sorts the tokens by (bucket, position) and splits the sorted sequence into chunks of
  `chunk_length` C (the last one padded); a query sees the keys of its own bucket in its chunk and
  in the previous one (the first chunk has no previous one: no wrap-around).
* A token's own key gets the logit -1e5 (the paper's constant), so it is attended only when no other
  key is available.
* The rounds are combined by their softmax normalisers: o_i = sum_r exp(L_r(i) - logsumexp_r L_r(i))
  o_r(i), with L_r(i) the log-sum-exp of query i's logits in round r (§2.4). A key found in several
  rounds is counted once per round (the paper's optional N_ij de-duplication is not applied).

Causal (`causal=True`). After the sort, a query may see only earlier positions; but the chunk
boundaries of the sorted sequence depend on the buckets of every token, the future ones included, so
the paper's causal chunking lets the future decide which past keys a query sees. Here a causal query
sees itself and the previous C tokens of its own bucket (in position order): the window the paper's
chunking gives, taken relative to the query, which depends on the prefix only. With one bucket and
C >= T both readings are causal softmax attention over the shared-QK keys with the self rule.

Padding and NaN safety: padded tokens are zeroed (`jnp.where`) and hashed into an extra bucket b that
sorts after every real one, so they neither change a valid token's chunk nor are ever attended. A
non-finite value is replaced by 0 and the rows that attend it are set to NaN (what attending it
gives), so NaN or 1e30 in padding or in the future changes no valid or past output. The causal
softmax statistics are computed in a layout relative to the query (slot s = the key s places back
in the sorted order), so a future token's bucket, which shifts the sorted positions, does not even
change their float rounding. Logits, weights, log-sum-exps and outputs are float32, and so is the
shared-QK projection of the layer whatever its `dtype`: the hash is an argmax, which a bf16 rounding
of q would move.

Cost per round: O(T C) logits (blocks of C queries against 2C keys) and an O(T log T) sort.

`ReformerAttention` (below) follows the zoo's layer contract (README "Layer contract"): non-causal
and causal self-attention, no `scan` / `step` / decode form and no cross form.
"""
from __future__ import annotations

__all__ = ["ReformerAttention", "lsh_attention"]

import math
from typing import Callable, ClassVar, Optional

import jax
import jax.numpy as jnp

from zoo_core import checks
from zoo_core.baselines import ProjectedAttention
from zoo_core.ops import masking

Array = jax.Array
DropoutFn = Optional[Callable[[Array, int], Array]]   # (weights, index) -> weights

MASKED = -1e9      # logit of a key a query may not see (finite: an all-masked padded row stays finite)
SELF_LOGIT = -1e5  # the paper's logit for a token's own key


def draw_rotations(seed: int, num_heads: int, num_hashes: int, head_dim: int,
                   num_buckets: int) -> Array:
    """The random rotations R of every head and round, `[H, R, D, b/2]` float32 (N(0, 1), §2).

    `num_buckets` = 1 needs no rotation: `[H, R, D, 0]`.
    """
    return jax.random.normal(jax.random.PRNGKey(seed),
                             (num_heads, num_hashes, head_dim, num_buckets // 2), jnp.float32)


def lsh_buckets(keys: Array, rotations: Array, valid: Array, num_buckets: int) -> Array:
    """Bucket of every token and round, `[B, H, R, T]` int32 in [0, b]; padded tokens get b.

    Args:
        keys: `[B, T, H, D]` (the shared-QK keys; the hash is scale-invariant).
        rotations: `[H, R, D, b/2]` from `draw_rotations`.
        valid: `[B, T]` bool.
        num_buckets: b (1 or even).
    """
    b, t, h, _ = keys.shape
    if num_buckets == 1:
        buckets = jnp.zeros((b, h, rotations.shape[1], t), jnp.int32)
    else:
        xr = jnp.einsum("bthd,hrdn->bhrtn", keys, rotations.astype(keys.dtype))
        buckets = jnp.argmax(jnp.concatenate([xr, -xr], axis=-1), axis=-1).astype(jnp.int32)
    return jnp.where(valid[:, None, None, :], buckets, num_buckets)


def _pad_value(x: Array) -> Array:
    """What fills slots outside the sequence: -1 for positions / buckets (no real one), else 0."""
    return jnp.asarray(-1 if jnp.issubdtype(x.dtype, jnp.integer) else 0, x.dtype)


def _blocks(x: Array, n: int, c: int) -> Array:
    """`[..., T, *f]` padded at the end to n * C along T and split: `[..., n, C, *f]` (axis 3 is T)."""
    t = x.shape[3]
    pad = [(0, 0)] * x.ndim
    pad[3] = (0, n * c - t)
    x = jnp.pad(x, pad, constant_values=_pad_value(x))
    return x.reshape(x.shape[:3] + (n, c) + x.shape[4:])


def _with_previous(x: Array) -> Array:
    """`[..., n, C, *f]` -> `[..., n, 2C, *f]`: each block after the previous one (zeros / -1 / False
    before the first block)."""
    fill = jnp.full_like(x[:, :, :, :1], _pad_value(x))
    return jnp.concatenate([jnp.concatenate([fill, x[:, :, :, :-1]], axis=3), x], axis=4)


def _relative_index(c: int) -> tuple[Array, Array, Array]:
    """Index maps between the block layout (query r of a block, key slot t of [previous, own] block,
    `[C, 2C]`) and the relative one (key s places back from query r in the sorted order, `[C, C+1]`):
    t = C + r - s. Returns (t `[C, C+1]`, s `[C, 2C]` clipped, whether t's s is in [0, C])."""
    r = jnp.arange(c)[:, None]
    to_block = c + r - jnp.arange(c + 1)[None, :]
    s = c + r - jnp.arange(2 * c)[None, :]
    return to_block, jnp.clip(s, 0, c), (s >= 0) & (s <= c)


def _take(x: Array, index: Array) -> Array:
    """x `[..., C, K]` gathered along its last axis by `index` `[C, K']` -> `[..., C, K']`."""
    return jnp.take_along_axis(x, jnp.broadcast_to(index, x.shape[:-1] + index.shape[-1:]), axis=-1)


def _sorted_rounds(q, k, v, valid, bad, buckets):
    """Per round, every array sorted by (bucket, position): q, k `[B, H, R, T, D]`, v `[B, H, R, T, M]`,
    bucket, position `[B, H, R, T]` int32, valid and bad `[B, H, R, T]` bool; and the sort order.
    valid is `[B, T]`, bad `[B, T, H]`."""
    t = q.shape[1]
    order = jnp.argsort(buckets * t + jnp.arange(t, dtype=jnp.int32), axis=-1)   # [B, H, R, T]

    def by_order(x):   # [B, T, H, F] -> [B, H, R, T, F]
        x = jnp.swapaxes(x, 1, 2)[:, :, None]
        return jnp.take_along_axis(x, order[..., None], axis=3)

    sorted_valid = jnp.take_along_axis(jnp.broadcast_to(valid[:, None, None, :], order.shape), order,
                                       axis=-1)
    sorted_buckets = jnp.take_along_axis(buckets, order, axis=-1)
    return (by_order(q), by_order(k), by_order(v), sorted_buckets, order, sorted_valid,
            by_order(bad[..., None])[..., 0]), order


def lsh_attention(q: Array, v: Array, rotations: Array, *, num_buckets: int, chunk_length: int,
                  mask: Optional[Array] = None, causal: bool = False,
                  dropout: DropoutFn = None) -> Array:
    """Shared-QK LSH attention (the module docstring), all rounds at once.

    Args:
        q: `[B, T, H, D]` queries (the keys are q / ||q||).
        v: `[B, T, H, M]` values.
        rotations: `[H, R, D, b/2]` (`draw_rotations`), R = the number of hash rounds.
        num_buckets: b, 1 or even (b = 1: one bucket, no hashing).
        chunk_length: C >= 1 (any C; T is padded to a multiple of C per round).
        mask: `[B, T]` bool key-padding mask (True = valid), or None.
        causal: a query sees only itself and the previous C tokens of its bucket.
        dropout: optional `(weights, 0) -> weights` on each round's weights `[B, H, R, n, C, 2C]`.

    Returns:
        `[B, T, H, M]` float32.
    """
    b, t, h, d = q.shape
    assert v.shape[:3] == (b, t, h) and rotations.shape[::2] == (h, d), (q.shape, v.shape,
                                                                      rotations.shape)
    assert num_buckets == 1 or (num_buckets % 2 == 0 and rotations.shape[3] == num_buckets // 2)
    dt = jnp.promote_types(jnp.result_type(q, v), jnp.float32)
    valid = masking.as_bool(mask, (b, t))
    keep = valid[:, :, None, None]
    q = jnp.where(keep, q.astype(dt), 0.0)
    v = jnp.where(keep, v.astype(dt), 0.0)
    # A non-finite value (per token and head) is zeroed; the rows that attend it become NaN below.
    bad = valid[:, :, None] & ~jnp.all(jnp.isfinite(v), axis=-1)                         # [B, T, H]
    v = jnp.where(bad[..., None], 0.0, v)
    k = q * jax.lax.rsqrt(jnp.maximum(jnp.sum(q * q, axis=-1, keepdims=True), 1e-30))
    buckets = lsh_buckets(k, rotations, valid, num_buckets)
    sorted_arrays, order = _sorted_rounds(q, k, v, valid, bad, buckets)
    out, lse = _rounds(*sorted_arrays, chunk_length=chunk_length, causal=causal, dropout=dropout)
    # Back to positions: `undo` inverts the per-round sort.
    undo = jnp.argsort(order, axis=-1)
    out = jnp.take_along_axis(out, undo[..., None], axis=3)                    # [B, H, R, T, M]
    lse = jnp.take_along_axis(lse, undo, axis=-1)                              # [B, H, R, T]
    weights = jax.nn.softmax(lse, axis=2)
    return jnp.swapaxes(jnp.sum(weights[..., None] * out, axis=2), 1, 2)


def _rounds(q, k, v, bucket, position, valid, bad, *, chunk_length, causal, dropout):
    """Every round's attention in the sorted order (arrays from `_sorted_rounds`).

    Returns (o `[B, H, R, T, M]`, log-sum-exp of each row's logits `[B, H, R, T]`), sorted order.
    """
    d, t = q.shape[-1], q.shape[3]
    c = max(1, min(int(chunk_length), t))
    n = -(-t // c)
    qb, pq, bq = _blocks(q, n, c), _blocks(position, n, c), _blocks(bucket, n, c)
    kb, vb = _with_previous(_blocks(k, n, c)), _with_previous(_blocks(v, n, c))
    pk, bk = _with_previous(pq), _with_previous(bq)
    valid_k = _with_previous(_blocks(valid, n, c))
    bad_k = _with_previous(_blocks(bad, n, c))
    logits = jnp.einsum("...qd,...kd->...qk", qb, kb) / math.sqrt(d)                 # [.., n, C, 2C]
    allowed = valid_k[..., None, :] & (bq[..., :, None] == bk[..., None, :])
    own = pq[..., :, None] == pk[..., None, :]
    bad_k = jnp.broadcast_to(bad_k[..., None, :], allowed.shape)
    if causal:
        # The softmax statistics in the relative layout `[.., C, C+1]` (see the module docstring).
        to_block, to_rel, in_window = _relative_index(c)
        logits, allowed, own, bad_k = (_take(x, to_block) for x in (logits, allowed, own, bad_k))
    logits = jnp.where(allowed, logits, MASKED)
    logits = jnp.where(allowed & own, SELF_LOGIT, logits)
    lse = jax.nn.logsumexp(logits, axis=-1)
    w = jnp.exp(logits - lse[..., None])
    poisoned = jnp.any(allowed & bad_k, axis=-1)
    if causal:
        w = jnp.where(in_window, _take(w, to_rel), 0.0)
    if dropout is not None:
        w = dropout(w, 0)
    o = jnp.einsum("...qk,...km->...qm", w, vb)
    o = jnp.where(poisoned[..., None], jnp.nan, o)
    shape = q.shape[:3] + (n * c,)
    return (o.reshape(shape + o.shape[-1:])[:, :, :, :t], lse.reshape(shape)[:, :, :, :t])


class ReformerAttention(ProjectedAttention):
    """Reformer self-attention: shared-QK LSH attention (module docstring), the zoo's layer contract.

    Parameters have `SoftmaxAttention`'s names and shapes except that there is no `key` projection
    (the keys are the normalised queries): `query` and `value` kernel `[E, H, D]`, bias `[H, D]`;
    `out` kernel `[H, D, E']`, bias `[E']`. A softmax parameter tree applies once its `key` entry is
    dropped. The rotations are drawn from `hash_seed` at every call, not stored.

    Shapes: x `[B, T, E]` -> y `[B, T, E']`. `__call__` only: no `scan` / `step` / decode form.

    Attributes:
        num_heads: H.
        head_dim: D (the width of queries, keys and values per head).
        out_features: E' (default: the input width E).
        causal: a query sees only itself and the previous `chunk_length` tokens of its bucket.
        num_buckets: b, the number of hash buckets: even, or 1 (no hashing, one bucket).
        num_hashes: the number of hash rounds, >= 1.
        chunk_length: C, the chunk of the sorted sequence, >= 1 (need not divide T).
        hash_seed: seed of the random rotations (give each layer its own for independent hashes).
        dropout_rate, dtype, param_dtype, kernel_init, bias_init, out_bias_init: as
            `ProjectedAttention` (`zoo_core.baselines`); the attention maths is float32.
    """
    keeps_documents_apart: ClassVar[bool] = False   # segment_ids refused in one line
    causal: bool = False
    num_buckets: int = 8
    num_hashes: int = 2
    chunk_length: int = 64
    hash_seed: int = 0

    def setup(self):
        self._check_common()
        checks.check_int("num_buckets", self.num_buckets, 1)
        if self.num_buckets != 1 and self.num_buckets % 2:
            checks.fail(f"`num_buckets` must be 1 or even (h(x) = argmax([xR; -xR])), got {self.num_buckets}")
        checks.check_int("num_hashes", self.num_hashes, 1)
        checks.check_int("chunk_length", self.chunk_length, 1)
        checks.check_int("hash_seed", self.hash_seed, 0)
        # The shared-QK projection in at least float32 whatever `dtype` is: it feeds the hash, an
        # argmax, where a bf16 rounding of q moves tokens to other buckets (benchmarks.precision).
        hashed = None if self.dtype is None else jnp.promote_types(self.dtype, jnp.float32)
        self.query, self.value = self._projection("query", hashed), self._projection("value")

    def rotations(self) -> Array:
        """The random rotations, `[H, num_hashes, D, num_buckets // 2]` float32."""
        return draw_rotations(self.hash_seed, self.num_heads, self.num_hashes, self.head_dim,
                              self.num_buckets)

    def __call__(self, x: Array, *, mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, dict]:
        """x `[B, T, E]`, mask `[B, T]` bool key-padding mask (True = valid) -> (y `[B, T, E']`, {}).
        `segment_ids` (packed documents) is refused in one line: the definition mixes the whole sequence.

        `deterministic=False` with `dropout_rate` > 0 drops attention weights (the 'dropout' rng).
        """
        self._refuse_segments(segment_ids, "Reformer", "hash buckets and sorted chunks")
        self._check_inputs(x, mask)
        o = lsh_attention(self.query(x), self.value(x), self.rotations(), num_buckets=self.num_buckets,
                          chunk_length=self.chunk_length, mask=mask, causal=self.causal,
                          dropout=self._indexed_dropout(deterministic))
        return self._finish(o, x), {}
