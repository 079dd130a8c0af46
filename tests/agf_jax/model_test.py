"""Tests of the AGF models and the Model factory (agf_jax/model.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agf_jax import model as model_lib
from agf_jax.model import VARIANTS, Model
from zoo_core import testing
from zoo_core.ops import xla_forms
from zoo_core.testing import F32_MODEL, assert_trees_close, param_shapes

B, T, C, K = 2, 7, 3, 4
IDS = jnp.array([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 0, 0, 0]], jnp.int32)
IDS2 = jnp.array([[2, 7, 1, 8, 2, 8, 0], [1, 4, 1, 4, 2, 1, 3]], jnp.int32)
UEA_X = jax.random.normal(jax.random.key(0), (B, T, C))
UEA_MASK = jnp.asarray(np.arange(T)[None] < np.array([[T], [5]]))
LRA = dict(variant="tiny", num_classes=K, vocab_size=10, max_len=8, order=3, alpha=1.5, beta=2.0,
           ortho_weight=0.1)
UEA = dict(variant="tiny", num_classes=K, feat_dim=C, max_len=T, order=3, ortho_weight=0.5)
CASES = {
    "lra_classifier": (LRA, {"inputs": IDS}),
    "lra_retrieval": (LRA, {"inputs1": IDS, "inputs2": IDS2}),
    "uea_classifier": (UEA, {"inputs": UEA_X * (UEA_MASK[..., None]), "mask": UEA_MASK}),
}


def _perturb_thetas(params, seed=0):
    """Non-zero thetas so that the filters are non-trivial (init is theta = 0)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    key = jax.random.key(seed)
    out = []
    for path, leaf in leaves:
        if "theta" in jax.tree_util.keystr(path):
            key, sub = jax.random.split(key)
            leaf = 0.8 * jax.random.normal(sub, leaf.shape)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(tree, out)


@pytest.mark.parametrize("kind", list(CASES))
def test_forward_shapes_finite_and_aux(kind):
    kwargs, batch = CASES[kind]
    model = Model(kind=kind, **kwargs)
    variables = model.init(jax.random.key(1), batch)
    variables = {"params": _perturb_thetas(variables["params"])}
    apply = jax.jit(model.apply, static_argnames=("train",))
    out, aux = apply(variables, batch)
    assert set(out) == {"logits"} and out["logits"].shape == (B, K)
    assert out["logits"].dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(out["logits"])))
    layers = VARIANTS["tiny"]["num_layers"]
    assert set(aux) == {"loss/orthogonality", "orthogonality/per_sample",
                        "orthogonality/per_layer", "filter/coefficients"}
    assert aux["loss/orthogonality"].shape == ()
    assert aux["orthogonality/per_layer"].shape == (layers, B)
    assert aux["filter/coefficients"].shape == (layers, 4)
    per_layer = np.asarray(aux["orthogonality/per_layer"])
    weight = 1.0 if kind.startswith("lra") else kwargs["ortho_weight"]   # LRA: reg is inside
    np.testing.assert_allclose(aux["orthogonality/per_sample"], weight * per_layer.mean(0),
                               **F32_MODEL)
    np.testing.assert_allclose(aux["loss/orthogonality"], weight * per_layer.mean(), **F32_MODEL)
    assert float(aux["loss/orthogonality"]) > 0.0
    if kind == "lra_classifier":   # dropout only with train=True, driven by the 'dropout' rng
        out_t, _ = apply(variables, batch, train=True, rngs={"dropout": jax.random.key(2)})
        assert not np.allclose(out_t["logits"], out["logits"])
        out_e, _ = apply(variables, batch)
        np.testing.assert_array_equal(out_e["logits"], out["logits"])


def test_lra_regulariser_weight_inside_layers():
    kwargs, batch = CASES["lra_classifier"]
    m1 = Model(kind="lra_classifier", **kwargs)
    m2 = Model(kind="lra_classifier", **{**kwargs, "ortho_weight": 0.3})
    v = {"params": _perturb_thetas(m1.init(jax.random.key(3), batch)["params"])}
    out1, aux1 = m1.apply(v, batch)
    out2, aux2 = m2.apply(v, batch)
    np.testing.assert_allclose(aux2["orthogonality/per_layer"],
                               3.0 * aux1["orthogonality/per_layer"], **F32_MODEL)
    np.testing.assert_array_equal(out1["logits"], out2["logits"])


def test_retrieval_towers_share_the_encoder():
    kwargs, batch = CASES["lra_retrieval"]
    dual = Model(kind="lra_retrieval", **kwargs)
    v = {"params": _perturb_thetas(dual.init(jax.random.key(4), batch)["params"])}
    _, aux = dual.apply(v, batch)
    single = Model(kind="lra_classifier", **kwargs)
    sv = single.init(jax.random.key(5), {"inputs": IDS})
    sv = {"params": {**sv["params"], "encoder": v["params"]["encoder"]}}
    _, a1 = single.apply(sv, {"inputs": IDS})
    _, a2 = single.apply(sv, {"inputs": IDS2})
    both = a1["orthogonality/per_layer"] + a2["orthogonality/per_layer"]
    np.testing.assert_allclose(aux["orthogonality/per_layer"], 0.5 * both, **F32_MODEL)
    assert v["params"]["head_hidden"]["kernel"].shape == (4 * VARIANTS["tiny"]["d_model"],
                                                          VARIANTS["tiny"]["mlp_dim"])


def test_param_name_snapshot():
    kwargs, batch = CASES["lra_classifier"]
    shapes = param_shapes(jax.eval_shape(Model(kind="lra_classifier", **kwargs).init,
                                         jax.random.key(0), batch)["params"])
    e, mlp = VARIANTS["tiny"]["d_model"], VARIANTS["tiny"]["mlp_dim"]
    assert shapes["encoder/token_embed/embedding"] == (10, e)
    assert shapes["encoder/pos_embed/embedding"] == (8, e)
    assert shapes["encoder/block_01/attention/theta"] == (3,)
    assert {k.split("/")[2] for k in shapes if k.startswith("encoder/block_00/")} == {
        "attention_norm", "attention", "mlp_norm", "mlp_in", "mlp_out"}
    assert shapes["head_out/kernel"] == (mlp, K)
    kwargs, batch = CASES["uea_classifier"]
    shapes = param_shapes(jax.eval_shape(Model(kind="uea_classifier", **kwargs).init,
                                         jax.random.key(0), batch)["params"])
    assert shapes["pos_embed"] == (T, e)
    assert shapes["output/kernel"] == (T * e, K)
    assert {k.split("/")[1] for k in shapes if k.startswith("block_00/")} == {
        "attention", "attention_norm", "ffn_in", "ffn_out", "ffn_norm"}
    assert {k.split("/")[0] for k in shapes} == {"input_proj", "pos_embed", "block_00", "block_01",
                                                  "final_norm", "output"}


@pytest.mark.parametrize("kind", ["lra_classifier", "uea_classifier"])
def test_softmax_baseline(kind):
    kwargs, batch = CASES[kind]
    kwargs = {k: v for k, v in kwargs.items() if k not in model_lib.AGF_ONLY_KWARGS}
    model = Model(kind=kind, attention="softmax", **kwargs)
    variables = model.init(jax.random.key(6), batch)
    out, aux = model.apply(variables, batch)
    assert out["logits"].shape == (B, K) and bool(jnp.all(jnp.isfinite(out["logits"])))
    assert aux == {}
    assert not any("sigma" in k or "theta" in k for k in param_shapes(variables["params"]))


def test_uea_padding_is_masked_before_the_head():
    kwargs, batch = CASES["uea_classifier"]
    model = Model(kind="uea_classifier", **kwargs)
    v = model.init(jax.random.key(7), batch)
    (_, state) = model.apply(v, batch, mutable=["intermediates"])
    assert len(state["intermediates"]["hidden_states"]) == VARIANTS["tiny"]["num_layers"] + 1
    # With the output kernel rows of padded steps set to garbage, logits do not change.
    p = jax.tree.map(lambda x: x, v["params"])
    e = VARIANTS["tiny"]["d_model"]
    kernel = p["output"]["kernel"].reshape(T, e, K)
    p["output"]["kernel"] = kernel.at[5:].set(100.0).reshape(T * e, K)
    out1, _ = model.apply(v, batch)
    out2, _ = model.apply({"params": p}, batch)
    np.testing.assert_allclose(out2["logits"][1], out1["logits"][1], **F32_MODEL)


def test_factory_head_dim_rule():
    # UEA derives head_dim = d_model // num_heads (reference) unless it is passed explicitly.
    assert Model(kind="uea_classifier", variant="tiny", num_classes=2, feat_dim=3, max_len=T,
                 d_model=32).head_dim is None
    assert Model(kind="uea_classifier", variant="tiny", num_classes=2, feat_dim=3, max_len=T,
                 head_dim=4).head_dim == 4


@pytest.mark.parametrize("kind", ["lra_classifier", "uea_classifier"])
def test_blocks_and_encoders_merge_aux(kind):
    """Encoders sum their blocks' `loss/*`; the model's loss is weight / L times that sum."""
    kwargs, batch = CASES[kind]
    model = Model(kind=kind, **kwargs)
    v = {"params": _perturb_thetas(model.init(jax.random.key(9), batch)["params"])}
    _, aux = model.apply(v, batch)
    if kind == "lra_classifier":
        enc = model_lib.LRAEncoder(model_lib.BlockConfig.from_module(model), model.vocab_size,
                                   model.num_layers)
        _, enc_aux = enc.apply({"params": v["params"]["encoder"]}, IDS,
                               (IDS != 0).astype(jnp.float32))
        weight = 1.0
    else:
        # The UEA blocks are applied by the classifier itself: rebuild the sum from per-layer.
        enc_aux = {"loss/orthogonality": jnp.sum(jnp.mean(aux["orthogonality/per_layer"], 1))}
        weight = kwargs["ortho_weight"]
    layers = VARIANTS["tiny"]["num_layers"]
    assert enc_aux["loss/orthogonality"].shape == ()
    np.testing.assert_allclose(aux["loss/orthogonality"],
                               weight / layers * enc_aux["loss/orthogonality"], **F32_MODEL)
    if kind == "lra_classifier":
        np.testing.assert_allclose(enc_aux["orthogonality/per_sample"],
                                   aux["orthogonality/per_layer"], **F32_MODEL)


@pytest.mark.parametrize("kind", list(CASES))
def test_biases_follow_pytorch_linear_init(kind):
    """Every Linear bias is U(+-1/sqrt(fan_in)) as torch.nn.Linear (agf.md §2.7); norms start at 0."""
    fields, batch = CASES[kind]
    m = Model(kind=kind, **fields, head_dim=5)            # H*D = 10 != d_model = 16: two fan-ins
    params = m.init(jax.random.key(0), batch)["params"]
    d, h, mlp = VARIANTS["tiny"]["d_model"], VARIANTS["tiny"]["num_heads"], VARIANTS["tiny"]["mlp_dim"]
    fan_in = {"query": d, "key": d, "value": d, "sigma": d, "out": h * 5, "mlp_in": d, "ffn_in": d,
              "mlp_out": mlp, "ffn_out": mlp, "head_hidden": (4 if kind == "lra_retrieval" else 1) * d,
              "head_out": mlp, "input_proj": C, "output": T * d}
    seen = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [p.key for p in path]
        if names[-1] != "bias":
            continue
        if "norm" in names[-2]:
            np.testing.assert_array_equal(leaf, 0.0)
            continue
        bound = 1.0 / np.sqrt(fan_in[names[-2]])
        assert 0.5 * bound < np.abs(leaf).max() <= bound, (names, float(np.abs(leaf).max()), bound)
        seen.add(names[-2])
    assert {"query", "out", "head_out" if kind != "uea_classifier" else "output"} <= seen


@pytest.mark.parametrize("plain", xla_forms.PLAIN_FORMS)
@pytest.mark.parametrize("kind", ["lra_classifier", "uea_classifier"])
def test_each_plain_form_has_the_same_parameters_values_and_gradients(kind, plain):
    # Each part the bf16 bisection swaps (`xla_forms.plain`, read at trace time) computes the same
    # numbers in its plain form (dropout: other random bits, so compared without dropout).
    kwargs, batch = CASES[kind]
    model = Model(kind=kind, **kwargs)
    variables = {"params": _perturb_thetas(model.init(jax.random.key(4), batch)["params"])}
    with xla_forms.plain(plain):
        assert param_shapes(model.init(jax.random.key(4), batch)["params"]) == param_shapes(
            variables["params"])

    def loss():
        def f(params):
            out, aux = model.apply({"params": params}, batch)
            return jnp.sum(jnp.sin(out["logits"])) + aux["loss/orthogonality"]
        return jax.jit(jax.value_and_grad(f))(variables["params"])

    zoo = loss()
    with xla_forms.plain(plain):
        swapped = loss()
    assert_trees_close(swapped, zoo, **F32_MODEL)
    if plain == "dropout":   # train mode runs with the plain layer's own bits
        with xla_forms.plain(plain):
            out, _ = jax.jit(model.apply, static_argnames=("train",))(
                variables, batch, train=True, rngs={"dropout": jax.random.key(5)})
        assert bool(jnp.all(jnp.isfinite(out["logits"])))


def test_a_bf16_lra_step_scatters_its_embedding_gradient_in_float32():
    # The token lookup's backward is a scatter-add of every token's gradient into the table's
    # rows; in bfloat16 a GPU serialises it (a compare-and-swap loop), so it runs in float32.
    kwargs, batch = CASES["lra_classifier"]
    model = Model(kind="lra_classifier", **kwargs, dtype=jnp.bfloat16)
    params = model.init(jax.random.key(6), batch)["params"]

    for plain, want in (((), "f32"), (("embed",), "bf16")):
        def grad(params, ids):   # a new function per block: jit caches a function's trace
            return jax.grad(lambda p: jnp.sum(model.apply({"params": p}, {"inputs": ids})[0][
                "logits"]))(params)

        with xla_forms.plain(*plain):
            program = testing.exported_program(grad, params, batch["inputs"], platform="cuda")
        scatters = [line for line in program.split("\n") if "scatter-add" in line
                    and "^bb0" in line]
        assert scatters and all(f"tensor<{want}>" in line for line in scatters), (plain, scatters)


# ---------------------------------------------------------------------------------------------
# The Table 6 variants and the registry's attentions in the AGF models.
# ---------------------------------------------------------------------------------------------

_NO_FILTER = ("order", "alpha", "beta")


@pytest.mark.parametrize("graph_filter", ["uvt", "svd"])
@pytest.mark.parametrize("kind", ["lra_retrieval", "uea_classifier"])
def test_graph_filter_variants_in_the_models(kind, graph_filter):
    kwargs, batch = CASES[kind]
    kwargs = {k: v for k, v in kwargs.items() if k not in _NO_FILTER}
    model = Model(kind=kind, **kwargs, graph_filter=graph_filter)
    params = model.init(jax.random.key(1), batch)["params"]
    shapes = param_shapes(params)
    layers, heads, d = (VARIANTS["tiny"][k] for k in ("num_layers", "num_heads", "head_dim"))
    assert not any("sigma" in n or "theta" in n for n in shapes)
    spectra = [n for n in shapes if n.endswith("/singular_values")]
    assert len(spectra) == (layers if graph_filter == "svd" else 0)
    assert all(shapes[n] == (heads, d) for n in spectra)
    out, aux = jax.jit(model.apply)({"params": params}, batch)
    assert bool(jnp.all(jnp.isfinite(out["logits"])))
    assert aux["filter/coefficients"].shape == (layers, 1)
    assert ("filter/singular_values" in aux) == (graph_filter == "svd")
    assert float(aux["loss/orthogonality"]) > 0.0   # the regulariser stays in every variant
    if graph_filter == "svd":   # singular values start at one: the same model as H_UV^T
        uvt = Model(kind=kind, **kwargs, graph_filter="uvt")
        drop = lambda tree: {k: drop(v) if isinstance(v, dict) else v   # noqa: E731
                             for k, v in tree.items() if k != "singular_values"}
        want, _ = jax.jit(uvt.apply)({"params": drop(params)}, batch)
        np.testing.assert_allclose(out["logits"], want["logits"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in model_lib.attentions() if n not in model_lib.OWN_ATTENTIONS])
@pytest.mark.parametrize("kind", ["lra_classifier", "uea_classifier"])
def test_every_registry_self_attention_in_the_models(kind, name):
    kwargs, batch = CASES[kind]
    kwargs = {k: v for k, v in kwargs.items() if k not in model_lib.AGF_ONLY_KWARGS}
    model = Model(kind=kind, **kwargs, attention=name)
    variables = model.init(jax.random.key(1), batch)

    def loss(params):
        out, aux = model.apply({"params": params}, batch)
        return jnp.sum(out["logits"] ** 2), (out, aux)

    # The outputs and the gradients in one program (one compile instead of two).
    (_, (out, aux)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    assert out["logits"].shape == (B, K) and bool(jnp.all(jnp.isfinite(out["logits"])))
    assert all(k.startswith("loss/") for k in aux)   # no AGF diagnostics; the mechanism's own losses
    blocks = variables["params"]["encoder"] if kind.startswith("lra") else variables["params"]
    assert "attention" in blocks["block_00"]          # the same place as AGF's layer
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))


def test_attention_options_reach_the_registry_layer():
    kwargs, batch = CASES["lra_classifier"]
    kwargs = {k: v for k, v in kwargs.items() if k not in model_lib.AGF_ONLY_KWARGS}
    model = Model(kind="lra_classifier", **kwargs, attention="favor",
                  attention_options={"num_features": 6})
    assert model.attention_options == (("num_features", 6),)
    bound = model.bind(model.init(jax.random.key(1), batch))
    assert bound.encoder.blocks[0].attention_layer.num_features == 6


def test_a_registry_length_option_is_the_models_max_len(monkeypatch):
    # A mechanism whose registry row names a length option (Linformer's max_length) gets the
    # model's max_len there unless attention_options set it; favor's num_features stands in.
    from agf_jax import model_attention
    monkeypatch.setattr(model_attention.zoo_attention, "length_option",
                        lambda name: "num_features" if name == "favor" else None, raising=False)
    kwargs, batch = CASES["lra_classifier"]
    kwargs = {k: v for k, v in kwargs.items() if k not in model_lib.AGF_ONLY_KWARGS}
    for options, want in (({}, kwargs["max_len"]), ({"num_features": 6}, 6)):
        model = Model(kind="lra_classifier", **kwargs, attention="favor", attention_options=options)
        bound = model.bind(model.init(jax.random.key(1), batch))
        assert bound.encoder.blocks[0].attention_layer.num_features == want
