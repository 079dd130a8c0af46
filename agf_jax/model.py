"""AGF models of the reference harnesses (Wi, Choi, Park, IJCAI 2025; code jeongwhanchoi/agf).

* `LRAClassifier` / `LRARetrieval`: `AGF_LRA` (Nystromformer/Primalformer LRA harness, agf.md §3.1):
    learned token + position embeddings, pre-LN blocks, final LN times the mask, MEAN pooling over
    all T positions (padding counts as zeros), Linear-ReLU-Linear head; retrieval is a
    weight-shared dual encoder with the head on [x0, x1, x0*x1, x0-x1].
* `UEAClassifier`: `AGF_UEA` (Flowformer/mvts_transformer lineage, agf.md §3.2): Linear input
    projection times sqrt(d_model), learnable positional table, post-LN blocks with a 1x1-conv FFN,
    final LN, activation, padding mask, flatten [B, T*E] -> Linear.

Each takes `attention=` any self-attention name of the zoo's registry (`zoo_core.attention.names('self')`,
read when the model is built): 'agf' and 'softmax' (the vanilla Transformer baseline) are built here
with PyTorch's inits, every other name by `zoo_core.attention.layer` (or `make` for a mechanism whose
non-causal form has no contract layer, such as linear attention's global form) with its own options
from `attention_options`, so the linear Transformers the paper compares against run on the same code.
AGF's `graph_filter` selects the paper's Table 6 ablations ('uvt', 'svd'; `AGFAttention`).
`Model(**config.model)` builds one of them from a `kind`, a `VARIANTS` size preset and overrides.

Interface (the zoo's model contract): `model.apply(variables, batch, train=False, rngs={'dropout': ...})`
returns `({'logits': [B, K] float32}, aux)`; dropout is active only when `train=True` (it is
`zoo_core.ops.dropout.Dropout`: flax's semantics, cheap hashed bits, keep probability within 2^-33). Blocks and
encoders return `(y, aux)` too: a block passes its layer's aux up, an encoder merges its blocks'
(`zoo_core.ops.aux_merge.stack_aux`: `loss/*` summed, diagnostics stacked per layer).

aux (attention='agf'; with 'softmax' it is empty, there is no regulariser; another registry
attention passes its own `loss/*` terms, summed over layers, e.g. window_graph's 'loss/kl'):
    'loss/orthogonality': scalar, mean over the batch of 'orthogonality/per_sample' (already
        weighted; the shared trainer adds it to the task loss). The reference averages over layers
        (agf.md §2.5), so this is weight / L times the encoder's summed 'loss/orthogonality'; it is
        computed from the per-sample values in the reference's order (the training loss is the
        same, bit for bit, as before the layer contract).
    'orthogonality/per_sample': [B], weighted mean over layers: the reference's `loss_ortho` (LRA,
        reg applied inside each layer) or eta * `ortho_mean` (UEA, eta applied outside).
    'orthogonality/per_layer': [L, B], what each layer returns as in the reference: times `reg`
        for LRA, unweighted for UEA. Retrieval averages the two towers.
    'filter/coefficients': [L, K+1], the effective c_k of each layer ([L, 1] ones for 'uvt'/'svd').
    'filter/singular_values': [L, H, D], graph_filter='svd' only.
Larger intermediates are sown (collection 'intermediates', only when made mutable):
    'hidden_states' (embedded input and the output of every block, [B, T, E] each) and 'token_out'
    (the encoder output after the final LN; LRA: times the mask). See `agf_jax.analysis`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from agf_jax import validation
from agf_jax.layers import torch_linear_bias_init, torch_linear_kernel_init

# AGF_ONLY_KWARGS, OWN_ATTENTIONS and attentions are this module's public names too.
from agf_jax.model_attention import (  # noqa: F401
    AGF_ONLY_KWARGS,
    OWN_ATTENTIONS,
    attentions,
    call_attention,
    check_attention_options,
    options_tuple,
)
from agf_jax.model_attention import block_attention as _attention
from zoo_core import checks, moved
from zoo_core.ops import xla_forms
from zoo_core.ops.aux_merge import stack_aux
from zoo_core.ops.block_config import config_class
from zoo_core.ops.dropout import Dropout
from zoo_core.ops.positions import sinusoidal_table
from zoo_core.ops.remat import call_block
from zoo_core.ops.residual import feed_forward, residual

Array = jax.Array

# Sizes only; the AGF hyperparameters of each task go in the configs (agf.md §3 tables).
VARIANTS: dict[str, dict[str, int]] = {
    # AGF_LRA shared settings: D=64, hidden 128, 2 heads x 32, 2 layers (agf.md §3.1).
    "lra": dict(d_model=64, mlp_dim=128, num_heads=2, head_dim=32, num_layers=2),
    # AGF_UEA options.py defaults: d_model 512, 8 heads (d=64), d_ff 2048, 2 layers (agf.md §3.2).
    "uea": dict(d_model=512, mlp_dim=2048, num_heads=8, head_dim=64, num_layers=2),
    # Smoke tests and CPU notebooks.
    "tiny": dict(d_model=16, mlp_dim=32, num_heads=2, head_dim=8, num_layers=2),
}

# PyTorch LayerNorm epsilon (Flax's default is 1e-6).
LN_EPS = 1e-5


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {"gelu": xla_forms.gelu, "relu": nn.relu}

# Traced inside `xla_forms.plain(...)` (the bfloat16 bisect), the parts named there ('embed',
# 'layer_norm', 'add_to_each', 'dense', 'dropout', 'agf_backward'; `xla_forms.PLAIN_FORMS`) are
# computed in their plain form, with the same parameters and values.


def _dense(features: int, fan_in: int, m, name: str) -> nn.Dense:
    """nn.Linear(fan_in -> features) with PyTorch's kernel and bias initialisation."""
    cls = nn.Dense if xla_forms.is_plain("dense") else xla_forms.Dense
    return cls(features, dtype=m.dtype, param_dtype=m.param_dtype,
               kernel_init=torch_linear_kernel_init(), bias_init=torch_linear_bias_init(fan_in),
               name=name)


def _layer_norm(m, name: str) -> nn.LayerNorm:
    cls = nn.LayerNorm if xla_forms.is_plain("layer_norm") else xla_forms.LayerNorm
    return cls(epsilon=LN_EPS, dtype=m.dtype, param_dtype=m.param_dtype, name=name)


def _dropout(m) -> nn.Module:
    return (nn.Dropout if xla_forms.is_plain("dropout") else Dropout)(m.dropout_rate)


def _embed(m, num: int, init) -> nn.Embed:
    cls = nn.Embed if xla_forms.is_plain("embed") else xla_forms.Embed
    return cls(num, m.d_model, embedding_init=init, dtype=m.dtype, param_dtype=m.param_dtype)


def _aux(aux: dict, weight: float) -> dict:
    """The model's aux from its encoder's (`stack_aux`); `weight` is applied on top (UEA eta, LRA 1).

    AGF's regulariser is averaged over layers (agf.md §2.5); another mechanism's `loss/*` terms
    pass through as `stack_aux` summed them."""
    if "orthogonality/per_sample" not in aux:
        return {k: v for k, v in aux.items() if k.startswith("loss/")}
    per_layer = aux["orthogonality/per_sample"]                # [L, B]
    per_sample = weight * jnp.mean(per_layer, axis=0)          # [B]
    out = {"loss/orthogonality": jnp.mean(per_sample),
           "orthogonality/per_sample": per_sample,
           "orthogonality/per_layer": per_layer,
           "filter/coefficients": aux["filter/coefficients"]}
    if "filter/singular_values" in aux:
        out["filter/singular_values"] = aux["filter/singular_values"]
    return out


class _ModelFields(nn.Module, kw_only=True):
    """The fields the three models share, declared once (keyword-only). Attributes: see `_LRABase`
    / `UEAClassifier`; the models pass them to their blocks as one `BlockConfig`."""
    d_model: int
    mlp_dim: int
    num_heads: int
    head_dim: int
    attention: str = "agf"
    attention_options: Any = ()
    graph_filter: str = "agf"
    basis: str = "jacobi"
    order: int = 3
    alpha: Optional[float] = None
    beta: Optional[float] = None
    dropout_rate: float = 0.1
    attention_dropout: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    remat: bool = False
    # The longest input (a registry attention's length option, `model_attention.registry_attention`);
    # the models declare it as a required field.
    max_len: Optional[int] = None
    sequence_axis: Optional[str] = None


BlockConfig = config_class(_ModelFields, "BlockConfig", """The fields every block and encoder of a model
    shares, built once by the model from its own same-named fields (`BlockConfig.from_module(model,
    **overrides)`) and passed down as `config` (flax wmt's `TransformerConfig` pattern,
    `zoo_core.ops.block_config`; `htgn_jax.blocks.BlockConfig` is HTGN's).

    Attributes: the `_ModelFields` (`_LRABase`, `UEAClassifier`), with head_dim resolved (UEA:
    d_model // num_heads unless given); ortho_weight: LRA's `reg`, applied inside each layer;
    learn_c0, activation: UEA's.
    """, extra=(("ortho_weight", float, 0.0), ("learn_c0", bool, False), ("activation", str, "gelu")))


def _attend(layer: nn.Module, aux: dict, mask, deterministic: bool):
    """A block's attention as a residual branch `h -> y`; its aux goes into `aux`."""
    def branch(h):
        y, layer_aux = call_attention(layer, h, mask=mask, deterministic=deterministic)
        aux.update(layer_aux)
        return y
    return branch


# ---------------------------------------------------------------------------------------------
# LRA (pre-LN encoder, agf.md §3.1).
# ---------------------------------------------------------------------------------------------


class LRABlock(nn.Module):
    """Pre-LN block: x += Drop(Attn(LN(x))); x += Drop(W2 Drop(GELU(W1 LN(x)))). x `[B, T, E]`.

    Attributes:
        config: the model's `BlockConfig`.
    """
    config: BlockConfig

    def setup(self):
        c = self.config
        self.attention_norm = _layer_norm(c, "attention_norm")
        # LRA: c_0 is always frozen (the reference ignores fixI); `reg` is applied inside the layer.
        self.attention_layer = _attention(self, c, ortho_scale=c.ortho_weight, learn_c0=False,
                                          name="attention")
        self.mlp_norm = _layer_norm(c, "mlp_norm")
        self.mlp_in = _dense(c.mlp_dim, c.d_model, c, "mlp_in")
        self.mlp_out = _dense(c.d_model, c.mlp_dim, c, "mlp_out")
        self.dropout = _dropout(c)

    def __call__(self, x, *, mask=None, deterministic: bool = True):
        """x `[B, T, E]`, mask `[B, T]` -> (y `[B, T, E]`, the attention layer's aux)."""
        drop = functools.partial(self.dropout, deterministic=deterministic)
        aux = {}
        x = residual(x, _attend(self.attention_layer, aux, mask, deterministic),
                     norm=self.attention_norm, drop=drop)
        mlp = lambda h: feed_forward(h, self.mlp_in, self.mlp_out, xla_forms.gelu, drop)  # noqa: E731
        return residual(x, mlp, norm=self.mlp_norm, drop=drop), aux


class LRAEncoder(nn.Module):
    """Token + position embeddings, `num_layers` pre-LN blocks, final LN times the mask.

    Attributes:
        config: the model's `BlockConfig` (its max_len: rows of the position table).
        vocab_size: V (token 0 is padding).
        num_layers: L.
    """
    config: BlockConfig
    vocab_size: int
    num_layers: int

    def setup(self):
        c = self.config
        emb_init = nn.initializers.normal(stddev=0.02)
        self.token_embed = _embed(c, self.vocab_size, emb_init)
        self.pos_embed = _embed(c, c.max_len, emb_init)
        self.blocks = [LRABlock(c, name=f"block_{i:02d}") for i in range(self.num_layers)]
        self.final_norm = _layer_norm(c, "final_norm")
        self.dropout = _dropout(c)

    def __call__(self, ids: Array, mask: Array, *, deterministic: bool = True):
        """ids `[B, T]` int, mask `[B, T]` 0/1 -> (x `[B, T, E]`, aux merged over the blocks)."""
        t = ids.shape[1]
        # x + table[None], with a backward XLA's CPU backend runs fast (zoo_core/ops/xla_forms.py).
        add = ((lambda x, table: x + table[None]) if xla_forms.is_plain("add_to_each")
               else xla_forms.add_to_each)
        c = self.config
        x = add(self.token_embed(ids), self.pos_embed.embedding[:t].astype(c.dtype or c.param_dtype))
        x = self.dropout(x, deterministic=deterministic)
        self.sow("intermediates", "hidden_states", x)
        auxes = []
        for block in self.blocks:
            x, aux = call_block(block, x, mask=mask, deterministic=deterministic, remat=c.remat)
            self.sow("intermediates", "hidden_states", x)
            auxes.append(aux)
        x = self.final_norm(x) * mask[:, :, None].astype(x.dtype)
        self.sow("intermediates", "token_out", x)
        return x, stack_aux(auxes)


class _LRABase(_ModelFields, kw_only=True):
    """Fields shared by the LRA classifier and the retrieval model.

    Attributes:
        num_classes: K.
        vocab_size: V (token 0 is padding).
        max_len: rows of the position table (the reference rounds max_seq_len up to a power of 2;
            configs pass the rounded value). Inputs may be shorter.
        d_model: E (`transformer_dim` = `embedding_dim`).
        mlp_dim: block MLP width (`transformer_hidden_dim`), also the head's hidden width.
        num_heads: H (`num_head`).
        head_dim: D (`head_dim`).
        num_layers: L.
        attention: a name of `attentions()` (`zoo_core.attention.names('self')`): 'agf', 'softmax'
            (the vanilla Transformer), or another registry mechanism (its defaults and inits).
        attention_options: that other mechanism's own fields, a mapping (e.g. {'num_features':
            64} for 'favor'); empty for 'agf' and 'softmax', whose options are fields here.
        graph_filter: 'agf' | 'uvt' | 'svd' (`AGFAttention`; the paper's Table 6).
        basis, order, alpha, beta: the AGF filter (`poly_type`, `K`, `alpha`, `beta`).
        ortho_weight: gamma = `reg`, applied inside each layer as in the reference.
        dropout_rate: `dropout_prob` (embeddings, attention output, MLP).
        attention_dropout: softmax attention only (other mechanisms: `attention_options`).
        pooling: 'mean' (the reference's MEAN: over all T positions) or 'cls' (the reference's CLS:
            a token vocab_size-1 is prepended and the last input token dropped, pooling position 0).
        dtype, param_dtype: compute and parameter dtypes.
        remat: recompute each block's forward pass in the backward pass (`zoo_core.ops.remat`).
        sequence_axis: the mesh axis T is split over (context parallelism; None: one device):
            every block's attention runs its context-parallel form (`names('context_parallel')`;
            another attention is refused), called under `jax.set_mesh(mesh)` with T divisible by
            the axis size; the pooling and the head are jit's global view, so the numbers are one
            device's (tested). `parallel.sequence > 1` sets it.
    """
    num_classes: int
    vocab_size: int
    max_len: int
    num_layers: int
    ortho_weight: float = 0.0
    pooling: str = "mean"

    def _setup_encoder(self):
        self.encoder = LRAEncoder(BlockConfig.from_module(self), self.vocab_size, self.num_layers)
        self.head_hidden = _dense(self.mlp_dim, self.head_inputs * self.d_model, self, "head_hidden")
        self.head_out = _dense(self.num_classes, self.mlp_dim, self, "head_out")

    def _ids(self, batch: dict, key: str) -> Array:
        validation.check_lra_batch(batch, key, self.max_len)
        return jnp.asarray(batch[key])

    def _encode(self, ids: Array, deterministic: bool):
        ids, mask = lra_encoder_tokens(ids, pooling=self.pooling, vocab_size=self.vocab_size)
        x, aux = self.encoder(ids, mask, deterministic=deterministic)
        pooled = x[:, 0] if self.pooling == "cls" else jnp.mean(x, axis=1)
        return pooled, aux

    def _head(self, z: Array) -> Array:
        return self.head_out(nn.relu(self.head_hidden(z))).astype(jnp.float32)


def lra_encoder_tokens(ids: Array, *, pooling: str, vocab_size: int) -> tuple[Array, Array]:
    """The token ids `[B, T]` and float mask `[B, T]` (1 = token) that the LRA encoder sees.

    With pooling='cls' the reference prepends a CLS token (id vocab_size - 1) and drops the last
    input token, so position t holds input token t - 1; with 'mean' the ids are unchanged.
    """
    mask = (ids != 0).astype(jnp.float32)
    if pooling == "cls":
        ids = jnp.concatenate([jnp.full_like(ids[:, :1], vocab_size - 1), ids[:, :-1]], 1)
        mask = jnp.concatenate([jnp.ones_like(mask[:, :1]), mask[:, :-1]], 1)
    return ids, mask


class LRAClassifier(_LRABase, kw_only=True):
    """AGF_LRA `ModelForSC`: encoder, pooling, Linear-ReLU-Linear head.

    Batch: 'inputs' int `[B, T]` (0 = padding; mask = inputs != 0). Other keys are ignored (labels
    belong to the loss). Returns ({'logits': `[B, K]`}, aux) as in the module docstring.
    """

    head_inputs = 1   # the head reads the pooled vector

    def setup(self):
        self._setup_encoder()

    def __call__(self, batch: dict, *, train: bool = False):
        pooled, aux = self._encode(self._ids(batch, "inputs"), not train)
        return {"logits": self._head(pooled)}, _aux(aux, 1.0)


class LRARetrieval(_LRABase, kw_only=True):
    """AGF_LRA `ModelForSCDual`: a shared encoder on two documents, head on [x0, x1, x0*x1, x0-x1].

    Batch: 'inputs1', 'inputs2' int `[B, T]` (0 = padding). The per-layer regulariser is the mean of
    the two towers, then the mean over layers (agf.md §2.5).
    """

    head_inputs = 4   # the head reads [x0, x1, x0*x1, x0-x1]

    def setup(self):
        self._setup_encoder()

    def __call__(self, batch: dict, *, train: bool = False):
        x0, a0 = self._encode(self._ids(batch, "inputs1"), not train)
        x1, a1 = self._encode(self._ids(batch, "inputs2"), not train)
        z = jnp.concatenate([x0, x1, x0 * x1, x0 - x1], axis=-1)
        aux = {k: 0.5 * (a0[k] + a1[k]) if not k.startswith("filter/") else a0[k] for k in a0}
        return {"logits": self._head(z)}, _aux(aux, 1.0)


# ---------------------------------------------------------------------------------------------
# UEA (post-LN encoder, agf.md §3.2).
# ---------------------------------------------------------------------------------------------


class UEABlock(nn.Module):
    """Post-LN block: x = LN1(x + Drop(Attn(x))); x = LN2(x + Drop(W2 Drop(act(W1 x)))).

    The 1x1 Conv1d layers of the reference are position-wise Dense layers. x `[B, T, E]`.

    Attributes:
        config: the model's `BlockConfig`.
    """
    config: BlockConfig

    def setup(self):
        c = self.config
        # UEA: the layer's regulariser is unweighted; eta is applied by the model (agf.md §6).
        self.attention_layer = _attention(self, c, ortho_scale=1.0, learn_c0=c.learn_c0,
                                          name="attention")
        self.attention_norm = _layer_norm(c, "attention_norm")
        self.ffn_in = _dense(c.mlp_dim, c.d_model, c, "ffn_in")
        self.ffn_out = _dense(c.d_model, c.mlp_dim, c, "ffn_out")
        self.ffn_norm = _layer_norm(c, "ffn_norm")
        self.dropout = _dropout(c)

    def __call__(self, x, *, mask=None, deterministic: bool = True):
        """x `[B, T, E]` -> (y `[B, T, E]`, the attention layer's aux). The UEA model passes no mask:
        the reference UEA attention is never masked, padding is zero input (agf.md §2.2)."""
        drop = functools.partial(self.dropout, deterministic=deterministic)
        aux = {}
        x = residual(x, _attend(self.attention_layer, aux, mask, deterministic),
                     norm=self.attention_norm, drop=drop, pre=False)
        act = ACTIVATIONS[self.config.activation]
        ffn = lambda h: feed_forward(h, self.ffn_in, self.ffn_out, act, drop)  # noqa: E731
        return residual(x, ffn, norm=self.ffn_norm, drop=drop, pre=False), aux


def _uniform(lo: float, hi: float):
    """U(lo, hi) initialiser (the reference's learnable positional table uses U(-0.02, 0.02))."""
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, lo, hi)
    return init


class UEAClassifier(_ModelFields, kw_only=True):
    """AGF_UEA `AGFClassiregressor` (classification).

    Batch: 'inputs' float `[B, T, C]` with T == max_len (zero beyond each length), optional 'mask'
    bool `[B, T]` (True = real step; default all True). The attention is not masked (reference);
    only the encoder output is, before the flatten head.

    Attributes:
        num_classes: K.
        feat_dim: C, input channels.
        max_len: T; the flatten head has max_len * d_model inputs.
        d_model: E.
        mlp_dim: d_ff of the 1x1-conv feed-forward.
        num_heads: H.
        head_dim: D (None: d_model // num_heads, as the reference).
        num_layers: L.
        attention, attention_options: as in `LRAClassifier`.
        graph_filter: 'agf' | 'uvt' | 'svd' (`AGFAttention`; the paper's Table 6).
        basis, order, alpha, beta: the AGF filter.
        learn_c0: True = reference without `--fixI` (c_0 = tanh(theta_0), filter 0 at init).
        ortho_weight: gamma = `eta`, applied to the layer-mean regulariser.
        dropout_rate: `dropout` (positional encoding, blocks, before the head).
        attention_dropout: softmax attention only.
        activation: 'gelu' | 'relu' (blocks and the output activation).
        pos_encoding: 'learnable' (U(-0.02, 0.02) table) | 'fixed' (sinusoidal, not trained).
        dtype, param_dtype: compute and parameter dtypes.
        remat: recompute each block's forward pass in the backward pass (`zoo_core.ops.remat`).
        sequence_axis: as in `LRAClassifier` (max_len divisible by the axis size).
    """
    num_classes: int
    feat_dim: int
    max_len: int
    num_layers: int
    head_dim: Optional[int] = None
    learn_c0: bool = False
    ortho_weight: float = 0.1
    activation: str = "gelu"
    pos_encoding: str = "learnable"

    def setup(self):
        if self.head_dim is None:
            # The reference would silently use d_model // num_heads per head (a narrower layer);
            # pass head_dim explicitly for a different width.
            checks.check_divisible("d_model", self.d_model, "num_heads", self.num_heads)
        head_dim = self.d_model // self.num_heads if self.head_dim is None else self.head_dim
        self.input_proj = _dense(self.d_model, self.feat_dim, self, "input_proj")
        if self.pos_encoding == "learnable":
            self.pos_embed = self.param("pos_embed", _uniform(-0.02, 0.02),
                                        (self.max_len, self.d_model), self.param_dtype)
        config = BlockConfig.from_module(self, head_dim=head_dim)
        self.blocks = [UEABlock(config, name=f"block_{i:02d}") for i in range(self.num_layers)]
        self.final_norm = _layer_norm(self, "final_norm")
        self.output = _dense(self.num_classes, self.max_len * self.d_model, self, "output")
        self.dropout = _dropout(self)

    def __call__(self, batch: dict, *, train: bool = False):
        validation.check_uea_batch(batch, self.max_len, self.feat_dim)
        x = jnp.asarray(batch["inputs"])
        mask = batch.get("mask")
        mask = jnp.ones(x.shape[:2], bool) if mask is None else jnp.asarray(mask)
        det = not train
        h = self.input_proj(x) * math.sqrt(self.d_model)
        if self.pos_encoding == "learnable":
            pe = self.pos_embed
        else:
            pe = jnp.asarray(sinusoidal_table(self.max_len, self.d_model))
        h = self.dropout(h + pe.astype(h.dtype)[None], deterministic=det)
        self.sow("intermediates", "hidden_states", h)
        auxes = []
        for block in self.blocks:
            h, aux = call_block(block, h, deterministic=det, remat=self.remat)
            self.sow("intermediates", "hidden_states", h)
            auxes.append(aux)
        h = self.final_norm(h)
        self.sow("intermediates", "token_out", h)
        h = self.dropout(ACTIVATIONS[self.activation](h), deterministic=det)
        h = h * mask[:, :, None].astype(h.dtype)
        logits = self.output(h.reshape(h.shape[0], -1)).astype(jnp.float32)
        return {"logits": logits}, _aux(stack_aux(auxes), self.ortho_weight)


# ---------------------------------------------------------------------------------------------
# Factory.
# ---------------------------------------------------------------------------------------------

KINDS: dict[str, type] = {
    "lra_classifier": LRAClassifier,
    "lra_retrieval": LRARetrieval,
    "uea_classifier": UEAClassifier,
}


def model_kwargs(kind: str) -> tuple[str, ...]:
    """The constructor kwargs accepted by `Model(kind=kind, ...)` besides `kind` and `variant`."""
    checks.check_choice("kind", kind, KINDS)
    return tuple(f.name for f in dataclasses.fields(KINDS[kind])
                 if f.name not in ("parent", "name"))


def _check_options(kind: str, args: dict) -> None:
    """Validates the model options once, at the factory (the classes trust their fields)."""
    field = {f.name: f.default for f in dataclasses.fields(KINDS[kind])}
    get = lambda k: args.get(k, field[k])   # noqa: E731
    for name in ("d_model", "mlp_dim", "num_heads", "num_layers", "num_classes", "max_len"):
        checks.check_int(name, get(name), 1)
    checks.check_nonnegative("ortho_weight", get("ortho_weight"))
    checks.check_optional_int("head_dim", get("head_dim"))
    checks.check_rate("dropout_rate", get("dropout_rate"))
    check_attention_options(args, get)
    if kind == "uea_classifier":
        checks.check_choice("activation", get("activation"), ACTIVATIONS)
        checks.check_choice("pos_encoding", get("pos_encoding"), ("learnable", "fixed"))
    else:
        checks.check_choice("pooling", get("pooling"), ("mean", "cls"))


def Model(*, kind: str, variant: Optional[str] = None, **kwargs) -> nn.Module:  # noqa: N802
    """Builds a model from `config.model` (the only place that reads config values).

    Args:
        kind: 'lra_classifier' | 'lra_retrieval' | 'uea_classifier'.
        variant: a key of `VARIANTS` giving d_model, mlp_dim, num_heads, head_dim, num_layers;
            explicit kwargs override it. Without a variant those sizes must be given. For
            kind='uea_classifier' the variant's head_dim is not used: unless passed explicitly,
            head_dim = d_model // num_heads as in the reference.
        **kwargs: the fields of the selected class (see `model_kwargs(kind)` and the class
            docstrings); None leaves a field unset and dtypes may be named (`checks.constructor_kwargs`).

    Returns:
        An unbound Linen module; `apply(variables, batch, train=...)` -> ({'logits'}, aux).

    Raises:
        ValueError: unknown kind/variant/kwarg, a missing or invalid option, or an AGF-only kwarg
            with attention='softmax'.
    """
    kwargs = checks.constructor_kwargs(kwargs)
    allowed = model_kwargs(kind)
    if variant is not None:
        checks.check_choice("variant", variant, VARIANTS)
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        checks.fail(f"unknown Model kwargs for kind={kind!r}: {unknown}; allowed: {allowed}")
    args = dict(VARIANTS[variant]) if variant is not None else {}
    if kind == "uea_classifier" and "head_dim" not in kwargs:
        # The UEA reference ties the head width to d_model // n_heads; derive it (head_dim=None)
        # so that overriding d_model or num_heads alone stays consistent.
        args.pop("head_dim", None)
    args.update(kwargs)
    missing = [f.name for f in dataclasses.fields(KINDS[kind])
               if f.name not in ("parent", "name") and f.default is dataclasses.MISSING
               and f.name not in args]
    if missing:
        checks.fail(f"Model(kind={kind!r}) is missing required kwargs {missing}")
    if "attention_options" in args:
        args["attention_options"] = options_tuple(args["attention_options"])
    _check_options(kind, args)
    return KINDS[kind](**args)


# The names of 0.1.0 that were renamed warn and give the new function (zoo_core.moved.RENAMED).
__getattr__ = moved.renamed_getattr(__name__)
