"""`sequence_axis` on the zoo's own models (issue 49): every config builds with it, a layer without a
context-parallel form is refused in one line, and one config of each architecture, sharded over P = 2 and 4
host devices (a subprocess: the suite has 2), equals one device, values and gradients, aux losses included;
the trainer's padding of a length P does not divide equals the unpadded batch."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.environment import assert_host_devices, run_on_host_devices


def _configs():
    from zoo_core.configs.agf import lra_listops, lra_retrieval, uea
    from zoo_core.configs.htgn import digits, number_words, wmt14_en_de
    from zoo_core.configs.samovar import ett, synthetic_var
    return {"agf": [lra_listops, lra_retrieval, uea], "samovar": [synthetic_var, ett],
            "htgn": [number_words, digits, wmt14_en_de]}


def _factory(arch):
    import agf_jax.model
    import htgn_jax.model
    import samovar_jax.model
    return {"agf": agf_jax.model, "samovar": samovar_jax.model, "htgn": htgn_jax.model}[arch].Model


@pytest.mark.parametrize("arch", ["agf", "samovar", "htgn"])
def test_every_config_builds_with_a_sequence_axis(arch):
    for module in _configs()[arch]:
        for arg in ("smoke", None):
            model = dict(module.get_config(arg).model)
            if model.get("kind") == "dlinear":
                continue
            built = _factory(arch)(**{**model, "sequence_axis": "sequence"})
            assert built.sequence_axis == "sequence", (module.__name__, arg)


@pytest.mark.parametrize("arch, arg, overrides, fragment", [
    ("agf", "smoke", dict(attention="linformer", attention_options={}),
     "attention='linformer' has no context-parallel form; these have one: "),
    ("htgn", "smoke,attention=softmax", {}, "attention='softmax' (its decoder is exact softmax) has no context-parallel"),
    ("htgn", "smoke", dict(feature_map="exact", num_features=None, redraw_every=0),
     "feature_map='exact' (the quadratic oracle) has no context-parallel form"),
    ("agf", "smoke", dict(sequence_axis=3), "`sequence_axis` must be a mesh axis name or None, got 3"),
])
def test_a_layer_without_a_context_parallel_form_is_one_line(arch, arg, overrides, fragment):
    from zoo_core.configs.agf import lra_listops
    from zoo_core.configs.htgn import number_words
    model = dict((lra_listops if arch == "agf" else number_words).get_config(arg).model)
    with pytest.raises(ValueError) as e:
        _factory(arch)(**{**model, "sequence_axis": "sequence", **overrides})
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def _batches(rng):
    """(architecture, config, batch, output key, unpadded batch or None, shard counts) of one config per
    architecture (UEA's 26 steps split over 2; HTGN's decoder of 12 tokens, 3 a shard on 4, is shorter than
    its window of 4)."""
    from zoo_core.configs.agf import lra_listops, uea
    from zoo_core.configs.htgn import number_words
    from zoo_core.configs.samovar import synthetic_var
    ids = rng.integers(1, 10, (2, 64)).astype(np.int32)
    ids[1, 40:] = 0
    yield "agf", lra_listops.get_config("smoke"), {"inputs": ids}, "logits", None, (2, 4)
    c = uea.get_config("smoke")
    yield "agf", c, {"inputs": rng.normal(size=(2, c.model.max_len, c.model.feat_dim)).astype(np.float32)}, \
        "logits", None, (2,)
    # patch length 5: 13 patches, 26 ARX tokens, padded by the model to 28 on 4 shards
    c = synthetic_var.get_config("smoke")
    c.model.patch_len = 5
    yield "samovar", c, {"inputs": rng.normal(size=(2, 64, 2)).astype(np.float32)}, "forecast", None, (2, 4)
    c = number_words.get_config("smoke")
    src = rng.integers(3, 38, (2, 15)).astype(np.int32)
    src[1, 9:] = 0
    tgt = rng.integers(3, 37, (2, 12)).astype(np.int32)
    tgt[0, 8:] = 0
    # the trainer's padding of 'inputs' 15 -> 16 with the pad id (the model pads its 2 + 16 nodes itself)
    padded = {"inputs": np.pad(src, ((0, 0), (0, 1))), "targets": tgt}
    yield "htgn", c, padded, "logits", {"inputs": src, "targets": tgt}, (2,)


def _loss(model, key, params, batch):
    from zoo_core.run.steps import feature_step_kwargs
    out, aux = model.apply({"params": params}, batch, train=False, **feature_step_kwargs(model, jnp.asarray(3)))
    loss = jnp.sum(jnp.square(out[key])) + sum(v for k, v in aux.items() if k.startswith("loss/"))
    return loss, (out, aux)


def _assert_close(got, want, what):
    """Leaf by leaf, within float32 rounding of the leaf's own scale (sums over shards are added in another
    order: a gradient entry near 0 in a leaf of entries near 300 differs by about 300 x 1e-6)."""
    for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)):
        e = np.asarray(e, np.float64)
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
        np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=2e-4, atol=2e-6 * scale,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _check_all():
    from zoo_core.run import sharding
    from zoo_core.run.steps import feature_step_kwargs
    rng = np.random.default_rng(0)
    for arch, config, batch, key, unpadded, shards in _batches(rng):
        kw = config.model.to_dict()
        one = _factory(arch)(**kw)
        reference = batch if unpadded is None else unpadded
        params = jax.jit(functools.partial(one.init, **feature_step_kwargs(one, jnp.asarray(0))))(
            jax.random.PRNGKey(0), reference)["params"]
        want = jax.jit(jax.value_and_grad(functools.partial(_loss, one, key), has_aux=True))(params, reference)
        cp = _factory(arch)(**{**kw, "sequence_axis": "sequence"})
        for p in shards:
            mesh = jax.make_mesh((1, p), ("data", "sequence"), devices=jax.devices()[:p],
                                 axis_types=(jax.sharding.AxisType.Auto,) * 2)
            with jax.set_mesh(mesh):
                placed = sharding.global_batch(batch, mesh)
                got = jax.jit(jax.value_and_grad(functools.partial(_loss, cp, key), has_aux=True))(params, placed)
            _assert_close(got, want, f"{arch} P={p}")
            print(f"{arch}:{type(one).__name__}:P={p}")


@pytest.mark.slow
def test_the_models_split_over_two_and_four_devices_equal_one():
    words = run_on_host_devices("tests.zoo_core.context_parallel_models_test", count=4, timeout=1800)
    assert words == ["agf:LRAClassifier:P=2", "agf:LRAClassifier:P=4", "agf:UEAClassifier:P=2",
                     "samovar:Forecaster:P=2", "samovar:Forecaster:P=4",
                     "htgn:Seq2Seq:P=2"], words


if __name__ == "__main__":
    assert_host_devices(4)
    _check_all()
