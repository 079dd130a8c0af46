"""Every boundary error of agf_jax, one table: (what is called, its arguments, message regex)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agf_jax import ops
from agf_jax.layers import AGFAttention, SoftmaxAttention
from agf_jax.model import Model

B, T, E, H, D = 2, 7, 8, 2, 4
X = jnp.ones((B, T, E))
IDS = jnp.array([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 0, 0, 0]], jnp.int32)
LRA = dict(kind="lra_classifier", variant="tiny", num_classes=4, vocab_size=10, max_len=8)
UEA = dict(kind="uea_classifier", variant="tiny", num_classes=4, feat_dim=3, max_len=T)


def _layer(kwargs):
    """Builds, initialises and calls a layer: kwargs = fields + 'call' (method, args, kwargs)."""
    kwargs = dict(kwargs)
    cls = SoftmaxAttention if kwargs.pop("softmax", False) else AGFAttention
    method, args, call_kw = kwargs.pop("call", ("__call__", (X,), {}))
    layer = cls(num_heads=kwargs.pop("num_heads", H), head_dim=D, **kwargs)
    v = layer.init(jax.random.key(0), X)
    args = tuple(layer.apply(v, B, method="init_state") if isinstance(a, str) else a for a in args)
    layer.apply(v, *args, method=method, **call_kw)


def _model(kwargs):
    kwargs = dict(kwargs)
    batch = kwargs.pop("batch", None)
    model = Model(**kwargs)
    if batch is not None:
        model.init(jax.random.key(0), batch)


def _ops(kwargs):
    name, args, kw = kwargs["call"]
    getattr(ops, name)(*args, **kw)


Z = jnp.ones((B, T, H, D))
CASES = [
    # Layer fields.
    (_layer, dict(num_heads=0), r"`num_heads` must be an integer >= 1"),
    (_layer, dict(basis="hermite"), r"basis must be one of"),
    (_layer, dict(basis="legendre", alpha=1.0), r"alpha/beta apply only to basis='jacobi'"),
    (_layer, dict(basis="jacobi", alpha=-1.0, beta=-1.0), r"singular"),
    (_layer, dict(basis="jacobi", beta=float("inf")), r"Jacobi alpha and beta must be finite"),
    (_layer, dict(order=-1), r"`order` must be an integer >= 0"),
    (_layer, dict(order=2.5), r"`order` must be an integer >= 0"),
    (_layer, dict(chunk_size=4), r"`chunk_size` applies only to causal=True"),
    (_layer, dict(causal=True, chunk_size=0), r"`chunk_size` must be an integer >= 1"),
    (_layer, dict(dropout_rate=1.5), r"`dropout_rate` must be in \[0, 1\)"),
    (_layer, dict(softmax=True, max_length=8), r"`max_length` applies only to causal=True"),
    (_layer, dict(softmax=True, chunk_size=2), r"`chunk_size` applies only to causal=True"),
    # Layer calls.
    (_layer, dict(call=("__call__", (X[0],), {})), r"`x` must have rank 3"),
    (_layer, dict(call=("__call__", (X,), dict(mask=jnp.ones((B, 5), bool)))), r"`mask` must have shape"),
    (_layer, dict(call=("scan", (X,), {})), r"AGFAttention.scan exists only for causal=True"),
    (_layer, dict(call=("init_state", (B,), {})), r"init_state exists only for causal=True"),
    (_layer, dict(causal=True, call=("step", ("STATE", X), {})), r"`x_t` must have rank 2"),
    (_layer, dict(causal=True, call=("step", (ops.init_state(B, H, D + 1), X[:, 0]), {})),
     r"state shapes"),
    (_layer, dict(softmax=True, call=("step", (None, X[:, 0]), {})), r"step exists only for causal"),
    (_layer, dict(softmax=True, causal=True, call=("init_state", (B,), {})), r"needs `max_length`"),
    (_layer, dict(softmax=True, causal=True, max_length=4, call=("scan", (X,), {})),
     r"more than max_length = 4"),
    # The Model factory.
    (_model, dict(kind="imagenet", variant="tiny"), r"`kind` must be one of"),
    (_model, dict(LRA, variant="huge"), r"`variant` must be one of"),
    (_model, dict(LRA, feat_dim=3), r"unknown Model kwargs.*feat_dim"),
    (_model, dict(LRA, attention="softmax", order=3), r"\['order'\] apply only to attention='agf'"),
    (_model, dict(kind="uea_classifier", variant="tiny", num_classes=2), r"missing required"),
    (_model, dict(LRA, ortho_weight=-1.0), r"`ortho_weight` must be a finite number >= 0"),
    (_model, dict(UEA, ortho_weight=float("nan")), r"`ortho_weight` must be a finite number >= 0"),
    (_model, dict(UEA, max_len=0), r"`max_len` must be an integer >= 1"),
    (_model, dict(LRA, alpha=float("nan"), batch={"inputs": IDS}), r"Jacobi alpha and beta must be finite"),
    (_model, dict(UEA, attention="performer"), r"`attention` must be one of"),
    (_model, dict(LRA, attention_dropout=0.1), r"`attention_dropout` applies only to"),
    (_model, dict(LRA, pooling="max"), r"`pooling` must be one of"),
    (_model, dict(UEA, activation="tanh"), r"`activation` must be one of"),
    (_model, dict(UEA, pos_encoding="rotary"), r"`pos_encoding` must be one of"),
    (_model, dict(LRA, num_layers=0), r"`num_layers` must be an integer >= 1"),
    (_model, dict(LRA, dropout_rate=1.0), r"`dropout_rate` must be in"),
    (_model, dict(LRA, plain=("dense",)), r"unknown Model kwargs .*'plain'"),
    (_model, dict(LRA, graph_filter="svdd"), r"`graph_filter` must be one of \('agf', 'uvt', 'svd'\)"),
    (_model, dict(UEA, graph_filter="svd", learn_c0=True), r"\['learn_c0'\] apply only to graph_filter='agf'"),
    (_model, dict(LRA, graph_filter="uvt", order=2), r"\['order'\] apply only to graph_filter='agf'"),
    (_model, dict(LRA, attention="favor", graph_filter="svd"), r"apply only to attention='agf'"),
    (_model, dict(LRA, attention_options={"num_features": 8}), r"`attention_options` apply to registry"),
    (_model, dict(LRA, attention="favor", attention_options={"windo": 3}), r"'favor' has no option"),
    (_model, dict(LRA, attention="favor", attention_dropout=0.1), r"pass dropout_rate in attention_options"),
    (_model, dict(LRA, attention="linear", attention_options=3), r"`attention_options` must be a mapping"),
    (_model, dict(UEA, d_model=18, num_heads=4, batch={"inputs": jnp.ones((B, T, 3))}),
     r"`d_model` = 18 must be divisible by `num_heads` = 4"),
    # Batches.
    (_model, dict(LRA, batch={"tokens": IDS}), r"`batch` must contain 'inputs'"),
    (_model, dict(LRA, batch={"inputs": IDS.astype(jnp.float32)}), r"must be int \[B, T"),
    (_model, dict(LRA, batch={"inputs": jnp.ones((B, 9), jnp.int32)}), r"max_len = 8"),
    (_model, dict(UEA, batch={"inputs": jnp.ones((B, T + 1, 3))}), r"batch\['inputs'\]"),
    (_model, dict(UEA, batch={"inputs": jnp.ones((B, T, 3)), "mask": jnp.ones((B, 3), bool)}),
     r"batch\['mask'\]"),
    # Kernels.
    (_ops, dict(call=("agf_parallel", (Z[0], Z, Z, Z, np.ones(2)), {})), r"rank 4"),
    (_ops, dict(call=("agf_parallel", (Z, Z, Z, Z, np.ones(2)), dict(mask=jnp.ones((B, 6))))),
     r"mask"),
    (_ops, dict(call=("agf_chunked", (Z, Z, Z, Z, np.ones(2)), dict(chunk_size=0))),
     r"chunk_size"),
    (_ops, dict(call=("agf_scan", (Z, Z, Z, Z, np.ones(2)),
                      dict(state=ops.init_state(B, H, D + 1, D)))), r"state"),
]


@pytest.mark.parametrize("run,kwargs,message", CASES,
                         ids=[f"{i:02d}-{c[0].__name__[1:]}" for i, c in enumerate(CASES)])
def test_boundary_errors(run, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run(kwargs)
