"""Reference PyTorch state_dicts (jeongwhanchoi/agf) -> `agf_jax` Flax params; golden checker.

Library:
    `convert_attention(state_dict, layer, naming=None)`  AGF_LRA `attention.py::Attention` or
            AGF_UEA `AGF_Attention.py::AttentionLayer` -> params of `AGFAttention` /
            `SoftmaxAttention`.
    `convert_model(state_dict, model)`  AGF_LRA `ModelForSC` / `ModelForSCDual`, AGF_UEA
            `AGFClassiregressor` -> params of `LRAClassifier` / `LRARetrieval` / `UEAClassifier`.
    `convert(state_dict, module)` dispatches on the module type and returns {'params': ...}.
    `module_from_meta(meta)` builds our module from a golden file's `meta` (reference constructor
            arguments); `check_golden(path)` runs one golden file.

Conventions (tests/testdata/README.md): `nn.Linear.weight` is [out, in] (Flax kernel = W^T, then
reshaped to [E, H, D] / [H, D, E] for the head projections; the reference splits heads as
(B, T, H*D) -> (B, T, H, D)); `Conv1d(k=1).weight` [out, in, 1]; `nn.LayerNorm` weight/bias ->
scale/bias; the polynomial theta's are 0-d arrays `...poly.thetas.{k}`. A frozen c_0 (LRA always,
UEA with fixI) is stored as `thetas.0` = 1.0 and has no Flax parameter. Conversion is strict:
unknown or missing keys and shape mismatches raise a `ValueError` that names them.

CLI: `python -m agf_jax.convert --check FILE.npz [FILE.npz ...]` prints, for every `output/*` of
every file, the max absolute difference and the golden excess
max(|port - golden| - (1e-5 + 1e-5|golden|)), and exits 1 if any excess is > 0 (or a file cannot
be checked).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Mapping, Optional

import numpy as np

from zoo_core.testing import Golden, check_golden_files, golden_excess, golden_parser

# Reference state_dict name roots of the two harnesses.
LRA_ATTENTION_NAMES = dict(query="W_q", key="W_k", value="W_v", sigma="W_Sigma", out="ff",
                           poly="attn.poly.thetas")
UEA_ATTENTION_NAMES = dict(query="query_projection", key="key_projection",
                           value="value_projection", sigma="Sigma_projection",
                           out="out_projection", poly="inner_attention.poly.thetas")


class _StateDict:
    """A state_dict view that records which keys were used, to report unknown keys at the end."""

    def __init__(self, state_dict: Mapping[str, Any]):
        self.arrays = {str(k): np.asarray(v) for k, v in state_dict.items()}
        self.used: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.arrays

    def take(self, key: str, shape: Optional[tuple] = None) -> np.ndarray:
        if key not in self.arrays:
            raise ValueError(f"missing state_dict key {key!r}")
        a = self.arrays[key]
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise ValueError(f"state_dict key {key!r} has shape {a.shape}, expected {tuple(shape)}")
        self.used.add(key)
        return a.astype(np.float32)

    def finish(self) -> None:
        unknown = sorted(set(self.arrays) - self.used)
        if unknown:
            raise ValueError(f"unknown state_dict keys (not used by the conversion): {unknown}")


def _linear(sd: _StateDict, name: str) -> tuple[np.ndarray, np.ndarray]:
    w = sd.take(f"{name}.weight")
    if w.ndim != 2:
        raise ValueError(f"{name}.weight must be [out, in], got shape {w.shape}")
    b = sd.take(f"{name}.bias", (w.shape[0],))
    return w, b


def _dense(sd: _StateDict, name: str) -> dict:
    w, b = _linear(sd, name)
    return {"kernel": w.T, "bias": b}


def _conv1x1(sd: _StateDict, name: str) -> dict:
    w = sd.take(f"{name}.weight")
    if w.ndim != 3 or w.shape[2] != 1:
        raise ValueError(f"{name}.weight must be Conv1d [out, in, 1], got shape {w.shape}")
    b = sd.take(f"{name}.bias", (w.shape[0],))
    return {"kernel": w[:, :, 0].T, "bias": b}


def _layer_norm(sd: _StateDict, name: str) -> dict:
    w = sd.take(f"{name}.weight")
    return {"scale": w, "bias": sd.take(f"{name}.bias", w.shape)}


def _detect_naming(sd: _StateDict, prefix: str) -> str:
    if sd.has(f"{prefix}W_q.weight"):
        return "lra"
    if sd.has(f"{prefix}query_projection.weight"):
        return "uea"
    raise ValueError(f"cannot find an attention layer under prefix {prefix!r} (expected "
                     f"'{prefix}W_q.weight' or '{prefix}query_projection.weight')")


def _attention(sd: _StateDict, layer, prefix: str = "", naming: Optional[str] = None) -> dict:
    from agf_jax.layers import AGFAttention, SoftmaxAttention

    if not isinstance(layer, (AGFAttention, SoftmaxAttention)):
        raise ValueError(f"layer must be AGFAttention or SoftmaxAttention, got "
                         f"{type(layer).__name__}")
    naming = naming or _detect_naming(sd, prefix)
    if naming not in ("lra", "uea"):
        raise ValueError(f"naming must be 'lra' or 'uea', got {naming!r}")
    names = LRA_ATTENTION_NAMES if naming == "lra" else UEA_ATTENTION_NAMES
    h, d = layer.num_heads, layer.head_dim
    roles = ["query", "key", "value"] + (["sigma"] if isinstance(layer, AGFAttention) else [])
    params = {}
    for role in roles:
        w, b = _linear(sd, prefix + names[role])
        if w.shape[0] != h * d:
            raise ValueError(f"{prefix}{names[role]}.weight has {w.shape[0]} outputs, expected "
                             f"num_heads * head_dim = {h * d}")
        params[role] = {"kernel": w.T.reshape(w.shape[1], h, d), "bias": b.reshape(h, d)}
    w, b = _linear(sd, prefix + names["out"])
    if w.shape[1] != h * d:
        raise ValueError(f"{prefix}{names['out']}.weight has {w.shape[1]} inputs, expected {h * d}")
    if layer.out_features is not None and w.shape[0] != layer.out_features:
        raise ValueError(f"{prefix}{names['out']}.weight has {w.shape[0]} outputs, expected "
                         f"out_features = {layer.out_features}")
    params["out"] = {"kernel": w.T.reshape(h, d, w.shape[0]), "bias": b}
    if isinstance(layer, AGFAttention):
        poly = prefix + names["poly"]
        theta_0 = sd.take(f"{poly}.0", ())
        if layer.learn_c0:
            params["theta_0"] = theta_0
        elif float(theta_0) != 1.0:
            raise ValueError(f"{poly}.0 = {float(theta_0)} but learn_c0=False freezes c_0 at 1.0 "
                             "(use learn_c0=True for a learnable c_0 = tanh(theta_0))")
        if layer.order > 0:
            params["theta"] = np.stack([sd.take(f"{poly}.{k}", ())
                                        for k in range(1, layer.order + 1)])
        extra = sorted(k for k in sd.arrays if k.startswith(f"{poly}.") and k not in sd.used)
        if extra:
            raise ValueError(f"state_dict has thetas beyond order K={layer.order}: {extra}")
    return params


def convert_attention(state_dict: Mapping[str, Any], layer, *, naming: Optional[str] = None,
                      prefix: str = "") -> dict:
    """Converts one reference attention layer.

    Args:
        state_dict: name -> array, the reference `state_dict()` of `Attention` (LRA names `W_q`,
            ..., `attn.poly.thetas.k`) or `AttentionLayer` (UEA names `query_projection`, ...,
            `inner_attention.poly.thetas.k`).
        layer: the target `AGFAttention` / `SoftmaxAttention` (its num_heads, head_dim, order and
            learn_c0 must match the reference configuration).
        naming: 'lra' | 'uea' | None (detected from the keys).
        prefix: key prefix of the layer inside `state_dict` (then other keys are not checked).

    Returns:
        The layer's params tree (numpy arrays).
    """
    sd = _StateDict(state_dict)
    params = _attention(sd, layer, prefix, naming)
    if not prefix:
        sd.finish()
    return params


def _lra_model(sd: _StateDict, model) -> dict:
    enc = {"token_embed": {"embedding": sd.take("model.embeddings.word_embeddings.weight")},
           "pos_embed": {"embedding": sd.take("model.embeddings.position_embeddings.weight")}}
    attn = _block_attention(model)
    for i in range(model.num_layers):
        p = f"model.transformer_{i}."
        enc[f"block_{i:02d}"] = {
            "attention_norm": _layer_norm(sd, p + "norm1"),
            "attention": _attention(sd, attn, p + "mha.", "lra"),
            "mlp_norm": _layer_norm(sd, p + "norm2"),
            "mlp_in": _dense(sd, p + "mlpblock.0"),
            "mlp_out": _dense(sd, p + "mlpblock.3"),
        }
    enc["final_norm"] = _layer_norm(sd, "model.norm")
    return {"encoder": enc, "head_hidden": _dense(sd, "seq_classifer.mlpblock.0"),
            "head_out": _dense(sd, "seq_classifer.mlpblock.2")}


def _uea_model(sd: _StateDict, model) -> dict:
    from zoo_core.ops.positions import sinusoidal_table

    params = {"input_proj": _dense(sd, "project_inp")}
    pe = sd.take("pos_enc.pe")
    if pe.ndim != 3 or pe.shape[1] != 1:
        raise ValueError(f"pos_enc.pe must be [max_len, 1, d_model], got shape {pe.shape}")
    if model.pos_encoding == "learnable":
        params["pos_embed"] = pe[:, 0, :]
    elif not np.allclose(pe[:, 0, :], sinusoidal_table(*pe[:, 0, :].shape), atol=1e-6):
        raise ValueError("pos_enc.pe is not the fixed sinusoidal table but pos_encoding='fixed'")
    attn = _block_attention(model)
    for i in range(model.num_layers):
        p = f"encoder.attn_layers.{i}."
        params[f"block_{i:02d}"] = {
            "attention": _attention(sd, attn, p + "attention.", "uea"),
            "attention_norm": _layer_norm(sd, p + "norm1"),
            "ffn_in": _conv1x1(sd, p + "conv1"),
            "ffn_out": _conv1x1(sd, p + "conv2"),
            "ffn_norm": _layer_norm(sd, p + "norm2"),
        }
    params["final_norm"] = _layer_norm(sd, "encoder.norm")
    params["output"] = _dense(sd, "output_layer")
    return params


def _block_attention(model):
    """An unbound attention layer with the model's attention hyperparameters (for the converter)."""
    from agf_jax.layers import AGFAttention, SoftmaxAttention

    head_dim = getattr(model, "head_dim", None) or model.d_model // model.num_heads
    if model.attention == "softmax":
        return SoftmaxAttention(num_heads=model.num_heads, head_dim=head_dim)
    return AGFAttention(num_heads=model.num_heads, head_dim=head_dim, basis=model.basis,
                        order=model.order, alpha=model.alpha, beta=model.beta,
                        learn_c0=getattr(model, "learn_c0", False))


def convert_model(state_dict: Mapping[str, Any], model) -> dict:
    """Converts a reference model state_dict to the params of an `agf_jax.model` module.

    Args:
        state_dict: AGF_LRA `ModelForSC` / `ModelForSCDual` (keys `model.*`, `seq_classifer.*`) or
            AGF_UEA `AGFClassiregressor` (keys `project_inp.*`, `pos_enc.pe`, `encoder.*`,
            `output_layer.*`).
        model: the target `LRAClassifier` / `LRARetrieval` / `UEAClassifier` with matching sizes.

    Returns:
        The model's params tree (numpy arrays).
    """
    from agf_jax.model import LRAClassifier, LRARetrieval, UEAClassifier

    sd = _StateDict(state_dict)
    if isinstance(model, (LRAClassifier, LRARetrieval)):
        params = _lra_model(sd, model)
    elif isinstance(model, UEAClassifier):
        params = _uea_model(sd, model)
    else:
        raise ValueError(f"model must be LRAClassifier, LRARetrieval or UEAClassifier, got "
                         f"{type(model).__name__}")
    sd.finish()
    return params


def _example_input(module):
    """A dummy input for shape inference of `module.init`."""
    import jax.numpy as jnp

    from agf_jax.model import LRAClassifier, LRARetrieval, UEAClassifier

    if isinstance(module, UEAClassifier):
        return ({"inputs": jnp.zeros((1, module.max_len, module.feat_dim)),
                 "mask": jnp.ones((1, module.max_len), bool)},)
    if isinstance(module, LRARetrieval):
        ids = jnp.ones((1, 2), jnp.int32)
        return ({"inputs1": ids, "inputs2": ids},)
    if isinstance(module, LRAClassifier):
        return ({"inputs": jnp.ones((1, 2), jnp.int32)},)
    raise ValueError(f"cannot infer an input for {type(module).__name__}")


def convert(state_dict: Mapping[str, Any], module, *, input_width: Optional[int] = None) -> dict:
    """Converts and checks against `module`'s own parameter shapes; returns {'params': ...}.

    Args:
        state_dict: a reference state_dict (see `convert_attention` / `convert_model`).
        module: an `AGFAttention`, `SoftmaxAttention`, `LRAClassifier`, `LRARetrieval` or
            `UEAClassifier`.
        input_width: E for attention layers (default: read from the query weight).

    Returns:
        {'params': tree of jnp float32 arrays}, structure and shapes equal to `module.init`'s.
    """
    import jax
    import jax.numpy as jnp

    from agf_jax.layers import AGFAttention, SoftmaxAttention

    if isinstance(module, (AGFAttention, SoftmaxAttention)):
        params = convert_attention(state_dict, module)
        width = input_width or params["query"]["kernel"].shape[0]
        example = (jnp.zeros((1, 2, width)),)
    else:
        params = convert_model(state_dict, module)
        example = _example_input(module)
    abstract = jax.eval_shape(module.init, jax.random.key(0), *example)["params"]
    want = {jax.tree_util.keystr(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    got = {jax.tree_util.keystr(p): tuple(np.shape(x))
           for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    if want != got:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        bad = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise ValueError(f"converted params do not match the module: missing {missing}, unexpected "
                         f"{extra}, shape mismatches {[(k, got[k], want[k]) for k in bad]}")
    return {"params": jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)}


# ---------------------------------------------------------------------------------------------
# Golden files: meta -> module, run, compare.
# ---------------------------------------------------------------------------------------------


def _basis_args(poly_type: str, alpha, beta) -> dict:
    # The reference ignores alpha/beta for every basis but jacobi; ours refuses them there.
    if poly_type == "jacobi":
        return dict(basis="jacobi", alpha=float(alpha), beta=float(beta))
    return dict(basis=poly_type)


def _expect(cfg: Mapping, key: str, allowed, where: str) -> None:
    if key in cfg and cfg[key] not in allowed:
        raise ValueError(f"{where}: unsupported {key}={cfg[key]!r} (supported: {allowed})")


def module_from_meta(meta: Mapping[str, Any]):
    """Builds our module from a golden file's `meta`.

    Args:
        meta: decoded `meta` JSON (fields `official_class`, `constructor_args`).

    Returns:
        (case, module) with case one of 'lra_attention', 'uea_attention', 'lra_classifier',
        'lra_retrieval', 'uea_classifier'.
    """
    from agf_jax.layers import AGFAttention, SoftmaxAttention
    from agf_jax.model import LRAClassifier, LRARetrieval, UEAClassifier

    cls = meta.get("official_class", "")
    args = meta.get("constructor_args", {})
    if "ModelForSC" in cls:
        cfg = args["config"]
        where = cls
        _expect(cfg, "attn_type", ("svd", "softmax"), where)
        _expect(cfg, "learn_pos_emb", (True,), where)
        _expect(cfg, "tied_weights", (False,), where)
        _expect(cfg, "pooling_mode", ("MEAN", "CLS"), where)
        if cfg.get("embedding_dim", cfg["transformer_dim"]) != cfg["transformer_dim"]:
            raise ValueError(f"{where}: embedding_dim must equal transformer_dim")
        kw = dict(num_classes=cfg["num_classes"], vocab_size=cfg["vocab_size"],
                  max_len=cfg["max_seq_len"], d_model=cfg["transformer_dim"],
                  mlp_dim=cfg["transformer_hidden_dim"], num_heads=cfg["num_head"],
                  head_dim=cfg["head_dim"], num_layers=cfg["num_layers"],
                  dropout_rate=float(cfg.get("dropout_prob", 0.0)),
                  pooling=cfg.get("pooling_mode", "MEAN").lower())
        if cfg["attn_type"] == "svd":
            kw.update(attention="agf", order=int(cfg["K"]), ortho_weight=float(cfg.get("reg", 0.0)),
                      **_basis_args(cfg["poly_type"], cfg.get("alpha"), cfg.get("beta")))
        else:
            kw.update(attention="softmax",
                      attention_dropout=float(cfg.get("attention_dropout", 0.0)))
        if "ModelForSCDual" in cls:
            return "lra_retrieval", LRARetrieval(**kw)
        return "lra_classifier", LRAClassifier(**kw)
    if "AGFClassiregressor" in cls:
        where = cls
        _expect(args, "attn_type", ("svd", "softmax"), where)
        _expect(args, "pos_encoding", ("learnable", "fixed"), where)
        _expect(args, "activation", ("gelu", "relu"), where)
        kw = dict(num_classes=args["num_classes"], feat_dim=args["feat_dim"],
                  max_len=args["max_len"], d_model=args["d_model"], mlp_dim=args["d_ff"],
                  num_heads=args["n_heads"], num_layers=args["num_layers"],
                  dropout_rate=float(args.get("dropout", 0.0)),
                  activation=args.get("activation", "gelu"),
                  pos_encoding=args.get("pos_encoding", "learnable"))
        if args["attn_type"] == "svd":
            # eta is applied by the loss, outside the reference model: weight 1 gives ortho_mean.
            kw.update(attention="agf", order=int(args["K"]),
                      learn_c0=not bool(args.get("fixI", False)), ortho_weight=1.0,
                      **_basis_args(args["poly_type"], args.get("alpha"), args.get("beta")))
        else:
            kw.update(attention="softmax")
        return "uea_classifier", UEAClassifier(**kw)
    if "AGF_LRA/attention.py::Attention" in cls:
        cfg = args["config"]
        _expect(cfg, "attn_type", ("svd", "softmax"), cls)
        h, d = cfg["num_head"], cfg["head_dim"]
        if cfg["attn_type"] == "softmax":
            return "lra_attention", SoftmaxAttention(num_heads=h, head_dim=d)
        # LRA always freezes c_0 (its fixI flag has no effect) and scales the regulariser by reg.
        return "lra_attention", AGFAttention(
            num_heads=h, head_dim=d, order=int(cfg["K"]), learn_c0=False,
            ortho_scale=float(cfg["reg"]),   # required like the other keys: no silent default
            ortho_count_padding=True,        # the reference regulariser (agf.md §2.5)
            **_basis_args(cfg["poly_type"], cfg.get("alpha"), cfg.get("beta")))
    if "AttentionLayer" in cls:
        _expect(args, "attn_type", ("svd", "softmax"), cls)
        h = args["n_heads"]
        d = args.get("d_keys") or args["d_model"] // h
        if args["attn_type"] == "softmax":
            return "uea_attention", SoftmaxAttention(num_heads=h, head_dim=d)
        return "uea_attention", AGFAttention(
            num_heads=h, head_dim=d, order=int(args["K"]),
            learn_c0=not bool(args.get("fixI", False)),
            **_basis_args(args["poly_type"], args.get("alpha"), args.get("beta")))
    raise ValueError(f"unsupported golden class {cls!r}")


def _cross_entropy(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, labels[:, None].astype(np.int64), -1)[:, 0]


def _check_lra_mask(ids: np.ndarray, mask: np.ndarray, name: str) -> None:
    if not np.array_equal(np.asarray(mask) != 0, ids != 0):
        raise ValueError(f"input {name} differs from (ids != 0); the LRA models derive the mask "
                         "from the token ids")


def run_golden(golden) -> dict[str, np.ndarray]:
    """Runs our port on a golden case; returns {output name: array} for the names it defines.

    Args:
        golden: a `zoo_core.testing.Golden`.

    Returns:
        Port outputs keyed like the golden's `output/*`.
    """
    import jax.numpy as jnp

    case, module = module_from_meta(golden.meta)
    inp = golden.inputs
    if case in ("lra_attention", "uea_attention"):
        x = jnp.asarray(inp["x"], jnp.float32)
        variables = convert(golden.params, module, input_width=x.shape[-1])
        mask = jnp.asarray(inp["mask"]) if "mask" in inp else None
        y, aux = module.apply(variables, x, mask=mask)
        out = {"y": y}
        if "orthogonality/per_sample" in aux:
            out["ortho"] = aux["orthogonality/per_sample"]
        return {k: np.asarray(v) for k, v in out.items()}
    variables = convert(golden.params, module)
    if case == "uea_classifier":
        batch = {"inputs": jnp.asarray(inp["x"], jnp.float32),
                 "mask": jnp.asarray(inp["padding_mask"]).astype(bool)}
    elif case == "lra_classifier":
        ids = np.asarray(inp["input_ids"])
        if "mask" in inp:
            _check_lra_mask(ids, inp["mask"], "mask")
        batch = {"inputs": jnp.asarray(ids, jnp.int32)}
    else:
        ids0, ids1 = np.asarray(inp["input_ids_0"]), np.asarray(inp["input_ids_1"])
        for i, ids in ((0, ids0), (1, ids1)):
            if f"mask_{i}" in inp:
                _check_lra_mask(ids, inp[f"mask_{i}"], f"mask_{i}")
        batch = {"inputs1": jnp.asarray(ids0, jnp.int32), "inputs2": jnp.asarray(ids1, jnp.int32)}
    (outputs, aux), state = module.apply(variables, batch, mutable=["intermediates"])
    out = {"logits": np.asarray(outputs["logits"])}
    if "orthogonality/per_layer" in aux:
        out["ortho_per_layer"] = np.asarray(aux["orthogonality/per_layer"])
        per_sample = np.asarray(aux["orthogonality/per_sample"])
        out["loss_ortho" if case.startswith("lra") else "ortho_mean"] = per_sample
    if case == "lra_classifier":
        out["token_out"] = np.asarray(state["intermediates"]["encoder"]["token_out"][-1])
    if "label" in inp:
        ce = _cross_entropy(out["logits"].astype(np.float64), np.asarray(inp["label"]))
        out["loss_ce"] = ce
        out["loss"] = ce + out.get("loss_ortho", out.get("ortho_mean", 0.0))
    return out


def check_golden(path) -> dict[str, tuple[float, float]]:
    """Checks one golden file.

    Args:
        path: a `.npz` golden file (tests/testdata/README.md format).

    Returns:
        {output name: (max |port - golden|, golden excess)}; excess <= 0 means within
        |port - golden| <= 1e-5 + 1e-5 |golden|.

    Raises:
        ValueError: the port does not produce one of the golden's outputs, or conversion failed.
    """
    golden = Golden(path)
    port = run_golden(golden)
    missing = sorted(set(golden.outputs) - set(port))
    if missing:
        raise ValueError(f"{path}: the port does not produce outputs {missing}")
    result = {}
    for name, expected in sorted(golden.outputs.items()):
        actual = np.asarray(port[name], np.float64)
        diff = float(np.max(np.abs(actual - expected), initial=0.0)) if actual.shape == \
            expected.shape else float("inf")
        result[name] = (diff, golden_excess(actual, expected))
    return result


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (`--check FILE.npz ...`); exits with the usage line on a bad one."""
    return golden_parser("python -m agf_jax.convert", __doc__.split("\n")[0],
                         "golden files to run through the converter and the port").parse_args(argv)


def _output_lines(path) -> list[tuple[str, float]]:
    """(line, excess) per output of one golden (`zoo_core.testing.check_golden_files`)."""
    return [(f"output/{name}: max_abs_diff={diff:.3e} excess={excess:+.3e}", excess)
            for name, (diff, excess) in check_golden(path).items()]


def main(argv=None) -> int:
    return check_golden_files(parse_args(argv).check, _output_lines)


if __name__ == "__main__":
    sys.exit(main())
