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

import math
from typing import Any

import jax
import jax.numpy as jnp

from zoo_core.ops import linear_attention, masking
from zoo_core.ops.linear_attention import LinearState, acc_dtype

Array = Any

FEATURE_MAPS = ("softmax", "trig", "relu", "elu", "exact")
RANDOM_FEATURE_MAPS = ("softmax", "trig")   # maps with a random projection Omega (num_features, redraw)
KEY_STABILISERS = ("max", "constant")
CAUSAL_IMPLS = ("chunked", "recurrent", "quadratic")
RELU_EPS = 1e-3  # kernel_epsilon of the original's generalized (ReLU) attention


# --------------------------------------------------------------------------------------------
# Random projection matrices (paper §2.4; original GaussianOrthogonalRandomMatrix)
# --------------------------------------------------------------------------------------------


def gaussian_orthogonal_random_matrix(key: Array, num_features: int, dim: int, *,
                                      scaling: int = 0, fix_signs: bool = True,
                                      dtype: Any = jnp.float32) -> Array:
    """Orthogonal random features matrix (ORF, paper §2.4), built as the original constructor.

    floor(M/D) full D x D blocks plus one partial block; each block is the transposed Q factor of
    the QR decomposition of an i.i.d. Gaussian D x D matrix (rows orthonormal within a block, the
    partial block keeps its first rows). Rows are then rescaled: `scaling=0` by the norms of the
    rows of an independent Gaussian [M, D] draw (chi_D, so every row is marginally N(0, I_D));
    `scaling=1` by sqrt(D). The key-splitting order is the original's, so with `fix_signs=False`
    the same key gives the original's matrix.

    `fix_signs=True` (default, our correction) multiplies the columns of each Q by sign(diag R)
    (Mezzadri 2007), which makes Q Haar-distributed. Without it the Householder QR's sign
    convention gives every block row i a negative i-th coordinate on average (mean direction
    about -0.4 e_i at D=4), so the rows are not marginally isotropic, the positive-feature kernel
    estimate is biased, and the FAVOR+ error stops decreasing with M (measured: mean abs error
    vs exact softmax stuck at ~1.5e-2 from M=256 to 16384 at D=4, while the corrected or i.i.d.
    matrices converge). The goldens' matrix was made with the original (`fix_signs=False`).

    Args:
      key: a PRNG key.
      num_features: M, the number of rows (random features).
      dim: D, the head width.
      scaling: 0 (chi-distributed row norms) or 1 (all row norms sqrt(D)).
      fix_signs: make each block Haar-distributed (see above); False = the original.
      dtype: dtype of the Gaussian draws and of the result.

    Returns:
      Omega, `[M, D]`.
    """
    if not isinstance(num_features, int) or num_features < 1:
        raise ValueError(f"num_features must be a positive int, got {num_features!r}")
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    if scaling not in (0, 1):
        raise ValueError(f"scaling must be 0 or 1, got {scaling!r}")
    num_blocks = -(-num_features // dim)

    # The original splits sequentially (rng, sub = split(rng)) once per block; a Python loop
    # reproduces that key chain with no while loop (an accelerator runs a loop's control from the
    # host, and a redraw is on the training path), then one batched call draws and factorises.
    rng, subkeys = key, []
    for _ in range(num_blocks):
        rng, sub = jax.random.split(rng)
        subkeys.append(sub)
    subkeys = jnp.stack(subkeys)
    gauss = jax.vmap(lambda k: jax.random.normal(k, (dim, dim), dtype))(subkeys)
    q, r = jnp.linalg.qr(gauss)
    if fix_signs:
        signs = jnp.where(jnp.diagonal(r, axis1=-2, axis2=-1) < 0, -1.0, 1.0).astype(q.dtype)
        q = q * signs[:, None, :]  # column j of Q times sign(R_jj)
    # Rows of each block are the columns of Q; the partial last block keeps its first rows.
    matrix = jnp.swapaxes(q, -1, -2).reshape(num_blocks * dim, dim)[:num_features]
    if scaling == 0:
        multiplier = jnp.linalg.norm(jax.random.normal(key, (num_features, dim), dtype), axis=1)
    else:
        multiplier = jnp.full((num_features,), math.sqrt(dim), dtype)
    return multiplier[:, None] * matrix


def gaussian_iid_random_matrix(key: Array, num_features: int, dim: int, *,
                               dtype: Any = jnp.float32) -> Array:
    """Unstructured i.i.d. N(0, 1) projection `[M, D]` (the original's unstructured option)."""
    return jax.random.normal(key, (num_features, dim), dtype)


def draw_projection(key: Array, feature_step: Array | int | None, *, num_features: int, dim: int,
                    redraw_every: int = 0, orthogonal: bool = True, scaling: int = 0,
                    fix_signs: bool = True, dtype: Any = jnp.float32) -> Array:
    """The projection in force at training step `feature_step`: a pure, deterministic schedule.

    Omega(s) = G(fold_in(key, s // redraw_every)), G the (orthogonal) Gaussian constructor.
    Within a window of `redraw_every` steps the matrix is constant; `redraw_every=0` (or
    `feature_step=None`) always gives draw 0. `feature_step` may be traced (it is only folded
    into the key).

    Args:
      key: base PRNG key of the layer (or of the model, to share Omega across layers).
      feature_step: training-step counter, int or int scalar array, or None.
      num_features: M.
      dim: D.
      redraw_every: redraw period in steps; 0 = never.
      orthogonal: ORF (True) or i.i.d. Gaussian rows (False).
      scaling: row-norm mode of the orthogonal constructor (0 or 1).
      fix_signs: Haar sign correction of the orthogonal constructor (see there).
      dtype: result dtype.

    Returns:
      Omega, `[M, D]`.
    """
    if not isinstance(redraw_every, int) or redraw_every < 0:
        raise ValueError(f"redraw_every must be an int >= 0, got {redraw_every!r}")
    if feature_step is None or redraw_every == 0:
        index = jnp.zeros((), jnp.uint32)
    else:
        index = (jnp.asarray(feature_step) // redraw_every).astype(jnp.uint32)
    sub = jax.random.fold_in(key, index)
    if orthogonal:
        return gaussian_orthogonal_random_matrix(sub, num_features, dim, scaling=scaling,
                                                 fix_signs=fix_signs, dtype=dtype)
    return gaussian_iid_random_matrix(sub, num_features, dim, dtype=dtype)


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


def softmax_kernel_features(x: Array, projection: Array, *, is_query: bool,
                            mask: Array | None = None, eps: float = 1e-6,
                            key_stabiliser: str = "max") -> Array:
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

    Returns:
      phi(x), `[B, T, H, M]`, in float32 (float64 for float64 inputs).
    """
    if x.ndim != 4:
        raise ValueError(f"x must have rank 4 [B, T, H, D], got shape {tuple(x.shape)}")
    if projection.ndim != 2 or projection.shape[1] != x.shape[-1]:
        raise ValueError(f"projection must have shape [M, D={x.shape[-1]}], "
                         f"got {tuple(projection.shape)}")
    if key_stabiliser not in KEY_STABILISERS:
        raise ValueError(f"key_stabiliser must be one of {KEY_STABILISERS}, got {key_stabiliser!r}")
    if is_query and mask is not None:
        raise ValueError("mask applies to keys only; pass is_query=False or mask=None")
    masking.check_mask(mask, x.shape[:2])
    mask = None if mask is None else jnp.asarray(mask).astype(bool)
    dt = acc_dtype(x, projection)
    x = masking.zero_padding(x.astype(dt), mask)
    projection = projection.astype(dt)
    num_features, dim = projection.shape
    normaliser = dim ** -0.25
    ratio = num_features ** -0.5
    x = normaliser * x
    proj = jnp.einsum("bthd,md->bthm", x, projection)
    half_sq = 0.5 * jnp.sum(jnp.square(x), axis=-1, keepdims=True)
    if is_query:
        return ratio * (jnp.exp(proj - half_sq - jnp.max(proj, axis=-1, keepdims=True)) + eps)
    if key_stabiliser == "constant":
        stab = jax.lax.stop_gradient(constant_key_stabiliser(projection))
        phi = ratio * (jnp.exp(proj - half_sq - stab) + eps * jnp.exp(-stab))
    else:
        valid = proj if mask is None else jnp.where(mask[:, :, None, None], proj, -jnp.inf)
        stab = jnp.max(valid, axis=(1, 3), keepdims=True)
        # A fully padded example has stab = -inf; any finite value works since its phi is zeroed.
        stab = jax.lax.stop_gradient(jnp.where(jnp.isfinite(stab), stab, 0.0))
        phi = ratio * (jnp.exp(proj - half_sq - stab) + eps)
    return masking.zero_padding(phi, mask)


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
                         mask: Array | None = None, key_stabiliser: str = "max") -> Array:
    """Random Fourier (sin/cos) features of the softmax kernel (Performer §2.2, "trig" features).

    phi(x) = exp(||x'||^2/2 - s) / sqrt(M) [sin(w_i^T x'), cos(w_i^T x')]_{i=1..M}, x' = x D^(-1/4),
    so E[phi(q)^T phi(k)] = exp(q^T k / sqrt(D)) up to the scales s (Bochner: E cos(w^T(q'-k')) =
    exp(-||q'-k'||^2/2)). The features can be negative, so the estimated denominator can be 0 or
    negative (`normalize(..., floor=True)` handles it). The scales s keep exp() in range:

    * queries: s = ||q'||^2/2 per token (it cancels between numerator and denominator);
    * keys, 'max': s = stop_gradient of the max of ||k'||^2/2 over the valid keys, one scalar per
      (batch, head) (a global constant, cancels; the original's trig stabiliser);
    * keys, 'constant' (causal: no data-dependent constant may be used): s = 0, with the exponent
      capped at `TRIG_KEY_CAP` = 10; the cap changes a key only if ||k||^2 > 20 sqrt(D) (at
      initialisation ||k||^2 is about D, so it binds for no key there), and it bounds the key
      scales, which the absolute denominator floor needs to keep adversarial inputs finite.

    Args:
      x: `[B, T, H, D]`; projection: Omega `[M, D]`; mask: optional `[B, T]` (keys only).
      is_query, key_stabiliser: as in `softmax_kernel_features`.

    Returns:
      phi(x), `[B, T, H, 2M]` (sines then cosines), float32 (float64 for float64 inputs).
    """
    if key_stabiliser not in KEY_STABILISERS:
        raise ValueError(f"key_stabiliser must be one of {KEY_STABILISERS}, got {key_stabiliser!r}")
    masking.check_mask(mask, x.shape[:2])
    mask = None if mask is None else jnp.asarray(mask).astype(bool)
    dt = acc_dtype(x, projection)
    x = masking.zero_padding(x.astype(dt), mask) * projection.shape[1] ** -0.25
    proj = jnp.einsum("bthd,md->bthm", x, projection.astype(dt))
    half_sq = 0.5 * jnp.sum(jnp.square(x), axis=-1, keepdims=True)
    if is_query:
        scale = jnp.ones_like(half_sq)
    elif key_stabiliser == "constant":
        scale = jnp.exp(jnp.minimum(half_sq, TRIG_KEY_CAP))
    else:
        valid = half_sq if mask is None else jnp.where(mask[:, :, None, None], half_sq, -jnp.inf)
        stab = jnp.max(valid, axis=(1, 3), keepdims=True)
        stab = jax.lax.stop_gradient(jnp.where(jnp.isfinite(stab), stab, 0.0))
        scale = jnp.exp(half_sq - stab)
    phi = scale * projection.shape[0] ** -0.5 * jnp.concatenate([jnp.sin(proj), jnp.cos(proj)], -1)
    return masking.zero_padding(phi, mask)


def favor_features(q: Array, k: Array, *, feature_map: str = "softmax",
                   projection: Array | None = None, key_mask: Array | None = None,
                   eps: float = 1e-6, key_stabiliser: str = "max") -> tuple[Array, Array, Array]:
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

    Returns:
      (phi_q `[B, T, H, M]`, phi_k `[B, S, H, M]`, guard), where `guard` is the scalar threshold
      to pass to `normalize` (eps, scaled by exp(-c) for the constant key stabiliser).
    """
    if feature_map not in ("softmax", "trig", "relu", "elu"):
        raise ValueError(f"feature_map must be 'softmax', 'trig', 'relu' or 'elu' here, "
                         f"got {feature_map!r}")
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must have rank 4 [B, T, H, D], got {q.shape} and {k.shape}")
    masking.check_mask(key_mask, k.shape[:2], "key_mask", "[B, S]")
    if feature_map == "softmax":
        if projection is None:
            raise ValueError("projection is required for feature_map='softmax'")
        phi_q = softmax_kernel_features(q, projection, is_query=True, eps=eps)
        phi_k = softmax_kernel_features(k, projection, is_query=False, mask=key_mask, eps=eps,
                                        key_stabiliser=key_stabiliser)
        guard = jnp.asarray(eps, phi_k.dtype)
        if key_stabiliser == "constant":
            guard = guard * jnp.exp(-jax.lax.stop_gradient(
                constant_key_stabiliser(projection.astype(phi_k.dtype))))
        return phi_q, phi_k, guard
    if feature_map == "trig":
        if projection is None:
            raise ValueError("projection is required for feature_map='trig'")
        phi_q = trig_kernel_features(q, projection, is_query=True)
        phi_k = trig_kernel_features(k, projection, is_query=False, mask=key_mask,
                                     key_stabiliser=key_stabiliser)
        return phi_q, phi_k, jnp.asarray(eps, phi_k.dtype)
    if projection is not None:
        raise ValueError(f"projection must be None for the deterministic "
                         f"feature_map={feature_map!r}")
    fn = relu_features if feature_map == "relu" else elu_features
    phi_q, phi_k = fn(q), masking.zero_padding(fn(masking.zero_padding(k, key_mask)), key_mask)
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


def favor_parallel(phi_q: Array, phi_k: Array, v: Array) -> tuple[Array, Array]:
    """Non-causal linear attention: Z = phi(K)^T V, W = phi(Q) Z, t = phi(K)^T 1, R = phi(Q) t.

    Args:
      phi_q: `[B, T, H, M]`.
      phi_k: `[B, S, H, M]` (zero at padded keys).
      v: `[B, S, H, Dv]` (zero at padded keys: `favor_attention` removes them with `where`).

    Returns:
      (numerator W `[B, T, H, Dv]`, denominator R `[B, T, H]`), before `normalize`.
    """
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
                            causal: bool = False) -> Array:
    """Exact softmax(q k^T / sqrt(D)) v, O(T S) memory: the oracle mode (`feature_map='exact'`).

    NaN-safe: padded keys/values are removed with `where`; a non-finite value at a valid key s is
    replaced by 0 in the product and every row that attends to s (s <= t when causal) is set to
    NaN, which is what the unmasked product gives to those rows only.

    Args:
      q: `[B, T, H, D]`; k: `[B, S, H, D]`; v: `[B, S, H, Dv]`.
      key_mask: optional `[B, S]` key-padding mask.
      causal: mask keys s > t (requires S == T).

    Returns:
      `[B, T, H, Dv]` in the accumulation dtype; rows with no valid key are 0 (as in FAVOR+).
    """
    keys = masking.as_bool(key_mask, k.shape[:2], "key_mask", "[B, S]")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs equal lengths, got {q.shape[1]} and {k.shape[1]}")
    dt = acc_dtype(q, k, v)
    q, k, v = q.astype(dt), masking.zero_padding(k.astype(dt), keys), masking.zero_padding(v.astype(dt), keys)
    bad = keys[:, :, None] & ~jnp.all(jnp.isfinite(v), axis=-1)               # [B, S, H]
    v = jnp.where(bad[..., None], 0.0, v)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    valid = jnp.broadcast_to(keys[:, None, None, :], logits.shape)
    if causal:
        valid = valid & jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    # finfo.min / 2 instead of -inf keeps fully masked rows finite; they are zeroed below.
    logits = jnp.where(valid, logits, jnp.finfo(dt).min / 2)
    weights = jnp.where(jnp.any(valid, axis=-1, keepdims=True), jax.nn.softmax(logits, axis=-1), 0.0)
    out = jnp.einsum("bhts,bshd->bthd", weights, v)
    poisoned = jnp.swapaxes(jnp.any(valid & jnp.swapaxes(bad, 1, 2)[:, :, None, :], axis=-1), 1, 2)
    return jnp.where(poisoned[..., None], jnp.nan, out)


def favor_attention(q: Array, k: Array, v: Array, *, feature_map: str = "softmax",
                    projection: Array | None = None, causal: bool = False,
                    key_mask: Array | None = None, eps: float = 1e-6,
                    key_stabiliser: str | None = None, causal_impl: str = "chunked",
                    chunk_size: int = 64) -> Array:
    """End-to-end FAVOR+ attention: features, the chosen form, then `normalize`.

    Args:
      q: `[B, T, H, D]`; k: `[B, S, H, D]`; v: `[B, S, H, Dv]`.
      feature_map: 'softmax' | 'trig' | 'relu' | 'elu' | 'exact'.
      projection: Omega `[M, D]` for 'softmax' and 'trig' (None otherwise).
      causal: unidirectional attention (S == T).
      key_mask: optional `[B, S]` key-padding mask.
      eps: numerical stabiliser (features and denominator guard).
      key_stabiliser: 'max' | 'constant'; None picks 'constant' when causal, else 'max'.
      causal_impl: 'chunked' | 'recurrent' | 'quadratic' (`linear_attention.causal_chunked` /
        `causal_scan` / `causal_parallel`).
      chunk_size: chunk length of the chunked form.

    Returns:
      `[B, T, H, Dv]` in float32 (float64 for float64 inputs).
    """
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")
    if causal_impl not in CAUSAL_IMPLS:
        raise ValueError(f"causal_impl must be one of {CAUSAL_IMPLS}, got {causal_impl!r}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs equal lengths, got {q.shape[1]} and {k.shape[1]}")
    if feature_map == "exact":
        if projection is not None:
            raise ValueError("projection must be None for feature_map='exact'")
        return exact_softmax_attention(q, k, v, key_mask=key_mask, causal=causal)
    if key_stabiliser is None:
        key_stabiliser = "constant" if causal else "max"
    phi_q, phi_k, guard = favor_features(q, k, feature_map=feature_map, projection=projection,
                                         key_mask=key_mask, eps=eps, key_stabiliser=key_stabiliser)
    v = masking.zero_padding(v, key_mask)
    if not causal:
        num, den = favor_parallel(phi_q, phi_k, v)
    elif causal_impl == "chunked":
        num, den, _ = linear_attention.causal_chunked(phi_q, phi_k, v, chunk_size=chunk_size,
                                                      mask=key_mask, denominator=True)
    elif causal_impl == "recurrent":
        num, den, _ = linear_attention.causal_scan(phi_q, phi_k, v, mask=key_mask,
                                                   denominator=True)
    else:
        num, den = linear_attention.causal_parallel(phi_q, phi_k, v, mask=key_mask,
                                                    denominator=True)
    return normalize(num, den, guard, floor=feature_map == "trig")
