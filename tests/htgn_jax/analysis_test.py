"""Tests of htgn_jax.analysis: stencil graphs, learned graph-attention maps, FAVOR+ error."""
import flax.linen as nn
import jax
import numpy as np
import pytest

from htgn_jax import CrossGraphAttention, WindowGraphAttention, analysis
from htgn_jax.model import Model
from zoo_core.testing import F32_SIMPLE

B, S, T = 2, 7, 7
SEQ = dict(kind="seq2seq", variant="test", source_vocab_size=11, target_vocab_size=9,
           max_source_len=16, max_target_len=16, rho=0.8)


def _batch():
    rng = np.random.default_rng(0)
    inputs = rng.integers(3, 11, (B, S)).astype(np.int32)
    inputs[0, -1] = 2
    inputs[1, 4], inputs[1, 5:] = 2, 0           # a padded example
    targets = rng.integers(3, 9, (B, T)).astype(np.int32)
    targets[1, 5], targets[1, 6:] = 2, 0
    return {"inputs": inputs, "targets": targets}


def _random_params(model, batch):
    """Well-scaled random parameters from the abstract init (nothing compiled)."""
    shapes = jax.eval_shape(lambda b: model.init(jax.random.PRNGKey(0), b), batch)["params"]
    rng = np.random.default_rng(1)

    def draw(path, leaf):
        noise = rng.normal(0.0, 0.3, leaf.shape).astype(np.float32)
        # numpy: jnp.asarray would compile a conversion per shape
        return noise + np.float32(1.0 if path[-1].key == "scale" else 0.0)
    return jax.tree_util.tree_map_with_path(draw, shapes)


def test_window_graph_adjacency_counts_and_causality():
    adj = analysis.window_graph_adjacency(10, window=2, num_global=2)
    assert adj.shape == (12, 12) and adj.dtype == bool
    assert adj[:2].all() and adj[:, :2].all()                      # globals <-> everything
    np.testing.assert_array_equal(adj, adj.T)
    tok = adj[2:, 2:]
    np.testing.assert_array_equal(tok.sum(1), [3, 4, 5, 5, 5, 5, 5, 5, 4, 3])
    causal = analysis.window_graph_adjacency(6, window=2, causal=True)
    np.testing.assert_array_equal(causal, np.tril(np.triu(np.ones((6, 6), bool), -2)))
    with pytest.raises(ValueError, match="num_global"):
        analysis.window_graph_adjacency(6, window=2, num_global=1, causal=True)


def test_grid_stencil_adjacency_is_the_2d_neighbourhood():
    """grid_width: the (2w+1)^2 stencil on the raster grid (htgn.md §5.12), nothing across row ends."""
    adj = analysis.window_graph_adjacency(12, window=1, num_global=1, grid_width=4)  # 3 x 4 grid
    tok = adj[1:, 1:]
    np.testing.assert_array_equal(tok.sum(1).reshape(3, 4),
                                  [[4, 6, 6, 4], [6, 9, 9, 6], [4, 6, 6, 4]])
    assert not tok[3, 4] and not tok[4, 3]          # (0, 3) and (1, 0): raster-adjacent only
    assert tok[5, 0] and tok[5, 10] and not tok[5, 3]   # (1, 1): diagonals yes, (0, 3) no
    with pytest.raises(ValueError, match="causal"):
        analysis.window_graph_adjacency(12, window=1, causal=True, grid_width=4)


def test_cross_graph_adjacency_follows_the_centres():
    adj = analysis.cross_graph_adjacency_matrix(5, 8, window=1, num_global=2, rho=1.5)
    assert adj.shape == (5, 10)
    assert adj[:, :2].all()
    for i in range(5):
        c = min(round(1.5 * i), 7)
        want = [abs(j - c) <= 1 for j in range(8)]
        np.testing.assert_array_equal(adj[i, 2:], want)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_graph_attention_maps_are_the_coefficients_the_layers_use(version):
    """Each dense map, applied to the layer's own messages and output projection, gives the
    layer's output (so the maps are exactly its alpha), lies on the graph and sums to 1."""
    model = Model(**SEQ, gat_version=version, num_layers=1)   # one block: each kind once
    batch = _batch()
    params = _random_params(model, batch)
    maps = analysis.graph_attention_maps(model, params, batch)
    assert list(maps) == ["encoder/block_00/graph", "decoder_block_00/graph",
                          "decoder_block_00/cross_graph"]

    def layer_io(params, batch):
        """{path: (senders, mask, output)} of every graph layer (jitted: eager is slow)."""
        seen = {}

        def record(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if context.method_name == "__call__" and isinstance(
                    context.module, (WindowGraphAttention, CrossGraphAttention)):
                seen["/".join(context.module.scope.path)] = (args[-1], kwargs["mask"], out[0])
            return out

        with nn.intercept_methods(record):
            model.apply({"params": params}, batch)
        return seen

    seen = jax.tree_util.tree_map(np.asarray, jax.jit(layer_io)(params, batch))
    g = model.num_global
    for path, r in maps.items():
        senders, mask, y = seen[path]
        p = params
        for part in path.split("/"):
            p = p[part]
        # The reference in numpy: eagerly each jnp op compiles on its own.
        messages = np.einsum("bld,dhk->blhk", senders, p["source"]["kernel"])
        out = np.einsum("bhij,bjhk->bihk", r["map"], messages)
        y_ref = np.einsum("bihk,hkf->bif", out, p["output"]["kernel"]) + p["output"]["bias"]
        y_ref = np.where(mask[..., None], y_ref, np.float32(0.0))
        np.testing.assert_allclose(y_ref, y, **F32_SIMPLE)
        rows = np.asarray(mask)                           # [B, rows]
        sums = r["map"].sum(-1)                                      # [B, H, rows]
        np.testing.assert_allclose(sums, np.broadcast_to(rows[:, None], sums.shape), **F32_SIMPLE)
        if r["kind"] == "window":
            adj = analysis.window_graph_adjacency(S, window=r["window"], num_global=g)
            assert r["map"].shape == (B, 2, g + S, g + S)
            assert np.all(r["map"][:, :, ~adj] == 0)
        elif r["kind"] == "causal_window":
            adj = analysis.window_graph_adjacency(T, window=r["window"], causal=True)
            assert np.all(r["map"][:, :, ~adj] == 0)
        else:
            assert r["map"].shape == (B, 2, T, g + S)
            assert r["centres"].shape == (B, T)


def test_classifier_graph_maps_live_on_the_2d_stencil():
    model = Model(kind="classifier", variant="digits", num_classes=10, d_model=16, num_heads=2,
                  mlp_dim=32, num_features=8, num_layers=1)
    batch = {"image": np.random.default_rng(2).normal(size=(B, 8, 8, 1)).astype(np.float32)}
    maps = analysis.graph_attention_maps(model, _random_params(model, batch), batch)
    (r,) = maps.values()
    assert r["kind"] == "window" and r["grid_width"] == 4 and r["window"] == 1
    adj = analysis.window_graph_adjacency(16, window=1, num_global=1, grid_width=4)
    assert np.all(r["map"][:, :, ~adj] == 0) and np.all(r["map"][:, :, adj] > 0)
    np.testing.assert_allclose(r["map"].sum(-1), 1.0, **F32_SIMPLE)


def test_favor_error_curve_decreases_with_features():
    curve = analysis.favor_error_curve([4, 256], length=32, head_dim=4, num_draws=2,
                                      input_scale=0.5)
    assert curve["mean_abs_error"].shape == (2, 2)
    err = curve["mean_abs_error"].mean(1)
    assert err[1] < 0.5 * err[0]
    assert err[1] < 0.05                       # htgn.md §5.14 test 3 scale (0.003 at m=256, d=8)
    causal = analysis.favor_error_curve([256], length=32, head_dim=4, num_draws=1, causal=True,
                                       input_scale=0.5)
    assert causal["relative_error"][0, 0] < 0.2
    with pytest.raises(ValueError, match="num_features"):
        analysis.favor_error_curve([0])
