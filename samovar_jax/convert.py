"""Reference PyTorch state_dicts -> `samovar_jax` Flax params, and a golden-file checker.

The reference is LJC-FVNR/Structural-Aligned-Mixture-of-VAR @ 4e2581f (`models/AutoregressiveAlignment.py`
for SAMoVAR and FixedVAR, `models/Autoregressive.py` for LinTrans); spec `samovar.md` §13 and
`tests/testdata/README.md` (section `samovar/`) describe the goldens.

Library:
  `model_kwargs_from_reference(configs, kind)`: the reference constructor namespace -> `Model` kwargs.
  `kind_from_meta(meta)`, `model_from_meta(meta)`: the same from a golden file's `meta`.
  `convert_state_dict(state_dict, model)`: state_dict (numpy arrays under the official keys) -> params,
    checked against the model's parameter shapes. Keys that match no rule or are missing raise a
    ValueError naming them. Keys accepted and dropped because they have no effect in the reference:
    `transformer.pns.*` (SAMoVAR/FixedVAR: the block norms are unused on the VAR path),
    `transformer.layer_attn.*` (LinTrans: never called), and with `univariate` the exogenous-path
    weights `tokenizer.context_*` / `tokenizer.input_norm_ctx.*` (their output is zeroed).
  `check_golden(path)`: runs one golden file; returns one `CheckResult` per `output/*`.

CLI:
  python -m samovar_jax.convert --check tests/testdata/samovar/*.npz
prints the max abs difference of every output (eval and train mode) and exits 1 if any exceeds the
golden criterion |port - golden| <= 1e-5 + 1e-5 |golden|.

Layout: `nn.Linear.weight` [out, in] -> Flax `kernel` [in, out] (transposed); embedding tables and
gains are copied; the leading singleton axes of `channel_emb`, `pos_emb_2`, `channel_emb_pos`,
`fixed_q` and `fixed_v` are dropped.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Any, Callable, Mapping

import numpy as np

from zoo_core.testing import Golden, check_golden_files, golden_excess, golden_parser

_LINEAR = "linear"   # [out, in] weight / [out] bias -> kernel [in, out] / bias
_COPY = "copy"
_SQUEEZE = "squeeze"  # drop the leading singleton axes


def _rules(kind: str) -> list[tuple[str, str | None, str]]:
    """(regex on the official key, target path template or None = accepted and dropped, transform)."""
    common = [
        (r"tokenizer\.tokenizer\.(weight|bias)", "tokenizer/endogenous/{p}", _LINEAR),
        (r"tokenizer\.context_channel_projection\.(weight|bias)", "tokenizer/channel_mix/{p}", _LINEAR),
        (r"tokenizer\.context_temporal_projection\.(weight|bias)", "tokenizer/exogenous/{p}", _LINEAR),
        (r"tokenizer\.tokenizer_output\.(weight|bias)", "head/{p}", _LINEAR),
        (r"tokenizer\.input_norm_main\.weight", "tokenizer/endogenous_norm/scale", _COPY),
        (r"tokenizer\.input_norm_ctx\.weight", "tokenizer/exogenous_norm/scale", _COPY),
        (r"pre_norm\.weight", "pre_norm/scale", _COPY),
        (r"final_norm\.weight", "final_norm/scale", _COPY),
        (r"pos_emb\.weight", "embedding/position", _COPY),
        (r"channel_emb", "embedding/channel", _SQUEEZE),
    ]
    if kind == "lintrans":
        return common + [
            (r"transformer\.attn\.(\d+)\.q1\.(weight|bias)", "block_{i}/attention/query/{p}", _LINEAR),
            (r"transformer\.attn\.(\d+)\.k1\.(weight|bias)", "block_{i}/attention/key/{p}", _LINEAR),
            (r"transformer\.attn\.(\d+)\.v1\.(weight|bias)", "block_{i}/attention/value/{p}", _LINEAR),
            (r"transformer\.attn\.(\d+)\.c_proj\.(weight|bias)", "block_{i}/attention/out/{p}", _LINEAR),
            (r"transformer\.pns\.(\d+)\.weight", "block_{i}/attention_norm/scale", _COPY),
            (r"transformer\.lns\.(\d+)\.weight", "block_{i}/mlp/norm/scale", _COPY),
            (r"transformer\.mlps\.(\d+)\.c_fc\.(weight|bias)", "block_{i}/mlp/fc_in/{p}", _LINEAR),
            (r"transformer\.mlps\.(\d+)\.c_proj\.(weight|bias)", "block_{i}/mlp/fc_out/{p}", _LINEAR),
            (r"transformer\.layer_attn\.(weight|bias)", None, _COPY),     # never called by the reference
        ]
    return common + [
        (r"pos_emb_2", "embedding/type", _SQUEEZE),
        (r"channel_emb_pos", "embedding/channel_type", _SQUEEZE),
        (r"transformer\.lns\.(\d+)\.weight", "mlp_{i}/norm/scale", _COPY),
        (r"transformer\.mlps\.(\d+)\.c_fc\.(weight|bias)", "mlp_{i}/fc_in/{p}", _LINEAR),
        (r"transformer\.mlps\.(\d+)\.c_proj\.(weight|bias)", "mlp_{i}/fc_out/{p}", _LINEAR),
        (r"transformer\.pns\.(\d+)\.weight", None, _COPY),               # unused on the VAR path
        (r"transformer\.VAR_input_norm\.weight", "var_norm/scale", _COPY),
        (r"transformer\.attn\.(\d+)\.q_proj\.(weight|bias)", "var/layer_{i}/query/{p}", _LINEAR),
        (r"transformer\.attn\.(\d+)\.v_proj\.(weight|bias)", "var/layer_{i}/value/{p}", _LINEAR),
        (r"transformer\.attn\.(\d+)\.q_norm\.weight", "var/layer_{i}/query_norm/scale", _COPY),
        (r"transformer\.attn\.(\d+)\.v_norm\.weight", "var/layer_{i}/value_norm/scale", _COPY),
        (r"transformer\.attn\.(\d+)\.fixed_q", "var/layer_{i}/query", _SQUEEZE),
        (r"transformer\.attn\.(\d+)\.fixed_v", "var/layer_{i}/value", _SQUEEZE),
        (r"transformer\.generate_S\.LU", "structural/theta", _COPY),
    ]


def _dtype(dtype) -> np.dtype:
    """numpy dtype of a dtype or dtype name (bfloat16 included)."""
    import jax.numpy as jnp

    return jnp.dtype(dtype)


def _transform(arr: np.ndarray, how: str, param: str | None, rank: int | None) -> np.ndarray:
    """One reference tensor -> our layout; `rank` is the target parameter's rank (None: unknown)."""
    if how == _LINEAR:
        return arr.T if param == "weight" else arr
    if how == _SQUEEZE:
        # Drop the reference's leading broadcast axes, but only down to the target rank: a size-1
        # axis of the parameter itself (e.g. one target channel) must stay.
        while arr.ndim and arr.shape[0] == 1 and (rank is None or arr.ndim > rank):
            arr = arr[0]
        return arr
    return arr


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}/{k}" if prefix else k
        if isinstance(v, Mapping):
            out.update(_flatten(v, path))
        else:
            out[path] = v
    return out


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, v in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def expected_param_shapes(model) -> dict[str, tuple[int, ...]]:
    """{'a/b/kernel': shape} of `model`'s parameters (abstract init, nothing allocated)."""
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((1, model.input_len, model.num_channels), jnp.float32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), {"inputs": jnp.zeros(x.shape, x.dtype)}))
    return {k: tuple(v.shape) for k, v in _flatten(shapes["params"]).items()}


def convert_state_dict(state_dict: Mapping[str, Any], model) -> dict[str, Any]:
    """Converts a reference state_dict to this package's Flax params for `model`.

    Args:
      state_dict: {official key: array} (numpy or anything `np.asarray` accepts, e.g. torch tensors
        moved to CPU) of `models/AutoregressiveAlignment.py::Model` (SAMoVAR, FixedVAR) or
        `models/Autoregressive.py::Model` (LinTrans).
      model: the `samovar_jax.model.Model` to load into (gives kind, univariate and the shapes).

    Returns:
      Nested params dict (numpy arrays in model.param_dtype) for `model.apply({'params': ...}, ...)`.

    Raises:
      ValueError: naming every key that matches no rule, every parameter of `model` with no source,
        and every shape mismatch.
    """
    rules = [(re.compile(p + r"\Z"), t, how) for p, t, how in _rules(model.kind)]
    expected = expected_param_shapes(model)
    dropped_if_univariate = re.compile(r"tokenizer\.(context_channel_projection|context_temporal_projection|"
                                       r"input_norm_ctx)\.")
    flat: dict[str, np.ndarray] = {}
    unknown, mismatched = [], []
    for key, value in state_dict.items():
        if model.univariate and dropped_if_univariate.match(key):
            continue
        for pattern, target, how in rules:
            m = pattern.match(key)
            if m is None:
                continue
            if target is None:
                break
            groups = m.groups()
            layer = next((g for g in groups if g is not None and g.isdigit()), None)
            param = next((g for g in groups if g in ("weight", "bias")), None)
            path = target.format(i=f"{int(layer):02d}" if layer is not None else "",
                                 p="kernel" if param == "weight" else "bias")
            arr = _transform(np.asarray(value), how, param,
                             len(expected[path]) if path in expected else None)
            if path not in expected:
                unknown.append(f"{key} (-> {path}, not a parameter of this model)")
            elif tuple(arr.shape) != expected[path]:
                mismatched.append(f"{key} {tuple(np.shape(value))} -> {path} needs {expected[path]}")
            else:
                flat[path] = arr.astype(_dtype(model.param_dtype))
            break
        else:
            unknown.append(key)
    missing = sorted(set(expected) - set(flat))
    problems = []
    if unknown:
        problems.append("unknown state_dict keys: " + ", ".join(unknown))
    if mismatched:
        problems.append("shape mismatches: " + "; ".join(mismatched))
    if missing:
        problems.append("model parameters with no state_dict entry: " + ", ".join(missing))
    if problems:
        raise ValueError(f"cannot convert state_dict for kind={model.kind!r}: " + " | ".join(problems))
    return _unflatten(flat)


def model_kwargs_from_reference(configs: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """Reference constructor namespace (`seq_len`, `pred_len`, `enc_in`, ...) -> `Model` kwargs.

    `d_model=0` / `n_heads=0` keep their automatic meaning (width 32 floor(sqrt(C)), heads d // 16).
    LinTrans ignores `univariate` in the reference, so it maps to False there. `time_emb_dim > 0`
    (time-stamp features) is not supported and raises.
    """
    if configs.get("time_emb_dim", 0):
        raise ValueError(f"time_emb_dim={configs['time_emb_dim']} is not supported (only 0, as the paper runs)")
    if kind in ("samovar", "fixedvar"):
        want = "LinearAttention" if kind == "samovar" else "FixedVAR"
        if configs.get("predictor", want) != want:
            raise ValueError(f"predictor {configs.get('predictor')!r} does not match kind {kind!r}")
    known = {"seq_len", "pred_len", "enc_in", "number_of_targets", "d_model", "n_heads", "e_layers",
             "dropout", "predictor", "time_emb_dim", "univariate", "label_len", "features",
             "local_attention", "local_attention_window", "n_layer", "max_len"}
    extra = set(configs) - known
    if extra:
        raise ValueError(f"unknown reference config fields: {sorted(extra)}")
    if configs.get("local_attention"):
        raise ValueError("local_attention=True is not supported (disabled in the reference)")
    return dict(
        kind=kind, variant="paper",
        num_channels=int(configs["enc_in"]), input_len=int(configs["seq_len"]),
        patch_len=int(configs["pred_len"]), num_targets=int(configs.get("number_of_targets", 0) or 0),
        width=int(configs.get("d_model", 0) or 0), num_heads=int(configs.get("n_heads", 0) or 0),
        num_layers=int(configs["e_layers"]), mlp_ratio=4, dropout=float(configs.get("dropout", 0.0)),
        univariate=bool(configs.get("univariate", 0)) and kind != "lintrans",
    )


def kind_from_meta(meta: Mapping[str, Any]) -> str:
    """'samovar' | 'fixedvar' | 'lintrans' from a golden file's `meta['official_class']`."""
    cls = meta.get("official_class", "")
    if cls.startswith("models/Autoregressive.py"):
        return "lintrans"
    if cls.startswith("models/AutoregressiveAlignment.py"):
        pred = meta["constructor_args"]["configs"].get("predictor", "LinearAttention")
        return {"LinearAttention": "samovar", "FixedVAR": "fixedvar"}.get(pred) or _bad(f"predictor {pred!r}")
    return _bad(f"official_class {cls!r}")


def _bad(what: str):
    raise ValueError(f"not a SAMoVAR-family golden: unknown {what}")


def model_from_meta(meta: Mapping[str, Any], **overrides):
    """`Model` built from a golden file's `meta` (constructor_args.configs)."""
    from samovar_jax.model import Model

    kind = kind_from_meta(meta)
    kwargs = model_kwargs_from_reference(meta["constructor_args"]["configs"], kind)
    kwargs.update(overrides)
    return Model(**kwargs)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One compared output: name, mode, max |port - golden|, max excess over the criterion."""
    name: str
    mode: str
    max_abs: float
    excess: float

    @property
    def ok(self) -> bool:
        return self.excess <= 0.0


# output name -> (mode, extractor of (outputs, aux))
_OUTPUTS: dict[str, tuple[str, Callable[[dict, dict], Any]]] = {
    "forecast": ("eval", lambda out, aux: out["forecast"]),
    "forecast_train": ("train", lambda out, aux: out["forecast"]),
    "ar_loss": ("train", lambda out, aux: aux["loss/ar"]),
}


def check_golden(path, *, jit: bool = True) -> list[CheckResult]:
    """Builds the model from `meta`, converts `param/*`, runs `input/x` in eval and train mode
    (dropout 0), and compares every `output/*`.

    Args:
      path: a golden `.npz` of the `samovar/` family.
      jit: compile the two forwards (False runs them eagerly, cheaper for one-off test calls).

    Raises:
      ValueError: for an output name this checker does not know, or a conversion problem.
    """
    import jax

    g = Golden(path)
    unknown = set(g.outputs) - set(_OUTPUTS)
    if unknown:
        raise ValueError(f"{path}: unknown golden outputs {sorted(unknown)}")
    if set(g.inputs) != {"x"}:
        raise ValueError(f"{path}: expected the single input 'x', got {sorted(g.inputs)}")
    model = model_from_meta(g.meta)
    params = convert_state_dict(g.params, model)
    batch = {"inputs": g.inputs["x"]}
    wrap = jax.jit if jit else (lambda f: f)
    runs = {
        "eval": wrap(lambda p, b: model.apply({"params": p}, b))(params, batch),
        "train": wrap(lambda p, b: model.apply({"params": p}, b, train=True,
                                               rngs={"dropout": jax.random.PRNGKey(0)}))(params, batch),
    }
    results = []
    for name in sorted(g.outputs):
        mode, get = _OUTPUTS[name]
        got = np.asarray(get(*runs[mode]), np.float64)
        want = g.outputs[name]
        results.append(CheckResult(name, mode, float(np.max(np.abs(got - want), initial=0.0)),
                                   golden_excess(got, want)))
    return results


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (`--check FILE.npz ...`); exits with the usage line on a bad one."""
    return golden_parser("python -m samovar_jax.convert", __doc__.split("\n")[0],
                         "golden files (tests/testdata/samovar/*.npz) to convert and compare").parse_args(argv)


def _output_lines(path) -> list[tuple[str, float]]:
    """(line, excess) per output of one golden (`zoo_core.testing.check_golden_files`)."""
    return [(f"{r.name:15s} [{r.mode:5s}] max|diff| = {r.max_abs:.3e}", r.excess) for r in check_golden(path)]


def main(argv=None) -> int:
    return check_golden_files(parse_args(argv).check, _output_lines)


if __name__ == "__main__":
    sys.exit(main())
