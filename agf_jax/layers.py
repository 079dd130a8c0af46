"""Flax Linen layers for AGF (Wi, Choi, Park, IJCAI 2025, arXiv 2505.08516) and a softmax baseline.

Both layers follow the zoo's layer contract (README "Layer contract"):

* `__call__(x, *, mask=None, deterministic=True) -> (y, aux)`, x `[B, T, E]`, mask bool `[B, T]`
  (True = valid); `aux['loss/<name>']` scalars are auxiliary losses, other keys diagnostics;
* with `causal=True` also `init_state(batch_size)`, `scan(x, state=None, *, mask=None,
  deterministic=True) -> (y, state)` and `step(state, x_t) -> (y_t, state)`;
* `chunk_size` chooses the form of a causal `__call__`: None = parallel, C = chunked.

`AGFAttention` owns the four projections of agf.md §2.1 (W_U, W_V, W_Sigma, W_val), the output
projection and the K+1 filter parameters theta (agf.md §2.4); the maths is in `agf_jax.ops` (and
`agf_jax.softmax` for the baseline). One parameter tree serves every form.

Parameter names (stable; `agf_jax.convert` maps the reference names onto them):

    query  (W_U, LRA `W_q`, UEA `query_projection`)      kernel [E, H, D], bias [H, D]
    key    (W_V, LRA `W_k`, UEA `key_projection`)        kernel [E, H, D], bias [H, D]
    sigma  (W_Sigma, `W_Sigma` / `Sigma_projection`)     kernel [E, H, D], bias [H, D]
    value  (W_val, `W_v` / `value_projection`)           kernel [E, H, D], bias [H, D]
    out    (`ff` / `out_projection`)                     kernel [H, D, E'], bias [E']
    theta  (`poly.thetas.1..K`)                          [K]   (absent when K = 0)
    theta_0 (`poly.thetas.0`, only if learn_c0)          []

With `graph_filter='uvt'` or `'svd'` (the paper's Table 6 ablations, docs/agf_options.md) there
is no `sigma`, `theta` or `theta_0`; 'svd' adds `singular_values` [H, D] (initialised to one).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from agf_jax import context_parallel as agf_context_parallel
from agf_jax import ops, validation
from agf_jax import softmax as softmax_ops
from agf_jax.ops import AGFState
from agf_jax.softmax import KVCache
from zoo_core import checks
from zoo_core.ops import packing, xla_forms
from zoo_core.ops.dropout import Dropout, keep_mask

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
    checks.check_int("fan_in", fan_in, 1)
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


class _Attention(nn.Module):
    """Fields, projections and helpers shared by the two layers (not a layer itself).

    The fields are documented in the layers' docstrings (`AGFAttention`, `SoftmaxAttention`).
    """
    num_heads: int
    head_dim: int
    out_features: Optional[int] = None
    causal: bool = False
    chunk_size: Optional[int] = None
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = torch_linear_kernel_init()
    bias_init: Initializer = nn.initializers.zeros_init()
    out_bias_init: Optional[Initializer] = None

    # Inside `xla_forms.plain('dense')` the projections are flax's DenseGeneral (not the 2-D matmuls
    # of `xla_forms.DenseGeneral`), inside `xla_forms.plain('dropout')` the dropout is flax's.
    def _dense_cls(self) -> type:
        return nn.DenseGeneral if xla_forms.is_plain("dense") else xla_forms.DenseGeneral

    def _dropout(self) -> nn.Module:
        return (nn.Dropout if xla_forms.is_plain("dropout") else Dropout)(self.dropout_rate)

    def _projection(self, name: str) -> nn.Module:
        return self._dense_cls()(features=(self.num_heads, self.head_dim), dtype=self.dtype,
                                 param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                 bias_init=self.bias_init, name=name)

    @nn.compact
    def _out(self, o: Array, width: int) -> Array:
        # A DenseGeneral over (H, D) -> E', declared in this one compact method (called from every
        # form) because E' defaults to the input width, unknown in setup().
        return self._dense_cls()(self.out_features or width, axis=(-2, -1), dtype=self.dtype,
                                 param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                 bias_init=self.out_bias_init or self.bias_init, name="out")(o)

    def _compute_dtype(self, x: Array):
        return self.dtype if self.dtype is not None else jnp.result_type(x, self.param_dtype)

    def _dropout_fn(self, deterministic: bool):
        """Pure `(w, index) -> w` dropout for the forms that run inside `lax.scan` / `lax.map`."""
        if deterministic or self.dropout_rate == 0.0:
            return None
        rng, keep = self.make_rng("dropout"), 1.0 - self.dropout_rate

        def drop(w, index):
            m = keep_mask(jax.random.fold_in(rng, index), keep, w.shape)
            return jnp.where(m, w / keep, 0.0)
        return drop


class AGFAttention(_Attention):
    """Attentive Graph Filter self-attention (agf.md §2), with an optional causal extension.

    Shapes: x `[B, T, E]` -> y `[B, T, E']` (E' = `out_features` or E).

    Attributes:
        num_heads: H.
        head_dim: D, the width of the singular vectors and of the per-head values.
        out_features: output width E' (default: the input width E).
        graph_filter: the spectrum between U and V^T (the paper's Table 6; docs/agf_options.md):
            'agf' (default): g = sum_k c_k P_k(sigmoid(X W_Sigma)), token-specific and filtered;
            'uvt' (H_UV^T): the singular values fixed at one, g = 1 (no `sigma`, no filter);
            'svd' (H_SVD): learnable singular values `singular_values` [H, D], initialised to one
            and shared by all tokens, g = singular_values (no `sigma`, no filter).
            The basis, order, alpha, beta and learn_c0 fields apply to 'agf' only. The
            orthogonality regulariser is the same in all three: it acts on U and V only.
        basis: 'jacobi' | 'chebyshev' | 'legendre' | 'monomial' (agf.md §2.4).
        order: polynomial order K >= 0 (K+1 coefficients).
        alpha: Jacobi alpha (only for basis='jacobi'; default 1.0).
        beta: Jacobi beta (only for basis='jacobi'; default 0.2).
        learn_c0: False: c_0 frozen at 1 (LRA always; UEA `--fixI`); True: c_0 = tanh(theta_0),
            initialised to 0, so the filter starts at 0 (UEA without `--fixI`).
        ortho_scale: factor on the orthogonality regulariser returned in aux (the LRA layer
            multiplies by `reg` inside; UEA uses 1 and applies eta in the loss).
        ortho_count_padding: False (default): padded rows of U are removed from the regulariser,
            so padding cannot change it; True: the reference's regulariser, whose U Gram counts
            padded tokens (agf.md §2.5; the reference models and the converter set it).
        causal: prefix-normalised V (an extension the paper does not have; see `agf_jax.ops`).
        chunk_size: causal only: None = the parallel (associative-scan) form of `__call__`, an int
            C >= 1 = the chunked form. Its intra-chunk work is C * D exponentials per token and head
            (every row keeps its own running maximum), so small chunks are fast: on a 2-core CPU at
            8 heads x 64 and 4K tokens, C = 16 took 0.58 s fwd+bwd against 1.91 s for C = 64
            (benchmarks/agf_scaling.py).
        dropout_rate: dropout on the merged head outputs before `out` (not in the reference, whose
            `attention_dropout` is unused on the AGF path; default 0 keeps it identical).
        dtype: compute dtype of the projections (None: inferred); attention maths is float32.
        param_dtype: parameter dtype.
        kernel_init: kernel initialiser of the five projections.
        bias_init: bias initialiser of query, key, sigma and value.
        out_bias_init: bias initialiser of `out` (None: `bias_init`); PyTorch's bound depends on
            the fan-in, E for the four input projections and H*D for `out`.
        theta_init: initialiser of theta and theta_0 (reference: zeros).
        sequence_axis: None (one device holds each sequence), or the mesh axis the sequence is
            split over (context parallelism, `agf_jax.context_parallel`): `__call__` then runs
            under `jax.shard_map`, called under `jax.set_mesh(mesh)` with x sharded along T, and
            gives the single-device numbers (T must divide by the axis size; a causal layer
            without `chunk_size` runs chunks of min(T / P, 64)). `scan` and `step` stay one
            device's; `prefill(x, state)` is `scan`'s numbers over the shards, its final state
            replicated for `step`. Packed documents (`segment_ids`) may span shards.

    Traced inside `zoo_core.ops.xla_forms.plain(...)` (timing only; same parameters and values), the
    layer computes 'dense' (flax's DenseGeneral), 'dropout' (flax's Dropout) and 'agf_backward'
    (autodiff of the plain non-causal maths) in their plain forms.

    The causal forms keep AGF's own kernels rather than `zoo_core.ops.linear_attention`: AGF normalises
    each of the D features by its own prefix sum under a running maximum (an online softmax), which
    the linear kernels' unstabilised `q . sum_s k_s v_s^T` cannot express.
    """
    # num_heads, head_dim, out_features, causal, chunk_size, dropout_rate, dtype, param_dtype,
    # kernel_init, bias_init, out_bias_init: declared in `_Attention`.
    graph_filter: str = "agf"
    basis: str = "jacobi"
    order: int = 3
    alpha: Optional[float] = None
    beta: Optional[float] = None
    learn_c0: bool = False
    ortho_scale: float = 1.0
    ortho_count_padding: bool = False
    theta_init: Initializer = nn.initializers.zeros_init()
    sequence_axis: Optional[str] = None

    def setup(self):
        validation.check_agf_fields(self)
        if self.sequence_axis is not None and not isinstance(self.sequence_axis, str):
            checks.fail(f"`sequence_axis` must be a mesh axis name or None, got {self.sequence_axis!r}")
        self.query, self.key = self._projection("query"), self._projection("key")
        self.value = self._projection("value")
        if self.graph_filter == "agf":
            self.sigma = self._projection("sigma")
            if self.order > 0:
                self.theta = self.param("theta", self.theta_init, (self.order,), self.param_dtype)
            if self.learn_c0:
                self.theta_0 = self.param("theta_0", self.theta_init, (), self.param_dtype)
        elif self.graph_filter == "svd":
            self.singular_values = self.param("singular_values", nn.initializers.ones_init(),
                                              (self.num_heads, self.head_dim), self.param_dtype)
        self.dropout = self._dropout()

    def coefficients(self) -> Array:
        """Effective filter coefficients c_0..c_K, `[K+1]` float32 ('uvt' / 'svd': `[1.0]`, no
        filter: g is the spectrum itself)."""
        if self.graph_filter != "agf":
            return ops.filter_coefficients(None)
        theta = self.theta if self.order > 0 else None
        theta_0 = self.theta_0 if self.learn_c0 else None
        return ops.filter_coefficients(theta, theta_0)

    def spectrum(self) -> Optional[Array]:
        """The fixed spectrum of 'uvt' (ones) and 'svd' (`singular_values`), `[H, D]` float32;
        None for 'agf', whose spectrum is the token-specific filter."""
        if self.graph_filter == "uvt":
            return jnp.ones((self.num_heads, self.head_dim), jnp.float32)
        if self.graph_filter == "svd":
            return ops.as_float(self.singular_values)
        return None

    def _basis_kwargs(self) -> dict:
        return dict(basis=self.basis, alpha=self.alpha, beta=self.beta, spectrum=self.spectrum())

    def _project(self, x: Array):
        # One matmul on the CPU (`xla_forms.dense_group`), in the order the layers were called before.
        if self.graph_filter == "agf":
            zs, zu, zv, val = xla_forms.dense_group(x, (self.sigma, self.query, self.key, self.value))
            return zu, zv, zs, val
        zu, zv, val = xla_forms.dense_group(x, (self.query, self.key, self.value))
        return zu, zv, None, val

    def _finish(self, o: Array, x: Array, deterministic: bool) -> Array:
        o = self.dropout(o.astype(self._compute_dtype(x)), deterministic=deterministic)
        return self._out(o, x.shape[-1])

    def __call__(self, x: Array, *, mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, dict]:
        """Parallel form (chunked if `chunk_size` is set).

        Args:
            x: `[B, T, E]`.
            mask: `[B, T]` key-padding mask (bool, True = valid; 0/1 accepted), applied to V (and
                Val) only as in the reference; padded rows of y are not zeroed.
            segment_ids: int `[B, T]` packed documents (0 = padding; `zoo_core.ops.packing`): each
                document is computed as if alone (V over its own tokens, the causal state cut at
                its start), and the regulariser of a row is the mean of its documents'.
            deterministic: disables dropout (uses the 'dropout' rng when dropout_rate > 0).

        Returns:
            (y `[B, T, E']`, aux) with aux['loss/orthogonality'] the batch mean of
            'orthogonality/per_sample' `[B]` = ortho_scale * regulariser,
            'filter/coefficients' `[K+1]` and, for graph_filter='svd', 'filter/singular_values'
            `[H, D]` (all float32).
        """
        validation.check_inputs(x, mask)
        packing.check_segment_ids(segment_ids, jnp.shape(x)[:2])
        zu, zv, zs, val = self._project(x)
        c = self.coefficients()
        packed = dict(segment_ids=segment_ids) if segment_ids is not None else {}
        if self.sequence_axis is not None:
            o, ortho = self._context_parallel(zu, zv, zs, val, c, mask, segment_ids)
        elif not self.causal:
            # The output and the regulariser in one pass (a hand-written backward pass, or
            # autodiff of the plain maths inside xla_forms.plain('agf_backward')).
            fused = (ops.agf_with_orthogonality_plain
                     if xla_forms.is_plain("agf_backward") and not packed
                     else ops.agf_with_orthogonality)
            o, ortho = fused(zu, zv, zs, val, c, mask=mask, count_padding=self.ortho_count_padding,
                             **packed, **self._basis_kwargs())
        else:
            if self.chunk_size is not None:
                o, _ = ops.agf_chunked(zu, zv, zs, val, c, chunk_size=self.chunk_size, mask=mask,
                                       **packed, **self._basis_kwargs())
            else:
                o = ops.agf_parallel(zu, zv, zs, val, c, mask=mask, causal=True,
                                     **packed, **self._basis_kwargs())
            ortho = ops.orthogonality_loss(zu, zv, mask=mask, count_padding=self.ortho_count_padding,
                                           **packed)
        ortho = self.ortho_scale * ortho
        aux = {"loss/orthogonality": jnp.mean(ortho), "orthogonality/per_sample": ortho,
               "filter/coefficients": c}
        if self.graph_filter == "svd":
            aux["filter/singular_values"] = self.spectrum()
        return self._finish(o, x, deterministic), aux

    def _context_parallel(self, zu, zv, zs, val, c, mask, segment_ids):
        """(o, regulariser) with T split over `sequence_axis` (`agf_jax.context_parallel`)."""
        kw = dict(axis_name=self.sequence_axis, mask=mask, segment_ids=segment_ids)
        if not self.causal:
            return agf_context_parallel.noncausal(zu, zv, zs, val, c, count_padding=self.ortho_count_padding,
                                                  **kw, **self._basis_kwargs())
        o = agf_context_parallel.causal(zu, zv, zs, val, c, chunk_size=self.chunk_size, **kw,
                                        **self._basis_kwargs())
        return o, agf_context_parallel.orthogonality(zu, zv, count_padding=self.ortho_count_padding, **kw)

    def factors(self, x: Array, *, mask: Optional[Array] = None) -> dict:
        """Singular-domain intermediates for analysis (float32).

        Args:
            x: `[B, T, E]`.
            mask: `[B, T]` or None.

        Returns:
            dict with 'zu', 'zv', 'zs' `[B, T, H, D]` logits (zs None for 'uvt' / 'svd'), 'value'
            `[B, T, H, D]`, 'u', 'v', 's', 'g' (`ops.AGFFactors`, V over the whole sequence; s = g
            = the spectrum for 'uvt' / 'svd') and 'coeffs' `[K+1]`.
        """
        validation.check_inputs(x, mask)
        zu, zv, zs, val = self._project(x)
        c = self.coefficients()
        f = ops.agf_factors(zu, zv, zs, c, mask=mask, **self._basis_kwargs())
        return dict(zu=zu, zv=zv, zs=zs, value=val, coeffs=c, **f._asdict())

    def init_state(self, batch_size: int) -> AGFState:
        """Empty causal state, float32: num `[B, H, D, D]`, den and max `[B, H, D]`."""
        validation.require_causal(self, "init_state")
        return ops.init_state(batch_size, self.num_heads, self.head_dim, self.head_dim)

    def scan(self, x: Array, state: Optional[AGFState] = None, *, mask: Optional[Array] = None,
             segment_ids: Optional[Array] = None, deterministic: bool = True) -> tuple[Array, AGFState]:
        """Token recurrence: projections for the whole sequence, then `jax.lax.scan` of pure maths.

        Args:
            x: `[B, T, E]`.
            state: `AGFState` of the preceding tokens, or None (empty).
            mask: `[B, T]` or None.
            segment_ids: int `[B, T]` packed documents or None: the state is emptied at each
                document start (the first token continues `state`).
            deterministic: as in `__call__`.

        Returns:
            (y `[B, T, E']`, final state).
        """
        validation.check_scan(self, x, mask)
        packing.check_segment_ids(segment_ids, jnp.shape(x)[:2])
        zu, zv, zs, val = self._project(x)
        o, state = ops.agf_scan(zu, zv, zs, val, self.coefficients(), mask=mask, state=state,
                                segment_ids=segment_ids, **self._basis_kwargs())
        return self._finish(o, x, deterministic), state

    def prefill(self, x: Array, state: Optional[AGFState] = None, *, mask: Optional[Array] = None,
                segment_ids: Optional[Array] = None, deterministic: bool = True) -> tuple[Array, AGFState]:
        """`scan`'s numbers (arguments and results as there) in `__call__`'s chunked form, over
        `sequence_axis` when set (the fold starts from `state`; the final state is the last shard's,
        replicated): a prompt prefilled over P devices, from which `step` decodes. No regulariser
        (decoding has no loss); chunks of `chunk_size` (None: min(T, 64) per shard or device)."""
        validation.require_causal(self, "prefill")
        validation.check_inputs(x, mask)
        packing.check_segment_ids(segment_ids, jnp.shape(x)[:2])
        zu, zv, zs, val = self._project(x)
        c = self.coefficients()
        if self.sequence_axis is not None:
            o, state = agf_context_parallel.causal(zu, zv, zs, val, c, chunk_size=self.chunk_size,
                                                   axis_name=self.sequence_axis, mask=mask, segment_ids=segment_ids,
                                                   initial_state=state, return_state=True, **self._basis_kwargs())
        else:
            o, state = ops.agf_chunked(zu, zv, zs, val, c, chunk_size=self.chunk_size or min(x.shape[1],
                                                                                             agf_context_parallel.CHUNK),
                                       mask=mask, state=state, segment_ids=segment_ids, **self._basis_kwargs())
        return self._finish(o, x, deterministic), state

    def step(self, state: AGFState, x_t: Array) -> tuple[Array, AGFState]:
        """One token, O(H D^2): x_t `[B, E]` -> (y_t `[B, E']`, new state)."""
        validation.check_step(self, x_t)
        zu, zv, zs, val = self._project(x_t)
        state, o = ops.agf_step(state, zu, zv, zs, val, self.coefficients(), **self._basis_kwargs())
        return self._finish(o, x_t, True), state


class SoftmaxAttention(_Attention):
    """Multi-head softmax attention, the baseline of the reference harnesses (O(T^2)).

    Same projection names as `AGFAttention` minus `sigma`, and the same contract (aux is empty:
    no regulariser). Shapes: x `[B, T, E]` -> `[B, T, E']`. Kernels: `agf_jax.softmax`.

    Attributes:
        num_heads: H.
        head_dim: D.
        out_features: E' (default E).
        causal: token t attends to s <= t; adds `init_state` / `scan` / `step` on a `KVCache`.
        chunk_size: causal only: None = the parallel form of `__call__`, C = C queries at a time.
        max_length: causal only: the `KVCache` slots of `init_state` (required there).
        dropout_rate: dropout on the attention weights (the reference's `attention_dropout`).
        dtype, param_dtype, kernel_init, bias_init, out_bias_init: as in `AGFAttention`.
        sequence_axis: the mesh axis one sequence is split over (context parallelism): `__call__`
            then runs `agf_jax.softmax.softmax_context_parallel` (an all-gather of K and V, any
            `chunk_size` ignored) under the mesh of `jax.set_mesh`; None = the single-device program.

    Inside `zoo_core.ops.xla_forms.plain('dense' / 'dropout')` as `AGFAttention`.
    """
    # num_heads, head_dim, out_features, causal, chunk_size, dropout_rate, dtype, param_dtype,
    # kernel_init, bias_init, out_bias_init: declared in `_Attention`.
    max_length: Optional[int] = None
    sequence_axis: Optional[str] = None

    def setup(self):
        validation.check_softmax_fields(self)
        if self.sequence_axis is not None and not isinstance(self.sequence_axis, str):
            checks.fail(f"`sequence_axis` must be a mesh axis name or None, got {self.sequence_axis!r}")
        self.query, self.key = self._projection("query"), self._projection("key")
        self.value = self._projection("value")
        self.dropout = self._dropout()

    def _finish(self, o: Array, x: Array) -> Array:
        return self._out(o.astype(self._compute_dtype(x)), x.shape[-1])

    def __call__(self, x: Array, *, mask: Optional[Array] = None, segment_ids: Optional[Array] = None,
                 deterministic: bool = True) -> tuple[Array, dict]:
        """x `[B, T, E]`, mask `[B, T]` key-padding mask, segment_ids int `[B, T]` packed documents
        (0 = padding; a token attends within its document) -> (y `[B, T, E']`, {})."""
        validation.check_inputs(x, mask)
        packing.check_segment_ids(segment_ids, x.shape[:2])
        q, k, v = self.query(x), self.key(x), self.value(x)
        if self.sequence_axis is not None:
            o = softmax_ops.softmax_context_parallel(q, k, v, axis_name=self.sequence_axis, causal=self.causal,
                                                     mask=mask, segment_ids=segment_ids,
                                                     dropout=self._dropout_fn(deterministic))
        elif self.chunk_size is not None:
            o = softmax_ops.softmax_chunked(q, k, v, chunk_size=self.chunk_size, mask=mask,
                                            dropout=self._dropout_fn(deterministic), segment_ids=segment_ids)
        else:
            # No dropout function when none applies, so that a GPU takes the fused attention.
            active = not deterministic and self.dropout_rate > 0.0
            o = softmax_ops.softmax_parallel(
                q, k, v, mask=mask, causal=self.causal, segment_ids=segment_ids,
                dropout=(lambda w, _: self.dropout(w, deterministic=False)) if active else None)
        return self._finish(o, x), {}

    def init_state(self, batch_size: int) -> KVCache:
        """Empty `KVCache` of `max_length` slots (float32 key/value, int32 length `[B]`)."""
        validation.check_cache_size(self)
        return softmax_ops.init_cache(batch_size, self.max_length, self.num_heads, self.head_dim)

    def scan(self, x: Array, state: Optional[KVCache] = None, *, mask: Optional[Array] = None,
             segment_ids: Optional[Array] = None, deterministic: bool = True) -> tuple[Array, KVCache]:
        """Token recurrence on the KV cache (padded tokens are not written; with segment_ids the
        cache is emptied at each document start): (y, final cache)."""
        validation.check_softmax_scan(self, x, mask, state)
        packing.check_segment_ids(segment_ids, x.shape[:2])
        if state is None:
            state = self.init_state(x.shape[0])
        q, k, v = self.query(x), self.key(x), self.value(x)
        o, state = softmax_ops.softmax_scan(q, k, v, cache=state, mask=mask, segment_ids=segment_ids,
                                            dropout=self._dropout_fn(deterministic))
        return self._finish(o, x), state

    def step(self, state: KVCache, x_t: Array) -> tuple[Array, KVCache]:
        """One token x_t `[B, E]` -> (y_t `[B, E']`, new cache); NaN once the cache is full."""
        validation.check_step(self, x_t)
        q, k, v = self.query(x_t), self.key(x_t), self.value(x_t)
        state, o = softmax_ops.softmax_step(state, q, k, v)
        return self._finish(o, x_t), state
