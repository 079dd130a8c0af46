"""samovar_jax's argument errors in one table (issue 43): each row a call that must raise ValueError or
TypeError with a one-line message holding the fragment. Kernels (`ops`, `context_parallel`) check their
arguments once at their entry; layers check fields in `setup` and inputs at each call."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from samovar_jax import analysis, context_parallel, convert, modules, ops
from samovar_jax.baselines import DLinear
from samovar_jax.layers import LinearAttention, LinTransBlock, VARChain
from samovar_jax.model import Model
from tests.environment import sequence_mesh
from zoo_core import testing
from zoo_core.testing import TESTDATA, Golden

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


# The Model's shapes: C=2 channels, L_I=10, P=3 (as tests/samovar_jax/model_test.py).
_BASE = dict(kind="samovar", num_channels=2, input_len=10, patch_len=3, variant="tiny", width=8)
_XM = np.ones((2, 10, 2), np.float32)
_DLINEAR = dict(num_channels=2, input_len=16, horizon=7, kernel_size=5)   # as tests/samovar_jax/baselines_test.py


def _model(**fields):
    return lambda: Model(**{**_BASE, **fields})


def _model_apply(batch, *args, **kwargs):
    """Applies the tiny SAMoVAR Model (parameters made on a good batch) to `batch`."""
    model = Model(**_BASE)
    return lambda: model.apply(model.init(KEY, {"inputs": _XM}), batch, *args, **kwargs)


def _dlinear_init(batch):
    model = DLinear(**_DLINEAR)
    return lambda: jax.eval_shape(lambda: model.init(KEY, batch))


@functools.lru_cache(maxsize=None)
def _golden(name):
    return Golden(TESTDATA / "samovar" / name)


def _convert(params_change, golden="samovar_padded.npz"):
    """`convert.convert_state_dict` of samovar_padded.npz's parameters, changed, into `golden`'s model."""
    g = _golden("samovar_padded.npz")
    return lambda: convert.convert_state_dict(params_change(dict(g.params)),
                                              convert.model_from_meta(_golden(golden).meta))


def _reference(**configs):
    return lambda: convert.model_kwargs_from_reference(
        dict(_golden("fixedvar.npz").meta["constructor_args"]["configs"], **configs.pop("extra", {})), **configs)


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
                                                                  mesh=sequence_mesh(2)),
     "must divide by the 'sequence' axis size 2"),
    ("context parallel axis",
     lambda: context_parallel.var_chain(X0, Q, Q, chunk_size=2, mesh=sequence_mesh(2), axis_name="seq"),
     "the mesh has no axis 'seq'"),
    ("context parallel chunk_size", lambda: context_parallel.var_chain(X0, Q, Q, chunk_size=0, mesh=sequence_mesh(2)),
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
    # the Model factory: options
    ("model kind=transformer", _model(kind="transformer"), "kind"),
    ("model variant=huge", _model(variant="huge"), "variant"),
    ("model num_heads=3", _model(num_heads=3), "divisible by `num_heads`"),
    ("model kind=lintrans num_heads=0", _model(kind="lintrans", num_heads=0), "num_heads`=0"),
    ("model kind=lintrans use_qv_norm=False", _model(kind="lintrans", use_qv_norm=False), "use_qv_norm"),
    ("model kind=fixedvar use_key_proj=True", _model(kind="fixedvar", use_key_proj=True), "use_key_proj"),
    ("model kind=lintrans structural=lu", _model(kind="lintrans", structural="lu"), "structural"),
    ("model structural=qr", _model(structural="qr"), "structural"),
    ("model norm_mean=median", _model(norm_mean="median"), "norm_mean"),
    ("model attention_form", _model(attention_form="chunked"),   # replaced by chunk_size
     "unknown Model kwargs for kind='samovar': ['attention_form']"),
    ("model horizon=6 num_targets=1", _model(horizon=6, num_targets=1), "num_targets == num_channels"),
    ("model horizon=6", _model(horizon=6), "max_patches"),
    ("model input_len=3", _model(input_len=3), "at least 2 patches"),
    ("model num_targets=3", _model(num_targets=3), "num_targets"),
    ("model dropout=1.0", _model(dropout=1.0), "dropout"),
    ("model chunk_size=0", _model(chunk_size=0), "chunk_size"),
    ("model dtype=float33", _model(dtype="float33"), "dtype"),
    ("model mlp_ratio=2.5", _model(mlp_ratio=2.5), "`mlp_ratio` must be an integer"),
    ("model num_layers=True", _model(num_layers=True), "`num_layers` must be an integer"),
    ("model fixed_max_tokens=64", _model(fixed_max_tokens=64), "`fixed_max_tokens` applies to kind in"),
    ("model kind=dlinear variant=tiny", _model(kind="dlinear", variant="tiny"), "variant"),
    ("model channel_drop=yes", _model(channel_drop="yes"), "`channel_drop` must be True or False"),
    # the Model: batches and the rollout mode
    ("model batch key", _model_apply({"x": _XM}), "'inputs'"),
    ("model batch rank", _model_apply({"inputs": _XM[0]}), "batch['inputs']"),
    ("model batch channels", _model_apply({"inputs": _XM[..., :1]}), "C=2"),
    ("model batch length", _model_apply({"inputs": _XM[:, 1:]}), "L_I=10"),
    ("model batch dtype", _model_apply({"inputs": _XM.astype(np.int32)}), "floating"),
    ("model rollout mode", _model_apply({"inputs": _XM}, 1, mode="beam", method="rollout"), "mode"),
    # baselines.DLinear
    ("dlinear kernel_size", lambda: DLinear(**{**_DLINEAR, "kernel_size": 4}), "`kernel_size` must be odd"),
    ("dlinear horizon", lambda: DLinear(**{**_DLINEAR, "horizon": 0}), "`horizon` must be an integer >= 1"),
    ("dlinear num_targets", lambda: DLinear(**_DLINEAR, num_targets=3), "num_targets"),
    ("dlinear dtype", lambda: DLinear(**_DLINEAR, dtype="nonsense"), "dtype"),
    ("dlinear input length", _dlinear_init({"inputs": jnp.zeros((2, 15, 2))}), "input_len=16"),
    ("dlinear batch key", _dlinear_init({"x": jnp.zeros((2, 16, 2))}), "'inputs'"),
    ("dlinear batch dtype", _dlinear_init({"inputs": jnp.zeros((2, 16, 2), jnp.int32)}), "floating"),
    # analysis
    ("analysis lintrans lags", lambda: (lambda lin: analysis.model_lag_matrices(
        lin, lin.init(KEY, {"inputs": _XM})["params"], {"inputs": _XM}))(Model(**{**_BASE, "kind": "lintrans"})),
     "LinTrans has no VAR chain"),
    ("analysis negative lag", lambda: analysis.num_temporal_paths(-1, 2), "need lag >= 0 and depth >= 1"),
    ("analysis coefficient shapes", lambda: analysis.var_coefficient_distance(np.zeros((2, 3, 3)), np.zeros((3, 3, 2))),
     "coefficients"),
    # convert: the reference checkpoints (tests/testdata/samovar)
    ("convert unknown key", _convert(lambda p: dict(p, **{"transformer.attn.0.k_proj.weight": np.zeros((32, 32))})),
     "unknown state_dict keys: transformer.attn.0.k_proj.weight"),
    ("convert missing key", _convert(lambda p: {k: v for k, v in p.items() if k != "transformer.generate_S.LU"}),
     "no state_dict entry: structural/theta"),
    ("convert wrong shape", _convert(lambda p: dict(p, **{"final_norm.weight": np.ones(16)})),
     "final_norm.weight (16,) -> final_norm/scale needs (32,)"),
    ("convert other kind", _convert(lambda p: p, golden="lintrans.npz"), "unknown state_dict keys"),
    ("reference time_emb_dim", _reference(extra=dict(time_emb_dim=4), kind="fixedvar"), "time_emb_dim"),
    ("reference predictor", _reference(kind="samovar"), "predictor"),
    ("reference official_class", lambda: convert.kind_from_meta({"official_class": "AGF_LRA/attention.py::Attention"}),
     "official_class"),
]


@pytest.mark.parametrize("call,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_argument_is_one_line(call, fragment):
    testing.assert_refused(call, fragment)
