"""Bad-argument rows of FAVOR+ and HRPE (htgn_jax.ops, random_features, hrpe, layers.FavorAttention,
context_parallel), for the one htgn table `tests/htgn_jax/bad_arguments_test.py` (issue 43 item 2).

`FAVOR_ROWS` is a list of `(id, call, fragment)`: `call` a zero-argument lambda that must raise
`ValueError` (or `TypeError`) with ONE line containing `fragment`. No tests here: the table test
parametrises over the rows.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from htgn_jax import hrpe, ops
from htgn_jax.layers import FavorAttention
from tests.environment import sequence_mesh

B, T, H, D, M = 2, 7, 2, 4, 8
E = H * D


def _qkv(length=T):
    return tuple(np.ones((B, length, H, D), np.float32) for _ in range(3))


@functools.lru_cache(maxsize=None)
def _omega():
    return np.asarray(ops.draw_projection(jax.random.PRNGKey(1), 0, num_features=M, dim=D))


def _x(length=T, width=E):
    return np.ones((B, length, width), np.float32)


def _layer(**kw):
    kw = {"num_heads": H, "head_dim": D, "use_rotary": True, **kw}
    if kw.get("feature_map", "softmax") == "softmax":
        kw.setdefault("num_features", M)
    return FavorAttention(**kw)


@functools.lru_cache(maxsize=None)
def _variables():
    """The parameter tree of every FAVOR+ option used below (it does not depend on them)."""
    return _layer().init(jax.random.PRNGKey(1), _x())


def _apply(*args, layer=None, **kwargs):
    return (layer or _layer()).apply(_variables(), *args, **kwargs)


def _field(**kw):
    """A bad field: raised by setup at the first (tracing) call."""
    return lambda: jax.eval_shape(_layer(**kw).init, jax.random.PRNGKey(0), _x())


def _state(layer):
    return layer.apply(_variables(), B, method="init_state")


def _split(mesh: bool):
    """FavorAttention with `sequence_axis="sequence"` on T = 7 tokens, under a 2-device mesh or none."""
    def call():
        if not mesh:
            return _apply(_x(), layer=_layer(sequence_axis="sequence"))
        with jax.set_mesh(sequence_mesh(2)):
            return _apply(_x(), layer=_layer(sequence_axis="sequence"))
    return call


_ids = np.ones((B, T), np.int32)
_attn = functools.partial(ops.favor_attention, *_qkv())
_causal = _layer(causal=True)
_cross = _layer(use_rotary=False)

FAVOR_ROWS = [
    # htgn_jax.ops (kernels) and random_features
    ("favor_feature_map", lambda: _attn(feature_map="cosine"), "feature_map"),
    ("favor_key_mask_shape", lambda: _attn(projection=_omega(), key_mask=np.ones((B, T + 1), bool)), "key_mask"),
    ("favor_projection_missing", lambda: _attn(), "projection"),
    ("favor_projection_for_relu", lambda: _attn(feature_map="relu", projection=_omega()), "projection"),
    ("favor_projection_shape", lambda: _attn(projection=np.ones((M, D + 1), np.float32)), "projection"),
    ("favor_key_stabiliser", lambda: _attn(projection=_omega(), key_stabiliser="mean"), "key_stabiliser"),
    ("favor_chunk_size", lambda: _attn(projection=_omega(), causal=True, chunk_size=0), "chunk_size"),
    ("favor_causal_impl", lambda: _attn(projection=_omega(), causal=True, causal_impl="fft"), "causal_impl"),
    ("favor_causal_lengths", lambda: ops.favor_attention(*_qkv()[:1], *_qkv(T + 1)[1:], projection=_omega(),
                                                         causal=True), "equal lengths"),
    ("favor_segment_ids_shape", lambda: _attn(projection=_omega(), segment_ids=np.ones((B, T + 1), np.int32)),
     "segment_ids"),
    ("favor_segment_ids_dtype", lambda: _attn(projection=_omega(), segment_ids=np.ones((B, T), np.float32)),
     "integers"),
    ("favor_kv_segment_ids_alone", lambda: _attn(projection=_omega(), kv_segment_ids=_ids), "needs `segment_ids`"),
    ("favor_kv_segment_ids_causal", lambda: _attn(projection=_omega(), causal=True, segment_ids=_ids,
                                                  kv_segment_ids=_ids), "self-attention"),
    ("favor_cross_needs_kv_ids", lambda: ops.favor_attention(*_qkv()[:1], *_qkv(T + 1)[1:], projection=_omega(),
                                                             segment_ids=_ids), "kv_segment_ids"),
    ("favor_parallel_kv_ids_alone", lambda: ops.favor_parallel(*_qkv(), kv_segment_ids=_ids), "needs `segment_ids`"),
    ("features_rank", lambda: ops.softmax_kernel_features(_qkv()[0][0], _omega(), is_query=True), "rank 4"),
    ("features_query_mask", lambda: ops.softmax_kernel_features(_qkv()[0], _omega(), is_query=True,
                                                                mask=np.ones((B, T), bool)), "keys only"),
    ("features_map", lambda: ops.favor_features(*_qkv()[:2], feature_map="exact"), "feature_map"),
    ("trig_key_stabiliser", lambda: ops.trig_kernel_features(_qkv()[0], _omega(), is_query=False,
                                                             key_stabiliser="mean"), "key_stabiliser"),
    ("exact_causal_lengths", lambda: ops.exact_softmax_attention(*_qkv()[:1], *_qkv(T + 1)[1:], causal=True),
     "equal lengths"),
    ("draw_redraw_every", lambda: ops.draw_projection(jax.random.PRNGKey(0), 3, num_features=M, dim=D,
                                                      redraw_every=-1), "redraw_every"),
    ("draw_num_features", lambda: ops.draw_projection(jax.random.PRNGKey(0), 0, num_features=0, dim=D),
     "num_features"),
    ("orthogonal_scaling", lambda: ops.gaussian_orthogonal_random_matrix(jax.random.PRNGKey(0), M, D, scaling=2),
     "scaling"),
    # htgn_jax.hrpe
    ("rotary_positions", lambda: hrpe.apply_rotary(jnp.zeros((B, T, H, D)), jnp.arange(T + 1)), "positions"),
    ("rotary_head_dim", lambda: hrpe.apply_rotary(jnp.zeros((B, T, H, 5)), jnp.arange(T)), "head_dim"),
    ("path_pe_basis", lambda: hrpe.path_graph_pe(T, 3, basis="spectral"), "basis"),
    ("masked_pe_rank", lambda: hrpe.masked_path_graph_pe(jnp.ones((T,), bool), 3), "mask"),
    ("masked_pe_segment_ids", lambda: hrpe.masked_path_graph_pe(jnp.ones((B, T), bool), 3,
                                                                segment_ids=np.ones((B, T + 1), np.int32)),
     "segment_ids"),
    ("masked_skip_pe_segment_ids", lambda: hrpe.masked_skip_path_graph_pe(jnp.ones((B, T), bool), 3, (2,),
                                                                          segment_ids=np.ones((B, 2), np.int32)),
     "segment_ids"),
    ("grid_pe_num_pe", lambda: hrpe.grid_graph_pe(2, 2, 4), "num_pe"),
    ("adjacency_pe_num_pe", lambda: hrpe.adjacency_graph_pe(hrpe.path_adjacency(4), 4), "num_pe"),
    ("adjacency_pe_square", lambda: hrpe.adjacency_graph_pe(np.ones((3, 4)), 1), "square"),
    # htgn_jax.layers.FavorAttention: fields (setup) and method arguments
    ("layer_x_rank", lambda: _apply(np.zeros((B, E), np.float32)), "`x` must have rank 3"),
    ("layer_mask_shape", lambda: _apply(_x(), mask=np.ones((B, T + 1), bool)), "mask"),
    ("layer_positions_shape", lambda: _apply(_x(), positions=np.arange(T + 1)), "positions"),
    ("layer_positions_without_rotary", lambda: _apply(_x(), positions=np.arange(T), layer=_cross), "positions"),
    ("layer_segment_ids_shape", lambda: _apply(_x(), segment_ids=np.ones((B, T + 1), np.int32)), "segment_ids"),
    ("layer_cross_needs_both_ids", lambda: _apply(_x(), _x(), segment_ids=_ids, layer=_cross, method="cross"),
     "kv_segment_ids"),
    ("layer_cross_kv_ids_shape", lambda: _apply(_x(), _x(), segment_ids=_ids, kv_segment_ids=np.ones((B, 2), np.int32),
                                                layer=_cross, method="cross"), "kv_segment_ids"),
    ("layer_feature_map", _field(feature_map="cosine"), "feature_map"),
    ("layer_num_features_for_relu", _field(feature_map="relu", num_features=8), "num_features"),
    ("layer_exact_has_no_features", lambda: _apply(_x(), layer=_layer(feature_map="exact"), method="cross_cache"),
     "kernel feature_map"),
    ("layer_redraw_for_elu", _field(feature_map="elu", redraw_every=10), "redraw_every"),
    ("layer_head_dim_odd", _field(head_dim=3), "head_dim"),
    ("layer_chunk_size", _field(chunk_size=0, causal=True), "chunk_size"),
    ("layer_chunk_size_noncausal", _field(chunk_size=4), "chunk_size` applies only to causal=True"),
    ("layer_sequence_axis_exact", _field(feature_map="exact", sequence_axis="sequence"), "sequence_axis"),
    ("layer_sequence_axis_type", _field(sequence_axis=3), "sequence_axis"),
    ("layer_sequence_axis_no_mesh", lambda: _apply(_x(), layer=_layer(sequence_axis="sequence")),
     "the mesh has no axis 'sequence'"),
    ("layer_scan_needs_causal", lambda: _apply(_x(), method="scan"), "causal=True"),
    ("layer_cross_needs_noncausal", lambda: _apply(_x(), _x(), layer=_causal, method="cross"), "needs causal=False"),
    ("layer_cross_needs_no_rotary", lambda: _apply(_x(), _x(), method="cross"), "use_rotary=False"),
    ("layer_step_position_shape", lambda: _apply(_state(_causal), _x()[:, 0], position=np.zeros((B + 1,), np.int32),
                                                 layer=_causal, method="step"), "position"),
    ("layer_exact_has_no_state", lambda: _apply(B, layer=_layer(causal=True, feature_map="exact"),
                                                method="init_state"), "exact"),
    ("layer_step_needs_position", lambda: _apply(_state(_causal), _x()[:, 0], layer=_causal, method="step"),
     "position` is required"),
    ("layer_scan_state_needs_positions", lambda: _apply(_x()[:, :3], _state(_causal), layer=_causal, method="scan"),
     "positions` is required"),
    ("layer_memory_mask_shape", lambda: _apply(_x(), _x(length=16), memory_mask=np.ones((B, T), bool), layer=_cross,
                                               method="cross"), "memory_mask"),
    ("layer_feature_step_required", lambda: _apply(_x(), deterministic=False, layer=_layer(redraw_every=5)),
     "feature_step"),
    ("layer_sequence_length", _split(mesh=True), "must divide by the 'sequence' axis size 2"),
    ("layer_sequence_no_mesh", _split(mesh=False), "the mesh has no axis 'sequence'"),
]
