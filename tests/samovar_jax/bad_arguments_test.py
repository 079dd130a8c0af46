"""samovar_jax's argument errors in one table (issue 43): each row a call that must raise ValueError or
TypeError with a one-line message holding the fragment. Kernels (`ops`, `context_parallel`) check their
arguments once at their entry; layers check fields in `setup` and inputs at each call."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samovar_jax import modules, context_parallel, ops
from samovar_jax.layers import LinearAttention, LinTransBlock, VARChain
from zoo_core import testing

B, T, E, H, L = 2, 8, 8, 2, 2
D = E // H
_rng = np.random.default_rng(0)
X = _rng.standard_normal((B, T, E)).astype(np.float32)
X0 = _rng.standard_normal((B, T, H, D)).astype(np.float32)
Q = _rng.standard_normal((L, B, T, H, D)).astype(np.float32)
IDS = np.array([[1] * 5 + [2] * 3, [1] * 8], np.int32)
KEY = jax.random.PRNGKey(0)


@functools.lru_cache(maxsize=None)
def _attention():
    la = LinearAttention(num_heads=H, head_dim=4)
    return la, la.init(KEY, X)


@functools.lru_cache(maxsize=None)
def _chain(**fields):
    chain = VARChain(E, H, L, **fields)
    return chain, chain.init(KEY, X)


_FIXED = dict(qv_source="fixed", use_qv_norm=False, max_tokens=T)


def _mesh():
    return jax.make_mesh((2,), ("sequence",), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))


ROWS = [
    # ops: the VAR chain kernels
    ("chain q without L", lambda: ops.var_chain_parallel(X0, Q[0], Q[0]), "the VAR chain expects"),
    ("chain x0 rank", lambda: ops.var_chain_chunked(X0[0], Q, Q, 2), "`x0` must have rank 4"),
    ("chain key_kernels", lambda: ops.var_chain_parallel(X0, Q, Q, key_kernels=np.zeros((L, E, 3))),
     "`key_kernels` must have shape [L, E, E]"),
    ("chain dropout_mask", lambda: ops.var_chain_scan(X0, Q, Q, dropout_mask=Q[:, :1]),
     "`dropout_mask` must have shape"),
    ("chain chunk_size", lambda: ops.var_chain_chunked(X0, Q, Q, 0), "`chunk_size` must be an integer >= 1"),
    ("chain batched chunk_size", lambda: ops.var_chain_chunked_batched(X0, Q, Q, 1.5),
     "`chunk_size` must be an integer >= 1"),
    ("chain mask", lambda: ops.var_chain_parallel(X0, Q, Q, mask=np.ones((B, T + 1), bool)),
     "`mask` must have shape [B, T]"),
    ("chain segment_ids shape", lambda: ops.var_chain_chunked(X0, Q, Q, 2, segment_ids=IDS[:, :4]),
     "`segment_ids` must have shape [B, T]"),
    ("chain segment_ids dtype", lambda: ops.var_chain_scan(X0, Q, Q, segment_ids=IDS.astype(np.float32)),
     "`segment_ids` must be integers"),
    ("chain state", lambda: ops.var_chain_scan(X0, Q, Q, state=np.zeros((L, B, H, D, D + 1))),
     "`state` must have shape [L, B, H, D, D]"),
    ("chain layers lengths", lambda: ops.var_chain_layers(X0, list(Q), list(Q)[:1]), "the VAR chain expects"),
    ("chain layers shapes", lambda: ops.var_chain_layers(X0, [a[:, :3] for a in Q], list(Q)), "x0's shape"),
    ("chain step state", lambda: ops.var_chain_step(np.zeros((L + 1, B, H, D, D)), X0[:, 0], Q[:, :, 0], Q[:, :, 0]),
     "`state` must have shape [L, B, H, D, D]"),
    ("chain step q", lambda: ops.var_chain_step(np.zeros((L, B, H, D, D)), X0[:, 0], Q[:, :, 0, 0], Q[:, :, 0]),
     "the VAR chain expects"),
    ("per_head_product", lambda: ops.per_head_product(np.zeros((2, 5, 3, 3)), np.zeros((3, 4, 4))),
     "`x` must be [..., 3, 4]"),
    ("instance norm mean_mode", lambda: ops.instance_norm_stats(X, 4, "median"), "mean_mode"),
    # context_parallel
    ("context parallel length", lambda: context_parallel.var_chain(X0[:, :7], Q[:, :, :7], Q[:, :, :7], chunk_size=2,
                                                                  mesh=_mesh()),
     "must divide by the 'sequence' axis size 2"),
    ("context parallel axis", lambda: context_parallel.var_chain(X0, Q, Q, chunk_size=2, mesh=_mesh(), axis_name="seq"),
     "the mesh has no axis 'seq'"),
    ("context parallel chunk_size", lambda: context_parallel.var_chain(X0, Q, Q, chunk_size=0, mesh=_mesh()),
     "`chunk_size` must be an integer >= 1"),
    # layers
    ("attention rank", lambda: _attention()[0].init(KEY, X[0]), "`x` must have rank 3"),
    ("attention chunk_size", lambda: _attention()[0].clone(chunk_size=0).init(KEY, X), "`chunk_size`"),
    ("attention sequence_axis", lambda: _attention()[0].clone(sequence_axis=1).init(KEY, X), "`sequence_axis`"),
    ("attention mask shape", lambda: _attention()[0].apply(_attention()[1], X, mask=np.ones((B, T + 1), bool)),
     "`mask` must have shape"),
    ("attention scan segment_ids", lambda: _attention()[0].apply(_attention()[1], X, segment_ids=IDS[:1],
                                                                 method="scan"), "`segment_ids` must have shape"),
    ("attention cross memory rank", lambda: _attention()[0].apply(_attention()[1], X, X[0], method="cross"),
     "`memory` must have rank 3"),
    ("attention cross memory batch", lambda: _attention()[0].apply(_attention()[1], X, X[:1], method="cross"),
     "must have x's batch 2"),
    ("attention step rank", lambda: _attention()[0].apply(_attention()[1], _attention()[0].init_state(B), X,
                                                          method="step"), "`x_t` must have rank 2"),
    ("chain positions (SAMoVAR)", lambda: _chain()[0].apply(_chain()[1], X, positions=np.arange(T)),
     "qv_source='fixed'"),
    ("chain step position (SAMoVAR)", lambda: _chain()[0].apply(
        _chain()[1], _chain()[0].apply(_chain()[1], B, method="init_state"), X[:, 0], position=jnp.asarray(0),
        method="step"), "qv_source='fixed'"),
    ("chain step rank", lambda: _chain()[0].apply(_chain()[1], _chain()[0].apply(_chain()[1], B, method="init_state"),
                                                  X, method="step"), "`x0_t` must have rank 2"),
    ("chain width", lambda: VARChain(E, 3, 2).init(KEY, X), "divisible by `num_heads`"),
    ("chain qv_source", lambda: VARChain(E, H, 2, qv_source="free").init(KEY, X), "qv_source"),
    ("chain sequence_axis", lambda: VARChain(E, H, 2, sequence_axis=("a",)).init(KEY, X), "`sequence_axis`"),
    ("chain fixed with norms", lambda: VARChain(E, H, 2, qv_source="fixed").init(KEY, X), "FixedVAR"),
    ("chain fixed rows", lambda: VARChain(E, H, 2, **_FIXED, num_channels=3).init(KEY, X), "FixedVAR rows"),
    ("chain fixed positions shape", lambda: _chain(**_FIXED)[0].apply(_chain(**_FIXED)[1], X,
                                                                      positions=np.zeros((T + 1,), np.int32)),
     "`positions` must be [T]"),
    ("chain fixed packed scan", lambda: _chain(**_FIXED)[0].apply(_chain(**_FIXED)[1], X, segment_ids=IDS,
                                                                  method="scan"),
     "a packed FixedVAR `scan` needs `positions`"),
    ("chain x0 width", lambda: _chain()[0].init(KEY, X[..., :4]), "`x0` must be [B, T, 8]"),
    ("chain layer_outputs width", lambda: _chain()[0].apply(_chain()[1], X[..., :4], method="layer_outputs"),
     "`x0` must be [B, T, 8]"),
    ("chain segment_ids dtype", lambda: _chain(chunk_size=3)[0].apply(_chain()[1], X,
                                                                      segment_ids=IDS.astype(np.float32)),
     "`segment_ids` must be integers"),
    ("block width", lambda: LinTransBlock(E, 3, 16).init(KEY, X), "divisible by `num_heads`"),
    ("rms norm width", lambda: modules.RMSNorm(8).init(KEY, np.ones((2, 1), np.float32)), "[..., 8]"),
    ("embedding positions", lambda: modules.ARXEmbedding(num_targets=1, max_tokens=4, width=E).init(KEY, jnp.arange(6)),
     "token positions must be in [0, max_tokens=4)"),
    ("tokenizer segments", lambda: modules.ARXTokenizer(5, 3, 2, E).init(KEY, np.ones((B, 2, 4, 5), np.float32)),
     "segments"),
]


@pytest.mark.parametrize("call,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_argument_is_one_line(call, fragment):
    testing.assert_refused(call, fragment)
