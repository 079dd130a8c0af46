"""Nyströmformer (Xiong et al., 2021, "Nyströmformer: A Nyström-Based Algorithm for Approximating
Self-Attention"), non-causal.

With m = `num_landmarks` landmarks Q~, K~ `[m, D]`, the segment means of Q and K over m contiguous
segments of ceil(T / m) positions (docs/specs/baselines.md, "Nyströmformer"):

    F = softmax(Q K~^T / sqrt(D))   [T, m]      A = softmax(Q~ K~^T / sqrt(D))   [m, m]
    B = softmax(Q~ K^T / sqrt(D))   [m, T]      O = F A^+ (B V)                  cost O(T m)

A^+ is the iterative Moore-Penrose inverse of the paper (`iterative_pinv`, 6 iterations) or, with
`pinv_iterations=None`, `jnp.linalg.pinv` (exact, for checks and small m).

Padding: the means are over the valid tokens of each segment only, padded keys are masked out of B
and padded values replaced by 0 (`jnp.where`), so padding (even NaN) changes no valid output. A
segment without a valid token (the tail of a padded row, or T < m) is an empty landmark: its
column of F and A gets weight 0 and its row of A is the identity's, so A = diag(A_valid, I) and
A^+ = diag(A_valid^+, I): the empty landmarks contribute nothing, and with m = T each landmark is
one token and F A^+ B = S S^+ S = S, softmax attention itself.

The official code's depthwise convolution of V (kernel 33 there) is the option `conv_kernel`: a
skip O += conv(V) along the sequence, one kernel `[K]` per head shared by the head's features.
"""
from __future__ import annotations

__all__ = ["NystromformerAttention", "nystrom_attention"]

import math
from typing import Callable, ClassVar, Optional

import jax
import jax.numpy as jnp

from zoo_core import checks
from zoo_core.baselines import TORCH_LINEAR_KERNEL_INIT, Initializer, ProjectedAttention

Array = jax.Array
_OFF = 1e9          # the masked-logit offset of the softmax baseline
_HIGHEST = jax.lax.Precision.HIGHEST


def _float(x: Array) -> Array:
    return jnp.asarray(x).astype(jnp.promote_types(jnp.result_type(x), jnp.float32))


def segment_means(x: Array, valid: Array, num_landmarks: int) -> tuple[Array, Array]:
    """Means of x over m contiguous segments of ceil(T / m) positions, valid tokens only.

    Args:
      x: `[B, T, H, D]` (padded tokens may hold anything).
      valid: `[B, T]` bool.
      num_landmarks: m.

    Returns:
      (landmarks `[B, m, H, D]` (0 for an empty segment), nonempty `[B, m]` bool).
    """
    b, t = x.shape[:2]
    s = -(-t // num_landmarks)
    pad = num_landmarks * s - t
    x = jnp.pad(jnp.where(valid[:, :, None, None], x, 0.0), ((0, 0), (0, pad), (0, 0), (0, 0)))
    counts = jnp.pad(valid, ((0, 0), (0, pad))).reshape(b, num_landmarks, s).sum(axis=2)
    sums = x.reshape((b, num_landmarks, s) + x.shape[2:]).sum(axis=2)
    means = sums / jnp.maximum(counts, 1)[:, :, None, None].astype(sums.dtype)
    return means, counts > 0


def iterative_pinv(a: Array, iterations: int) -> Array:
    """Moore-Penrose pseudo-inverse of each `[..., m, m]` matrix by the paper's iteration:
    Z0 = A^T / (max row sum |A| * max column sum |A|) (per matrix), then
    Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4, `iterations` times (unrolled: no loop in the
    compiled program). Products in full float32 precision (`Precision.HIGHEST`)."""
    abs_a = jnp.abs(a)
    norm = jnp.max(jnp.sum(abs_a, axis=-1), axis=-1) * jnp.max(jnp.sum(abs_a, axis=-2), axis=-1)
    z = jnp.swapaxes(a, -1, -2) / norm[..., None, None]
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)
    mm = lambda x, y: jnp.matmul(x, y, precision=_HIGHEST)
    for _ in range(iterations):
        az = mm(a, z)
        z = 0.25 * mm(z, 13 * eye - mm(az, 15 * eye - mm(az, 7 * eye - az)))
    return z


def depthwise_conv(v: Array, kernel: Array) -> Array:
    """Per-head convolution of v along the sequence ('same' size, zero padding): v `[B, T, H, M]`,
    kernel `[H, K]` (K odd) -> `[B, T, H, M]`, out[t] = sum_j kernel[j] v[t + j - K // 2]."""
    b, t, h, m = v.shape
    k = kernel.shape[-1]
    rhs = jnp.repeat(kernel.T[:, :, None], m, axis=2).reshape(k, 1, h * m)      # [K, 1, H*M]
    out = jax.lax.conv_general_dilated(v.reshape(b, t, h * m), rhs.astype(v.dtype), (1,),
                                       [(k // 2, k // 2)], dimension_numbers=("NWC", "WIO", "NWC"),
                                       feature_group_count=h * m, precision=_HIGHEST)
    return out.reshape(b, t, h, m)


def nystrom_attention(q: Array, k: Array, v: Array, *, num_landmarks: int,
                      mask: Optional[Array] = None, pinv_iterations: Optional[int] = 6,
                      dropout: Optional[Callable[[Array], Array]] = None) -> Array:
    """F A^+ (B V) per head (module docstring), float32 (float64 stays float64).

    Args:
      q, k: `[B, T, H, D]`.
      v: `[B, T, H, M]`.
      num_landmarks: m >= 1.
      mask: `[B, T]` key-padding mask (True = valid) or None.
      pinv_iterations: iterations of `iterative_pinv`; None: `jnp.linalg.pinv`.
      dropout: optional `w -> w` on F `[B, H, T, m]` (each query's weights over the landmarks).

    Returns:
      `[B, T, H, M]`.
    """
    q, k, v = _float(q), _float(k), _float(v)
    valid = jnp.ones(q.shape[:2], bool) if mask is None else jnp.asarray(mask).astype(bool)
    keep = valid[:, :, None, None]
    q, k, v = jnp.where(keep, q, 0.0), jnp.where(keep, k, 0.0), jnp.where(keep, v, 0.0)
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_l, full = segment_means(q, valid, num_landmarks)
    k_l, _ = segment_means(k, valid, num_landmarks)
    cols = full[:, None, None, :]                                                   # [B, 1, 1, m]
    f = jax.nn.softmax(jnp.where(cols, jnp.einsum("bthd,bmhd->bhtm", q, k_l) * scale, -_OFF), axis=-1)
    a = jax.nn.softmax(jnp.where(cols, jnp.einsum("bnhd,bmhd->bhnm", q_l, k_l) * scale, -_OFF), axis=-1)
    eye = jnp.eye(num_landmarks, dtype=a.dtype)
    a = jnp.where(full[:, None, :, None], a, eye)                    # an empty landmark's row: identity
    bw = jax.nn.softmax(jnp.where(valid[:, None, None, :], jnp.einsum("bmhd,bthd->bhmt", q_l, k) * scale,
                                  -_OFF), axis=-1)
    a_inv = jnp.linalg.pinv(a) if pinv_iterations is None else iterative_pinv(a, pinv_iterations)
    if dropout is not None:
        f = dropout(f)
    bv = jnp.einsum("bhmt,bthc->bhmc", bw, v)                                     # [B, H, m, M]
    zbv = jnp.einsum("bhnm,bhmc->bhnc", a_inv, bv, precision=_HIGHEST)
    return jnp.einsum("bhtn,bhnc->bthc", f, zbv)


class NystromformerAttention(ProjectedAttention):
    """Multi-head Nyströmformer self-attention (non-causal), the zoo's layer contract.

    Shapes: x `[B, T, E]` -> y `[B, T, E']`. Parameters: those of the softmax baseline (`query`,
    `key`, `value`, `out`, see `zoo_core.baselines`), and with `conv_kernel` the skip's `conv`
    `[H, K]`.

    Attributes (besides `ProjectedAttention`'s):
      num_landmarks: m (the paper's 64 by default); T <= m makes each landmark one token.
      pinv_iterations: iterations of the Moore-Penrose iteration (the paper's 6); None:
        `jnp.linalg.pinv` (exact; an SVD, for checks and small m).
      conv_kernel: None (off) or an odd K: the depthwise convolution skip of V (33 in the official
        code).
      conv_init: initialiser of `conv` (PyTorch's Conv2d default, U(+-1/sqrt(K))).
      dropout_rate: dropout on F, each query's weights over the landmarks.
    """
    keeps_documents_apart: ClassVar[bool] = False   # segment_ids refused in one line
    num_landmarks: int = 64
    pinv_iterations: Optional[int] = 6
    conv_kernel: Optional[int] = None
    conv_init: Initializer = TORCH_LINEAR_KERNEL_INIT

    def setup(self):
        self._check_common()
        checks.check_int("num_landmarks", self.num_landmarks, 1)
        checks.check_optional_int("pinv_iterations", self.pinv_iterations, 1)
        checks.check_optional_int("conv_kernel", self.conv_kernel, 1)
        if self.conv_kernel is not None and self.conv_kernel % 2 == 0:
            checks.fail(f"`conv_kernel` must be odd (a centred window), got {self.conv_kernel}")
        self._qkv_layers()
        if self.conv_kernel is not None:
            self.conv = self.param("conv", self.conv_init, (self.num_heads, self.conv_kernel),
                                   self.param_dtype)

    def __call__(self, x: Array, *, mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, dict]:
        """x `[B, T, E]`, mask `[B, T]` key-padding mask (True = valid) -> (y `[B, T, E']`, {}).
        `segment_ids` (packed documents) is refused in one line: the definition mixes the whole sequence."""
        self._refuse_segments(segment_ids, "Nystromformer", "landmarks (segment means over the sequence)")
        self._check_inputs(x, mask)
        q, k, v = self.query(x), self.key(x), self.value(x)
        o = nystrom_attention(q, k, v, num_landmarks=self.num_landmarks, mask=mask,
                              pinv_iterations=self.pinv_iterations,
                              dropout=self._weights_dropout(deterministic))
        if self.conv_kernel is not None:
            v = _float(v)
            if mask is not None:
                v = jnp.where(jnp.asarray(mask).astype(bool)[:, :, None, None], v, 0.0)
            o = o + depthwise_conv(v, _float(self.conv))
        return self._finish(o, x), {}
