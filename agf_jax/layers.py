"""Flax Linen layers for AGF (Wi, Choi, Park, IJCAI 2025, arXiv 2505.08516) and a softmax baseline.

`AGFAttention` owns the four projections of spec §2.1 (W_U, W_V, W_Sigma, W_val), the output
projection and the K+1 filter parameters theta (spec §2.4); every piece of maths is in
`agf_jax.ops`. One parameter tree serves `__call__` (parallel; chunked when `chunk_size` is set),
`scan` (recurrent, `jax.lax.scan` of a parameter-free function), `step` and `init_state`; the last
three exist only for the causal extension (`causal=True`, see `agf_jax.ops`).

Parameter names (stable; `agf_jax.convert` maps the reference names onto them):

    query  (W_U, LRA `W_q`, UEA `query_projection`)      kernel [E, H, D], bias [H, D]
    key    (W_V, LRA `W_k`, UEA `key_projection`)        kernel [E, H, D], bias [H, D]
    sigma  (W_Sigma, `W_Sigma` / `Sigma_projection`)     kernel [E, H, D], bias [H, D]
    value  (W_val, `W_v` / `value_projection`)           kernel [E, H, D], bias [H, D]
    out    (`ff` / `out_projection`)                     kernel [H, D, E'], bias [E']
    theta  (`poly.thetas.1..K`)                          [K]   (absent when K = 0)
    theta_0 (`poly.thetas.0`, only if learn_c0)          []
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from agf_jax import ops

Array = jax.Array
Initializer = Callable[..., Array]


def torch_linear_kernel_init() -> Initializer:
    """PyTorch's `nn.Linear` weight init, kaiming-uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)).

    Flax's default lecun_normal differs (agf.md §2.7); this keeps training dynamics comparable to the
    reference. `nn.DenseGeneral` flattens the kernel to [fan_in, fan_out] before calling it, so
    fan_in is right for the [E, H, D] and [H, D, E] kernels too. Biases: `torch_linear_bias_init`.
    """
    return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_linear_bias_init(fan_in: int) -> Initializer:
    """PyTorch's `nn.Linear` (and 1x1 `Conv1d`) bias init, U(+-1/sqrt(fan_in)).

    A bias initialiser only sees the bias shape, so the layer's input width is given here; the
    models pass it for every projection (the layers' own default stays Flax's zeros).
    """
    if fan_in < 1:
        raise ValueError(f"fan_in must be >= 1, got {fan_in}")
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


def _check_x(x: Array, mask: Optional[Array]) -> None:
    if jnp.ndim(x) != 3:
        raise ValueError(f"x must have rank 3 [B, T, E], got shape {jnp.shape(x)}")
    if mask is not None and tuple(jnp.shape(mask)) != tuple(jnp.shape(x)[:2]):
        raise ValueError(f"mask must have shape [B, T] = {jnp.shape(x)[:2]}, got {jnp.shape(mask)}")


class AGFAttention(nn.Module):
    """Attentive Graph Filter self-attention (spec §2), with an optional causal extension.

    Shapes: x `[B, T, E]` -> y `[B, T, E']` (E' = `out_features` or E).

    Attributes:
        num_heads: H.
        head_dim: D, the width of the singular vectors and of the per-head values.
        out_features: output width E' (default: the input width E).
        basis: 'jacobi' | 'chebyshev' | 'legendre' | 'monomial' (spec §2.4).
        order: polynomial order K >= 0 (K+1 coefficients).
        alpha: Jacobi alpha (only for basis='jacobi'; default 1.0).
        beta: Jacobi beta (only for basis='jacobi'; default 0.2).
        learn_c0: False: c_0 frozen at 1 (LRA always; UEA `--fixI`); True: c_0 = tanh(theta_0),
            initialised to 0, so the filter starts at 0 (UEA without `--fixI`).
        ortho_scale: factor on the orthogonality regulariser returned in aux (the LRA layer
            multiplies by `reg` inside; UEA uses 1 and applies eta in the loss).
        causal: prefix-normalised V (an extension the paper does not have; see `agf_jax.ops`).
        chunk_size: causal only; if set, `__call__` uses the chunked form with this chunk length,
            else the parallel (associative-scan) form.
        dropout_rate: dropout on the merged head outputs before `out` (not in the reference, whose
            `attention_dropout` is unused on the AGF path; default 0 keeps it identical).
        dtype: compute dtype of the projections (None: inferred); attention maths is float32.
        param_dtype: parameter dtype.
        kernel_init: kernel initialiser of the five projections.
        bias_init: bias initialiser of query, key, sigma and value.
        out_bias_init: bias initialiser of `out` (None: `bias_init`); PyTorch's bound depends on
            the fan-in, E for the four input projections and H*D for `out`.
        theta_init: initialiser of theta and theta_0 (reference: zeros).
    """
    num_heads: int
    head_dim: int
    out_features: Optional[int] = None
    basis: str = "jacobi"
    order: int = 3
    alpha: Optional[float] = None
    beta: Optional[float] = None
    learn_c0: bool = False
    ortho_scale: float = 1.0
    causal: bool = False
    chunk_size: Optional[int] = None
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = torch_linear_kernel_init()
    bias_init: Initializer = nn.initializers.zeros_init()
    out_bias_init: Optional[Initializer] = None
    theta_init: Initializer = nn.initializers.zeros_init()

    def setup(self):
        # Validate every option before anything is traced: bad input fails with one clear error.
        if self.num_heads < 1 or self.head_dim < 1:
            raise ValueError(f"num_heads and head_dim must be >= 1, got {self.num_heads}, "
                             f"{self.head_dim}")
        if not isinstance(self.order, int) or isinstance(self.order, bool) or self.order < 0:
            raise ValueError(f"order must be an int >= 0, got {self.order!r}")
        ops.resolve_basis(self.basis, self.alpha, self.beta, self.order)
        if self.chunk_size is not None:
            if not self.causal:
                raise ValueError("chunk_size applies only to causal=True (the non-causal form is "
                                 "already O(T D^2))")
            if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
                raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
        proj = functools.partial(nn.DenseGeneral, features=(self.num_heads, self.head_dim),
                                 dtype=self.dtype, param_dtype=self.param_dtype,
                                 kernel_init=self.kernel_init, bias_init=self.bias_init)
        self.query = proj(name="query")
        self.key = proj(name="key")
        self.sigma = proj(name="sigma")
        self.value = proj(name="value")
        if self.order > 0:
            self.theta = self.param("theta", self.theta_init, (self.order,), self.param_dtype)
        if self.learn_c0:
            self.theta_0 = self.param("theta_0", self.theta_init, (), self.param_dtype)
        self.dropout = nn.Dropout(self.dropout_rate)

    @nn.compact
    def _out(self, o: Array, width: int) -> Array:
        # A DenseGeneral over (H, D) -> E', declared in this one compact method (called from every
        # form) because E' defaults to the input width, unknown in setup().
        return nn.DenseGeneral(self.out_features or width, axis=(-2, -1), dtype=self.dtype,
                               param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                               bias_init=self.out_bias_init or self.bias_init, name="out")(o)

    def coefficients(self) -> Array:
        """Effective filter coefficients c_0..c_K, `[K+1]` float32."""
        theta = self.theta if self.order > 0 else None
        theta_0 = self.theta_0 if self.learn_c0 else None
        return ops.filter_coefficients(theta, theta_0)

    def _basis_kwargs(self) -> dict:
        return dict(basis=self.basis, alpha=self.alpha, beta=self.beta)

    def _project(self, x: Array):
        return self.query(x), self.key(x), self.sigma(x), self.value(x)

    def _finish(self, o: Array, width: int, dtype, deterministic: bool = True) -> Array:
        o = o.astype(dtype)
        o = self.dropout(o, deterministic=deterministic)
        return self._out(o, width)

    def _compute_dtype(self, x: Array):
        return self.dtype if self.dtype is not None else jnp.result_type(x, self.param_dtype)

    def __call__(self, x: Array, *, mask: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, dict]:
        """Parallel form (chunked if `chunk_size` is set).

        Args:
            x: `[B, T, E]`.
            mask: `[B, T]` padding mask (bool or 0/1; 1 = real), applied to V only as in the
                reference; padded rows of y are not zeroed.
            deterministic: disables dropout (only matters when dropout_rate > 0; uses the
                'dropout' rng).

        Returns:
            (y `[B, T, E']`, aux) with aux['orthogonality'] `[B]` = ortho_scale * regulariser
            (float32).
        """
        _check_x(x, mask)
        zu, zv, zs, val = self._project(x)
        c = self.coefficients()
        if self.causal and self.chunk_size is not None:
            o, _ = ops.agf_chunked(zu, zv, zs, val, c, chunk_size=self.chunk_size, mask=mask,
                                   **self._basis_kwargs())
        else:
            o = ops.agf_parallel(zu, zv, zs, val, c, mask=mask, causal=self.causal,
                                 **self._basis_kwargs())
        ortho = self.ortho_scale * ops.orthogonality_loss(zu, zv, mask=mask)
        y = self._finish(o, x.shape[-1], self._compute_dtype(x), deterministic)
        return y, {"orthogonality": ortho}

    def factors(self, x: Array, *, mask: Optional[Array] = None) -> dict:
        """Singular-domain intermediates for analysis (float32).

        Args:
            x: `[B, T, E]`.
            mask: `[B, T]` or None.

        Returns:
            dict with 'zu', 'zv', 'zs' `[B, T, H, D]` logits, 'value' `[B, T, H, D]`, 'u', 'v', 's',
            'g' (`ops.AGFFactors`, V over the whole sequence) and 'coeffs' `[K+1]`.
        """
        _check_x(x, mask)
        zu, zv, zs, val = self._project(x)
        c = self.coefficients()
        f = ops.agf_factors(zu, zv, zs, c, mask=mask, **self._basis_kwargs())
        return dict(zu=zu, zv=zv, zs=zs, value=val, coeffs=c, **f._asdict())

    def _require_causal(self, what: str) -> None:
        if not self.causal:
            raise ValueError(f"AGFAttention.{what} exists only for causal=True (the non-causal "
                             "right factor is normalised over the whole sequence, so there is no "
                             "recurrence)")

    def init_state(self, batch_size: int) -> ops.AGFState:
        """Empty causal state, float32: num `[B, H, D, D]`, den and max `[B, H, D]`."""
        self._require_causal("init_state")
        return ops.init_state(batch_size, self.num_heads, self.head_dim, self.head_dim)

    def scan(self, x: Array, state: Optional[ops.AGFState] = None, *,
             mask: Optional[Array] = None) -> tuple[Array, ops.AGFState]:
        """Recurrent form: projections for the whole sequence, then `jax.lax.scan` of pure maths.

        Args:
            x: `[B, T, E]`.
            state: `AGFState` of the preceding tokens, or None.
            mask: `[B, T]` or None.

        Returns:
            (y `[B, T, E']`, final state).
        """
        self._require_causal("scan")
        _check_x(x, mask)
        zu, zv, zs, val = self._project(x)
        o, state = ops.agf_recurrent(zu, zv, zs, val, self.coefficients(), mask=mask, state=state,
                                     **self._basis_kwargs())
        return self._finish(o, x.shape[-1], self._compute_dtype(x)), state

    def step(self, state: ops.AGFState, x_t: Array) -> tuple[Array, ops.AGFState]:
        """One token: O(H D^2).

        Args:
            state: `AGFState` of the prefix.
            x_t: `[B, E]`.

        Returns:
            (y_t `[B, E']`, new state).
        """
        self._require_causal("step")
        if jnp.ndim(x_t) != 2:
            raise ValueError(f"x_t must have rank 2 [B, E], got shape {jnp.shape(x_t)}")
        zu, zv, zs, val = self._project(x_t)
        state, o = ops.agf_step(state, zu, zv, zs, val, self.coefficients(), **self._basis_kwargs())
        return self._finish(o, x_t.shape[-1], self._compute_dtype(x_t)), state


class SoftmaxAttention(nn.Module):
    """Vanilla multi-head softmax attention, the baseline of the reference harnesses (O(T^2)).

    Same projections names as `AGFAttention` minus `sigma`, and the same `(y, aux)` interface
    (aux is empty: no regulariser). Shapes: x `[B, T, E]` -> `[B, T, E']`.

    Attributes:
        num_heads: H.
        head_dim: D.
        out_features: E' (default E).
        dropout_rate: dropout on the attention weights (the reference's `attention_dropout`).
        dtype, param_dtype, kernel_init, bias_init, out_bias_init: as in `AGFAttention`.
    """
    num_heads: int
    head_dim: int
    out_features: Optional[int] = None
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = torch_linear_kernel_init()
    bias_init: Initializer = nn.initializers.zeros_init()
    out_bias_init: Optional[Initializer] = None

    def setup(self):
        if self.num_heads < 1 or self.head_dim < 1:
            raise ValueError(f"num_heads and head_dim must be >= 1, got {self.num_heads}, "
                             f"{self.head_dim}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
        proj = functools.partial(nn.DenseGeneral, features=(self.num_heads, self.head_dim),
                                 dtype=self.dtype, param_dtype=self.param_dtype,
                                 kernel_init=self.kernel_init, bias_init=self.bias_init)
        self.query = proj(name="query")
        self.key = proj(name="key")
        self.value = proj(name="value")
        self.dropout = nn.Dropout(self.dropout_rate)

    def __call__(self, x: Array, *, mask: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, dict]:
        """Args: x `[B, T, E]`; mask `[B, T]` key padding mask. Returns (y `[B, T, E']`, {})."""
        _check_x(x, mask)
        q, k, v = self.query(x), self.key(x), self.value(x)
        w = ops.softmax_attention_weights(q, k, mask=mask)
        w = self.dropout(w, deterministic=deterministic)
        o = jnp.einsum("bhtj,bjhm->bthm", w, v.astype(w.dtype))
        dtype = self.dtype if self.dtype is not None else jnp.result_type(x, self.param_dtype)
        return self._out(o.astype(dtype), x.shape[-1]), {}

    @nn.compact
    def _out(self, o: Array, width: int) -> Array:
        return nn.DenseGeneral(self.out_features or width, axis=(-2, -1), dtype=self.dtype,
                               param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                               bias_init=self.out_bias_init or self.bias_init, name="out")(o)
