"""SAMoVAR forecaster and its LinTrans / FixedVAR baselines (Lu & Yang, ICML 2025, arXiv:2502.07244).

`Model(**config.model)` (a factory: `kind` picks `Forecaster` or `baselines.DLinear`, `variant` a size
preset) is the only place that reads a config. Sections refer to the project spec
`samovar.md`, which follows the released code (LJC-FVNR/Structural-Aligned-Mixture-of-VAR @ 4e2581f):

  §2.1 instance normalisation -> §2.2 left zero-padding and patching -> §2.3 ARX tokens
  -> §2.4 embeddings, `RMSNorm_pre(Dropout(tokens) + E)`, channels folded into the batch
  -> kind 'samovar' / 'fixedvar': §2.5 all MLP blocks first, `x0 = RMSNorm_var(h)`, §2.6 VAR chain,
     §2.7 `z = x0 + (sum over layers of the outputs at endogenous tokens) D` (key shortcut outside D)
  -> kind 'lintrans' (§7): pre-norm [linear attention; MLP] blocks, endogenous tokens
  -> §2.8 `RMSNorm_final`, `W_out` -> next-patch prediction of every patch; the last one, de-normalised,
     is the forecast; §2.9 `ar_loss` = next-patch MSE in normalised units.

Beyond the reference: horizons longer than one patch by autoregressive rollout (`horizon=`,
`Forecaster.rollout`), which continues the recurrent state of the prefix patch by patch (O(1) work per new
patch) and equals re-running the parallel form on the extended patch sequence.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from samovar_jax import baselines, layers, modules, ops, validation
from samovar_jax.validation import FORECASTER_KINDS
from zoo_core import checks
from zoo_core.ops.block_config import config_from
from zoo_core.ops.dropout import Dropout
from zoo_core.ops.remat import call_block
from zoo_core.ops.shard_padding import pad_end, padded_length

Array = jax.Array

KINDS = FORECASTER_KINDS + ("dlinear",)

# Sizes of the SAMoVAR kinds (`Forecaster` fields; without a variant its defaults are 'paper').
# `width=0` is the reference's automatic width 32 * floor(sqrt(C)) (C = input channels for
# SAMoVAR/FixedVAR, C_t for LinTrans); `num_heads=0` is its fallback width // 16 (not for LinTrans).
VARIANTS: dict[str, dict[str, Any]] = {
    # samovar.sh / baseline settings of the benchmarks (samovar.md §6, §9): d = 32 floor(sqrt(C)), 8 heads, 3 layers.
    "paper": dict(width=0, num_heads=8, num_layers=3, mlp_ratio=4, dropout=0.1),
    # The synthetic VAR experiment (samovar.md §10, Fig. 4 notebook): d 32, 2 heads, 3 layers.
    "synthetic": dict(width=32, num_heads=2, num_layers=3, mlp_ratio=4, dropout=0.1),
    # Smoke tests and CPU debugging.
    "tiny": dict(width=16, num_heads=2, num_layers=2, mlp_ratio=2, dropout=0.0),
}


def _pick(value, default):
    return default if value is None else value


def Model(*, kind: str, variant: Optional[str] = None, **kwargs) -> nn.Module:  # noqa: N802
    """Builds a forecaster from `config.model` (the only place that reads config values).

    Args:
      kind: 'samovar' | 'lintrans' | 'fixedvar' (`Forecaster`) or 'dlinear' (`baselines.DLinear`).
      variant: a key of `VARIANTS` (width, num_heads, num_layers, mlp_ratio, dropout) for the SAMoVAR
        kinds; explicit kwargs override it; None = `Forecaster`'s defaults (the 'paper' sizes).
      **kwargs: fields of the selected class (see its docstring); None leaves a field unset and
        dtypes may be named (`zoo_core.checks.constructor_kwargs`).

    Returns:
      An unbound Linen module: `apply(variables, batch, train=...)` -> ({'forecast'}, aux).

    Raises:
      ValueError: unknown kind, variant or kwarg, or an invalid value (named), before any tracing.
    """
    kwargs = checks.constructor_kwargs(kwargs)
    checks.check_choice("kind", kind, KINDS)
    cls = baselines.DLinear if kind == "dlinear" else Forecaster
    if variant is not None:
        checks.check_choice("variant", variant, tuple(VARIANTS) if kind != "dlinear" else ())
    args = {**(VARIANTS[variant] if variant else {}), **kwargs, **({} if kind == "dlinear" else {"kind": kind})}
    unknown = sorted(set(args) - {f.name for f in dataclasses.fields(cls)} - {"parent", "name"})
    if unknown:
        checks.fail(f"unknown Model kwargs for kind={kind!r}: {unknown}")
    module = cls(**args)
    module.check_fields()
    return module


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """The fields a `Forecaster` passes down to its blocks, resolved once from its own fields (the
    zoo's one way, `zoo_core.ops.block_config`; `Forecaster.resolved`): automatic width and heads,
    the per-kind defaults, and the patch counts. The blocks are the zoo's contract layers
    (`samovar_jax.layers`, `samovar_jax.modules`), which take explicit fields (house rule 4): the
    Forecaster reads each one from this config by keyword.
    """
    num_targets: int
    width: int
    num_heads: int
    head_dim: int
    num_layers: int
    mlp_ratio: int
    dropout: float
    num_patches: int        # N = ceil(input_len / patch_len)
    pad_len: int            # left zero-padding
    max_patches: int        # patch slots of the position tables
    horizon: int
    horizon_patches: int    # ceil(horizon / patch_len)
    use_qv_norm: bool
    use_key_proj: bool
    structural: str
    chunk_size: Optional[int] = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    sequence_axis: Optional[str] = None

    @classmethod
    def from_module(cls, m: "Forecaster") -> "BlockConfig":
        """The config of Forecaster `m`: its same-named fields (`config_from`), the derived sizes and
        the per-kind defaults; dtypes given by name ('bfloat16') become numpy dtypes."""
        c_t = m.num_targets or m.num_channels
        width = m.width or 32 * math.isqrt(c_t if m.kind == "lintrans" else m.num_channels)
        heads = m.num_heads or max(width // 16, 1)
        n = -(-m.input_len // m.patch_len)
        horizon = m.horizon or m.patch_len
        samovar = m.kind == "samovar"
        return config_from(
            cls, m, num_targets=c_t, width=width, num_heads=heads, head_dim=width // heads, num_patches=n,
            pad_len=n * m.patch_len - m.input_len, max_patches=m.max_patches or n, horizon=horizon,
            horizon_patches=-(-horizon // m.patch_len),
            use_qv_norm=_pick(m.use_qv_norm, True) if samovar else False,
            use_key_proj=_pick(m.use_key_proj, False) if samovar else False,
            structural=_pick(m.structural, "lu" if m.kind != "lintrans" else "none"),
            dtype=None if m.dtype is None else jnp.dtype(m.dtype), param_dtype=jnp.dtype(m.param_dtype))


class Forecaster(nn.Module):
    """SAMoVAR / LinTrans / FixedVAR forecaster on ARX patch tokens (built by `Model`).

    Batch keys: `inputs` float [B, L_I, C] (the input window, raw units); `target` [B, horizon, C_t]
    is not read by the model (the forecast task computes the MSE). Returns `(outputs, aux)` with
    `outputs = {'forecast': [B, horizon, C_t]}` (float32, raw units: the last C_t channels) and
    `aux = {'loss/ar': next-patch MSE times ar_loss_weight (train only, if the weight is > 0),
    'ar_mse': unweighted next-patch MSE, 'next_patch': [B, C_t, N, P] normalised next-patch
    predictions}`. The shared trainer adds every `aux['loss/*']`, giving the reference's total loss
    `forecast MSE + ar_loss` (samovar.md §2.9); as in the reference, validation uses the forecast MSE only.

    Attributes (`None` means "the default for this kind"):
      num_channels: C, input series (required).
      input_len: L_I, input window length (required; the channel embedding is indexed by absolute
        token position, so it is fixed).
      patch_len: P, patch length = per-token forecast step (the reference sets P = horizon).
      kind: 'samovar' | 'lintrans' | 'fixedvar'.
      horizon: forecast length; 0 -> patch_len (the reference). Longer horizons are produced by
        autoregressive rollout of ceil(horizon / P) patches and truncated (needs num_targets == C).
      num_targets: C_t, the last C_t channels are forecast; 0 -> all.
      width: d; 0 -> 32 floor(sqrt(C)) (C_t for LinTrans).
      num_heads: H; 0 -> d // 16 (SAMoVAR/FixedVAR; LinTrans needs H > 0).
      num_layers: l (MLP blocks and VAR layers; LinTrans blocks).
      mlp_ratio: MLP hidden width / d (4 in the reference).
      dropout: rate of every dropout (tokens, MLP outputs, VAR-layer outputs; LinTrans key input and
        attention output).
      ar_loss_weight: weight of `aux['loss/ar']` (1 in the reference; 0 -> no AR loss term, as FixedVAR
        in the synthetic notebook).
      use_qv_norm: per-head RMSNorm of q and v (SAMoVAR only; False = ablation "w/o QV Norm").
        None -> True for SAMoVAR.
      use_key_proj: bias-free E x E key matrix W_k in the VAR chain (SAMoVAR only; True = ablation
        "w/ W_k"). None -> False for SAMoVAR.
      structural: 'lu' (multiply by D = LU, the released code), 'lu_inverse' (multiply by D^-1 through
        two triangular solves, the paper's reading) or 'none' (ablation "w/o D"). SAMoVAR/FixedVAR
        only; None -> 'lu'.
      shortcut_inside: z = (x0 + M) D (the identity inside D, the paper's reading per the third-party
        docs) instead of the released z = x0 + M D. SAMoVAR/FixedVAR only.
      univariate: exogenous tokens are zero (ablation `--univariate 1`).
      norm_mean: 'last_patch' (instance-norm mean over the last P raw values, the released code) or
        'window' (whole-window mean).
      chunk_size: form of the training/eval pass: None = the parallel (masked) form, an int C >= 1 =
        the chunked form with chunks of C tokens. Rollouts continue the recurrent form (`scan`).
      max_patches: patch slots of the position tables; 0 -> N (the reference). Rollout to K patches
        needs N + K - 1 slots unless position_overflow='clamp'.
      position_overflow: 'error' (token positions beyond the tables raise) or 'clamp' (positions past
        the end reuse the last patch slot of the same token type; used by long rollouts).
      fixed_max_tokens: FixedVAR table length (128, hard-coded in the reference).
      crop_inputs: accept windows longer than input_len and use their last input_len steps (e.g.
        LinTrans in the synthetic run sees only the last 8 steps); otherwise a mismatch raises.
      channel_drop: the released synthetic notebook's channel-drop augmentation (samovar.md §10;
        docs/samovar_options.md), train mode only: per call draw r ~ U(0, 1) and zero each input channel
        with probability 1 - r, one mask [C] for the whole batch, from the 'dropout' rng (the trainer
        folds the step into it, so a resumed run draws the same masks). The reference zeroes the same
        channels of the target too: the model returns `outputs['forecast_keep']` [C_t] bool, with which
        the shared forecast task (`zoo_core.tasks.forecast`) zeroes the dropped target channels, and
        `aux['channel_keep']` [C] bool says which input channels were kept. Off (False) = no rng drawn.
      dtype: compute dtype or its name, e.g. 'bfloat16' (None: the parameter dtype). Instance-norm
        statistics, the attention sums/states and the returned forecast stay float32.
      param_dtype: parameter dtype or its name.
      remat: recompute the forward pass of each MLP block, LinTrans block and of the VAR chain in
        the backward pass (`zoo_core.ops.remat`; the stateful scan paths are not rematerialised).
      sequence_axis: the mesh axis the 2N ARX tokens are split over (context parallelism; None: one
        device): the VAR chain (`samovar_jax.context_parallel`) or LinTrans's causal linear attention
        runs its context-parallel form under `jax.set_mesh(mesh)`, on the tokens padded at their end
        to a multiple of the axis size (causal: the padding changes no output; it is cut off before
        the heads). Rollouts continue with one device's `scan`. `parallel.sequence > 1` sets it.
    """
    num_channels: int
    input_len: int
    patch_len: int
    kind: str = "samovar"
    horizon: int = 0
    num_targets: int = 0
    width: int = 0
    num_heads: int = 8
    num_layers: int = 3
    mlp_ratio: int = 4
    dropout: float = 0.1
    ar_loss_weight: float = 1.0
    use_qv_norm: Optional[bool] = None
    use_key_proj: Optional[bool] = None
    structural: Optional[str] = None
    shortcut_inside: bool = False
    univariate: bool = False
    norm_mean: str = "last_patch"
    chunk_size: Optional[int] = None
    max_patches: int = 0
    position_overflow: str = "error"
    fixed_max_tokens: int = 128
    crop_inputs: bool = False
    channel_drop: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    remat: bool = False
    sequence_axis: Optional[str] = None

    # ------------------------------------------------------------------ configuration

    def check_fields(self) -> None:
        """Boundary checks of every field (called by `Model`; `validation.check_forecaster`)."""
        validation.check_forecaster(self)

    @property
    def resolved(self) -> BlockConfig:
        """The `BlockConfig` resolved from the fields (automatic width and heads, patches, horizon)."""
        return BlockConfig.from_module(self)

    def _check_positions(self, res: BlockConfig, patches: int) -> None:
        validation.check_positions(self, res, patches)

    # ------------------------------------------------------------------ parameters

    def setup(self):
        r = self.resolved
        kw = dict(dtype=r.dtype, param_dtype=r.param_dtype)
        d = r.width
        out_std = 0.02 / math.sqrt(2 * r.num_layers)                        # samovar.md §5 (c_proj)
        self.tokenizer = modules.ARXTokenizer(patch_len=self.patch_len, num_channels=self.num_channels,
                                             num_targets=r.num_targets, width=d, univariate=self.univariate,
                                             **kw, name="tokenizer")
        self.embedding = modules.ARXEmbedding(num_targets=r.num_targets, max_tokens=2 * r.max_patches, width=d,
                                             with_types=self.kind != "lintrans", **kw, name="embedding")
        self.pre_norm = modules.RMSNorm(d, **kw, name="pre_norm")
        self.token_dropout = Dropout(r.dropout, position_axis=1)  # keyed by position: padding to P shards changes no mask
        if self.kind == "lintrans":
            self.blocks = [
                layers.LinTransBlock(width=d, num_heads=r.num_heads, hidden=r.mlp_ratio * d, dropout_rate=r.dropout,
                                     out_init_std=out_std, chunk_size=r.chunk_size, sequence_axis=r.sequence_axis,
                                     **kw, name=f"block_{i:02d}")
                for i in range(r.num_layers)]
        else:
            self.mlps = [modules.MLPBlock(width=d, hidden=r.mlp_ratio * d, dropout_rate=r.dropout,
                                         out_init_std=out_std, **kw, name=f"mlp_{i:02d}")
                         for i in range(r.num_layers)]
            self.var_norm = modules.RMSNorm(d, **kw, name="var_norm")
            self.var = layers.VARChain(
                width=d, num_heads=r.num_heads, num_layers=r.num_layers,
                qv_source="projection" if self.kind == "samovar" else "fixed",
                use_qv_norm=r.use_qv_norm, use_key_proj=r.use_key_proj, num_channels=r.num_targets,
                max_tokens=self.fixed_max_tokens, dropout_rate=r.dropout,
                chunk_size=r.chunk_size, sequence_axis=r.sequence_axis, **kw, name="var")
            if r.structural != "none":
                self.structural_matrix = modules.StructuralMatrix(
                    r.num_heads, r.head_dim, inverse=r.structural == "lu_inverse", **kw, name="structural")
        self.final_norm = modules.RMSNorm(d, **kw, name="final_norm")
        self.head = modules.dense(self.patch_len, name="head", **kw)

    # ------------------------------------------------------------------ pieces

    def _compute_dtype(self):
        return jnp.dtype(self.dtype if self.dtype is not None else self.param_dtype)

    def _inputs(self, batch: dict) -> Array:
        """batch['inputs'] [B, L_I, C] floating (cropped to input_len with crop_inputs)."""
        if not isinstance(batch, dict) or "inputs" not in batch:
            checks.fail("`batch` must be a dict with key 'inputs' [B, L_I, C]")
        x = jnp.asarray(batch["inputs"])
        length_ok = x.ndim == 3 and (x.shape[1] == self.input_len or (self.crop_inputs and x.shape[1] > self.input_len))
        if not (length_ok and x.shape[2] == self.num_channels and jnp.issubdtype(x.dtype, jnp.floating)):
            checks.fail(f"`batch['inputs']` must be floating [B, L_I={self.input_len}, C={self.num_channels}] "
                        f"(longer with crop_inputs), got {x.dtype} {x.shape}")
        return x[:, -self.input_len:]

    def normalise(self, x: Array) -> tuple[Array, Array, Array]:
        """Instance normalisation and patching (samovar.md §2.1-2.2).

        Args:
          x: [B, L_I, C] raw window.

        Returns:
          (segments [B, C, N, P] normalised and left-padded, mean [B, 1, C], std [B, 1, C]), float32.
        """
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        mean, std = ops.instance_norm_stats(x, self.patch_len, self.norm_mean)
        return ops.patchify((x - mean) / std, self.patch_len), mean, std

    def _positions(self, start, count: int) -> Array:
        """Absolute token indices start..start+count-1, clamped to the tables if requested."""
        pos = start + jnp.arange(count)
        if self.position_overflow == "clamp":
            r = self.resolved
            limit = 2 * r.max_patches
            if self.kind == "fixedvar":
                limit = min(limit, self.fixed_max_tokens - self.fixed_max_tokens % 2)
            pos = jnp.where(pos < limit, pos, limit - 2 + pos % 2)
        return pos

    def _table_positions(self, positions: Array) -> Optional[Array]:
        """Token positions for the VAR chain: read by FixedVAR's tables only."""
        return positions if self.kind == "fixedvar" else None

    def _embed(self, segments: Array, start, *, train: bool) -> tuple[Array, Array]:
        """Tokens + embeddings + pre-norm, channels folded (samovar.md §2.3-2.4).

        Args:
          segments: [B, C, n, P] normalised patches; start: patch index of the first one (int or traced).

        Returns:
          (h [B * C_t, 2n, E] with row b * C_t + c, token positions [2n]).
        """
        tokens = self.tokenizer(segments.astype(self._compute_dtype()))
        positions = self._positions(2 * start, tokens.shape[2])
        h = self.pre_norm(self.token_dropout(tokens, deterministic=not train) + self.embedding(positions)[None])
        b, c, t, d = h.shape
        return h.reshape(b * c, t, d), positions

    def _mixture(self, x0_endo: Array, outputs) -> Array:
        """Key shortcut and structural matrix (samovar.md §2.7): x0 and the layers' outputs -> z.

        Args:
          x0_endo: [B', n, E] at the endogenous tokens.
          outputs: the L layers' outputs, each [B', 2n, H, D] at every token (a tuple, or an
            [L, ...] array).

        Returns:
          z [B', n, E] = x0 + (sum_m o^(m)) D (or (x0 + sum_m o^(m)) D with shortcut_inside).
        """
        r = self.resolved
        # Adds of the layers' endogenous tokens, not jnp.sum over a stacked axis: XLA's CPU backend
        # runs that reduction as a slow strided reduce, and the adds fuse with the slicing.
        m = functools.reduce(jnp.add, [o[:, 1::2] for o in outputs])
        x0h = x0_endo.reshape(m.shape).astype(m.dtype)
        if self.shortcut_inside:
            m = m + x0h
        if r.structural != "none":
            m = self.structural_matrix(m).astype(m.dtype)
        z = m if self.shortcut_inside else x0h + m
        return z.reshape(x0_endo.shape)

    def _trunk(self, h: Array, positions: Array, *, state=None, want_state: bool = False,
               train: bool = False):
        """Sequence model on folded tokens: h [B', T, E] -> (z [B', T/2, E] at endogenous tokens, state).

        With `want_state` (or a `state` to continue from) the stateful `scan` entry points are used
        (the token recurrence), else `__call__` (parallel or chunked per `chunk_size`).
        """
        stateful = want_state or state is not None
        t = h.shape[1]
        if not stateful:   # context parallelism: T padded to a multiple of the shards (causal: no mask)
            length = padded_length(t, self.sequence_axis)
            h, positions = pad_end(h, length), pad_end(positions, length, axis=0)
        if self.kind == "lintrans":
            states = []
            for i, block in enumerate(self.blocks):
                if stateful:
                    h, s = block.scan(h, None if state is None else state[i], deterministic=not train)
                    states.append(s)
                else:
                    h, _ = call_block(block, h, deterministic=not train, remat=self.remat)
            z = h[:, 1:t:2]
            return z, (tuple(states) if stateful else None)
        for mlp in self.mlps:
            h = call_block(mlp, h, deterministic=not train, remat=self.remat)
        x0 = self.var_norm(h)
        if stateful:
            o, new_state = self.var.scan(x0, state, positions=self._table_positions(positions),
                                         deterministic=not train)
        else:
            o = call_block(self.var, x0, positions=self._table_positions(positions), deterministic=not train,
                           remat=self.remat, method="layer_outputs")
            o, x0 = tuple(x[:, :t] for x in o), x0[:, :t]
            new_state = None
        return self._mixture(x0[:, 1::2], o), new_state

    def _head(self, z: Array, batch: int) -> Array:
        """z [B * C_t, n, E] -> next-patch predictions [B, C_t, n, P]."""
        y = self.head(self.final_norm(z))
        return y.reshape(batch, -1, y.shape[1], self.patch_len)

    def _denormalise(self, pred: Array, mean: Array, std: Array) -> Array:
        """pred [B, C_t, K, P] normalised -> [B, K * P, C_t] raw units (float32)."""
        c_t = self.resolved.num_targets
        y = ops.unpatchify(pred.astype(jnp.float32))
        return y * std[:, :, -c_t:] + mean[:, :, -c_t:]

    def predict_segments(self, segments: Array, *, start: int = 0, train: bool = False) -> Array:
        """Parallel form on any normalised patch sequence (e.g. the input extended by predictions).

        Args:
          segments: [B, C, n, P] normalised patches (n + start within the position tables).
          start: patch index of the first patch.
          train: dropout on.

        Returns:
          [B, C_t, n, P] next-patch predictions (prediction i is for patch start + i + 1).
        """
        self._check_positions(self.resolved, start + segments.shape[2])
        h, positions = self._embed(segments, start, train=train)
        z, _ = self._trunk(h, positions, train=train)
        return self._head(z, segments.shape[0])

    # ------------------------------------------------------------------ forward

    def __call__(self, batch: dict, *, train: bool = False) -> tuple[dict, dict]:
        """Forecast of the next `horizon` steps.

        Args:
          batch: {'inputs': [B, L_I, C]} (other keys, e.g. 'target', are ignored).
          train: dropout on and `aux['loss/ar']` returned.

        Returns:
          ({'forecast': [B, horizon, C_t]}, aux) as described in the class docstring.
        """
        r = self.resolved
        x, keep = self._drop_channels(self._inputs(batch), train)
        segments, mean, std = self.normalise(x)
        if r.horizon_patches == 1:
            pred = self.predict_segments(segments, train=train)
            future = pred[:, :, -1:]
        else:
            pred, future = self._rollout(segments, r.horizon_patches, train=train)
        forecast = self._denormalise(future, mean, std)[:, :r.horizon]
        target = segments[:, self.num_channels - r.num_targets:, 1:]
        ar_mse = (jnp.mean(jnp.square(pred[:, :, :-1].astype(jnp.float32) - target))
                  if r.num_patches > 1 else jnp.zeros((), jnp.float32))
        aux = {"ar_mse": ar_mse, "next_patch": pred}
        if train and self.ar_loss_weight > 0:
            aux["loss/ar"] = self.ar_loss_weight * ar_mse
        outputs = {"forecast": forecast}
        if keep is not None:
            outputs["forecast_keep"] = keep[-r.num_targets:]
            aux["channel_keep"] = keep
        return outputs, aux

    # ------------------------------------------------------------------ channel drop (samovar.md §10)

    def _drop_channels(self, x: Array, train: bool) -> tuple[Array, Optional[Array]]:
        """x [B, L_I, C] -> (x with the dropped channels zeroed, keep [C] bool), or (x, None) when off.

        As the reference notebook: r ~ U(0, 1) per call, channel c dropped iff u_c < 1 - r, u ~ U(0, 1)^C.
        """
        if not (train and self.channel_drop):
            return x, None
        rate_key, mask_key = jax.random.split(self.make_rng("dropout"))
        kept_fraction = jax.random.uniform(rate_key, ())
        keep = jax.random.uniform(mask_key, (self.num_channels,)) >= 1.0 - kept_fraction
        return jnp.where(keep, x, jnp.zeros((), x.dtype)), keep

    # ------------------------------------------------------------------ rollout

    def _rollout(self, segments: Array, num_patches: int, *, train: bool = False) -> tuple[Array, Array]:
        """Recurrent rollout: prefix with state, then one patch at a time (O(1) work per patch).

        Returns:
          (prefix predictions [B, C_t, N, P], future patches [B, C_t, K, P]), normalised.
        """
        b = segments.shape[0]
        n = segments.shape[2]
        self._check_positions(self.resolved, n + num_patches - 1)
        h, positions = self._embed(segments, 0, train=train)
        z, state = self._trunk(h, positions, want_state=True, train=train)
        pred = self._head(z, b)
        first = pred[:, :, -1]                                                   # [B, C, P]
        if num_patches == 1:
            return pred, first[:, :, None]

        def body(module, carry, _):
            state, patch, index = carry
            h, pos = module._embed(patch[:, :, None].astype(segments.dtype), index, train=train)
            z, state = module._trunk(h, pos, state=state, train=train)
            nxt = module._head(z, b)[:, :, 0]
            return (state, nxt, index + 1), nxt

        scan = nn.scan(body, variable_broadcast="params", split_rngs={"params": False, "dropout": True},
                       length=num_patches - 1)
        _, rest = scan(self, (state, first, jnp.asarray(n)), None)               # [K-1, B, C, P]
        future = jnp.concatenate([first[:, :, None], jnp.moveaxis(rest, 0, 2)], axis=2)
        return pred, future

    def rollout(self, batch: dict, num_patches: int, *, mode: str = "recurrent",
                train: bool = False) -> Array:
        """Autoregressive forecast of `num_patches` patches (needs num_targets == num_channels).

        Each predicted patch (normalised units) is appended as the next input patch; the instance-norm
        statistics stay those of the input window.

        Args:
          batch: {'inputs': [B, L_I, C]}.
          num_patches: K >= 1.
          mode: 'recurrent' (prefix state, then `scan`-continued state per patch: O(1) work per patch)
            or 'parallel' (re-run the parallel form on the whole extended sequence for every new patch,
            O(K (N + K)^2); the reference for tests).
          train: dropout on.

        Returns:
          [B, K * P, C] forecast in raw units (float32).
        """
        r = self.resolved
        checks.check_int("num_patches", num_patches, 1)
        checks.check_choice("mode", mode, ("recurrent", "parallel"))
        if num_patches > 1 and r.num_targets != self.num_channels:
            checks.fail("rollout beyond one patch needs `num_targets` == num_channels")
        self._check_positions(r, r.num_patches + num_patches - 1)
        segments, mean, std = self.normalise(self._inputs(batch))
        if mode == "recurrent":
            future = self._rollout(segments, num_patches, train=train)[1]
        else:
            seq = segments
            outs = []
            for _ in range(num_patches):
                nxt = self.predict_segments(seq, train=train)[:, :, -1]
                outs.append(nxt)
                seq = jnp.concatenate([seq, nxt[:, :, None].astype(seq.dtype)], axis=2)
            future = jnp.stack(outs, axis=2)
        return self._denormalise(future, mean, std)

    # ------------------------------------------------------------------ analysis hooks

    def var_terms(self, batch: dict) -> dict:
        """Operands of the VAR reading (samovar.md §3) for `samovar_jax.analysis` (eval mode, no dropout).

        Returns:
          dict with 'x0' [B, C_t, T, H, D] VAR observations, 'q', 'v' [L, B, C_t, T, H, D],
          'key_kernels' [L, E, E] or None, 'structural' [H, D, D] matrix applied on the row side
          (D, D^-1) or None, 'shortcut_inside' bool, 'head_kernel' [E, P] (W_out^T), 'segments'
          [B, C, N, P].
        """
        if self.kind == "lintrans":
            checks.fail("var_terms needs kind='samovar' or 'fixedvar' (LinTrans has no VAR chain)")
        r = self.resolved
        segments, _, _ = self.normalise(self._inputs(batch))
        h, positions = self._embed(segments, 0, train=False)
        for mlp in self.mlps:
            h = mlp(h)
        x0 = self.var_norm(h)
        xh, q, v, kernels = self.var.project(x0, self._table_positions(positions))
        b = segments.shape[0]
        unfold = lambda a, lead: a.reshape(lead + (b, r.num_targets) + a.shape[len(lead) + 1:])  # noqa: E731
        return {
            "x0": unfold(xh, ()), "q": unfold(q, (r.num_layers,)), "v": unfold(v, (r.num_layers,)),
            "key_kernels": kernels,
            "structural": None if r.structural == "none" else self.structural_matrix.matrix(),
            "shortcut_inside": self.shortcut_inside,
            "head_kernel": self.head.variables["params"]["kernel"],
            "segments": segments,
        }
