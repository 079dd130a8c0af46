"""The checks of HTGN: the `Model(...)` boundary (kwargs, batches, the `step` argument) and the
layers' field consistency and method preconditions.

Validation happens once, here: `htgn_jax.model.Model` and the models' public methods call the
model checks; each layer calls its field check once from setup() (`check_favor_fields`,
`check_window_graph_fields`, `check_cross_graph_fields`) and its method checks at the entry
points, and keeps only structural one-liners (ranks, mask shapes) itself. Every error is the zoo's
`ValueError` with one line naming the argument (`zoo_core.checks`).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from htgn_jax import graph_ops, hrpe, ops
from zoo_core.checks import (
    check_choice,
    check_chunk_size,
    check_divisible,
    check_int,
    check_nonnegative,
    check_optional_int,
    check_rate,
    fail,
)
from zoo_core.ops.shard_padding import padded_length

ATTENTIONS = ("favor", "softmax")   # HTGN's own: every stack (encoder, causal decoder, cross)


def encoder_attentions() -> tuple[str, ...]:
    """The names `attention` accepts: 'favor', 'softmax' and every other self-attention of the
    zoo's registry (`zoo_core.attention.names('self')`) that has a non-causal contract layer
    (`zoo_core.attention.layer`), e.g. 'agf', 'window_graph' (and 'reformer', 'longformer' once
    registered). Those drive the encoder only; a seq2seq decoder then uses exact softmax."""
    from zoo_core import attention  # the registry imports the architecture packages lazily
    out = list(ATTENTIONS)
    for name in attention.names("self"):
        if name in out:
            continue
        try:
            attention.layer(name, num_heads=1, qkv_features=2)
        except ValueError:            # no non-causal contract layer (e.g. 'linear': causal only)
            continue
        out.append(name)
    return tuple(out)


def check_attention(name) -> None:
    """`attention` is one of `encoder_attentions()`, else one line naming the choices."""
    if name in ATTENTIONS:
        return
    allowed = encoder_attentions()
    if name not in allowed:
        fail(f"`attention` must be one of {allowed} (favor / softmax anywhere; the other registry "
             f"self-attentions with a non-causal layer for the encoder), got {name!r}")
FEATURE_MAPS = ops.FEATURE_MAPS
GAT_VERSIONS = graph_ops.VERSIONS
NORMS = ("pre", "post")
POOLS = ("cls", "mean")
CROSS_GRAPH_LAYERS = ("all", "last")
PE_BASES = hrpe.BASES

# Fields that only the graph layers / HRPE read: given explicitly while that part is switched off
# they would be ignored, so the factory refuses them.
GRAPH_ONLY_KWARGS = ("window", "cross_window", "rho", "cross_graph_layers", "gat_version",
                     "kl_tau", "kl_mode", "graph_activation", "skip_offsets", "graph_alpha")
HRPE_ONLY_KWARGS = ("num_pe", "pe_basis")


def _kl_options_set(a: dict) -> list[str]:
    """The KL alternatives (htgn.md §5.7) set away from the plain uniform prior."""
    return [name for name, default in (("kl_tau", None), ("kl_mode", "prior"))
            if a.get(name, default) != default]


def check_common(a: dict) -> None:
    """Checks of the fields every HTGN model has (`a`: the resolved constructor kwargs)."""
    check_attention(a["attention"])
    check_choice("feature_map", a["feature_map"], FEATURE_MAPS)
    check_choice("gat_version", a["gat_version"], GAT_VERSIONS)
    check_choice("norm", a["norm"], NORMS)
    for name in ("d_model", "num_heads", "mlp_dim", "num_layers"):
        check_int(name, a[name], 1)
    check_int("window", a["window"], 0)
    check_int("num_global", a["num_global"], 0)
    graph_ops.check_skip_offsets(a["skip_offsets"], a["window"])
    check_divisible("d_model", a["d_model"], "num_heads", a["num_heads"])
    if a["use_hrpe"] and (a["d_model"] // a["num_heads"]) % 2:
        fail(f"use_hrpe=True rotates channel pairs, so d_model / num_heads must be even, got "
             f"{a['d_model'] // a['num_heads']}")
    if a["attention"] == "favor" and a["feature_map"] in ops.RANDOM_FEATURE_MAPS:
        check_int("num_features", a["num_features"], 1)
    if a["qk_rank"] is not None:
        check_int("qk_rank", a["qk_rank"], 1)
        head = a["d_model"] // a["num_heads"]
        if a["qk_rank"] > head:
            fail(f"qk_rank={a['qk_rank']} must be <= the head width d_model / num_heads = {head} "
                 f"(a low-rank query/key projection)")
        if a["use_hrpe"] and a["qk_rank"] % 2:
            fail(f"use_hrpe=True rotates query/key channel pairs, so qk_rank must be even, got "
                 f"{a['qk_rank']}")
    if a["attention"] != "favor" and a["feature_map"] != "softmax":
        fail(f"feature_map applies to attention='favor' only, got feature_map={a['feature_map']!r} "
             f"with attention={a['attention']!r}")
    if a["attention"] not in ATTENTIONS and a["qk_rank"] is not None:
        fail(f"qk_rank applies to attention 'favor' or 'softmax' (the HTGN attention layers), got "
             f"attention={a['attention']!r}")
    check_choice("graph_activation", a["graph_activation"], graph_ops.ACTIVATIONS)
    check_choice("graph_alpha", a["graph_alpha"], graph_ops.ALPHAS)
    if a["graph_alpha"] == "attention" and (a["attention"] != "favor" or a["feature_map"] == "exact"):
        fail(f"graph_alpha='attention' reads the FAVOR+ kernel features, so it needs "
             f"attention='favor' and a kernel feature_map, got attention={a['attention']!r}, "
             f"feature_map={a['feature_map']!r}")
    if a["graph_alpha"] == "attention" and a["gat_version"] != "v2":
        fail(f"gat_version shapes the learned GAT scores; graph_alpha='attention' has none, got "
             f"gat_version={a['gat_version']!r}")
    for name in ("dropout_rate", "attention_dropout", "drop_path", "drop_path_start"):
        check_rate(name, a[name])
    graph_ops.check_kl(a["kl_tau"], a["kl_mode"])
    if _kl_options_set(a) and not a["use_graph_conv"]:
        fail(f"{_kl_options_set(a)[0]} shapes the KL term of the graph layers, but "
             f"use_graph_conv=False")
    if _kl_options_set(a) and not a["kl_weight"]:
        fail(f"{_kl_options_set(a)[0]} shapes the KL term, but kl_weight={a['kl_weight']!r} turns "
             f"it off")
    if a["attention_dropout"] and not a["use_graph_conv"]:
        fail("attention_dropout acts on the graph-attention probabilities (htgn.md §5.6), but "
             "use_graph_conv=False")
    check_int("redraw_every", a["redraw_every"], 0)
    if a["redraw_every"] and (a["attention"] != "favor"
                              or a["feature_map"] not in ops.RANDOM_FEATURE_MAPS):
        fail(f"redraw_every redraws the FAVOR+ random features, so it needs attention='favor' and "
             f"feature_map 'softmax' or 'trig', got attention={a['attention']!r}, "
             f"feature_map={a['feature_map']!r}")
    check_nonnegative("kl_weight", a["kl_weight"])
    if a["use_hrpe"]:
        check_int("num_pe", a["num_pe"], 1)


def check_sequence_axis(a: dict, kind: str) -> None:
    """A model's `sequence_axis`: None, or a mesh axis name with layers that all have a context-parallel
    form: FAVOR+ with a kernel feature map (the graph and Cross-Graph layers have one), or, in the
    classifier, a registry encoder attention of `names('context_parallel')`. The seq2seq baselines'
    exact softmax decoder has none."""
    from zoo_core import attention as zoo_attention  # the registry imports this package's layers

    axis, name = a["sequence_axis"], a["attention"]
    if axis is None:
        return
    if not isinstance(axis, str):
        fail(f"`sequence_axis` must be a mesh axis name or None, got {axis!r}")
    if name == "favor" and a["feature_map"] != "exact":
        return
    if kind == "classifier" and name not in ATTENTIONS and zoo_attention.capabilities(name)["context_parallel"]:
        return
    what = (f"feature_map={a['feature_map']!r} (the quadratic oracle)" if name == "favor"
            else f"attention={name!r}" + (" (its decoder is exact softmax)" if kind == "seq2seq" else ""))
    fail(f"sequence_axis={axis!r}: {what} has no context-parallel form; use attention='favor' with a "
         f"kernel feature_map" + ("" if kind == "seq2seq" else
                                  f", or one of {list(zoo_attention.names('context_parallel'))}"))


def check_seq2seq(a: dict) -> None:
    """Checks of `Seq2Seq`'s own fields."""
    check_sequence_axis(a, "seq2seq")
    for name in ("source_vocab_size", "target_vocab_size", "max_source_len", "max_target_len",
                 "chunk_size"):
        check_int(name, a[name], 1)
    check_optional_int("num_encoder_layers", a["num_encoder_layers"])
    check_optional_int("num_decoder_layers", a["num_decoder_layers"])
    check_int("cross_window", a["cross_window"], 0)
    graph_ops.check_skip_offsets(a["skip_offsets"], a["cross_window"], "cross_window")
    check_choice("cross_graph_layers", a["cross_graph_layers"], CROSS_GRAPH_LAYERS)
    check_choice("pe_basis", a["pe_basis"], PE_BASES)
    check_nonnegative("rho", a["rho"])
    if a["share_embeddings"] and a["source_vocab_size"] != a["target_vocab_size"]:
        fail(f"share_embeddings=True needs equal vocab sizes, got source_vocab_size="
             f"{a['source_vocab_size']} and target_vocab_size={a['target_vocab_size']}")
    ids = {name: a[name] for name in ("pad_id", "bos_id", "eos_id")}
    for name, value in ids.items():
        check_int(name, value, 0)
        if value >= a["target_vocab_size"]:
            fail(f"{name}={value} is outside the target vocabulary ({a['target_vocab_size']})")
    if len(set(ids.values())) != 3:
        fail(f"pad_id, bos_id and eos_id must differ, got {ids}")


def check_classifier(a: dict) -> None:
    """Checks of `Classifier`'s own fields."""
    check_sequence_axis(a, "classifier")
    for name in ("num_classes", "image_size", "patch_size", "channels"):
        check_int(name, a[name], 1)
    if a["image_size"] % a["patch_size"]:
        fail(f"image_size ({a['image_size']}) must be divisible by patch_size ({a['patch_size']})")
    check_choice("pool", a["pool"], POOLS)
    if a["pool"] == "cls" and not a["num_global"]:
        fail("pool='cls' reads global token 0, so num_global must be >= 1 (or use pool='mean')")
    cells = (a["image_size"] // a["patch_size"]) ** 2
    if a["use_hrpe"] and a["num_pe"] > cells - 1:
        fail(f"num_pe must be <= (image_size / patch_size)^2 - 1 = {cells - 1}, got {a['num_pe']}")


def check_switched_off(given: dict, a: dict) -> None:
    """Refuses explicitly given kwargs of a part that is switched off (they would be ignored)."""
    if not a.get("use_graph_conv", True):
        unused = [k for k in GRAPH_ONLY_KWARGS if k in given]
        unused += ["kl_weight"] if given.get("kl_weight") else []
        if unused:
            fail(f"{unused} apply to the graph layers, but use_graph_conv=False")
    if not a.get("use_hrpe", True):
        unused = [k for k in HRPE_ONLY_KWARGS if k in given]
        if unused:
            fail(f"{unused} apply to HRPE, but use_hrpe=False")
    if a.get("attention", "favor") != "favor" and "chunk_size" in given:
        fail("chunk_size applies to attention='favor' (the chunked causal FAVOR+ form) only")
    if given.get("num_features") is not None and (
            a.get("attention", "favor") != "favor"
            or a.get("feature_map", "softmax") not in ops.RANDOM_FEATURE_MAPS):
        fail("num_features applies to attention='favor' with feature_map='softmax' or 'trig' only")


def check_feature_step(m, feature_step: Any) -> None:
    """`feature_step` is required with redraw_every > 0 (it selects the random features), else refused."""
    if m.redraw_every and feature_step is None:
        fail(f"redraw_every={m.redraw_every} makes the random features depend on the training "
             f"step: pass feature_step= (the index of the last training update, "
             f"trainer.eval_feature_step(steps_done))")
    if not m.redraw_every and feature_step is not None:
        fail("feature_step selects the redrawn FAVOR+ features, but redraw_every=0 (one fixed draw): "
             "do not pass feature_step")


def int_array(name: str, x: Any, rank: int, doc: str):
    """`x` as an integer array of `rank` (named batch[name] in the error)."""
    x = jnp.asarray(x)
    if x.ndim != rank:
        fail(f"batch[{name!r}] must have rank {rank} {doc}, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        fail(f"batch[{name!r}] must hold integer ids, got dtype {x.dtype}")
    return x


def seq2seq_batch(m, batch: dict):
    """(inputs [B, S], mask [B, S], targets [B, T]) of a checked seq2seq batch."""
    if "inputs" not in batch or "targets" not in batch:
        fail(f"batch must contain 'inputs' [B, S] and 'targets' [B, T] ids, got keys "
             f"{sorted(batch)}")
    inputs, mask = source(m, batch["inputs"], batch.get("inputs_mask"))
    targets = int_array("targets", batch["targets"], 2, "[B, T]")
    if targets.shape[0] != inputs.shape[0]:
        fail(f"batch['targets'] has batch size {targets.shape[0]} but batch['inputs'] has "
             f"{inputs.shape[0]}")
    target_length(m, targets.shape[1], "batch['targets']")
    return inputs, mask, targets


def source(m, inputs: Any, inputs_mask: Any):
    """(inputs, mask) of a checked source batch (mask default inputs != pad_id)."""
    inputs = int_array("inputs", inputs, 2, "[B, S]")
    if inputs.shape[1] > _longest(m, m.max_source_len):
        fail(f"batch['inputs'] has length {inputs.shape[1]} > max_source_len={m.max_source_len}"
             f"{_padding_note(m, m.max_source_len)}")
    if inputs_mask is None:
        return inputs, inputs != m.pad_id
    inputs_mask = jnp.asarray(inputs_mask)
    if inputs_mask.shape != inputs.shape:
        fail(f"batch['inputs_mask'] must have the shape of batch['inputs'] [B, S] = "
             f"{tuple(inputs.shape)}, got {tuple(inputs_mask.shape)}")
    return inputs, inputs_mask.astype(bool)


def target_length(m, length: int, what: str) -> None:
    if length > _longest(m, m.max_target_len):
        fail(f"{what} has length {length} > max_target_len={m.max_target_len} (the decoder "
             f"position encodings cover max_target_len positions){_padding_note(m, m.max_target_len)}")


def _longest(m, max_len: int) -> int:
    """The longest sequence a model takes: max_len, or with `sequence_axis` max_len rounded up to a
    multiple of the shards (the positions past max_len are the trainer's padding, `sharding.pad_sequences`)."""
    return padded_length(max_len, m.sequence_axis)


def _padding_note(m, max_len: int) -> str:
    longest = _longest(m, max_len)
    return "" if longest == max_len else f" (or {longest} with padding, over sequence_axis={m.sequence_axis!r})"


def image(m, batch: dict):
    """The checked image `[B, H, W, C]` of a classifier batch ('image' or 'inputs')."""
    key = "image" if "image" in batch else "inputs"
    if key not in batch:
        fail(f"batch must contain 'image' (or 'inputs') [B, H, W, C], got keys {sorted(batch)}")
    x = jnp.asarray(batch[key])
    want = (m.image_size, m.image_size, m.channels)
    if x.ndim != 4 or tuple(x.shape[1:]) != want:
        fail(f"batch[{key!r}] must have shape [B, {want[0]}, {want[1]}, {want[2]}] "
             f"(image_size, image_size, channels), got {tuple(x.shape)}")
    return x


# --- layers (`htgn_jax.layers`, `htgn_jax.graph_layers`) ---------------------------------------

def check_favor_fields(m) -> None:
    """Field consistency of a `FavorAttention` `m` (called once from its setup)."""
    check_choice("feature_map", m.feature_map, ops.FEATURE_MAPS)
    if m.qk_rank is not None:
        check_int("qk_rank", m.qk_rank, 1)
    qk = m.head_dim if m.qk_rank is None else m.qk_rank
    if m.use_rotary and qk % 2:
        fail(f"`{'head_dim' if m.qk_rank is None else 'qk_rank'}` must be even with "
             f"use_rotary=True (RoPE rotates channel pairs), got {qk}")
    check_chunk_size(m.chunk_size, m.causal)
    if m.feature_map not in ops.RANDOM_FEATURE_MAPS and (m.num_features is not None
                                                         or m.redraw_every):
        fail(f"`num_features` and `redraw_every` apply to the random feature maps "
             f"{ops.RANDOM_FEATURE_MAPS} only, got {m.feature_map!r}")


def check_favor_method(m, method: str, *, causal: bool, state: bool = True) -> None:
    """`method` of `FavorAttention` `m` exists: causal ones need causal=True, cross ones
    causal=False and no RoPE; those with a constant-size state (`state`) need a kernel
    feature map."""
    if causal != m.causal or (not causal and m.use_rotary) or (
            state and m.feature_map == "exact"):
        fail(f"`{method}` needs causal={causal}" + ("" if causal else ", use_rotary=False")
             + (", a kernel feature_map (exact softmax has no constant-size state)"
                if state else "") + f"; got causal={m.causal}, "
             f"use_rotary={m.use_rotary}, feature_map={m.feature_map!r}")


def check_graph_fields(m) -> None:
    """Fields common to `WindowGraphAttention` and `CrossGraphAttention` `m`."""
    check_int("num_heads", m.num_heads, 1)
    check_int("window", m.window, 0)
    check_choice("version", m.version, graph_ops.VERSIONS)
    check_rate("dropout_rate", m.dropout_rate)
    graph_ops.check_skip_offsets(m.skip_offsets, m.window)
    check_choice("activation", m.activation, graph_ops.ACTIVATIONS)
    check_choice("alpha", m.alpha, graph_ops.ALPHAS)
    if m.alpha == "attention" and (m.version != "v2" or m.negative_slope is not None
                                   or m.attn_init is not None):
        fail("`version`, `negative_slope` and `attn_init` shape learned GAT scores; "
             "alpha='attention' takes its scores from the attention layer's features")
    if m.version == "dot" and m.attn_init is not None:
        fail("`attn_init` initialises the GAT attention vectors; version='dot' has none")


def check_window_graph_fields(m) -> None:
    """Field consistency of a `WindowGraphAttention` `m` (called once from its setup)."""
    check_graph_fields(m)
    if m.causal and m.num_global:
        fail(f"`num_global` must be 0 when causal=True (a global node would summarise the "
             f"future), got {m.num_global}")
    check_chunk_size(m.chunk_size, m.causal)


def check_window_state(m, state: Any, batch: int, head_dims: tuple[int, int]) -> None:
    """`state` is a `WindowState` of causal `WindowGraphAttention` `m` for `batch` sequences
    (C, D = `head_dims`): value `[B, w, H, D]`, key `[B, w, H, C]` for GAT v1 only, valid `[B, w]`."""
    c, d = head_dims
    keyed = m.version == "v1" or m.alpha == "attention"
    want = {"value": (batch, m.span, m.num_heads, d), "valid": (batch, m.span),
            "key": (batch, m.span, m.num_heads, c) if keyed else None}
    for name, shape in want.items():
        got = getattr(state, name, None)
        if (None if got is None else tuple(jnp.shape(got))) != shape:
            fail(f"`state.{name}` must have shape {shape} (a WindowState of this layer for "
                 f"{batch} sequences), got {None if got is None else tuple(jnp.shape(got))}")


def check_window_graph_method(m, method: str) -> None:
    """`method` (the recurrent forms) of `WindowGraphAttention` `m` exists: needs causal=True."""
    if not m.causal:
        fail(f"`{method}` needs causal=True (a non-causal window looks ahead)")


def check_cross_graph_fields(m) -> None:
    """Field consistency of a `CrossGraphAttention` `m` (called once from its setup)."""
    check_graph_fields(m)
    graph_ops.check_rho(m.rho)


def check_cross_graph_inputs(m, x: Any, memory: Any, memory_mask: Any) -> None:
    """x `[B, T, d]` fits memory `[B, L, d_m]` (checked mask `[B, L]`) of `CrossGraphAttention`
    `m`: one batch, and one width for GAT v1 (whose single W projects both)."""
    if m.version == "v1" and x.shape[-1] != memory.shape[-1]:
        fail(f"version='v1' projects `x` and `memory` with one W, so their widths must match, "
             f"got {x.shape[-1]} and {memory.shape[-1]}")
    if memory_mask.shape[0] != x.shape[0]:
        fail(f"`memory` batch {memory_mask.shape[0]} != `x` batch {x.shape[0]}")


def check_graph_position(position: Any, batch: int) -> None:
    """A decoding `position` is a scalar or `[B]` (B = `batch`)."""
    if jnp.ndim(position) not in (0, 1) or jnp.shape(position) not in ((), (batch,)):
        fail(f"`position` must be a scalar or have shape [B] = ({batch},), got "
             f"{jnp.shape(position)}")
