"""Flax (Linen) layers of HTGN: FAVOR+ self/cross attention with rotary HRPE (htgn.md §5.1, §5.4).

The maths lives in `htgn_jax.ops` (FAVOR+, Performer, Choromanski et al. 2021, htgn.md §2) and
`htgn_jax.hrpe` (RoPE before the feature map, htgn.md §5.2 (a)); the layers only own parameters and
call those pure functions. One parameter tree serves every entry point:

* `__call__(x, *, mask, deterministic, feature_step, positions) -> (y, aux)`: non-causal, or causal
  in the form `chunk_size` chooses (None: the masked quadratic form, an int C: chunks of C tokens);
* `init_state`, `scan`, `step`: the causal recurrence (token `lax.scan`) and one-token decoding
  with the state `LinearState(num = S, den = z)` of `zoo_core.ops.linear_attention`;
* `cross`, `cross_cache`, `cross_step`: FAVOR+ cross-attention (queries from x, keys/values from
  an encoder memory), as the decoder's third sub-layer (htgn.md §5.1 step 3), and its decoding
  cache Z_M = phi(K_M)^T V_M, t_M = phi(K_M)^T 1 (htgn.md §5.4), so each decoding step is O(M D).

* `kernel_features`, `query_features`, `key_features`: the features phi(q), phi(k) these forms use,
  for the graph layers' `alpha='attention'` (docs/htgn_options.md).

Random features (design, htgn.md §2.4 / §5.4). Omega `[M, D]` is a pure function of a fixed seed and
the training step, `ops.draw_projection(PRNGKey(projection_seed), feature_step, redraw_every=k)`: the
layer redraws every k steps deterministically (same seed and step, same matrix), and nothing is
learned or stored in the optimiser state. It is shared by the heads; layers share it when they
have the same `projection_seed` (give each layer its own seed for per-layer features). A copy
is kept in the non-trainable collection `random_features` ('projection'):

* `feature_step=None`: the stored copy is used if the variables have one (frozen evaluation), else
  draw 0 (e.g. `apply({'params': p}, x)` without that collection);
* `feature_step=s`: the draw in force at step s is used; if `random_features` is mutable in this apply
  it is also written back, so a later `feature_step=None` evaluation reuses the last training draw.
  A trainer that keeps only 'params' should pass the current step at evaluation too (the draw is
  frozen between redraws, so this is the same matrix the last training steps used).

`deterministic=False` (training) with `redraw_every > 0` requires `feature_step`, so that a forgotten
counter cannot silently disable the redraw. FAVOR+ has no dropout (htgn.md §5.6), so `deterministic`
has no other effect. `feature_step` is the training context, accepted by every feature map so that a
model can pass it uniformly; it changes nothing where there is nothing to redraw ('relu', 'elu',
'exact', or `redraw_every=0`).

Masking is NaN-safe (README "Layer contract"): padded positions of `x` (and of `memory`) are
replaced by 0 with `jnp.where` before anything else, so whatever they hold changes no valid output.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import promote_dtype

from htgn_jax import context_parallel, hrpe, ops, validation
from zoo_core.checks import check_rank, check_shape, check_tokens, fail
from zoo_core.ops import linear_attention, masking, packing, xla_forms
from zoo_core.ops.linear_attention import LinearState

Array = Any
Initializer = Callable[..., Array]

DEFAULT_NUM_FEATURES = 256  # m of the base preset (htgn.md §5.4); the presets pass their own (VARIANTS)


def flat_init(init: Initializer, n_in: int) -> Initializer:
    """Initialises a `[*in, *out]` kernel as the flat `[prod(in), prod(out)]` one (Dense fans)."""
    def f(rng, shape, dtype=jnp.float32):
        return init(rng, (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))), dtype
                    ).reshape(shape)
    return f


class HeadsOutput(nn.Module):
    """Concatenated heads `[..., H, D]` -> `[..., F]` (W_o); F = `features`, or `width` if None.

    Compact on purpose: F may follow the input width, which setup() cannot see. Parameters
    `kernel` `[H, D, F]` and `bias` `[F]`, initialised as `nn.DenseGeneral(axis=(-2, -1))`.
    """
    features: Optional[int]
    use_bias: bool
    dtype: Any
    param_dtype: Any
    kernel_init: Initializer
    bias_init: Initializer

    @nn.compact
    def __call__(self, y: Array, width: int) -> Array:
        f = self.features or width
        kernel = self.param("kernel", flat_init(self.kernel_init, 2), y.shape[-2:] + (f,),
                            self.param_dtype)
        bias = self.param("bias", self.bias_init, (f,), self.param_dtype) if self.use_bias else None
        y, kernel, _ = promote_dtype(y, kernel, bias, dtype=self.dtype)
        out = jnp.einsum("...hd,hdf->...f", y, kernel)
        # `add_bias`: the bias's gradient, a sum over every token, in float32 whatever `dtype` is.
        return out if bias is None else xla_forms.add_bias(out, bias)


class FavorAttention(nn.Module):
    """Multi-head FAVOR+ attention with rotary HRPE (htgn.md §5.4). Shapes: x `[B, T, E]`.

    Attributes:
      num_heads: H.
      head_dim: D, width of each head (values; queries and keys too unless `qk_rank`).
      qk_rank: r, the per-head width of the query and key projections (the HTGN card's low-rank
        W^Q, W^K in R^{d x r}, r < D; htgn.md §5.4, docs/htgn_options.md); None = D. The kernel
        is then exp(q^T k / sqrt(r)) on the r-dimensional queries and keys; values stay D wide.
      out_features: width of the output projection; None = the input width E.
      causal: unidirectional self-attention (data-independent key stabiliser, so that every form
        is exactly causal and streamable); enables `init_state`, `scan` and `step`.
      chunk_size: form of the causal `__call__`: None = the masked quadratic form
        (`linear_attention.causal_parallel`, O(T^2)), an int C >= 1 = the chunked form
        (`linear_attention.causal_chunked`).
        Must be None when not causal.
      num_features: M random features (feature_map 'softmax' or 'trig'; None = 256); must be None
        for the deterministic maps ('relu', 'elu': M = D) and for 'exact'.
      feature_map: 'softmax' (FAVOR+ positive random features), 'trig' (random Fourier sin/cos
        features of the same kernel, 2M features, `ops.trig_kernel_features`), 'relu'
        (Performer-ReLU, relu + 1e-3, LRA's default), 'elu' (elu + 1), or 'exact' (quadratic
        softmax oracle for tests / small T).
      redraw_every: redraw Omega every this many training steps; 0 = never (random maps only).
      use_rotary: rotate q and k (RoPE, HTGN's HRPE (a)) before the feature map; off by default
        (plain FAVOR+; the HTGN models turn it on); must be False for `cross`.
      rotary_base: RoPE frequency base.
      eps: FAVOR+ numerical stabiliser (softmax features) and denominator guard threshold.
      projection_seed: seed of Omega (see the module docstring).
      use_bias: biases in the four projections.
      dtype: compute dtype of the value and output projections (None = promote inputs and
        params). The query/key projections, FAVOR+ features, sums and states are computed in
        float32 whatever this is (the features are exponentials of q and k).
      param_dtype: parameter dtype.
      kernel_init: initialiser of the projection kernels.
      bias_init: initialiser of the projection biases.
      sequence_axis: the mesh axis one sequence is split over (context parallelism,
        `htgn_jax.context_parallel`): `__call__` then runs under `jax.shard_map`, called under
        `jax.set_mesh(mesh)` with T divisible by the axis size, and gives one device's numbers
        (`chunk_size` None: each shard one chunk). `scan`, `step`, `cross` and the features are one
        device's forms whatever it is; `prefill(x, state)` is `scan`'s numbers over the shards, its final
        state replicated for `step`. None: one device (the program is unchanged).
    """

    num_heads: int
    head_dim: int
    out_features: Optional[int] = None
    causal: bool = False
    chunk_size: Optional[int] = None
    qk_rank: Optional[int] = None
    num_features: Optional[int] = None
    feature_map: str = "softmax"
    redraw_every: int = 0
    use_rotary: bool = False
    rotary_base: float = 10000.0
    eps: float = 1e-6
    projection_seed: int = 0
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = nn.initializers.xavier_uniform()
    bias_init: Initializer = nn.initializers.zeros_init()
    sequence_axis: Optional[str] = None

    def setup(self):
        validation.check_favor_fields(self)
        if self.sequence_axis is not None and (not isinstance(self.sequence_axis, str)
                                               or self.feature_map == "exact"):
            fail(f"`sequence_axis` must be a mesh axis name or None, and None with feature_map='exact' "
                 f"(the quadratic oracle), got {self.sequence_axis!r} with {self.feature_map!r}")
        dense = functools.partial(nn.DenseGeneral, features=(self.num_heads, self.head_dim),
                                  axis=-1, use_bias=self.use_bias, dtype=self.dtype,
                                  param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                  bias_init=self.bias_init)
        # Queries and keys feed exp() in the features, so their projections run in at least
        # float32 whatever `dtype` is: a bf16 q.w is off by about |q.w| 2^-8 inside exp(), i.e.
        # a relative error of the feature itself (values and the output projection use `dtype`).
        qk_dtype = None if self.dtype is None else jnp.promote_types(self.dtype, jnp.float32)
        qk_features = (self.num_heads, self._qk_dim)
        self.query = dense(name="query", dtype=qk_dtype, features=qk_features)
        self.key = dense(name="key", dtype=qk_dtype, features=qk_features)
        self.value = dense(name="value")
        self.out = HeadsOutput(self.out_features, self.use_bias, self.dtype, self.param_dtype,
                               self.kernel_init, self.bias_init, name="out")
        if self.feature_map in ops.RANDOM_FEATURE_MAPS and (
                self.is_initializing() or self.has_variable("random_features", "projection")):
            self.projection = self.variable("random_features", "projection",
                                            lambda: self._draw(None))
        else:
            self.projection = None

    # --- shared pieces ---------------------------------------------------------------------

    @property
    def _qk_dim(self) -> int:
        return self.head_dim if self.qk_rank is None else self.qk_rank

    @property
    def _num_random(self) -> int:
        return self.num_features or DEFAULT_NUM_FEATURES

    @property
    def _m(self) -> int:
        """Width of the features (and of the state): M, 2M for 'trig', r or D when deterministic."""
        if self.feature_map in ops.RANDOM_FEATURE_MAPS:
            return self._num_random * (2 if self.feature_map == "trig" else 1)
        return self._qk_dim

    def _draw(self, feature_step) -> Array:
        return ops.draw_projection(jax.random.PRNGKey(self.projection_seed), feature_step,
                                   num_features=self._num_random, dim=self._qk_dim,
                                   redraw_every=self.redraw_every)

    def _omega(self, feature_step, deterministic: bool) -> Array | None:
        """The projection in force (see the module docstring); None for deterministic maps."""
        if self.feature_map not in ops.RANDOM_FEATURE_MAPS:
            return None  # deterministic maps: the features are the same at every step
        if feature_step is None:
            if not deterministic and self.redraw_every > 0:
                fail("`feature_step` is required when deterministic=False and redraw_every > 0 "
                     "(the training step selects the random-feature draw)")
            return self.projection.value if self.projection is not None else self._draw(None)
        omega = self._draw(feature_step)
        if self.projection is not None and self.is_mutable_collection("random_features"):
            self.projection.value = omega
        return omega

    def _positions(self, positions: Array | None, x: Array, *, required: bool = False,
                   segment_ids: Array | None = None):
        if not self.use_rotary:
            if positions is not None:
                fail("`positions` must be None with use_rotary=False")
            return None
        if positions is None:
            if required:
                fail("`positions` is required to continue from a state with use_rotary=True")
            if segment_ids is not None and self.sequence_axis is not None:
                return context_parallel.positions(jnp.asarray(segment_ids), axis_name=self.sequence_axis)
            if segment_ids is not None:   # RoPE restarts at each packed document
                return packing.positions_from_segments(jnp.asarray(segment_ids))
            return jnp.arange(x.shape[1])
        positions = jnp.asarray(positions)
        if positions.shape not in ((x.shape[1],), tuple(x.shape[:2])):
            fail(f"`positions` must have shape [T] = ({x.shape[1]},) or [B, T] = "
                 f"{tuple(x.shape[:2])}, got {tuple(positions.shape)}")
        return positions

    def _qkv(self, x: Array, memory: Array, positions: Array | None):
        q, k, v = self.query(x), self.key(memory), self.value(memory)
        if positions is not None:
            q = hrpe.apply_rotary(q, positions, base=self.rotary_base)
            k = hrpe.apply_rotary(k, positions, base=self.rotary_base)
        return q, k, v

    # The layer checked its fields (setup) and arguments (`_inputs`) once: it calls the kernels'
    # unchecked forms.
    def _features(self, q, k, omega, key_mask, key_stabiliser, segment_ids=None):
        return ops._features(q, k, self.feature_map, omega, key_mask, self.eps, key_stabiliser,
                             segment_ids)

    def _inputs(self, x: Array, mask: Array | None, name: str = "x",
                segment_ids: Array | None = None) -> tuple[Array, Array | None]:
        """x with its padding zeroed, and the bool valid mask `[B, T]` (mask and, packed, id > 0)."""
        check_tokens(name, x, "[B, T, E]")
        if mask is not None:
            check_shape(f"{name}_mask" if name != "x" else "mask", mask, x.shape[:2], "[B, T]")
            mask = jnp.asarray(mask).astype(bool)
        if segment_ids is not None:
            ids_name = "kv_segment_ids" if name == "memory" else "segment_ids"
            packing.check_segment_ids(segment_ids, x.shape[:2], ids_name)
            mask = packing.valid(jnp.asarray(segment_ids), mask)
        return masking.zero_padding(x, mask), mask

    def _read_out(self, num, den, guard, v, width: int) -> Array:
        y = ops.normalize(num, den, guard, floor=self.feature_map == "trig")
        return self.out(y.astype(v.dtype), width)

    # --- self-attention --------------------------------------------------------------------

    def __call__(self, x: Array, *, mask: Array | None = None, deterministic: bool = True,
                 feature_step: Array | int | None = None,
                 positions: Array | None = None,
                 segment_ids: Array | None = None) -> tuple[Array, dict]:
        """Parallel form: non-causal, or causal in the form `chunk_size` chooses.

        Args:
          x: `[B, T, E]`.
          mask: optional key-padding mask `[B, T]` (True = real token).
          deterministic: False while training (then `feature_step` is required if
            redraw_every > 0).
          feature_step: training-step index selecting the random-feature draw.
          positions: rotary positions `[T]` or `[B, T]` (default arange(T), or restarting at each
            document with `segment_ids`); must be None when use_rotary=False.
          segment_ids: optional int `[B, T]` packed documents (`zoo_core.ops.packing`; 0 = padding):
            a token attends only within its document (the causal state resets at each start; the
            global sums and the 'max' key stabiliser are per document).

        Returns:
          (y `[B, T, out_features]`, aux = {} (FAVOR+ has no auxiliary loss)).
        """
        x, mask = self._inputs(x, mask, segment_ids=segment_ids)
        positions = self._positions(positions, x, segment_ids=segment_ids)
        omega = self._omega(feature_step, deterministic)
        q, k, v = self._qkv(x, x, positions)
        if self.feature_map == "exact":
            y = ops._exact(q, k, v, mask, self.causal, segment_ids, segment_ids)
            return self.out(y.astype(v.dtype), x.shape[-1]), {}
        if self.sequence_axis is not None:
            y = context_parallel.favor(q, k, v, omega, axis_name=self.sequence_axis,
                                       feature_map=self.feature_map, causal=self.causal,
                                       chunk_size=self.chunk_size, eps=self.eps, mask=mask,
                                       segment_ids=segment_ids)
            return self.out(y.astype(v.dtype), x.shape[-1]), {}
        phi_q, phi_k, guard = self._features(q, k, omega, mask,
                                             "constant" if self.causal else "max", segment_ids)
        kw = dict(mask=mask, denominator=True, segment_ids=segment_ids)
        if not self.causal:
            num, den = ops._noncausal(phi_q, phi_k, masking.zero_padding(v, mask), segment_ids)
        elif self.chunk_size is None:
            num, den = linear_attention.causal_parallel(phi_q, phi_k, v, **kw)
        else:
            num, den, _ = linear_attention.causal_chunked(phi_q, phi_k, v, chunk_size=self.chunk_size,
                                                          **kw)
        return self._read_out(num, den, guard, v, x.shape[-1]), {}

    def init_state(self, batch_size: int) -> LinearState:
        """Zero causal state `LinearState(num [B, H, M, D], den [B, H, M])`, float32."""
        validation.check_favor_method(self, "init_state", causal=True)
        return linear_attention.init_state(batch_size, self.num_heads, self._m, self.head_dim,
                                           denominator=True)

    def scan(self, x: Array, state: LinearState | None = None, *, mask: Array | None = None,
             deterministic: bool = True, feature_step: Array | int | None = None,
             positions: Array | None = None,
             segment_ids: Array | None = None) -> tuple[Array, LinearState]:
        """Causal recurrent form: projections for the whole sequence, then a token `lax.scan`.

        Args:
          x: `[B, T, E]`.
          state: optional state of earlier tokens (then `positions` is required with rotary).
          mask: optional key-padding mask `[B, T]`.
          deterministic: as in `__call__`.
          feature_step: training-step index selecting the random-feature draw.
          positions: rotary positions `[T]` or `[B, T]` (default arange(T) from a fresh state, or
            restarting at each document with `segment_ids`).
          segment_ids: optional int `[B, T]` packed documents: the state resets at each document
            start (`state` is read by the first document only; the final state is the last one's).

        Returns:
          (y `[B, T, out_features]`, final state).
        """
        validation.check_favor_method(self, "scan", causal=True)
        x, mask = self._inputs(x, mask, segment_ids=segment_ids)
        positions = self._positions(positions, x, required=state is not None, segment_ids=segment_ids)
        omega = self._omega(feature_step, deterministic)
        q, k, v = self._qkv(x, x, positions)
        phi_q, phi_k, guard = self._features(q, k, omega, mask, "constant")
        num, den, state = linear_attention.causal_scan(phi_q, phi_k, v, state=state, mask=mask,
                                                       denominator=True, segment_ids=segment_ids)
        return self._read_out(num, den, guard, v, x.shape[-1]), state

    def prefill(self, x: Array, state: LinearState | None = None, *, mask: Array | None = None,
                deterministic: bool = True, feature_step: Array | int | None = None,
                positions: Array | None = None,
                segment_ids: Array | None = None) -> tuple[Array, LinearState]:
        """`scan`'s numbers (arguments and results as there) in `__call__`'s chunked form: over
        `sequence_axis` when set (the shards' fold starts from `state`; the final state is the last
        shard's, replicated), else `linear_attention.causal_chunked` from `state` (`chunk_size` None:
        one chunk). A prompt prefilled over P devices, from which `step` decodes."""
        validation.check_favor_method(self, "prefill", causal=True)
        x, mask = self._inputs(x, mask, segment_ids=segment_ids)
        positions = self._positions(positions, x, required=state is not None, segment_ids=segment_ids)
        omega = self._omega(feature_step, deterministic)
        q, k, v = self._qkv(x, x, positions)
        if self.sequence_axis is not None:
            y, state = context_parallel.favor(q, k, v, omega, axis_name=self.sequence_axis,
                                              feature_map=self.feature_map, causal=True, chunk_size=self.chunk_size,
                                              eps=self.eps, mask=mask, segment_ids=segment_ids,
                                              initial_state=state, return_state=True)
            return self.out(y.astype(v.dtype), x.shape[-1]), state
        phi_q, phi_k, guard = self._features(q, k, omega, mask, "constant", segment_ids)
        num, den, state = linear_attention.causal_chunked(phi_q, phi_k, v, chunk_size=self.chunk_size or x.shape[1],
                                                          state=state, mask=mask, denominator=True,
                                                          segment_ids=segment_ids)
        return self._read_out(num, den, guard, v, x.shape[-1]), state

    def step(self, state: LinearState, x_t: Array, *, position: Array | int | None = None,
             feature_step: Array | int | None = None,
             mask: Array | None = None) -> tuple[Array, LinearState]:
        """One decoding step of the causal form, O(M D) per head.

        Args:
          state: `LinearState` from `init_state` or an earlier step/scan.
          x_t: `[B, E]`, the current token.
          position: its index (RoPE position), int or `[B]`; required with use_rotary (a
            layer without rotary encodings does not depend on it).
          feature_step: training-step index selecting the random-feature draw.
          mask: optional `[B]`, False marks a padding token (it does not enter the state).

        Returns:
          (y_t `[B, out_features]`, new state).
        """
        validation.check_favor_method(self, "step", causal=True)
        if self.use_rotary and position is None:
            fail("`position` is required with use_rotary=True")
        x, _ = self._inputs(x_t[:, None], None if mask is None else jnp.reshape(mask, (-1, 1)))
        positions = None   # the index matters to RoPE only
        if self.use_rotary:   # `[T]` = (1,) or `[B, T]` = (B, 1)
            positions = self._positions(jnp.reshape(position, (-1, 1) if jnp.ndim(position) else 1), x)
        q, k, v = self._qkv(x, x, positions)
        phi_q, phi_k, guard = self._features(q, k, self._omega(feature_step, True), None,
                                             "constant")
        if mask is not None:
            keep = jnp.asarray(mask).astype(bool)[:, None, None]
            phi_q, phi_k, v = (jnp.where(keep, a[:, 0], 0.0)[:, None] for a in (phi_q, phi_k, v))
        num, den, state = linear_attention.causal_step(state, phi_q[:, 0], phi_k[:, 0], v[:, 0])
        return self._read_out(num[:, None], den[:, None], guard, v, x.shape[-1])[:, 0], state

    # --- cross-attention (decoder queries, encoder memory) ---------------------------------

    def cross(self, x: Array, memory: Array, *, memory_mask: Array | None = None,
              deterministic: bool = True, feature_step: Array | int | None = None,
              segment_ids: Array | None = None,
              kv_segment_ids: Array | None = None) -> tuple[Array, dict]:
        """Non-causal FAVOR+ cross-attention: queries from x, keys and values from memory.

        Args:
          x: `[B, T, E]` (decoder states).
          memory: `[B, S, E_m]` (encoder output).
          memory_mask: optional `[B, S]`, True for real memory tokens.
          deterministic: False while training (then `feature_step` is required if
            redraw_every > 0).
          feature_step: training-step index selecting the random-feature draw.
          segment_ids, kv_segment_ids: packed documents of x `[B, T]` and of memory `[B, S]` (both or
            neither; 0 = padding): a query reads only the memory of the document with its id.

        Returns:
          (y `[B, T, out_features]`, aux = {}) as `__call__` (the layer contract).
        """
        validation.check_favor_method(self, "cross", causal=False, state=False)
        check_tokens("x", x, "[B, T, E]")
        if (segment_ids is None) != (kv_segment_ids is None):
            fail("packed cross-attention needs both `segment_ids` [B, T] and `kv_segment_ids` [B, S]")
        if segment_ids is not None:
            packing.check_segment_ids(segment_ids, x.shape[:2])
        memory, memory_mask = self._inputs(memory, memory_mask, "memory", kv_segment_ids)
        omega = self._omega(feature_step, deterministic)
        q, k, v = self._qkv(x, memory, None)
        if self.feature_map == "exact":
            y = ops._exact(q, k, v, memory_mask, False, segment_ids, kv_segment_ids)
            return self.out(y.astype(v.dtype), x.shape[-1]), {}
        phi_q, phi_k, guard = self._features(q, k, omega, memory_mask, "max", kv_segment_ids)
        num, den = ops._noncausal(phi_q, phi_k, masking.zero_padding(v, memory_mask), segment_ids,
                                  kv_segment_ids)
        return self._read_out(num, den, guard, v, x.shape[-1]), {}

    def cross_cache(self, memory: Array, *, memory_mask: Array | None = None,
                    feature_step: Array | int | None = None) -> LinearState:
        """Decoding cache of `cross`: num = phi(K_M)^T V_M `[B, H, M, D]`, den = phi(K_M)^T 1.

        Args:
          memory: `[B, S, E_m]`.
          memory_mask: optional `[B, S]`.
          feature_step: training-step index selecting the random-feature draw.

        Returns:
          `LinearState` (float32), computed once per source sequence.
        """
        validation.check_favor_method(self, "cross_cache", causal=False)
        memory, memory_mask = self._inputs(memory, memory_mask, "memory")
        k, v = self.key(memory), self.value(memory)
        # Only the key features are needed; _features wants queries too, so pass the keys.
        _, phi_k, _ = self._features(k, k, self._omega(feature_step, True), memory_mask, "max")
        return ops.cross_cache(phi_k, masking.zero_padding(v, memory_mask))

    def cross_step(self, cache: LinearState, x_t: Array, *,
                   feature_step: Array | int | None = None) -> Array:
        """One decoding step of `cross` from its cache, O(M D) per head.

        Args:
          cache: from `cross_cache`.
          x_t: `[B, E]`.
          feature_step: training-step index selecting the random-feature draw.

        Returns:
          y_t `[B, out_features]`, equal to the corresponding row of `cross`.
        """
        validation.check_favor_method(self, "cross_step", causal=False)
        check_rank("x_t", x_t, 2, "[B, E]")
        q = self.query(x_t[:, None, :])
        phi_q, _, guard = self._features(q, q, self._omega(feature_step, True), None, "max")
        num = jnp.einsum("bthm,bhmd->bthd", phi_q, cache.num.astype(phi_q.dtype))
        den = jnp.einsum("bthm,bhm->bth", phi_q, cache.den.astype(phi_q.dtype))
        return self._read_out(num, den, guard, q, x_t.shape[-1])[:, 0]

    # --- kernel features for the graph layers' alpha='attention' (docs/htgn_options.md) -----

    def kernel_features(self, x: Array, *, mask: Array | None = None,
                        positions: Array | None = None, feature_step: Array | int | None = None,
                        segment_ids: Array | None = None) -> tuple[Array, Array]:
        """(phi(q) `[B, T, H, M]`, phi(k) `[B, T, H, M]`) of the self-attention on x `[B, T, E]`,
        exactly as `__call__` / `step` form them (same projections, RoPE, Omega, key stabiliser, per
        document with `segment_ids` `[B, T]`), so phi(q_i).phi(k_j) is this layer's kernelised score
        of the edge i -> j."""
        self._check_kernel("kernel_features")
        x, mask = self._inputs(x, mask, segment_ids=segment_ids)
        q, k, _ = self._qkv(x, x, self._positions(positions, x, segment_ids=segment_ids))
        phi_q, phi_k, _ = self._features(q, k, self._omega(feature_step, True), mask,
                                         "constant" if self.causal else "max", segment_ids)
        return phi_q, phi_k

    def query_features(self, x: Array, *, feature_step: Array | int | None = None) -> Array:
        """phi(q) `[B, T, H, M]` of the cross-attention's queries x `[B, T, E]` (as `cross`)."""
        self._check_kernel("query_features")
        q = self.query(x)
        return self._features(q, q, self._omega(feature_step, True), None, "max")[0]

    def key_features(self, memory: Array, *, memory_mask: Array | None = None,
                     feature_step: Array | int | None = None) -> Array:
        """phi(k) `[B, S, H, M]` of the cross-attention's memory keys (as `cross`, masked)."""
        self._check_kernel("key_features")
        memory, memory_mask = self._inputs(memory, memory_mask, "memory")
        k = self.key(memory)
        return self._features(k, k, self._omega(feature_step, True), memory_mask, "max")[1]

    def _check_kernel(self, method: str) -> None:
        if self.feature_map == "exact":
            fail(f"`{method}` needs a kernel feature_map (exact softmax has no features)")
