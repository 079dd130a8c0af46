"""agf_jax's argument errors in one table (issue 43): each row a call that must raise ValueError or TypeError
with a one-line message holding the fragment. Kernels (`ops`, `softmax`, `context_parallel`) check their
arguments once at their entry; layers check fields in `setup` and inputs at each call; the Model factory
checks its options and batches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agf_jax import context_parallel, convert, ops, softmax
from agf_jax.layers import AGFAttention, SoftmaxAttention
from agf_jax.model import Model
from tests.environment import sequence_mesh
from zoo_core import testing
from zoo_core.testing import TESTDATA, Golden

B, T, E, H, D = 2, 7, 8, 2, 4
X = jnp.ones((B, T, E))
Z = jnp.ones((B, T, H, D))
C = np.ones(2, np.float32)
IDS = jnp.array([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 0, 0, 0]], jnp.int32)
LRA = dict(kind="lra_classifier", variant="tiny", num_classes=4, vocab_size=10, max_len=8)
UEA = dict(kind="uea_classifier", variant="tiny", num_classes=4, feat_dim=3, max_len=T)
KEY = jax.random.key(0)


def _layer(method="__call__", *args, softmax_layer=False, **fields):
    """Builds, initialises and calls a layer; an argument "STATE" is the layer's `init_state(B)`."""
    call_kw = fields.pop("call_kw", {})
    cls = SoftmaxAttention if softmax_layer else AGFAttention
    layer = cls(num_heads=fields.pop("num_heads", H), head_dim=D, **fields)
    v = layer.init(KEY, X)
    args = tuple(layer.apply(v, B, method="init_state") if isinstance(a, str) else a for a in args) or (X,)
    layer.apply(v, *args, method=method, **call_kw)


def _model(batch=None, **kwargs):
    model = Model(**kwargs)
    if batch is not None:
        model.init(KEY, batch)



@functools.lru_cache(maxsize=None)
def _golden(name):
    return Golden(TESTDATA / "agf" / name)


def _convert(change=lambda p: p, layer=None):
    """`convert.convert_attention` of the UEA golden's reference attention, changed, into `layer` (default: the
    golden's own, 3 heads of 8, K=6, Jacobi(1.5, -1.5))."""
    layer = layer or AGFAttention(num_heads=3, head_dim=8, order=6, alpha=1.5, beta=-1.5)
    return lambda: convert.convert_attention(change(dict(_golden("agf_uea_attention_jacobi_fixI.npz").params)), layer)


def _convert_model(**changes):
    def call():
        golden = _golden("agf_lra_model.npz")
        return convert.convert_model(golden.params, convert.module_from_meta(golden.meta)[1].clone(**changes))
    return call

ROWS = [
    # Layer fields.
    ("num_heads", lambda: _layer(num_heads=0), "`num_heads` must be an integer >= 1"),
    ("basis name", lambda: _layer(basis="hermite"), "basis must be one of"),
    ("basis alpha", lambda: _layer(basis="legendre", alpha=1.0), "alpha/beta apply only to basis='jacobi'"),
    ("jacobi singular", lambda: _layer(basis="jacobi", alpha=-1.0, beta=-1.0), "singular"),
    ("jacobi finite", lambda: _layer(basis="jacobi", beta=float("inf")), "Jacobi alpha and beta must be finite"),
    ("order negative", lambda: _layer(order=-1), "`order` must be an integer >= 0"),
    ("order float", lambda: _layer(order=2.5), "`order` must be an integer >= 0"),
    ("chunk non-causal", lambda: _layer(chunk_size=4), "`chunk_size` applies only to causal=True"),
    ("chunk zero", lambda: _layer(causal=True, chunk_size=0), "`chunk_size` must be an integer >= 1"),
    ("dropout", lambda: _layer(dropout_rate=1.5), "`dropout_rate` must be in [0, 1)"),
    ("graph_filter", lambda: _layer(graph_filter="svdd"),
     "`graph_filter` must be one of ('agf', 'uvt', 'svd'), got 'svdd'"),
    ("learn_c0 variant", lambda: _layer(graph_filter="uvt", learn_c0=True),
     "`learn_c0` applies only to graph_filter='agf'"),
    ("sequence_axis", lambda: _layer(sequence_axis=3), "`sequence_axis` must be a mesh axis name or None"),
    ("softmax max_length", lambda: _layer(softmax_layer=True, max_length=8),
     "`max_length` applies only to causal=True"),
    ("softmax chunk", lambda: _layer(softmax_layer=True, chunk_size=2), "`chunk_size` applies only to causal=True"),
    # Layer calls.
    ("x rank", lambda: _layer("__call__", X[0]), "`x` must have rank 3"),
    ("mask shape", lambda: _layer(call_kw=dict(mask=jnp.ones((B, 5), bool))), "`mask` must have shape"),
    ("segment_ids shape", lambda: _layer(call_kw=dict(segment_ids=IDS[:, :5])), "`segment_ids` must have shape [B, T]"),
    ("segment_ids dtype", lambda: _layer(call_kw=dict(segment_ids=jnp.ones((B, T)))), "`segment_ids` must be integers"),
    ("scan non-causal", lambda: _layer("scan", X), "AGFAttention.scan exists only for causal=True"),
    ("scan segment_ids", lambda: _layer("scan", X, causal=True, call_kw=dict(segment_ids=IDS[:1])),
     "`segment_ids` must have shape [B, T]"),
    ("init_state non-causal", lambda: _layer("init_state", B), "init_state exists only for causal=True"),
    ("step x_t rank", lambda: _layer("step", "STATE", X, causal=True), "`x_t` must have rank 2"),
    ("step state", lambda: _layer("step", ops.init_state(B, H, D + 1), X[:, 0], causal=True), "state shapes"),
    ("softmax step non-causal", lambda: _layer("step", None, X[:, 0], softmax_layer=True),
     "step exists only for causal"),
    ("softmax cache size", lambda: _layer("init_state", B, softmax_layer=True, causal=True), "needs `max_length`"),
    ("softmax scan overflow", lambda: _layer("scan", X, softmax_layer=True, causal=True, max_length=4),
     "more than max_length = 4"),
    # The Model factory.
    ("model kind", lambda: _model(kind="imagenet", variant="tiny"), "`kind` must be one of"),
    ("model variant", lambda: _model(**dict(LRA, variant="huge")), "`variant` must be one of"),
    ("model unknown kwarg", lambda: _model(**LRA, feat_dim=3), "unknown Model kwargs"),
    ("model agf option", lambda: _model(**LRA, attention="softmax", order=3),
     "['order'] apply only to attention='agf'"),
    ("model missing", lambda: _model(kind="uea_classifier", variant="tiny", num_classes=2), "missing required"),
    ("ortho_weight negative", lambda: _model(**LRA, ortho_weight=-1.0), "`ortho_weight` must be a finite number >= 0"),
    ("ortho_weight nan", lambda: _model(**UEA, ortho_weight=float("nan")),
     "`ortho_weight` must be a finite number >= 0"),
    ("max_len", lambda: _model(**dict(UEA, max_len=0)), "`max_len` must be an integer >= 1"),
    ("model jacobi alpha", lambda: _model(**LRA, alpha=float("nan"), batch={"inputs": IDS}),
     "Jacobi alpha and beta must be finite"),
    ("model attention", lambda: _model(**UEA, attention="performer"), "`attention` must be one of"),
    ("attention_dropout", lambda: _model(**LRA, attention_dropout=0.1), "`attention_dropout` applies only to"),
    ("pooling", lambda: _model(**LRA, pooling="max"), "`pooling` must be one of"),
    ("activation", lambda: _model(**UEA, activation="tanh"), "`activation` must be one of"),
    ("pos_encoding", lambda: _model(**UEA, pos_encoding="rotary"), "`pos_encoding` must be one of"),
    ("num_layers", lambda: _model(**LRA, num_layers=0), "`num_layers` must be an integer >= 1"),
    ("model dropout", lambda: _model(**LRA, dropout_rate=1.0), "`dropout_rate` must be in"),
    ("plain is no field", lambda: _model(**LRA, plain=("dense",)), "'plain'"),
    ("model graph_filter", lambda: _model(**LRA, graph_filter="svdd"),
     "`graph_filter` must be one of ('agf', 'uvt', 'svd')"),
    ("model learn_c0", lambda: _model(**UEA, graph_filter="svd", learn_c0=True),
     "['learn_c0'] apply only to graph_filter='agf'"),
    ("model order variant", lambda: _model(**LRA, graph_filter="uvt", order=2),
     "['order'] apply only to graph_filter='agf'"),
    ("model favor filter", lambda: _model(**LRA, attention="favor", graph_filter="svd"),
     "apply only to attention='agf'"),
    ("attention_options agf", lambda: _model(**LRA, attention_options={"num_features": 8}),
     "`attention_options` apply to registry"),
    ("attention_options name", lambda: _model(**LRA, attention="favor", attention_options={"windo": 3}),
     "'favor' has no option"),
    ("favor dropout", lambda: _model(**LRA, attention="favor", attention_dropout=0.1),
     "pass dropout_rate in attention_options"),
    ("attention_options type", lambda: _model(**LRA, attention="linear", attention_options=3),
     "`attention_options` must be a mapping"),
    ("d_model heads", lambda: _model(**dict(UEA, d_model=18, num_heads=4), batch={"inputs": jnp.ones((B, T, 3))}),
     "`d_model` = 18 must be divisible by `num_heads` = 4"),
    # Batches.
    ("batch key", lambda: _model(**LRA, batch={"tokens": IDS}), "`batch` must contain 'inputs'"),
    ("batch dtype", lambda: _model(**LRA, batch={"inputs": IDS.astype(jnp.float32)}), "must be int [B, T"),
    ("batch length", lambda: _model(**LRA, batch={"inputs": jnp.ones((B, 9), jnp.int32)}), "max_len = 8"),
    ("uea inputs", lambda: _model(**UEA, batch={"inputs": jnp.ones((B, T + 1, 3))}), "batch['inputs']"),
    ("uea mask", lambda: _model(**UEA, batch={"inputs": jnp.ones((B, T, 3)), "mask": jnp.ones((B, 3), bool)}),
     "batch['mask']"),
    # AGF kernels (ops: basis, factors, fused, forms).
    ("parallel rank", lambda: ops.agf_parallel(Z[0], Z, Z, Z, C), "rank 4"),
    ("parallel zv shape", lambda: ops.agf_parallel(Z, Z[:, :3], Z, Z, C), "zv shape"),
    ("parallel val shape", lambda: ops.agf_parallel(Z, Z, Z, Z[:, :3], C), "val shape"),
    ("parallel mask", lambda: ops.agf_parallel(Z, Z, Z, Z, C, mask=jnp.ones((B, 6))), "`mask` must have shape"),
    ("parallel segment_ids", lambda: ops.agf_parallel(Z, Z, Z, Z, C, causal=True, segment_ids=IDS[:, :3]),
     "`segment_ids` must have shape"),
    ("parallel basis", lambda: ops.agf_parallel(Z, Z, Z, Z, C, basis="hermite"), "basis must be one of"),
    ("parallel coeffs", lambda: ops.agf_parallel(Z, Z, Z, Z, np.ones((2, 2))), "coeffs must be rank 1"),
    ("causal coeffs", lambda: ops.agf_parallel(Z, Z, Z, Z, np.ones((2, 2)), causal=True), "coeffs must be rank 1"),
    ("chunked chunk_size", lambda: ops.agf_chunked(Z, Z, Z, Z, C, chunk_size=0),
     "`chunk_size` must be an integer >= 1"),
    ("chunked_scan chunk_size", lambda: ops.agf_chunked_scan(Z, Z, Z, Z, C, chunk_size=2.0),
     "`chunk_size` must be an integer"),
    ("chunked_parallel mask", lambda: ops.agf_chunked_parallel(Z, Z, Z, Z, C, chunk_size=2, mask=jnp.ones((B,))),
     "`mask` must have shape"),
    ("chunked state", lambda: ops.agf_chunked(Z, Z, Z, Z, C, chunk_size=2, state=ops.init_state(B, H, D + 1, D)),
     "state shapes"),
    ("scan state", lambda: ops.agf_scan(Z, Z, Z, Z, C, state=ops.init_state(B, H, D + 1, D)), "state shapes"),
    ("scan segment_ids dtype", lambda: ops.agf_scan(Z, Z, Z, Z, C, segment_ids=jnp.ones((B, T))),
     "`segment_ids` must be integers"),
    ("step rank", lambda: ops.agf_step(ops.init_state(B, H, D), Z, Z, Z, Z, C), "rank 3"),
    ("step state", lambda: ops.agf_step(ops.init_state(B, H, D + 1), Z[:, 0], Z[:, 0], Z[:, 0], Z[:, 0], C),
     "state shapes"),
    ("attention_matrix mask", lambda: ops.agf_attention_matrix(Z, Z, Z, C, mask=jnp.ones((B, 3))),
     "`mask` must have shape"),
    ("fused mask", lambda: ops.agf_with_orthogonality(Z, Z, Z, Z, C, mask=jnp.ones((3, T))), "`mask` must have shape"),
    ("fused coeffs", lambda: ops.agf_with_orthogonality(Z, Z, Z, Z, np.ones(())), "coeffs must be rank 1"),
    ("fused segment_ids", lambda: ops.agf_with_orthogonality(Z, Z, Z, Z, C, segment_ids=IDS[:1]),
     "`segment_ids` must have shape"),
    ("factors rank", lambda: ops.agf_factors(Z[0], Z, Z, C), "rank 4"),
    ("orthogonality shape", lambda: ops.orthogonality_loss(Z, Z[:, :3]), "zv shape"),
    ("orthogonality segment_ids", lambda: ops.orthogonality_loss(Z, Z, segment_ids=IDS[:, :3]),
     "`segment_ids` must have shape"),
    ("left_factor coeffs", lambda: ops.left_factor(Z, Z, np.ones((2, 2))), "coeffs must be rank 1"),
    ("step basis", lambda: ops.agf_step(ops.init_state(B, H, D), Z[:, 0], Z[:, 0], Z[:, 0], Z[:, 0], C, basis="x"),
     "basis must be one of"),
    ("attention_matrix coeffs", lambda: ops.agf_attention_matrix(Z, Z, Z, np.ones(())), "coeffs must be rank 1"),
    ("masked_logits mask", lambda: ops.masked_logits(Z, jnp.ones((B, 2))), "`mask` must have shape"),
    ("polynomial order", lambda: ops.polynomial_basis(jnp.ones(3), -1), "order must be >= 0"),
    ("graph_filter coeffs", lambda: ops.graph_filter(jnp.ones(3), np.ones((2, 2))), "coeffs must be rank 1"),
    ("graph_filter basis", lambda: ops.graph_filter(jnp.ones(3), C, basis="chebyshev", beta=1.0),
     "alpha/beta apply only to basis='jacobi'"),
    ("basis_iter basis", lambda: ops.basis_iter(jnp.ones(3), 2, "hermite", None, None), "basis must be one of"),
    ("filter theta", lambda: ops.filter_coefficients(np.ones((2, 2))), "theta must be rank 1"),
    # Context parallelism.
    ("cp length", lambda: context_parallel.causal(Z, Z, Z, Z, C, chunk_size=2, mesh=sequence_mesh(2)),
     "must divide by the 'sequence' axis size 2"),
    ("cp axis", lambda: context_parallel.noncausal(Z, Z, Z, Z, C, mesh=sequence_mesh(2), axis_name="seq"),
     "the mesh has no axis 'seq'"),
    ("cp chunk_size", lambda: context_parallel.causal(Z, Z, Z, Z, C, chunk_size=-1, mesh=sequence_mesh(2)),
     "`chunk_size` must be an integer >= 1"),
    ("cp rank", lambda: context_parallel.orthogonality(Z[0], Z, mesh=sequence_mesh(2)), "rank 4"),
    ("cp segment_ids", lambda: context_parallel.noncausal(Z, Z, Z, Z, C, mesh=sequence_mesh(2), segment_ids=IDS[:, :2]),
     "`segment_ids` must have shape"),
    # Softmax kernels (agf_jax.softmax's public functions).
    ("softmax weights rank", lambda: softmax.softmax_attention_weights(Z[0], Z), "rank 4"),
    ("softmax parallel mask", lambda: softmax.softmax_parallel(Z, Z, Z, mask=jnp.ones((B, 3))),
     "`mask` must have shape"),
    ("softmax fused val", lambda: softmax.softmax_fused(Z, Z, Z[:, :2]), "val shape"),
    ("softmax chunked rank", lambda: softmax.softmax_chunked(Z, Z[0], Z, chunk_size=2), "rank 4"),
    ("softmax batched mask", lambda: softmax.softmax_chunked_batched(Z, Z, Z, chunk_size=2, mask=jnp.ones((1, T))),
     "`mask` must have shape"),
    ("softmax step cache", lambda: softmax.softmax_step(softmax.init_cache(B, 4, H, D + 1), Z[:, 0], Z[:, 0], Z[:, 0]),
     "do not match"),
    ("softmax scan rank", lambda: softmax.softmax_scan(Z[0], Z, Z, cache=softmax.init_cache(B, 4, H, D)), "rank 4"),
    ("softmax cross ids alone", lambda: softmax.softmax_cross(Z, Z, Z, segment_ids=IDS),
     "softmax cross-attention takes segment_ids (queries) and kv_segment_ids (keys) together"),
    ("softmax cp length", lambda: softmax.softmax_context_parallel(Z, Z, Z, mesh=sequence_mesh(2)),
     "must divide by the 'sequence' axis size 2"),
    ("softmax layer segment_ids shape", lambda: _layer(softmax_layer=True, causal=True, max_length=T,
                                                       call_kw=dict(segment_ids=IDS[:, :4])),
     "`segment_ids` must have shape [B, T]"),
    # convert: the reference checkpoints (tests/testdata/agf)
    ("convert unknown key", _convert(lambda p: {**p, "extra.weight": np.zeros(3)}),
     "unknown state_dict keys (not used by the conversion): ['extra.weight']"),
    ("convert missing key", _convert(lambda p: {k: v for k, v in p.items() if k != "Sigma_projection.bias"}),
     "Sigma_projection.bias"),
    ("convert theta_0 frozen", _convert(lambda p: {**p, "inner_attention.poly.thetas.0": np.float32(0.5)}), "learn_c0"),
    ("convert thetas beyond K", _convert(layer=AGFAttention(num_heads=3, head_dim=8, order=5, alpha=1.5, beta=-1.5)),
     "thetas.6"),
    ("convert num_heads", _convert(layer=AGFAttention(num_heads=2, head_dim=8, order=6)), "num_heads"),
    ("convert model layers", _convert_model(num_layers=3), "transformer_2"),
]


@pytest.mark.parametrize("call,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_argument_is_one_line(call, fragment):
    testing.assert_refused(call, fragment)
