"""FAVOR+ linear attention as pure `jnp` functions (Performer; htgn.md §2, §5.4).

Reference: Choromanski et al., "Rethinking Attention with Performers", ICLR 2021
(arXiv:2009.14794): attention as D^-1 A V with A = exp(Q K^T / sqrt(D)) replaced by
phi(Q) phi(K)^T, bidirectional and unidirectional (prefix sums) (§2.1-2.2, Fig. 1); the positive
random features of the softmax kernel (Lemma 1, §2.3); orthogonal random features (§2.4). The
spec's equations are htgn.md §2.2 (features), §2.5 (non-causal form and denominator guard) and
§2.6 (causal forms). Algorithmically the functions follow
google-research/google-research `performer/fast_attention/jax/fast_attention.py` (the goldens in
`tests/testdata/performer/` were recorded from it), rewritten for this project.

Layout (zoo shape letters): queries, keys and values are `[B, T, H, D]` (batch, time, heads, head
width); keys/values may have another length S; features are `[B, T, H, M]` (M random features).
Accumulators and states are kept in float32 (float64 when the inputs are float64), whatever the
compute dtype.

Forms (all take the *features*, so every form is tested against every other with the same phi):

* `favor_parallel`: non-causal, Z = phi(K)^T V, out = phi(Q) Z / phi(Q) phi(K)^T 1 (§2.5).
* causal (§2.6, §5.4): the zoo's shared kernels `zoo_core.ops.linear_attention` with
  `denominator=True` on (phi(Q), phi(K), V): `causal_parallel` (masked quadratic form),
  `causal_chunked` (intra-chunk quadratic, inter-chunk carried state, rematerialised chunk body),
  `causal_scan` / `causal_step` (the token recurrence). Their state is
  `LinearState(num = S [B, H, M, Dv], den = z [B, H, M])`; `normalize` divides num by den.

Masking is NaN-safe: padded keys and values are removed with `jnp.where` (never by multiplying
with 0), so a padded position holding NaN or 1e30 changes no valid output.

Packed sequences (`segment_ids` `[B, T]`, 0 = padding; issue 42, docs/specs/context_parallel.md §2):
a packed call gives each document the numbers it gets alone. The causal forms reset their state at
each document start (`linear_attention`'s packed forms); the global form sums per document
(`linear_attention.noncausal`'s packed form); a packed cross-attention (`kv_segment_ids` `[B, S]`,
documents matched by id) merges keys and queries into one row ordered by (id, keys first) and runs
the packed causal form on it (`linear_attention.noncausal`), O((S + T) (M + Dv)) memory. The original's 'max'
key stabiliser is a max over the whole row (all positions and features of a (batch, head)); since
it enters the output through `eps`, a row-wide max would let one document change another's numbers
(by up to eps exp(max_row - max_doc) relative to its features), so packed it is the max over the
key's own document (`segment_max`), i.e. the original's number for that document alone.

Stabilisers (htgn.md §5.4):

* queries: per-token max over the features (cancels between numerator and denominator);
* keys, `key_stabiliser='max'`: stop_gradient of the max over features and *valid* key positions,
  one scalar per (batch, head). With no mask this is the original's stabiliser (used for the
  golden parity tests, causal case included), but in a causal model it lets future keys leak into
  past outputs through `eps` (htgn.md §2.5);
* keys, `key_stabiliser='constant'` (our extension, the causal default): a data-independent
  constant c = min(M_w, 40), M_w = max_i ||w_i||^2 / 2. M_w bounds w^T x - ||x||^2/2 for every x
  (complete the square), so exp() <= exp(M_w - c). c depends on Omega only, so every form stays
  exactly causal and the step form can stream. Two **deviations from a literal reading of the
  spec** (which subtracts M_w and adds eps=1e-6 unscaled):
  - `eps` and the denominator guard are scaled by exp(-c), i.e. the key features are
    exp(-c) * (exp(w^T x - ||x||^2/2) + eps) / sqrt(M), so c cancels exactly, eps included, and
    only keeps exp() in floating-point range. M_w is about D/2 + O(sqrt(D)); exp(-M_w) is ~1e-9
    already at D=16, and an unscaled eps would swamp every key feature (measured at D=16: the
    mean abs error vs exact softmax is 2.5-3.5x larger and does not improve with M).
  - the cap at 40: for D=128, M_w is ~90 and exp(a - M_w) underflows float32 for almost every
    key (measured: 99.9% zero features, NaN outputs). With the cap, features stay <= e^60 (no
    overflow) while M_w < 100, i.e. D up to ~140 at m=256; below M_w = 40 (D <= ~32) c = M_w
    exactly as in the spec.

Trig features (`feature_map='trig'`, the HTGN card's sine-cosine kernel; docs/htgn_options.md):
`trig_kernel_features`, sin/cos random Fourier features of the same softmax kernel (2M wide), whose
denominator estimate can be 0 or negative; `normalize(..., floor=True)` floors it at eps.

Random features: `gaussian_orthogonal_random_matrix` is the original Gaussian-orthogonal
constructor (QR row blocks, rows rescaled by chi_D norms for `scaling=0`); with `fix_signs=False`
a PRNG key gives the original's matrix. By default it adds the Haar sign correction of the QR
factor (our fix of a bias of the original, see the function's docstring; it also makes the
matrix independent of the backend's QR sign convention). `draw_projection(key, feature_step,
redraw_every=k)` is the redraw design (htgn.md §2.4): a pure function of a PRNG key and the
training-step counter, Omega = G(fold_in(key, feature_step // k)), so a layer redraws every k steps
deterministically (same key and step -> same matrix, under jit or not) and evaluation is frozen
by passing the last training step (or none). k = 0 means never redraw (draw index 0 forever).
"""
from __future__ import annotations

__all__ = ["FEATURE_MAPS", "softmax_kernel_features", "trig_kernel_features", "relu_features", "elu_features",
           "favor_features", "normalize", "favor_parallel", "cross_cache", "exact_softmax_attention", "favor_attention"]

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from htgn_jax.random_features import draw_projection, gaussian_iid_random_matrix, gaussian_orthogonal_random_matrix  # noqa: F401  (the projection's home; ops keeps its names)
from zoo_core.checks import check_choice, check_rank, fail
from zoo_core.ops import linear_attention, masking, packing
from zoo_core.ops.linear_attention import LinearState, acc_dtype

Array = Any

FEATURE_MAPS = ("softmax", "trig", "relu", "elu", "exact")
KERNEL_MAPS = ("softmax", "trig", "relu", "elu")    # the maps with features (not the 'exact' oracle)
RANDOM_FEATURE_MAPS = ("softmax", "trig")   # maps with a random projection Omega (num_features, redraw)
KEY_STABILISERS = ("max", "constant")
CAUSAL_IMPLS = ("chunked", "scan", "quadratic")
RELU_EPS = 1e-3  # kernel_epsilon of the original's generalized (ReLU) attention


CONSTANT_STABILISER_CAP = 40.0


def constant_key_stabiliser(projection: Array) -> Array:
    """The causal key stabiliser c = min(M_w, 40), M_w = max_i ||w_i||^2 / 2 (module docstring).

    M_w >= w_i^T x - ||x||^2 / 2 for all x, so every key feature's exp() is <= exp(M_w - c).
    """
    m_w = 0.5 * jnp.max(jnp.sum(jnp.square(projection), axis=-1))
    return jnp.minimum(m_w, CONSTANT_STABILISER_CAP)


# --------------------------------------------------------------------------------------------
# Feature maps
# --------------------------------------------------------------------------------------------


def _stabilise_keys(values: Array, mask: Array | None, segment_ids: Array | None, key_max) -> Array:
    """The 'max' key stabiliser `[B, S, H, 1]`: stop_gradient of the max of `values` `[B, S, H]` over
    the valid keys of the key's row, or of its document with `segment_ids` (so that one packed
    document never changes another's numbers), reduced by `key_max` (default `row_max`)."""
    # stop_gradient first: the reduction (a collective under context parallelism) needs no derivative.
    values = jax.lax.stop_gradient(values)
    values = values if mask is None else jnp.where(mask[:, :, None], values, -jnp.inf)
    stab = (key_max or row_max)(values, segment_ids)
    # A fully padded row or document has stab = -inf; any finite value works since its phi is zeroed.
    return jax.lax.stop_gradient(jnp.where(jnp.isfinite(stab), stab, 0.0))[..., None]


def row_max(values: Array, segment_ids: Array | None = None) -> Array:
    """Max of `values` `[B, S, ...]` over S (`[B, 1, ...]`), or per token over its document
    (`segment_max`) with `segment_ids` `[B, S]`: the local reduction of the 'max' key stabiliser."""
    if segment_ids is None:
        return jnp.max(values, axis=1, keepdims=True)
    return segment_max(values, segment_ids)


def segment_max(values: Array, segment_ids: Array) -> Array:
    """Per token, the max of `values` `[B, S, ...]` over its document (a contiguous run of one id of
    `segment_ids` `[B, S]`): a segmented max scan forward and one backward, O(S) memory."""
    def forward(vals, ids):
        start = jnp.broadcast_to(masking.expand(packing.starts(ids), vals.ndim), vals.shape)

        def combine(a, b):
            return a[0] | b[0], jnp.where(b[0], b[1], jnp.maximum(a[1], b[1]))

        return jax.lax.associative_scan(combine, (start, vals), axis=1)[1]

    flip = lambda x: jnp.flip(x, axis=1)
    return jnp.maximum(forward(values, segment_ids), flip(forward(flip(values), flip(segment_ids))))


def _softmax_features(x, projection, is_query, mask, eps, key_stabiliser, segment_ids=None, key_max=None):
    """`softmax_kernel_features` after its checks (mask bool or None)."""
    dt = acc_dtype(x, projection)
    x = masking.zero_padding(x.astype(dt), mask)
    projection = projection.astype(dt)
    num_features, dim = projection.shape
    x = dim ** -0.25 * x
    ratio = num_features ** -0.5
    proj = jnp.einsum("bthd,md->bthm", x, projection)
    half_sq = 0.5 * jnp.sum(jnp.square(x), axis=-1, keepdims=True)
    if is_query:
        return ratio * (jnp.exp(proj - half_sq - jnp.max(proj, axis=-1, keepdims=True)) + eps)
    if key_stabiliser == "constant":
        stab = jax.lax.stop_gradient(constant_key_stabiliser(projection))
        phi = ratio * (jnp.exp(proj - half_sq - stab) + eps * jnp.exp(-stab))
    else:
        stab = _stabilise_keys(jnp.max(proj, axis=-1), mask, segment_ids, key_max)
        phi = ratio * (jnp.exp(proj - half_sq - stab) + eps)
    return masking.zero_padding(phi, mask)


def _key_valid(k_shape, key_mask, kv_segment_ids):
    """bool `[B, S]` valid keys (mask True and document id > 0), or None when every key is."""
    if kv_segment_ids is not None:
        return packing.valid(kv_segment_ids, key_mask)
    return None if key_mask is None else masking.as_bool(key_mask, k_shape[:2])


def _check_features(x, projection, key_stabiliser, mask, segment_ids, name="x"):
    """The user-facing checks of a feature map's arguments (one line each; projection None: not
    checked here)."""
    check_rank(name, x, 4, "[B, T, H, D]")
    if projection is not None:
        _check_projection("softmax", projection, np.shape(x)[-1])
    check_choice("key_stabiliser", key_stabiliser, KEY_STABILISERS)
    masking.check_mask(mask, np.shape(x)[:2])
    packing.check_segment_ids(segment_ids, np.shape(x)[:2])


def softmax_kernel_features(x: Array, projection: Array, *, is_query: bool,
                            mask: Array | None = None, eps: float = 1e-6,
                            key_stabiliser: str = "max", segment_ids: Array | None = None) -> Array:
    """Positive random features of the softmax kernel exp(q^T k / sqrt(D)) (Lemma 1; htgn.md §2.2).

    phi(x)_i = (exp(w_i^T x' - ||x'||^2/2 - stab) + eps') / sqrt(M), with x' = x D^(-1/4), so that
    E[phi(q)^T phi(k)] is proportional to exp(q^T k / sqrt(D)). `stab` and `eps'` are described in
    the module docstring ('max': eps' = eps; 'constant': stab = c, eps' = eps * exp(-c)).

    Args:
      x: queries or keys, `[B, T, H, D]`.
      projection: Omega, `[M, D]`.
      is_query: per-token stabiliser (queries) or per-(batch, head) stabiliser (keys).
      mask: optional key-padding mask `[B, T]` (True/1 = real token); keys only. Masked keys get
        zero features and are left out of the 'max' stabiliser.
      eps: the additive numerical stabiliser (the original factory's 1e-6).
      key_stabiliser: 'max' or 'constant' (keys only).
      segment_ids: optional int `[B, T]` packed documents of the keys (0 = padding): the 'max'
        stabiliser is taken per document, so a packed document gets its features computed alone.

    Returns:
      phi(x), `[B, T, H, M]`, in float32 (float64 for float64 inputs).
    """
    _check_features(x, projection, key_stabiliser, mask, segment_ids)
    if is_query and (mask is not None or segment_ids is not None):
        fail("`mask` and `segment_ids` apply to keys only; pass is_query=False or leave them None")
    return _softmax_features(x, projection, is_query, _key_valid(np.shape(x), mask, segment_ids), eps,
                             key_stabiliser, segment_ids)


def relu_features(x: Array, eps: float = RELU_EPS) -> Array:
    """Deterministic Performer-ReLU features relu(x) + eps (LRA's default generalized attention)."""
    x = x.astype(acc_dtype(x))
    return jax.nn.relu(x) + eps


def elu_features(x: Array) -> Array:
    """elu(x) + 1 features (Katharopoulos et al., "Transformers are RNNs", 2020), positive.

    Written as x + 1 (x > 0) / exp(x) (x <= 0): elu(x) + 1 = (exp(x) - 1) + 1 rounds to 0 for
    x < -17 in float32, which would break positivity.
    """
    x = x.astype(acc_dtype(x))
    return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))


# exp() cap of the causal trig key scale: a key's weight is at most e^10 that of a zero-norm key, so
# with the denominator floor (1e-6) outputs and gradients stay far inside float32 whatever the input.
TRIG_KEY_CAP = 10.0


def trig_kernel_features(x: Array, projection: Array, *, is_query: bool,
                         mask: Array | None = None, key_stabiliser: str = "max",
                         segment_ids: Array | None = None) -> Array:
    """Random Fourier (sin/cos) features of the softmax kernel (Performer §2.2, "trig" features).

    phi(x) = exp(||x'||^2/2 - s) / sqrt(M) [sin(w_i^T x'), cos(w_i^T x')]_{i=1..M}, x' = x D^(-1/4),
    so E[phi(q)^T phi(k)] = exp(q^T k / sqrt(D)) up to the scales s (Bochner: E cos(w^T(q'-k')) =
    exp(-||q'-k'||^2/2)). The features can be negative, so the estimated denominator can be 0 or
    negative (`normalize(..., floor=True)` handles it). The scales s keep exp() in range:

    * queries: s = ||q'||^2/2 per token (it cancels between numerator and denominator);
    * keys, 'max': s = stop_gradient of the max of ||k'||^2/2 over the valid keys, one scalar per
      (batch, head), or per document with `segment_ids` (a constant that cancels; the original's
      trig stabiliser);
    * keys, 'constant' (causal: no data-dependent constant may be used): s = 0, with the exponent
      capped at `TRIG_KEY_CAP` = 10; the cap changes a key only if ||k||^2 > 20 sqrt(D) (at
      initialisation ||k||^2 is about D, so it binds for no key there), and it bounds the key
      scales, which the absolute denominator floor needs to keep adversarial inputs finite.

    Args:
      x: `[B, T, H, D]`; projection: Omega `[M, D]`; mask: optional `[B, T]` (keys only).
      is_query, key_stabiliser, segment_ids: as in `softmax_kernel_features`.

    Returns:
      phi(x), `[B, T, H, 2M]` (sines then cosines), float32 (float64 for float64 inputs).
    """
    _check_features(x, projection, key_stabiliser, mask, segment_ids)
    return _trig_features(x, projection, is_query, _key_valid(np.shape(x), mask, segment_ids),
                          key_stabiliser, segment_ids)


def _trig_features(x, projection, is_query, mask, key_stabiliser, segment_ids=None, key_max=None):
    """`trig_kernel_features` after its checks (mask bool or None)."""
    dt = acc_dtype(x, projection)
    x = masking.zero_padding(x.astype(dt), mask) * projection.shape[1] ** -0.25
    proj = jnp.einsum("bthd,md->bthm", x, projection.astype(dt))
    half_sq = 0.5 * jnp.sum(jnp.square(x), axis=-1, keepdims=True)
    if is_query:
        scale = jnp.ones_like(half_sq)
    elif key_stabiliser == "constant":
        scale = jnp.exp(jnp.minimum(half_sq, TRIG_KEY_CAP))
    else:
        scale = jnp.exp(half_sq - _stabilise_keys(half_sq[..., 0], mask, segment_ids, key_max))
    phi = scale * projection.shape[0] ** -0.5 * jnp.concatenate([jnp.sin(proj), jnp.cos(proj)], -1)
    return masking.zero_padding(phi, mask)


def favor_features(q: Array, k: Array, *, feature_map: str = "softmax",
                   projection: Array | None = None, key_mask: Array | None = None,
                   eps: float = 1e-6, key_stabiliser: str = "max",
                   kv_segment_ids: Array | None = None, key_max=None) -> tuple[Array, Array, Array]:
    """Query and key features plus the denominator guard, for any random/deterministic map.

    Args:
      q: queries `[B, T, H, D]`.
      k: keys `[B, S, H, D]`.
      feature_map: 'softmax' (FAVOR+), 'trig' (sin/cos random Fourier features, `[.., 2M]`),
        'relu' or 'elu' ('exact' has no features).
      projection: Omega `[M, D]`; required for 'softmax' and 'trig', must be None otherwise.
      key_mask: optional `[B, S]` key-padding mask; masked keys get zero features.
      eps: additive stabiliser of the softmax features and threshold of the denominator guard.
      key_stabiliser: 'max' or 'constant' (softmax only; see the module docstring).
      kv_segment_ids: optional int `[B, S]` packed documents of the keys (0 = padding: zero features);
        the 'max' stabiliser is then per document.
      key_max: how the 'max' stabiliser reduces the per-key values `[B, S, H]` (-inf at padding)
        given `kv_segment_ids` (or None); default `row_max`. `htgn_jax.context_parallel` passes a
        reduction over the shards of a sequence.

    Returns:
      (phi_q `[B, T, H, M]`, phi_k `[B, S, H, M]`, guard), where `guard` is the scalar threshold
      to pass to `normalize` (eps, scaled by exp(-c) for the constant key stabiliser).
    """
    check_choice("feature_map", feature_map, KERNEL_MAPS)
    check_rank("q", q, 4, "[B, T, H, D]")
    _check_features(k, None, key_stabiliser, key_mask, kv_segment_ids, "k")
    _check_projection(feature_map, projection, k.shape[-1])
    return _features(q, k, feature_map, projection, _key_valid(np.shape(k), key_mask, kv_segment_ids),
                     eps, key_stabiliser, kv_segment_ids, key_max)


def _check_projection(feature_map: str, projection, dim: int) -> None:
    """Omega `[M, D]` is given exactly for the random feature maps."""
    if feature_map in RANDOM_FEATURE_MAPS and projection is None:
        fail(f"`projection` is required for feature_map={feature_map!r}")
    if feature_map not in RANDOM_FEATURE_MAPS and projection is not None:
        fail(f"`projection` must be None for the deterministic feature_map={feature_map!r}")
    if projection is not None and (np.ndim(projection) != 2 or np.shape(projection)[1] != dim):
        fail(f"`projection` must have shape [M, D={dim}], got {tuple(np.shape(projection))}")


def _features(q, k, feature_map, projection, mask, eps, key_stabiliser, segment_ids=None, key_max=None):
    """`favor_features` after its checks (mask: bool valid keys or None)."""
    if feature_map == "softmax":
        phi_q = _softmax_features(q, projection, True, None, eps, key_stabiliser)
        phi_k = _softmax_features(k, projection, False, mask, eps, key_stabiliser, segment_ids, key_max)
        guard = jnp.asarray(eps, phi_k.dtype)
        if key_stabiliser == "constant":
            guard = guard * jnp.exp(-jax.lax.stop_gradient(
                constant_key_stabiliser(projection.astype(phi_k.dtype))))
        return phi_q, phi_k, guard
    if feature_map == "trig":
        phi_q = _trig_features(q, projection, True, None, key_stabiliser)
        phi_k = _trig_features(k, projection, False, mask, key_stabiliser, segment_ids, key_max)
        return phi_q, phi_k, jnp.asarray(eps, phi_k.dtype)
    fn = relu_features if feature_map == "relu" else elu_features
    phi_q, phi_k = fn(q), masking.zero_padding(fn(masking.zero_padding(k, mask)), mask)
    return phi_q, phi_k, jnp.asarray(eps, phi_k.dtype)


# --------------------------------------------------------------------------------------------
# Linear-attention forms on features (Eqs. 5-6; htgn.md §2.5, §2.6)
# --------------------------------------------------------------------------------------------


def normalize(num: Array, den: Array, guard: Array | float, *, floor: bool = False) -> Array:
    """out = num / den with the original's guard den <- den + 2 guard [|den| <= guard] (§2.5).

    `floor=True` (the trig features, whose estimated denominator can be 0 or negative although
    the true one is positive): den <- max(den, guard) instead. A non-positive estimate is pure
    noise, so the row is read as "weak evidence" (num / guard, finite) rather than flipping its
    sign; the floor is inactive, and the estimate unbiased-ratio, wherever den > guard, which holds
    for every row once M is large enough (the convergence test checks it never binds).

    Args:
      num: numerator `[B, T, H, Dv]`.
      den: denominator `[B, T, H]`.
      guard: scalar threshold (see `favor_features`).
      floor: the trig floor above instead of the FAVOR+ guard.

    Returns:
      `[B, T, H, Dv]`; rows with no valid key (den = 0) come out as 0.
    """
    if floor:
        return num * jnp.reciprocal(jnp.maximum(den, guard))[..., None]
    den = den + 2.0 * guard * (jnp.abs(den) <= guard).astype(den.dtype)
    return num * jnp.reciprocal(den)[..., None]


def favor_parallel(phi_q: Array, phi_k: Array, v: Array, *, segment_ids: Array | None = None,
                   kv_segment_ids: Array | None = None) -> tuple[Array, Array]:
    """Non-causal linear attention: Z = phi(K)^T V, W = phi(Q) Z, t = phi(K)^T 1, R = phi(Q) t.

    Packed (`segment_ids`), each query reads the sums over its own document's keys only: a
    self-attention (`kv_segment_ids` None, S = T) by `linear_attention.noncausal`'s packed form; a
    cross-attention (`kv_segment_ids` `[B, S]`, documents matched by id) by `linear_attention.noncausal`.

    Args:
      phi_q: `[B, T, H, M]`.
      phi_k: `[B, S, H, M]` (zero at padded keys).
      v: `[B, S, H, Dv]` (zero at padded keys: `favor_attention` removes them with `where`).
      segment_ids: optional int `[B, T]` documents of the queries (0 = padding, output 0).
      kv_segment_ids: optional int `[B, S]` documents of the keys (cross-attention).

    Returns:
      (numerator W `[B, T, H, Dv]`, denominator R `[B, T, H]`), before `normalize`.
    """
    _check_documents(segment_ids, kv_segment_ids, phi_q.shape[:2], phi_k.shape[:2])
    return _noncausal(phi_q, phi_k, v, segment_ids, kv_segment_ids)


def _check_documents(segment_ids, kv_segment_ids, queries: tuple[int, int], keys: tuple[int, int]) -> None:
    """The packing arguments of a public FAVOR+/softmax kernel (docs/specs/context_parallel.md): `segment_ids`
    `[B, T]` alone (self-attention, S = T) or with `kv_segment_ids` `[B, S]` (packed cross-attention)."""
    if kv_segment_ids is not None and segment_ids is None:
        fail("`kv_segment_ids` needs `segment_ids` (the documents of the queries)")
    if segment_ids is not None and kv_segment_ids is None and keys[1] != queries[1]:
        fail(f"packed cross-attention (S = {keys[1]} keys, T = {queries[1]} queries) needs `kv_segment_ids` [B, S]")
    packing.check_segment_ids(segment_ids, queries)
    packing.check_segment_ids(kv_segment_ids, keys, "kv_segment_ids")


def _noncausal(phi_q, phi_k, v, segment_ids=None, kv_segment_ids=None):
    """`favor_parallel` after its checks."""
    if segment_ids is not None:   # packed self- or cross-attention (kv_segment_ids: the memory's documents)
        return linear_attention.noncausal(phi_q, phi_k, v, denominator=True, segment_ids=segment_ids,
                                          kv_segment_ids=kv_segment_ids)
    v = v.astype(acc_dtype(v, phi_k))
    z_mat = jnp.einsum("bshm,bshd->bhmd", phi_k, v)
    num = jnp.einsum("bthm,bhmd->bthd", phi_q, z_mat)
    t = jnp.sum(phi_k, axis=1)
    den = jnp.einsum("bthm,bhm->bth", phi_q, t)
    return num, den


def cross_cache(phi_k: Array, v: Array) -> LinearState:
    """Z = phi(K)^T V `[B, H, M, Dv]`, t = phi(K)^T 1 `[B, H, M]` (the decoding cache of a
    non-causal attention over a fixed memory, htgn.md §5.4), as a `LinearState`."""
    v = v.astype(acc_dtype(v, phi_k))
    return LinearState(jnp.einsum("bshm,bshd->bhmd", phi_k, v), jnp.sum(phi_k, axis=1))


# --------------------------------------------------------------------------------------------
# Exact softmax oracle and the end-to-end function
# --------------------------------------------------------------------------------------------


def exact_softmax_attention(q: Array, k: Array, v: Array, *, key_mask: Array | None = None,
                            causal: bool = False, segment_ids: Array | None = None,
                            kv_segment_ids: Array | None = None) -> Array:
    """Exact softmax(q k^T / sqrt(D)) v, O(T S) memory: the oracle mode (`feature_map='exact'`).

    NaN-safe: padded keys/values are removed with `where`; a non-finite value at a valid key s is
    replaced by 0 in the product and every row that attends to s (s <= t when causal) is set to
    NaN, which is what the unmasked product gives to those rows only.

    Args:
      q: `[B, T, H, D]`; k: `[B, S, H, D]`; v: `[B, S, H, Dv]`.
      key_mask: optional `[B, S]` key-padding mask.
      causal: mask keys s > t (requires S == T).
      segment_ids, kv_segment_ids: optional packed documents of the queries `[B, T]` and keys `[B, S]`
        (`favor_attention`): a query attends to the keys of its own document only.

    Returns:
      `[B, T, H, Dv]` in the accumulation dtype; rows with no valid key are 0 (as in FAVOR+).
    """
    _check_attention(q, k, v, key_mask, causal, segment_ids, kv_segment_ids)
    kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    return _exact(q, k, v, _key_valid(k.shape, key_mask, kv_segment_ids), causal, segment_ids, kv_segment_ids)


def _exact(q, k, v, keys, causal, segment_ids, kv_segment_ids):
    """`exact_softmax_attention` after its checks (keys: bool valid keys or None)."""
    keys = jnp.ones(k.shape[:2], bool) if keys is None else keys
    dt = acc_dtype(q, k, v)
    q, k, v = q.astype(dt), masking.zero_padding(k.astype(dt), keys), masking.zero_padding(v.astype(dt), keys)
    bad = keys[:, :, None] & ~jnp.all(jnp.isfinite(v), axis=-1)               # [B, S, H]
    v = jnp.where(bad[..., None], 0.0, v)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    valid = jnp.broadcast_to(keys[:, None, None, :], logits.shape)
    if causal:
        valid = valid & jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    if segment_ids is not None:
        valid = valid & (packing.same_segment(segment_ids, kv_segment_ids) & (segment_ids > 0)[..., None])[:, None]
    # finfo.min / 2 instead of -inf keeps fully masked rows finite; they are zeroed below.
    logits = jnp.where(valid, logits, jnp.finfo(dt).min / 2)
    weights = jnp.where(jnp.any(valid, axis=-1, keepdims=True), jax.nn.softmax(logits, axis=-1), 0.0)
    out = jnp.einsum("bhts,bshd->bthd", weights, v)
    poisoned = jnp.swapaxes(jnp.any(valid & jnp.swapaxes(bad, 1, 2)[:, :, None, :], axis=-1), 1, 2)
    return jnp.where(poisoned[..., None], jnp.nan, out)


def _check_attention(q, k, v, key_mask, causal, segment_ids, kv_segment_ids) -> None:
    """The checks shared by `exact_softmax_attention` and `favor_attention` (one line each)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_rank(name, x, 4, "[B, T, H, D]")
    if k.shape[:3] != v.shape[:3] or k.shape[0::2] != q.shape[0::2]:
        fail(f"q [B, T, H, D], k [B, S, H, D] and v [B, S, H, Dv] disagree: {q.shape}, {k.shape}, {v.shape}")
    if causal and q.shape[1] != k.shape[1]:
        fail(f"causal attention needs equal lengths, got {q.shape[1]} and {k.shape[1]}")
    masking.check_mask(key_mask, k.shape[:2], "key_mask", "[B, S]")
    if causal and kv_segment_ids is not None:
        fail("causal attention is a self-attention: pass `segment_ids` only, not `kv_segment_ids`")
    _check_documents(segment_ids, kv_segment_ids, q.shape[:2], k.shape[:2])


def favor_attention(q: Array, k: Array, v: Array, *, feature_map: str = "softmax",
                    projection: Array | None = None, causal: bool = False,
                    key_mask: Array | None = None, eps: float = 1e-6,
                    key_stabiliser: str | None = None, causal_impl: str = "chunked",
                    chunk_size: int = 64, segment_ids: Array | None = None,
                    kv_segment_ids: Array | None = None) -> Array:
    """End-to-end FAVOR+ attention: features, the chosen form, then `normalize`.

    Args:
      q: `[B, T, H, D]`; k: `[B, S, H, D]`; v: `[B, S, H, Dv]`.
      feature_map: 'softmax' | 'trig' | 'relu' | 'elu' | 'exact'.
      projection: Omega `[M, D]` for 'softmax' and 'trig' (None otherwise).
      causal: unidirectional attention (S == T).
      key_mask: optional `[B, S]` key-padding mask.
      eps: numerical stabiliser (features and denominator guard).
      key_stabiliser: 'max' | 'constant'; None picks 'constant' when causal, else 'max'.
      causal_impl: 'chunked' | 'scan' | 'quadratic' (`linear_attention.causal_chunked` /
        `causal_scan` / `causal_parallel`).
      chunk_size: chunk length of the chunked form.
      segment_ids: optional int `[B, T]` packed documents (`zoo_core.ops.packing`; 0 = padding): a
        query attends only within its document, the causal forms reset their state at each start,
        the global sums and the 'max' key stabiliser are per document.
      kv_segment_ids: optional int `[B, S]` documents of the keys of a non-causal cross-attention
        (matched to `segment_ids` by id); None with `segment_ids` = a self-attention (S = T).

    Returns:
      `[B, T, H, Dv]` in float32 (float64 for float64 inputs).
    """
    check_choice("feature_map", feature_map, FEATURE_MAPS)
    check_choice("causal_impl", causal_impl, CAUSAL_IMPLS)   # chunk_size: `causal_chunked` checks it
    _check_attention(q, k, v, key_mask, causal, segment_ids, kv_segment_ids)
    if key_stabiliser is None:
        key_stabiliser = "constant" if causal else "max"
    check_choice("key_stabiliser", key_stabiliser, KEY_STABILISERS)
    if feature_map == "exact":
        if projection is not None:
            fail("`projection` must be None for feature_map='exact'")
        kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        return _exact(q, k, v, _key_valid(k.shape, key_mask, kv_ids), causal, segment_ids, kv_ids)
    _check_projection(feature_map, projection, q.shape[-1])
    kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    valid = _key_valid(k.shape, key_mask, kv_ids)
    phi_q, phi_k, guard = _features(q, k, feature_map, projection, valid, eps, key_stabiliser, kv_ids)
    v = masking.zero_padding(v, valid)
    if not causal:
        num, den = _noncausal(phi_q, phi_k, v, segment_ids, kv_segment_ids)
    else:
        kw = dict(mask=valid, denominator=True, segment_ids=segment_ids)
        if causal_impl == "chunked":
            num, den, _ = linear_attention.causal_chunked(phi_q, phi_k, v, chunk_size=chunk_size, **kw)
        elif causal_impl == "scan":
            num, den, _ = linear_attention.causal_scan(phi_q, phi_k, v, **kw)
        else:
            num, den = linear_attention.causal_parallel(phi_q, phi_k, v, **kw)
    return normalize(num, den, guard, floor=feature_map == "trig")
