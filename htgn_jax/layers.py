"""Flax (Linen) layers of HTGN: FAVOR+ self/cross attention with rotary HRPE (spec §5.1, §5.4).

The maths lives in `htgn_jax.ops` (FAVOR+, Performer, Choromanski et al. 2021, spec §2) and
`htgn_jax.hrpe` (RoPE before the feature map, spec §5.2 (a)); the layers only own parameters and
call those pure functions. One parameter tree serves every entry point:

* `__call__`: parallel form (non-causal, or causal in chunked form);
* `scan`, `step`, `init_state`: recurrent causal form (token `lax.scan`) and one-token decoding
  with the (S, z) state;
* `cross`, `cross_cache`, `cross_step`: FAVOR+ cross-attention (queries from x, keys/values from
  an encoder memory), as the decoder's third sub-layer (spec §5.1 step 3), and its decoding
  cache Z_M = phi(K_M)^T V_M, t_M = phi(K_M)^T 1 (spec §5.4), so each decoding step is O(M D).

Random features (design, spec §2.4 / §5.4). Omega `[M, D]` is a pure function of a fixed seed and
the training step, `ops.draw_projection(PRNGKey(projection_seed), step, redraw_every=k)`: the
layer redraws every k steps deterministically (same seed and step, same matrix), and nothing is
learned or stored in the optimiser state. It is shared by the heads; layers share it when they
have the same `projection_seed` (give each layer its own seed for per-layer features). A copy
is kept in the non-trainable collection `random_features` ('projection'):

* `step=None`: the stored copy is used if the variables have one (frozen evaluation), else
  draw 0 (e.g. `apply({'params': p}, x)` without that collection);
* `step=s`: the draw in force at step s is used; if `random_features` is mutable in this apply
  it is also written back, so a later `step=None` evaluation reuses the last training draw.
  A trainer that keeps only 'params' should pass the current step at evaluation too (the draw is
  frozen between redraws, so this is the same matrix the last training steps used).

`deterministic=False` (training) with `redraw_every > 0` requires `step`, so that a forgotten
counter cannot silently disable the redraw. FAVOR+ has no dropout (spec §5.6), so `deterministic`
has no other effect. `step` is the training context, accepted by every feature map so that a
model can pass it uniformly; it changes nothing where there is nothing to redraw ('relu', 'elu',
'exact', or `redraw_every=0`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from htgn_jax import hrpe, ops

Array = Any
Initializer = Callable[..., Array]

DEFAULT_NUM_FEATURES = 256  # m of the base preset (spec §5.4); the presets pass their own (VARIANTS)


class FavorAttention(nn.Module):
    """Multi-head FAVOR+ attention with rotary HRPE (spec §5.4). Shapes: x `[B, T, E]`.

    Attributes:
      num_heads: H.
      head_dim: D, width of each head (queries, keys and values).
      num_features: M random features for feature_map='softmax' (None = 256); must be None for
        the deterministic maps ('relu', 'elu': M = D) and for 'exact'.
      feature_map: 'softmax' (FAVOR+ positive random features), 'relu' (Performer-ReLU, relu + 1e-3,
        LRA's default), 'elu' (elu + 1), or 'exact' (quadratic softmax oracle for tests / small T).
      causal: unidirectional self-attention (chunked form in `__call__`, data-independent key
        stabiliser so that it is exactly causal and streamable).
      redraw_every: redraw Omega every this many training steps; 0 = never (softmax only).
      use_rotary: rotate q and k (RoPE) before the feature map; must be False for `cross`.
      rotary_base: RoPE frequency base.
      chunk_size: C of the causal chunked form.
      eps: FAVOR+ numerical stabiliser (softmax features) and denominator guard threshold.
      projection_seed: seed of Omega (see the module docstring).
      out_features: width of the output projection; None = num_heads * head_dim.
      use_bias: biases in the four projections.
      dtype: compute dtype (None = promote inputs and params). FAVOR+ features, sums and states
        are computed in float32 whatever this is.
      param_dtype: parameter dtype.
      kernel_init: initialiser of the projection kernels.
      bias_init: initialiser of the projection biases.
    """

    num_heads: int
    head_dim: int
    num_features: int | None = None
    feature_map: str = "softmax"
    causal: bool = False
    redraw_every: int = 0
    use_rotary: bool = True
    rotary_base: float = 10000.0
    chunk_size: int = 64
    eps: float = 1e-6
    projection_seed: int = 0
    out_features: int | None = None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = nn.initializers.xavier_uniform()
    bias_init: Initializer = nn.initializers.zeros_init()

    def setup(self):
        self._check_fields()
        dense = functools.partial(nn.DenseGeneral, features=(self.num_heads, self.head_dim),
                                  axis=-1, use_bias=self.use_bias, dtype=self.dtype,
                                  param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                  bias_init=self.bias_init)
        self.query = dense(name="query")
        self.key = dense(name="key")
        self.value = dense(name="value")
        self.out = nn.DenseGeneral(features=self.out_features or self.num_heads * self.head_dim,
                                   axis=(-2, -1), use_bias=self.use_bias, dtype=self.dtype,
                                   param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                   bias_init=self.bias_init, name="out")
        if self.feature_map == "softmax" and (
                self.is_initializing() or self.has_variable("random_features", "projection")):
            self.projection = self.variable("random_features", "projection",
                                            lambda: self._draw(None))
        else:
            self.projection = None

    # ---------------------------------------------------------------------------------------
    # validation and shared pieces
    # ---------------------------------------------------------------------------------------

    def _check_fields(self) -> None:
        name = type(self).__name__

        def positive_int(value, field):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: {field} must be a positive int, got {value!r}")

        positive_int(self.num_heads, "num_heads")
        positive_int(self.head_dim, "head_dim")
        positive_int(self.chunk_size, "chunk_size")
        if self.feature_map not in ops.FEATURE_MAPS:
            raise ValueError(f"{name}: feature_map must be one of {ops.FEATURE_MAPS}, "
                             f"got {self.feature_map!r}")
        if self.feature_map == "softmax":
            if self.num_features is not None:
                positive_int(self.num_features, "num_features")
        elif self.num_features is not None:
            raise ValueError(f"{name}: num_features must be None for feature_map="
                             f"{self.feature_map!r} (only 'softmax' uses random features)")
        if not isinstance(self.redraw_every, int) or self.redraw_every < 0:
            raise ValueError(f"{name}: redraw_every must be an int >= 0, got {self.redraw_every!r}")
        if self.redraw_every and self.feature_map != "softmax":
            raise ValueError(f"{name}: redraw_every must be 0 for feature_map={self.feature_map!r} "
                             "(it has no random features)")
        if self.use_rotary and self.head_dim % 2:
            raise ValueError(f"{name}: head_dim must be even with use_rotary=True, "
                             f"got {self.head_dim}")
        if self.out_features is not None:
            positive_int(self.out_features, "out_features")
        if not self.eps >= 0:
            raise ValueError(f"{name}: eps must be >= 0, got {self.eps!r}")

    @property
    def _m(self) -> int:
        if self.feature_map == "softmax":
            return self.num_features or DEFAULT_NUM_FEATURES
        return self.head_dim

    def _draw(self, step) -> Array:
        return ops.draw_projection(jax.random.PRNGKey(self.projection_seed), step,
                                   num_features=self._m, dim=self.head_dim,
                                   redraw_every=self.redraw_every)

    def _omega(self, step, deterministic: bool) -> Array | None:
        """The projection in force (see the module docstring); None for deterministic maps."""
        if self.feature_map != "softmax":
            return None  # deterministic maps: the features are the same at every step
        if step is None:
            if not deterministic and self.redraw_every > 0:
                raise ValueError("step is required when deterministic=False and redraw_every > 0 "
                                 "(the training step selects the random-feature draw)")
            return self.projection.value if self.projection is not None else self._draw(None)
        omega = self._draw(step)
        if self.projection is not None and self.is_mutable_collection("random_features"):
            self.projection.value = omega
        return omega

    def _check_x(self, x: Array, name: str = "x") -> None:
        if x.ndim != 3:
            raise ValueError(f"{name} must have rank 3 [B, T, E], got shape {tuple(x.shape)}")

    @staticmethod
    def _check_mask(mask: Array | None, x: Array, name: str) -> None:
        if mask is not None and tuple(jnp.shape(mask)) != tuple(x.shape[:2]):
            raise ValueError(f"{name} must have shape [B, T] = {tuple(x.shape[:2])}, "
                             f"got {tuple(jnp.shape(mask))}")

    def _positions(self, positions: Array | None, x: Array, *,
                   required: bool = False) -> Array | None:
        if not self.use_rotary:
            if positions is not None:
                raise ValueError("positions must be None with use_rotary=False")
            return None
        if positions is None:
            if required:
                raise ValueError("positions is required to continue from a state with "
                                 "use_rotary=True")
            return jnp.arange(x.shape[1])
        positions = jnp.asarray(positions)
        if positions.shape not in ((x.shape[1],), tuple(x.shape[:2])):
            raise ValueError(f"positions must have shape [T] = ({x.shape[1]},) or [B, T] = "
                             f"{tuple(x.shape[:2])}, got {tuple(positions.shape)}")
        return positions

    def _qkv(self, x: Array, memory: Array, positions: Array | None):
        q, k, v = self.query(x), self.key(memory), self.value(memory)
        if positions is not None:
            q = hrpe.apply_rotary(q, positions, base=self.rotary_base)
            k = hrpe.apply_rotary(k, positions, base=self.rotary_base)
        return q, k, v

    def _features(self, q, k, omega, key_mask, key_stabiliser):
        return ops.favor_features(q, k, feature_map=self.feature_map, projection=omega,
                                  key_mask=key_mask, eps=self.eps, key_stabiliser=key_stabiliser)

    def _recurrent_only(self, method: str) -> None:
        if not self.causal:
            raise ValueError(f"{method} needs causal=True (it is the causal recurrent form)")
        if self.feature_map == "exact":
            raise ValueError(f"{method} is not defined for feature_map='exact' "
                             "(exact softmax has no constant-size state)")

    def _cross_only(self, method: str) -> None:
        if self.causal:
            raise ValueError(f"{method} needs causal=False (cross-attention is not causal)")
        if self.use_rotary:
            raise ValueError(f"{method} needs use_rotary=False: relative position between two "
                             "sequences is meaningless (spec §5.1)")

    # ---------------------------------------------------------------------------------------
    # self-attention
    # ---------------------------------------------------------------------------------------

    def __call__(self, x: Array, *, mask: Array | None = None, deterministic: bool = True,
                 step: Array | int | None = None, positions: Array | None = None) -> Array:
        """Parallel form: non-causal, or causal in chunked form.

        Args:
          x: `[B, T, E]`.
          mask: optional key-padding mask `[B, T]` (True = real token). Padded keys get zero
            features; padded query rows give finite values that the caller should ignore.
          deterministic: False while training (then `step` is required if redraw_every > 0).
          step: training-step counter selecting the random-feature draw (see module docstring).
          positions: rotary positions `[T]` or `[B, T]` (default arange(T)); must be None when
            use_rotary=False.

        Returns:
          `[B, T, out_features]`.
        """
        self._check_x(x)
        self._check_mask(mask, x, "mask")
        positions = self._positions(positions, x)
        omega = self._omega(step, deterministic)
        q, k, v = self._qkv(x, x, positions)
        if self.feature_map == "exact":
            y = ops.exact_softmax_attention(q, k, v, key_mask=mask, causal=self.causal)
        else:
            phi_q, phi_k, guard = self._features(q, k, omega, mask,
                                                 "constant" if self.causal else "max")
            if self.causal:
                num, den, _ = ops.favor_chunked(phi_q, phi_k, v, chunk_size=self.chunk_size)
            else:
                num, den = ops.favor_parallel(phi_q, phi_k, v)
            y = ops.normalize(num, den, guard)
        return self.out(y.astype(v.dtype))

    def init_state(self, batch_size: int) -> ops.FavorState:
        """Zero causal state `FavorState(s [B, H, M, D], z [B, H, M])`, float32."""
        self._recurrent_only("init_state")
        return ops.init_state(batch_size, self.num_heads, self._m, self.head_dim)

    def scan(self, x: Array, state: ops.FavorState | None = None, *, mask: Array | None = None,
             positions: Array | None = None,
             step: Array | int | None = None) -> tuple[Array, ops.FavorState]:
        """Causal recurrent form: projections for the whole sequence, then a token `lax.scan`.

        Args:
          x: `[B, T, E]`.
          state: optional state from earlier tokens (then `positions` is required with rotary).
          mask: optional key-padding mask `[B, T]`.
          positions: rotary positions `[T]` or `[B, T]` (default arange(T) from a fresh state).
          step: training-step counter selecting the random-feature draw.

        Returns:
          (y `[B, T, out_features]`, final state).
        """
        self._recurrent_only("scan")
        self._check_x(x)
        self._check_mask(mask, x, "mask")
        positions = self._positions(positions, x, required=state is not None)
        omega = self._omega(step, True)
        q, k, v = self._qkv(x, x, positions)
        phi_q, phi_k, guard = self._features(q, k, omega, mask, "constant")
        num, den, state = ops.favor_recurrent(phi_q, phi_k, v, state=state)
        return self.out(ops.normalize(num, den, guard).astype(v.dtype)), state

    def step(self, state: ops.FavorState, x_t: Array, position: Array | int | None = None, *,
             mask: Array | None = None,
             step: Array | int | None = None) -> tuple[Array, ops.FavorState]:
        """One decoding step of the causal form, O(M D) per head.

        Args:
          state: `FavorState` from `init_state` or an earlier step/scan.
          x_t: `[B, E]`, the current token.
          position: its rotary position, int or `[B]` (required iff use_rotary).
          mask: optional `[B]`, False marks a padding token (it does not enter the state).
          step: training-step counter selecting the random-feature draw (keyword only; not the
            position).

        Returns:
          (y_t `[B, out_features]`, new state).
        """
        self._recurrent_only("step")
        if x_t.ndim != 2:
            raise ValueError(f"x_t must have rank 2 [B, E], got shape {tuple(x_t.shape)}")
        batch = x_t.shape[0]
        if mask is not None and tuple(jnp.shape(mask)) != (batch,):
            raise ValueError(f"mask must have shape [B] = ({batch},), got {tuple(jnp.shape(mask))}")
        if self.use_rotary:
            if position is None:
                raise ValueError("position is required with use_rotary=True")
            position = jnp.asarray(position)
            if position.shape not in ((), (batch,)):
                raise ValueError(f"position must be a scalar or have shape [B] = ({batch},), "
                                 f"got {tuple(position.shape)}")
            position = position.reshape(-1, 1) if position.ndim else position.reshape(1)
        elif position is not None:
            raise ValueError("position must be None with use_rotary=False")
        omega = self._omega(step, True)
        x = x_t[:, None, :]
        q, k, v = self._qkv(x, x, position)
        phi_q, phi_k, guard = self._features(q, k, omega, None if mask is None else mask[:, None],
                                             "constant")
        state, num, den = ops.favor_step(state, phi_q[:, 0], phi_k[:, 0], v[:, 0])
        y = ops.normalize(num[:, None], den[:, None], guard).astype(v.dtype)
        return self.out(y)[:, 0], state

    # ---------------------------------------------------------------------------------------
    # cross-attention (decoder queries, encoder memory)
    # ---------------------------------------------------------------------------------------

    def cross(self, x: Array, memory: Array, *, memory_mask: Array | None = None,
              deterministic: bool = True, step: Array | int | None = None) -> Array:
        """Non-causal FAVOR+ cross-attention: queries from x, keys and values from memory.

        Args:
          x: `[B, T, E]` (decoder states).
          memory: `[B, S, E_m]` (encoder output).
          memory_mask: optional `[B, S]`, True for real memory tokens.
          deterministic: False while training (then `step` is required if redraw_every > 0).
          step: training-step counter selecting the random-feature draw.

        Returns:
          `[B, T, out_features]`.
        """
        self._cross_only("cross")
        self._check_x(x)
        self._check_x(memory, "memory")
        if memory.shape[0] != x.shape[0]:
            raise ValueError(f"memory batch {memory.shape[0]} != x batch {x.shape[0]}")
        self._check_mask(memory_mask, memory, "memory_mask")
        omega = self._omega(step, deterministic)
        q, k, v = self._qkv(x, memory, None)
        if self.feature_map == "exact":
            y = ops.exact_softmax_attention(q, k, v, key_mask=memory_mask)
        else:
            phi_q, phi_k, guard = self._features(q, k, omega, memory_mask, "max")
            y = ops.normalize(*ops.favor_parallel(phi_q, phi_k, v), guard)
        return self.out(y.astype(v.dtype))

    def cross_cache(self, memory: Array, *, memory_mask: Array | None = None,
                    step: Array | int | None = None) -> ops.FavorState:
        """Decoding cache of `cross`: s = phi(K_M)^T V_M `[B, H, M, D]`, z = phi(K_M)^T 1.

        Args:
          memory: `[B, S, E_m]`.
          memory_mask: optional `[B, S]`.
          step: training-step counter selecting the random-feature draw.

        Returns:
          `FavorState` (float32), computed once per source sequence.
        """
        self._cross_only("cross_cache")
        if self.feature_map == "exact":
            raise ValueError("cross_cache is not defined for feature_map='exact'")
        self._check_x(memory, "memory")
        self._check_mask(memory_mask, memory, "memory_mask")
        omega = self._omega(step, True)
        k, v = self.key(memory), self.value(memory)
        # Only the key features are needed; favor_features wants queries too, so pass the keys.
        _, phi_k, _ = self._features(k, k, omega, memory_mask, "max")
        v = v.astype(phi_k.dtype)
        return ops.FavorState(jnp.einsum("bshm,bshd->bhmd", phi_k, v), jnp.sum(phi_k, axis=1))

    def cross_step(self, cache: ops.FavorState, x_t: Array, *,
                   step: Array | int | None = None) -> Array:
        """One decoding step of `cross` from its cache, O(M D) per head.

        Args:
          cache: from `cross_cache`.
          x_t: `[B, E]`.
          step: training-step counter selecting the random-feature draw.

        Returns:
          y_t `[B, out_features]`, equal to the corresponding row of `cross`.
        """
        self._cross_only("cross_step")
        if self.feature_map == "exact":
            raise ValueError("cross_step is not defined for feature_map='exact'")
        if x_t.ndim != 2:
            raise ValueError(f"x_t must have rank 2 [B, E], got shape {tuple(x_t.shape)}")
        omega = self._omega(step, True)
        q = self.query(x_t[:, None, :])
        phi_q, _, guard = self._features(q, q, omega, None, "max")
        s, z = cache
        num = jnp.einsum("bthm,bhmd->bthd", phi_q, s.astype(phi_q.dtype))
        den = jnp.einsum("bthm,bhm->bth", phi_q, z.astype(phi_q.dtype))
        y = ops.normalize(num, den, guard).astype(q.dtype)
        return self.out(y)[:, 0]
