"""Every boundary error of HTGN's kernels and layers (issue 43 item 2): one table, `ROWS`, of
(id, call, fragment): `call` must raise a ValueError or TypeError whose message holds `fragment` and
is one line. The kernels check their arguments once at their public entry, the layers their fields in
setup and their inputs at each method; everything raises while tracing, before anything compiles."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htgn_jax import WindowState, decoding
from htgn_jax import graph_context_parallel as GCP
from htgn_jax import graph_ops as G
from htgn_jax.graph_layers import CrossGraphAttention, WindowGraphAttention
from htgn_jax.model import Model
from tests.environment import sequence_mesh
from tests.htgn_jax.bad_argument_rows_favor import FAVOR_ROWS
from zoo_core import testing

B, N, H, D, W, NG = 2, 7, 2, 4, 2, 2      # batch, tokens, heads, head dim, window, globals
WIDTH = H * D

_X = np.ones((B, N + NG, WIDTH), np.float32)
_WIN = WindowGraphAttention(num_heads=H, window=W, num_global=NG)
_CAUSAL = WindowGraphAttention(num_heads=H, window=W, causal=True)
_CROSS = CrossGraphAttention(num_heads=H, window=1, num_global=NG)
_Q = np.ones((B, 5, H, 4), np.float32)
_F = np.ones((B, N, H, D), np.float32)
_A = np.ones((H, D), np.float32)
_IDS = np.ones((B, N), np.int32)

_SEQ = dict(kind="seq2seq", variant="test", num_layers=1, source_vocab_size=11, target_vocab_size=9,
            max_source_len=16, max_target_len=16)
_CLS = dict(kind="classifier", variant="digits", num_classes=10, d_model=16, num_heads=2, mlp_dim=32, num_features=8)


def _model(**fields):
    return lambda: Model(**{**_SEQ, **fields})


def _seq2seq(change):
    """`Model(**_SEQ)` traced (`jax.eval_shape`) on a good seq2seq batch [2, 7] changed by `change`."""
    batch = {"inputs": np.full((B, 7), 3, np.int32), "targets": np.full((B, 7), 4, np.int32)}
    return lambda: jax.eval_shape(lambda b: Model(**_SEQ).init(jax.random.PRNGKey(0), b), change(batch))


def _classify(batch):
    return lambda: jax.eval_shape(lambda b: Model(**_CLS).init(jax.random.PRNGKey(0), b), batch)


def _init(layer, *args, **kwargs):
    return jax.jit(layer.init)(jax.random.PRNGKey(0), *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _win_vars():
    return _init(_WIN, _X)


@functools.lru_cache(maxsize=None)
def _causal_vars():
    return _init(_CAUSAL, _X)


def _sharded(length=N + 1, **kw):
    f = np.ones((B, length, H, D), np.float32)
    return GCP.window_graph_attention(f, f, f, _A, axis_name=kw.pop("axis_name", "sequence"),
                                      mesh=sequence_mesh(2), **{"window": W, **kw})



@functools.lru_cache(maxsize=None)
def _abstract_params():
    """The seq2seq model's parameter shapes (max_target_len=8): the searches check their arguments first."""
    model = Model(**{**_SEQ, "max_target_len": 8})
    batch = {"inputs": np.full((B, 7), 3, np.int32), "targets": np.zeros((B, 7), np.int32)}
    return jax.eval_shape(model.init, jax.random.PRNGKey(0), batch)["params"]


def _search(search, inputs=None, **kwargs):
    """`decoding.<search>` of the seq2seq model (max_target_len=8, or `kwargs["model"]`'s) on `inputs`."""
    model = kwargs.pop("model", Model(**{**_SEQ, "max_target_len": 8}))
    inputs = np.full((B, 7), 3, np.int32) if inputs is None else inputs
    return lambda: getattr(decoding, search)(model, _abstract_params(), inputs, **kwargs)

ROWS = [
    # --- WindowGraphAttention: fields (setup) and inputs -------------------------------------------
    ("window-x-rank", lambda: _WIN.apply(_win_vars(), _X[0]), "`x` must have rank 3"),
    ("window-mask-shape", lambda: _WIN.apply(_win_vars(), _X, mask=np.ones((B, N), np.float32)),
     "`mask` must have shape"),
    ("window-mask-shape-traced",
     lambda: jax.jit(lambda x_: _WIN.apply(_win_vars(), x_, mask=jnp.ones((1, 1)))).lower(_X),
     "`mask` must have shape"),
    ("window-heads-divide", lambda: _init(WindowGraphAttention(num_heads=3, window=W), _X),
     "not divisible by num_heads"),
    ("window-negative", lambda: _init(WindowGraphAttention(num_heads=H, window=-1), _X), "`window`"),
    ("window-version", lambda: _init(WindowGraphAttention(num_heads=H, window=W, version="v3"), _X),
     "`version`"),
    ("window-kl-tau", lambda: _init(WindowGraphAttention(num_heads=H, window=W, kl_tau=-1.0), _X),
     "`kl_tau`"),
    ("window-kl-one-slot",
     lambda: _init(WindowGraphAttention(num_heads=H, window=0, kl_mode="neighbour"), _X),
     "`kl_tau` and kl_mode='neighbour' need at least two neighbour slots"),
    ("window-kl-tau-neighbour",
     lambda: _init(WindowGraphAttention(num_heads=H, window=W, kl_tau=1.0, kl_mode="neighbour"), _X),
     "`kl_tau` sets the prior of kl_mode='prior'"),
    ("window-causal-kl-tau",
     lambda: _init(WindowGraphAttention(num_heads=H, window=W, causal=True, chunk_size=2,
                                        kl_tau=0.0), _X), "`kl_tau`"),
    ("window-dot-slope",
     lambda: _init(WindowGraphAttention(num_heads=H, window=W, version="dot", negative_slope=0.1), _X),
     "has no LeakyReLU"),
    ("window-dot-attn-init",
     lambda: _init(WindowGraphAttention(num_heads=H, window=W, version="dot",
                                        attn_init=nn.initializers.ones), _X),
     "version='dot' has none"),
    ("window-grid-causal",
     lambda: _init(WindowGraphAttention(num_heads=H, window=W, causal=True, grid_width=3), _X),
     "a 2-D stencil (grid_width) has no causal form"),
    ("window-grid-width", lambda: _init(WindowGraphAttention(num_heads=H, window=W, grid_width=0), _X),
     "`grid_width` must be an integer >= 1"),
    ("window-causal-globals",
     lambda: _init(WindowGraphAttention(num_heads=H, window=W, num_global=1, causal=True), _X),
     "`num_global` must be 0"),
    ("window-step-not-causal", lambda: _WIN.apply(_win_vars(), None, _X[:, 0], method=_WIN.step),
     "`step` needs causal=True"),
    ("window-chunk-not-causal",
     lambda: _init(WindowGraphAttention(num_heads=H, window=W, chunk_size=2), _X),
     "`chunk_size` applies only to causal=True"),
    ("window-chunk-size",
     lambda: _init(WindowGraphAttention(num_heads=H, window=W, causal=True, chunk_size=0), _X),
     "`chunk_size` must be an integer >= 1"),
    ("window-state-batch",
     lambda: _CAUSAL.apply(_causal_vars(), _CAUSAL.apply(_causal_vars(), B + 1, method="init_state"),
                           _X[:, 0], method="step"),
     "`state.value` must have shape (2, 2, 2, 4)"),
    ("window-state-valid",
     lambda: _CAUSAL.apply(_causal_vars(), _X, WindowState(np.zeros((B, W, H, D), np.float32), None,
                                                           np.zeros((B, W + 1), bool)), method="scan"),
     "`state.valid` must have shape (2, 2)"),
    ("window-dropout", lambda: _init(WindowGraphAttention(num_heads=H, window=W, dropout_rate=1.0), _X),
     "`dropout_rate`"),
    ("window-segment-ids-shape",
     lambda: _WIN.apply(_win_vars(), _X, segment_ids=np.ones((B, N), np.int32)),
     "`segment_ids` must have shape"),
    ("window-segment-ids-dtype",
     lambda: _WIN.apply(_win_vars(), _X, segment_ids=np.ones((B, N + NG), np.float32)),
     "`segment_ids` must be integers"),
    ("window-scan-segment-ids",
     lambda: _CAUSAL.apply(_causal_vars(), _X, segment_ids=_IDS, method="scan"),
     "`segment_ids` must have shape"),
    ("window-sequence-axis-type",
     lambda: _init(WindowGraphAttention(num_heads=H, window=W, sequence_axis=1), _X),
     "`sequence_axis` must be a mesh axis name or None"),
    ("window-sequence-axis-no-mesh",
     lambda: _init(WindowGraphAttention(num_heads=H, window=W, sequence_axis="sequence"), _X),
     "the mesh has no axis 'sequence'"),
    # --- the kernels --------------------------------------------------------------------------------
    ("kernel-kl-one-slot", lambda: G.window_graph_attention(_F, _F, _F, _A, window=0, kl_tau=1.0),
     "`kl_tau` and kl_mode='neighbour' need at least two neighbour slots"),
    ("kernel-kl-tau-zero", lambda: G.window_graph_attention(_F, _F, _F, _A, window=W, kl_tau=0),
     "`kl_tau`"),
    ("kernel-kl-mode", lambda: G.window_graph_attention(_F, _F, _F, _A, window=W, kl_mode="rows"),
     "`kl_mode` must be one of"),
    ("kernel-dot-slope",
     lambda: G.window_graph_attention(_F, _F, _F, None, window=W, negative_slope=0.1),
     "dot-product scoring (attn=None) has no LeakyReLU"),
    ("kernel-kernel-slope",
     lambda: G.window_graph_attention(_F, _F, _F, G.KERNEL, window=W, negative_slope=0.1),
     "kernel scoring (alpha='attention') has no LeakyReLU"),
    ("kernel-slope-finite",
     lambda: G.window_graph_attention(_F, _F, _F, _A, window=W, negative_slope=float("nan")),
     "`negative_slope` must be a finite number"),
    # Windows are offsets within one sequence: keys and values have the queries' length.
    ("kernel-key-length",
     lambda: G.window_graph_attention(_Q, _Q[:, :4], _Q[:, :4], np.ones((H, 4), np.float32), window=1),
     "`key` must have shape [B, L, H, C] = (2, 5, 2, 4)"),
    ("kernel-attn-shape",
     lambda: G.window_graph_attention(_X[..., None], _X[..., None], _X[..., None],
                                      np.ones((3, 1), np.float32), window=1),
     "`attn` must have shape"),
    ("kernel-skip-offsets",
     lambda: G.window_graph_attention(_F, _F, _F, _A, window=W, skip_offsets=(1,)),
     "`skip_offsets` must be distinct ints > window=2"),
    ("kernel-globals-length", lambda: G.window_graph_attention(_F, _F, _F, _A, window=W, num_global=N),
     "needs more than num_global=7"),
    ("kernel-segment-ids-shape",
     lambda: G.window_graph_attention(_F, _F, _F, _A, window=W, segment_ids=_IDS[:, :3]),
     "`segment_ids` must have shape"),
    ("cross-kernel-rho", lambda: G.cross_graph_attention(_F, _F, _F, _A, window=1, rho=float("inf")),
     "`rho` must be a finite Python scalar >= 0"),
    ("cross-kernel-positions",
     lambda: G.cross_graph_attention(_F, _F, _F, _A, window=1, positions=np.arange(3)),
     "`positions` must have shape [T] or [B, T]"),
    ("cross-kernel-kv-segment-ids-alone",
     lambda: G.cross_graph_attention(_F, _F, _F, _A, window=1, kv_segment_ids=_IDS),
     "are given together or not at all"),
    ("cross-kernel-kv-segment-ids-shape",
     lambda: G.cross_graph_attention(_F, _F, _F, _A, window=1, segment_ids=_IDS,
                                     kv_segment_ids=_IDS[:, :4]),
     "`kv_segment_ids` must have shape"),
    # --- the sequence axis (graph_context_parallel) -------------------------------------------------
    ("sharded-no-axis", lambda: _sharded(axis_name="seq"), "the mesh has no axis 'seq'"),
    ("sharded-length", lambda: _sharded(length=N), "the sequence length 7 must divide by"),
    ("sharded-reach", lambda: _sharded(length=4, skip_offsets=(3,)),
     "not more than the stencil's reach 3"),
    # --- CrossGraphAttention ------------------------------------------------------------------------
    ("cross-memory-rank", lambda: _init(_CROSS, _X, _X[0]), "`memory` must have rank 3"),
    ("cross-memory-mask", lambda: _init(_CROSS, _X, _X, memory_mask=np.ones((B, 3), np.float32)),
     "`memory_mask` must have shape"),
    ("cross-rho", lambda: _init(CrossGraphAttention(num_heads=H, rho=-1.0), _X, _X), "`rho`"),
    ("cross-segment-ids-alone", lambda: _init(_CROSS, _X, _X, segment_ids=np.ones((B, N + NG), np.int32)),
     "are given together or not at all"),
    # --- Model: options (htgn_jax.validation: one clear line before anything compiles) ---------------
    ("model d_model=18 num_heads=4", _model(d_model=18, num_heads=4),
     "`d_model` = 18 must be divisible by `num_heads` = 4"),
    ("model no_such_option=1", _model(no_such_option=1), "unknown Model kwargs"),
    ("model attention=linear", _model(attention="linear"), "`attention` must be one of"),
    ("model feature_map=cos", _model(feature_map="cos"), "`feature_map` must be one of"),
    ("model gat_version=v3", _model(gat_version="v3"), "`gat_version` must be one of"),
    ("model kl_tau=0.0", _model(kl_tau=0.0), "`kl_tau` must be None (uniform KL prior) or a finite number > 0"),
    ("model kl_tau=float(inf)", _model(kl_tau=float("inf")),
     "`kl_tau` must be None (uniform KL prior) or a finite number > 0"),
    ("model kl_tau=2.0 kl_weight=0.0", _model(kl_tau=2.0, kl_weight=0.0), "kl_tau shapes the KL term, but kl_weight"),
    ("model kl_mode=rows", _model(kl_mode="rows"), "`kl_mode` must be one of"),
    ("model kl_mode=neighbour kl_tau=1.0", _model(kl_mode="neighbour", kl_tau=1.0),
     "`kl_tau` sets the prior of kl_mode='prior'"),
    ("model kl_mode=neighbour kl_weight=0.0", _model(kl_mode="neighbour", kl_weight=0.0),
     "kl_mode shapes the KL term, but kl_weight"),
    ("model norm=mid", _model(norm="mid"), "`norm` must be one of"),
    ("model window=-1", _model(window=-1), "`window` must be an integer >= 0"),
    ("model dropout_rate=1.0", _model(dropout_rate=1.0), "`dropout_rate` must be in"),
    ("model share_embeddings=True", _model(share_embeddings=True), "share_embeddings=True needs equal vocab sizes"),
    ("model attention=softmax feature_map=relu", _model(attention="softmax", feature_map="relu"),
     "feature_map applies to attention='favor'"),
    ("model use_graph_conv=False attention_dropout=0.1", _model(use_graph_conv=False, attention_dropout=0.1),
     "attention_dropout"),
    ("model feature_map=relu num_features=16", _model(feature_map="relu", num_features=16), "num_features applies to"),
    ("model redraw_every=-1", _model(redraw_every=-1), "`redraw_every` must be an integer >= 0"),
    ("model attention=softmax redraw_every=10", _model(attention="softmax", redraw_every=10),
     "redraw_every redraws the FAVOR"),
    ("model feature_map=relu redraw_every=10", _model(feature_map="relu", redraw_every=10),
     "redraw_every redraws the FAVOR"),
    ("model kl_weight=-1.0", _model(kl_weight=-1.0), "`kl_weight` must be a finite number >= 0"),
    ("model kl_weight=float(inf)", _model(kl_weight=float("inf")), "`kl_weight` must be a finite number >= 0"),
    ("model rho=float(nan)", _model(rho=float("nan")), "`rho` must be a finite number >= 0"),
    ("model kind=lm", lambda: Model(kind="lm"), "kind must be one of"),
    ("model variant=huge", _model(variant="huge"), "variant must be one of"),
    ("model seq2seq without sizes", lambda: Model(kind="seq2seq", variant="tiny"), "missing required kwargs"),
    ("model cls without globals", lambda: Model(**_CLS, num_global=0), "pool='cls' reads global token 0"),
    ("model patch_size", lambda: Model(**_CLS, patch_size=3), "image_size (8) must be divisible by patch_size"),
    # --- Model: batches (checked while tracing, before anything compiles) -----------------------------
    ("batch inputs rank", _seq2seq(lambda b: dict(b, inputs=b["inputs"][0])), "batch['inputs'] must have rank 2"),
    ("batch targets rank", _seq2seq(lambda b: dict(b, targets=b["targets"][..., None])),
     "batch['targets'] must have rank 2"),
    ("batch float inputs", _seq2seq(lambda b: dict(b, inputs=b["inputs"].astype(np.float32))), "integer ids"),
    ("batch inputs_mask", _seq2seq(lambda b: dict(b, inputs_mask=np.ones((B, 8), bool))),
     "batch['inputs_mask'] must have"),
    ("batch targets length", _seq2seq(lambda b: dict(b, targets=np.zeros((B, 17), np.int32))), "max_target_len=16"),
    ("batch inputs length", _seq2seq(lambda b: dict(b, inputs=np.ones((B, 17), np.int32))), "max_source_len=16"),
    ("batch batch size", _seq2seq(lambda b: dict(b, targets=b["targets"][:1])), "batch size"),
    ("batch no targets", _seq2seq(lambda b: {"inputs": b["inputs"]}), "must contain 'inputs'"),
    ("image rank", _classify({"image": np.zeros((B, 8, 8), np.float32)}), "must have shape [B, 8, 8, 1]"),
    ("image key", _classify({"pixels": np.zeros((B, 8, 8, 1), np.float32)}), "must contain 'image'"),
    # --- Model: the options of htgn.md's items ------------------------------------------------------
    ("model qk_rank=0", _model(qk_rank=0), "`qk_rank` must be an integer >= 1"),
    ("model qk_rank=16", _model(qk_rank=16), "qk_rank=16 must be <= the head width"),
    ("model qk_rank=3", _model(qk_rank=3), "qk_rank must be even"),
    ("model graph_activation=tanh", _model(graph_activation="tanh"), "`graph_activation` must be one of"),
    ("model drop_path_start=1.0", _model(drop_path_start=1.0), "`drop_path_start` must be in"),
    ("model graph off graph_activation=relu", _model(use_graph_conv=False, kl_weight=0.0, graph_activation="relu"),
     "['graph_activation'] apply to the graph layers"),
    ("model feature_map=trig num_features=0", _model(feature_map="trig", num_features=0),
     "`num_features` must be an integer >= 1"),
    ("model skip_offsets=(2,)", _model(skip_offsets=(2,)), "`skip_offsets` must be distinct ints > window=2"),
    ("model skip_offsets=(3,3)", _model(skip_offsets=(3, 3)), "`skip_offsets` must be distinct ints"),
    ("model skip_offsets=8", _model(skip_offsets="8"), "`skip_offsets` must be a tuple of ints"),
    ("model window=1 cross_window=4 skip_offsets=(3,)", _model(window=1, cross_window=4, skip_offsets=(3,)),
     "distinct ints > cross_window=4"),
    ("model graph_alpha=gcn", _model(graph_alpha="gcn"), "`graph_alpha` must be one of"),
    ("model graph_alpha=attention feature_map=exact", _model(graph_alpha="attention", feature_map="exact"),
     "graph_alpha='attention' reads the FAVOR"),
    ("model graph_alpha=attention attention=softmax",
     _model(graph_alpha="attention", attention="softmax", use_graph_conv=True),
     "graph_alpha='attention' reads the FAVOR"),
    ("model graph_alpha=attention gat_version=v1", _model(graph_alpha="attention", gat_version="v1"),
     "gat_version shapes the learned GAT scores"),
    ("model attention=cross_graph", _model(attention="cross_graph"), "got 'cross_graph'"),
    ("model attention=agf qk_rank=2", _model(attention="agf", qk_rank=2),
     "qk_rank applies to attention 'favor' or 'softmax'"),
    # --- decoding: the searches' arguments ------------------------------------------------------------
    ("search max_len too long", _search("greedy_search", max_len=9), "exceeds the model's max_target_len"),
    ("search max_len 0", _search("greedy_search", max_len=0), "max_len must be a positive int"),
    ("search beam_size 0", _search("beam_search", max_len=4, beam_size=0), "beam_size must be an int"),
    ("search length_penalty", _search("beam_search", max_len=4, beam_size=2, length_penalty=-1.0),
     "length_penalty must be"),
    ("search inputs rank", _search("greedy_search", np.full((7,), 3, np.int32), max_len=4),
     "inputs must have rank 2"),
    ("search cache softmax", _search("greedy_search", max_len=7, use_cache=True,
                                     model=Model(**{**_SEQ, "max_target_len": 8}, attention="softmax")),
     "use_cache=True needs attention='favor'"),
    # --- Model: fields of a switched-off part (htgn_jax.validation.GRAPH_ONLY_KWARGS and HRPE's) ------
    ("model-graph-off-cross-window-rho", _model(use_graph_conv=False, rho=3.0, cross_window=7),
     "['cross_window', 'rho'] apply to the graph layers"),
    ("model-graph-off-kl-tau", lambda: Model(**_SEQ, use_graph_conv=False, kl_weight=0.0, kl_tau=2.0),
     "['kl_tau'] apply to the graph layers"),
    ("model-graph-off-kl-mode", lambda: Model(**_SEQ, use_graph_conv=False, kl_weight=0.0, kl_mode="neighbour"),
     "['kl_mode'] apply to the graph layers"),
    ("model-graph-off-kl-weight", lambda: Model(**_SEQ, use_graph_conv=False, kl_weight=0.5),
     "['kl_weight'] apply to the graph layers"),
    ("model-hrpe-off", lambda: Model(**_SEQ, use_hrpe=False, num_pe=3, pe_basis="adjacency"),
     "['num_pe', 'pe_basis'] apply to HRPE"),
    ("model-chunk-softmax", lambda: Model(**_SEQ, attention="softmax", chunk_size=3),
     "chunk_size applies to attention='favor'"),
] + FAVOR_ROWS   # FAVOR+, HRPE and the random features: tests/htgn_jax/bad_argument_rows_favor.py


@pytest.mark.parametrize("call,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_argument_raises_one_line(call, fragment):
    testing.assert_refused(call, fragment)
