"""SAMoVAR forecaster and its LinTrans / FixedVAR baselines (Lu & Yang, ICML 2025, arXiv:2502.07244).

`Model(**config.model)` is the only place that reads a config. Sections refer to the project spec
`samovar.md`, which follows the released code (LJC-FVNR/Structural-Aligned-Mixture-of-VAR @ 4e2581f):

  §2.1 instance normalisation -> §2.2 left zero-padding and patching -> §2.3 ARX tokens
  -> §2.4 embeddings, `RMSNorm_pre(Dropout(tokens) + E)`, channels folded into the batch
  -> kind 'samovar' / 'fixedvar': §2.5 all MLP blocks first, `x0 = RMSNorm_var(h)`, §2.6 VAR chain,
     §2.7 `z = x0 + (sum over layers of the outputs at endogenous tokens) D` (key shortcut outside D)
  -> kind 'lintrans' (§7): pre-norm [linear attention; MLP] blocks, endogenous tokens
  -> §2.8 `RMSNorm_final`, `W_out` -> next-patch prediction of every patch; the last one, de-normalised,
     is the forecast; §2.9 `ar_loss` = next-patch MSE in normalised units.

Beyond the reference: horizons longer than one patch by autoregressive rollout (`horizon=`,
`Model.rollout`), which continues the recurrent state of the prefix patch by patch (O(1) work per new
patch) and equals re-running the parallel form on the extended patch sequence.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from samovar_jax import layers, ops

Array = jax.Array

KINDS = ("samovar", "lintrans", "fixedvar")

# Model sizes. `width=0` is the reference's automatic width 32 * floor(sqrt(C)) (C = input channels for
# SAMoVAR/FixedVAR, C_t for LinTrans); `num_heads=0` is its fallback width // 16 (not for LinTrans).
VARIANTS: dict[str, dict[str, Any]] = {
    # samovar.sh / baseline settings of the benchmarks (spec §6, §9): d = 32 floor(sqrt(C)), 8 heads, 3 layers.
    "paper": dict(width=0, num_heads=8, num_layers=3, mlp_ratio=4, dropout=0.1),
    # The synthetic VAR experiment (spec §10, Fig. 4 notebook): d 32, 2 heads, 3 layers.
    "synthetic": dict(width=32, num_heads=2, num_layers=3, mlp_ratio=4, dropout=0.1),
    # Smoke tests and CPU debugging.
    "tiny": dict(width=16, num_heads=2, num_layers=2, mlp_ratio=2, dropout=0.0),
}


def _pick(value, default):
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Sizes derived from the constructor fields (see `Model.resolved`)."""
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


class Model(nn.Module):
    """SAMoVAR / LinTrans / FixedVAR forecaster on ARX patch tokens.

    Batch keys: `inputs` float [B, L_I, C] (the input window, raw units); `target` [B, horizon, C_t]
    is not read by the model (the forecast task computes the MSE). Returns `(outputs, aux)` with
    `outputs = {'forecast': [B, horizon, C_t]}` (float32, raw units: the last C_t channels) and
    `aux = {'loss/ar': next-patch MSE times ar_loss_weight (train only, if the weight is > 0),
    'ar_mse': unweighted next-patch MSE, 'next_patch': [B, C_t, N, P] normalised next-patch
    predictions}`. The shared trainer adds every `aux['loss/*']`, giving the reference's total loss
    `forecast MSE + ar_loss` (spec §2.9); as in the reference, validation uses the forecast MSE only.

    Attributes (every field; `None` means "from the variant" or "the default for this kind"):
      num_channels: C, input series (required).
      input_len: L_I, input window length (required; the channel embedding is indexed by absolute
        token position, so it is fixed).
      patch_len: P, patch length = per-token forecast step (the reference sets P = horizon).
      kind: 'samovar' | 'lintrans' | 'fixedvar'.
      variant: key of `VARIANTS` giving width, num_heads, num_layers, mlp_ratio, dropout.
      horizon: forecast length; 0 -> patch_len (the reference). Longer horizons are produced by
        autoregressive rollout of ceil(horizon / P) patches and truncated (needs num_targets == C).
      num_targets: C_t, the last C_t channels are forecast; 0 -> all.
      width: d; 0 -> 32 floor(sqrt(C)) (C_t for LinTrans). None -> variant.
      num_heads: H; 0 -> d // 16 (SAMoVAR/FixedVAR; LinTrans needs H > 0). None -> variant.
      num_layers: l (MLP blocks and VAR layers; LinTrans blocks). None -> variant.
      mlp_ratio: MLP hidden width / d (4 in the reference). None -> variant.
      dropout: rate of every dropout (tokens, MLP outputs, VAR-layer outputs; LinTrans key input and
        attention output). None -> variant.
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
      attention_form: 'parallel' (masked), 'chunked' or 'recurrent' for the training/eval pass.
      chunk_size: chunk length of the chunked form (any value >= 1).
      max_patches: patch slots of the position tables; 0 -> N (the reference). Rollout to K patches
        needs N + K - 1 slots unless position_overflow='clamp'.
      position_overflow: 'error' (token positions beyond the tables raise) or 'clamp' (positions past
        the end reuse the last patch slot of the same token type; used by long rollouts).
      fixed_max_tokens: FixedVAR table length (128, hard-coded in the reference).
      crop_inputs: accept windows longer than input_len and use their last input_len steps (e.g.
        LinTrans in the synthetic run sees only the last 8 steps); otherwise a mismatch raises.
      dtype: compute dtype or its name, e.g. 'bfloat16' (None: the parameter dtype). Instance-norm
        statistics, the attention sums/states and the returned forecast stay float32.
      param_dtype: parameter dtype or its name.
    """
    num_channels: int
    input_len: int
    patch_len: int
    kind: str = "samovar"
    variant: str = "paper"
    horizon: int = 0
    num_targets: int = 0
    width: Optional[int] = None
    num_heads: Optional[int] = None
    num_layers: Optional[int] = None
    mlp_ratio: Optional[int] = None
    dropout: Optional[float] = None
    ar_loss_weight: float = 1.0
    use_qv_norm: Optional[bool] = None
    use_key_proj: Optional[bool] = None
    structural: Optional[str] = None
    shortcut_inside: bool = False
    univariate: bool = False
    norm_mean: str = "last_patch"
    attention_form: str = "parallel"
    chunk_size: int = 64
    max_patches: int = 0
    position_overflow: str = "error"
    fixed_max_tokens: int = 128
    crop_inputs: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    # ------------------------------------------------------------------ configuration

    def __post_init__(self):
        self.resolved  # validates the configuration at construction, before any tracing
        super().__post_init__()

    @property
    def resolved(self) -> Resolved:
        """Checks the fields and derives the sizes; raises ValueError naming a bad argument."""
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {self.variant!r}")
        for name in ("dtype", "param_dtype"):
            try:
                if getattr(self, name) is not None:
                    jnp.dtype(getattr(self, name))
            except TypeError:
                raise ValueError(f"{name} must be a dtype or its name (e.g. 'bfloat16'), "
                                 f"got {getattr(self, name)!r}") from None
        for name in ("num_channels", "input_len", "patch_len"):
            if not isinstance(getattr(self, name), numbers.Integral) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("num_targets", "width", "num_heads", "num_layers", "mlp_ratio", "max_patches", "horizon",
                     "chunk_size", "fixed_max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.kind != "fixedvar" and self.fixed_max_tokens != 128:
            raise ValueError(f"fixed_max_tokens applies to kind='fixedvar' only, got {self.fixed_max_tokens} "
                             f"with kind={self.kind!r}")
        if self.input_len < 2:
            raise ValueError(f"input_len must be >= 2 (the unbiased std needs two values), got {self.input_len}")
        if not 0 <= self.num_targets <= self.num_channels:
            raise ValueError(f"num_targets must be in [0, num_channels={self.num_channels}], got {self.num_targets}")
        var = VARIANTS[self.variant]
        c_t = self.num_targets or self.num_channels
        width = _pick(self.width, var["width"])
        if width == 0:
            width = 32 * math.isqrt(c_t if self.kind == "lintrans" else self.num_channels)
        heads = _pick(self.num_heads, var["num_heads"])
        if heads == 0:
            if self.kind == "lintrans":
                raise ValueError("num_heads=0 (automatic) is not available for kind='lintrans' "
                                 "(the reference has no fallback); give num_heads > 0")
            heads = max(width // 16, 1)
        if width < 1 or heads < 1 or width % heads:
            raise ValueError(f"width {width} must be a positive multiple of num_heads {heads}")
        layers_ = _pick(self.num_layers, var["num_layers"])
        mlp_ratio = _pick(self.mlp_ratio, var["mlp_ratio"])
        dropout = _pick(self.dropout, var["dropout"])
        if layers_ < 1:
            raise ValueError(f"num_layers must be >= 1, got {layers_}")
        if mlp_ratio < 1:
            raise ValueError(f"mlp_ratio must be >= 1, got {mlp_ratio}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if self.ar_loss_weight < 0:
            raise ValueError(f"ar_loss_weight must be >= 0, got {self.ar_loss_weight}")

        var_kinds = ("samovar", "fixedvar")
        if self.kind != "samovar":
            for name in ("use_qv_norm", "use_key_proj"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to kind='samovar' only, got {name}="
                                     f"{getattr(self, name)!r} with kind={self.kind!r}")
        if self.kind not in var_kinds:
            if self.structural is not None:
                raise ValueError(f"structural applies to kind='samovar'/'fixedvar' only, got {self.structural!r}")
            if self.shortcut_inside:
                raise ValueError("shortcut_inside applies to kind='samovar'/'fixedvar' only")
        structural = _pick(self.structural, "lu" if self.kind in var_kinds else "none")
        if structural not in ("lu", "lu_inverse", "none"):
            raise ValueError(f"structural must be 'lu', 'lu_inverse' or 'none', got {structural!r}")
        if self.norm_mean not in ("last_patch", "window"):
            raise ValueError(f"norm_mean must be 'last_patch' or 'window', got {self.norm_mean!r}")
        if self.attention_form not in layers.FORMS:
            raise ValueError(f"attention_form must be one of {layers.FORMS}, got {self.attention_form!r}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.position_overflow not in ("error", "clamp"):
            raise ValueError(f"position_overflow must be 'error' or 'clamp', got {self.position_overflow!r}")

        n = -(-self.input_len // self.patch_len)
        pad = n * self.patch_len - self.input_len
        max_patches = self.max_patches or n
        if max_patches < n:
            raise ValueError(f"max_patches {max_patches} is smaller than the {n} input patches")
        if self.kind == "fixedvar" and 2 * n > self.fixed_max_tokens:
            raise ValueError(f"fixed_max_tokens {self.fixed_max_tokens} < {2 * n} tokens of the input window")
        horizon = self.horizon or self.patch_len
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon}")
        k = -(-horizon // self.patch_len)
        if k > 1 and c_t != self.num_channels:
            raise ValueError(f"horizon {horizon} > patch_len needs num_targets == num_channels (rollout feeds "
                             f"the predicted patches back); got num_targets={c_t}, num_channels={self.num_channels}")
        if self.ar_loss_weight > 0 and n < 2:
            raise ValueError(f"ar_loss_weight > 0 needs at least 2 patches; input_len {self.input_len} with "
                             f"patch_len {self.patch_len} gives {n}")
        use_qv_norm = _pick(self.use_qv_norm, True) if self.kind == "samovar" else False
        use_key_proj = _pick(self.use_key_proj, False) if self.kind == "samovar" else False
        res = Resolved(num_targets=c_t, width=width, num_heads=heads, head_dim=width // heads,
                       num_layers=layers_, mlp_ratio=mlp_ratio, dropout=dropout, num_patches=n,
                       pad_len=pad, max_patches=max_patches, horizon=horizon, horizon_patches=k,
                       use_qv_norm=use_qv_norm, use_key_proj=use_key_proj, structural=structural)
        self._check_positions(res, n + k - 1)
        return res

    def _check_positions(self, res: Resolved, patches: int) -> None:
        """Raises if `patches` patches do not fit the position tables (unless clamping)."""
        if self.position_overflow == "clamp":
            return
        if patches > res.max_patches:
            raise ValueError(f"{patches} patches (input + rollout) exceed max_patches={res.max_patches}; "
                             f"raise max_patches or set position_overflow='clamp'")
        if self.kind == "fixedvar" and 2 * patches > self.fixed_max_tokens:
            raise ValueError(f"{2 * patches} tokens (input + rollout) exceed fixed_max_tokens="
                             f"{self.fixed_max_tokens}; set position_overflow='clamp'")

    # ------------------------------------------------------------------ parameters

    def setup(self):
        r = self.resolved
        # Configs give dtypes as strings ('bfloat16'); the layers get numpy dtypes.
        kw = dict(dtype=None if self.dtype is None else jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype))
        d = r.width
        out_std = 0.02 / math.sqrt(2 * r.num_layers)                        # spec §5 (c_proj)
        self.tokenizer = layers.ARXTokenizer(self.patch_len, self.num_channels, r.num_targets, d,
                                             self.univariate, **kw, name="tokenizer")
        self.embedding = layers.ARXEmbedding(r.num_targets, 2 * r.max_patches, d,
                                             with_types=self.kind != "lintrans", **kw, name="embedding")
        self.pre_norm = layers.RMSNorm(d, **kw, name="pre_norm")
        self.token_dropout = nn.Dropout(r.dropout)
        if self.kind == "lintrans":
            self.blocks = [
                layers.LinTransBlock(d, r.num_heads, r.mlp_ratio * d, r.dropout, out_std, self.attention_form,
                                     self.chunk_size, **kw, name=f"block_{i:02d}")
                for i in range(r.num_layers)]
        else:
            self.mlps = [layers.MLPBlock(d, r.mlp_ratio * d, r.dropout, out_std, **kw, name=f"mlp_{i:02d}")
                         for i in range(r.num_layers)]
            self.var_norm = layers.RMSNorm(d, **kw, name="var_norm")
            self.var = layers.VARChain(
                d, r.num_heads, r.num_layers,
                qv_source="projection" if self.kind == "samovar" else "fixed",
                use_qv_norm=r.use_qv_norm, use_key_proj=r.use_key_proj, num_channels=r.num_targets,
                max_tokens=self.fixed_max_tokens, dropout=r.dropout, form=self.attention_form,
                chunk_size=self.chunk_size, **kw, name="var")
            if r.structural != "none":
                self.structural_matrix = layers.StructuralMatrix(
                    r.num_heads, r.head_dim, inverse=r.structural == "lu_inverse", **kw, name="structural")
        self.final_norm = layers.RMSNorm(d, **kw, name="final_norm")
        self.head = layers.dense(self.patch_len, name="head", **kw)

    # ------------------------------------------------------------------ pieces

    def _compute_dtype(self):
        return jnp.dtype(self.dtype if self.dtype is not None else self.param_dtype)

    def _inputs(self, batch: dict) -> Array:
        if not isinstance(batch, dict) or "inputs" not in batch:
            raise ValueError("batch must be a dict with key 'inputs' [B, L_I, C]")
        x = jnp.asarray(batch["inputs"])
        if x.ndim != 3:
            raise ValueError(f"batch['inputs'] must be [B, L_I, C], got shape {x.shape}")
        if x.shape[2] != self.num_channels:
            raise ValueError(f"batch['inputs'] has {x.shape[2]} channels, the model has num_channels="
                             f"{self.num_channels}")
        if x.shape[1] != self.input_len:
            if not (self.crop_inputs and x.shape[1] > self.input_len):
                raise ValueError(f"batch['inputs'] has length {x.shape[1]}, the model has input_len="
                                 f"{self.input_len}" + ("" if self.crop_inputs else " (crop_inputs=False)"))
            x = x[:, -self.input_len:]
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"batch['inputs'] must be floating point, got {x.dtype}")
        return x

    def normalise(self, x: Array) -> tuple[Array, Array, Array]:
        """Instance normalisation and patching (spec §2.1-2.2).

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

    def _embed(self, segments: Array, start, *, train: bool) -> tuple[Array, Array]:
        """Tokens + embeddings + pre-norm, channels folded (spec §2.3-2.4).

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

    def _mixture(self, x0_endo: Array, o_endo: Array) -> Array:
        """Key shortcut and structural matrix (spec §2.7): x0, o at endogenous tokens -> z.

        Args:
          x0_endo: [B', n, E]; o_endo: [L, B', n, H, D] per-layer outputs.

        Returns:
          z [B', n, E] = x0 + (sum_m o^(m)) D (or (x0 + sum_m o^(m)) D with shortcut_inside).
        """
        r = self.resolved
        m = jnp.sum(o_endo, axis=0)
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
        (chunked or recurrent per `attention_form`), else `__call__`.
        """
        stateful = want_state or state is not None
        if self.kind == "lintrans":
            states = []
            for i, block in enumerate(self.blocks):
                if stateful:
                    h, s = block.scan(h, None if state is None else state[i], train=train)
                    states.append(s)
                else:
                    h = block(h, train=train)
            z = h[:, 1::2]
            return z, (tuple(states) if stateful else None)
        for mlp in self.mlps:
            h = mlp(h, train=train)
        x0 = self.var_norm(h)
        if stateful:
            o, new_state = self.var.scan(x0, state, positions=positions, train=train)
        else:
            o, new_state = self.var(x0, positions=positions, train=train), None
        return self._mixture(x0[:, 1::2], o[:, :, 1::2]), new_state

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
        x = self._inputs(batch)
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
        return {"forecast": forecast}, aux

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
        if num_patches < 1:
            raise ValueError(f"num_patches must be >= 1, got {num_patches}")
        if num_patches > 1 and r.num_targets != self.num_channels:
            raise ValueError("rollout beyond one patch needs num_targets == num_channels")
        if mode not in ("recurrent", "parallel"):
            raise ValueError(f"mode must be 'recurrent' or 'parallel', got {mode!r}")
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
        """Operands of the VAR reading (spec §3) for `samovar_jax.analysis` (eval mode, no dropout).

        Returns:
          dict with 'x0' [B, C_t, T, H, D] VAR observations, 'q', 'v' [L, B, C_t, T, H, D],
          'key_kernels' [L, E, E] or None, 'structural' [H, D, D] matrix applied on the row side
          (D, D^-1) or None, 'shortcut_inside' bool, 'head_kernel' [E, P] (W_out^T), 'segments'
          [B, C, N, P].
        """
        if self.kind == "lintrans":
            raise ValueError("var_terms needs kind='samovar' or 'fixedvar' (LinTrans has no VAR chain)")
        r = self.resolved
        segments, _, _ = self.normalise(self._inputs(batch))
        h, positions = self._embed(segments, 0, train=False)
        for mlp in self.mlps:
            h = mlp(h, train=False)
        x0 = self.var_norm(h)
        xh, q, v, kernels = self.var.project(x0, positions)
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
