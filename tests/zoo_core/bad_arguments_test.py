"""zoo_core's bad arguments, one table (issue 43 item 2): every public kernel and layer refuses a bad argument
once, at its boundary, in one line that names it. Each row is (id, call, fragment): `call` must raise
ValueError or TypeError whose one-line message contains `fragment`."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.environment import sequence_mesh
from zoo_core import attention, testing
from zoo_core.baselines.linformer import LinformerAttention
from zoo_core.baselines.longformer import LongformerAttention, longformer_context_parallel
from zoo_core.baselines.nystromformer import NystromformerAttention
from zoo_core.baselines.reformer import ReformerAttention
from zoo_core.ops import context_parallel, masking, packing
from zoo_core.ops import linear_attention as la

B, T, H, D, M = 2, 6, 2, 4, 3
Q = jnp.ones((B, T, H, D))
V = jnp.ones((B, T, H, M))
X = jnp.ones((B, T, 8))
IDS = jnp.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 3, 3]], jnp.int32)
KEY = jax.random.PRNGKey(0)


def _init(layer, **call):
    """`layer.init` on X with `call`'s keyword arguments (a field error raises in setup)."""
    return lambda: layer.init(KEY, X, **call)


def _apply(layer, **call):
    """`layer.apply` with valid parameters (made when the row runs) and `call`'s keyword arguments."""
    return lambda: layer.apply(layer.init(KEY, X), X, **call)


def _in_module(call):
    """Runs `call(x [2, 7, 8], memory [2, 5, 8])` inside a module's `init`, as a user's block calls the drop-in."""
    class Wrap(nn.Module):
        @nn.compact
        def __call__(self, x, m):
            return call(x, m)
    return lambda: Wrap().init(KEY, jnp.zeros((2, 7, 8)), jnp.zeros((2, 5, 8)))


def _decode(x_len, cross=False, name="linear", **call):
    """A decode=True drop-in ([2, 7, 16] inputs, 2 heads) applied to `x_len` tokens with `call`."""
    x = jnp.zeros((2, 7, 16))
    dec = attention.make(name, num_heads=2, qkv_features=16, causal=not cross, decode=True)
    if cross:
        return lambda: dec.init(KEY, x)
    return lambda: dec.apply(dec.init(KEY, x), x[:, :x_len], mutable=["cache"], **call)


XA = jnp.zeros((2, 7, 16))   # the drop-in's inputs [B, T, E] in the packing rows


ROWS = [
    # ops.linear_attention: each public kernel checks its own arguments once.
    ("la-parallel-q-rank", lambda: la.causal_parallel(Q[0], Q[0], V[0]), "expects q [B, T, H, D]"),
    ("la-parallel-k-shape", lambda: la.causal_parallel(Q, Q[:, :3], V), "k like q"),
    ("la-parallel-mask", lambda: la.causal_parallel(Q, Q, V, mask=jnp.ones((B, 3), bool)),
     "`mask` must have shape [B, T] = (2, 6), got (2, 3)"),
    ("la-parallel-segments", lambda: la.causal_parallel(Q, Q, V, segment_ids=IDS[:, :3]),
     "`segment_ids` must have shape [B, T] = (2, 6), got (2, 3)"),
    ("la-parallel-segments-float", lambda: la.causal_parallel(Q, Q, V, segment_ids=IDS.astype(jnp.float32)),
     "`segment_ids` must be integers"),
    ("la-chunked-chunk-0", lambda: la.causal_chunked(Q, Q, V, chunk_size=0), "`chunk_size` must be an integer >= 1"),
    ("la-batched-chunk-float", lambda: la.causal_chunked_batched(Q, Q, V, chunk_size=2.0),
     "`chunk_size` must be an integer >= 1"),
    ("la-chunked-state", lambda: la.causal_chunked(Q, Q, V, chunk_size=2, state=la.init_state(B, H, D, D)),
     "state.num must be [B, H, D, M] = (2, 2, 4, 3)"),
    ("la-scan-state-den", lambda: la.causal_scan(Q, Q, V, state=la.init_state(B, H, D, M), denominator=True),
     "state.den must be [B, H, D] with denominator=True"),
    ("la-step-rank", lambda: la.causal_step(la.init_state(B, H, D, M), Q, Q, V), "[B, H, D] (one token)"),
    ("la-step-state", lambda: la.causal_step(la.init_state(B, H, D, D), Q[:, 0], Q[:, 0], V[:, 0]),
     "state.num must be [B, H, D, M]"),
    ("la-noncausal-v", lambda: la.noncausal(Q, Q, V[:, :2]), "non-causal linear attention expects"),
    ("la-noncausal-query-mask", lambda: la.noncausal(Q, Q, V, query_mask=jnp.ones((B, 2), bool)),
     "`query_mask` must have shape [B, T]"),
    ("la-noncausal-packed-cross", lambda: la.noncausal(Q, Q[:, :4], V[:, :4], segment_ids=IDS),
     "packed cross-attention takes both `segment_ids` [B, T] (queries) and `kv_segment_ids`"),
    ("la-noncausal-kv-ids-alone", lambda: la.noncausal(Q, Q, V, kv_segment_ids=IDS), "takes both `segment_ids`"),
    ("la-noncausal-kv-ids-shape", lambda: la.noncausal(Q, Q[:, :4], V[:, :4], segment_ids=IDS, kv_segment_ids=IDS),
     "`kv_segment_ids` must have shape"),
    ("la-summary-v", lambda: la.summary(Q, V[:, :2]), "summary expects k [B, S, H, D]"),
    ("la-summary-mask", lambda: la.summary(Q, V, mask=jnp.ones((B, 2), bool)), "`mask` must have shape [B, S]"),
    ("la-read-state", lambda: la.read(Q, la.init_state(B, H + 1, D, M)), "state.num must be [B, H, D, M]"),
    # ops.packing and ops.context_parallel
    ("packing-shape", lambda: packing.check_segment_ids(IDS, (B, T + 1)), "`segment_ids` must have shape [B, T]"),
    ("cp-length", lambda: context_parallel.causal(Q[:, :5], Q[:, :5], V[:, :5], chunk_size=2, mesh=sequence_mesh(2)),
     "the sequence length 5 must divide by the 'sequence' axis size 2"),
    ("cp-axis", lambda: context_parallel.noncausal(Q, Q, V, mesh=sequence_mesh(1), axis_name="seq"),
     "the mesh has no axis 'seq'"),
    ("cp-sequence-map-axis", lambda: context_parallel.sequence_map(lambda **a: a["x"], dict(x=V), mesh=sequence_mesh(1),
                                                                   axis_name="seq"), "the mesh has no axis 'seq'"),
    # baselines: fields, and segment_ids where the definition mixes the whole sequence
    ("reformer-buckets-odd", _init(ReformerAttention(num_heads=H, head_dim=D, num_buckets=3)), "`num_buckets`"),
    ("reformer-chunk-0", _init(ReformerAttention(num_heads=H, head_dim=D, chunk_length=0)), "`chunk_length`"),
    ("reformer-hashes-0", _init(ReformerAttention(num_heads=H, head_dim=D, num_hashes=0)), "`num_hashes`"),
    ("longformer-window-0", _init(LongformerAttention(num_heads=H, head_dim=D, window=0)), "`window`"),
    ("longformer-global-neg", _init(LongformerAttention(num_heads=H, head_dim=D, num_global=-1)), "`num_global`"),
    ("longformer-cp-length", lambda: longformer_context_parallel(Q[:, :5], Q[:, :5], V[:, :5], window=2,
                                                                 mesh=sequence_mesh(2)),
     "the sequence length 5 must divide by the 'sequence' axis size 2"),
    ("longformer-cp-halo", lambda: longformer_context_parallel(Q, Q, V, window=4, causal=True, mesh=sequence_mesh(2)),
     "each of the 2 shards holds 3 tokens, fewer than Longformer's halo 4 (the window)"),
    ("longformer-cp-axis", lambda: longformer_context_parallel(Q, Q, V, window=2, mesh=sequence_mesh(2), axis_name="seq"),
     "the mesh has no axis 'seq' (its axes: ('sequence',))"),
    ("longformer-sequence-axis-int", _init(LongformerAttention(num_heads=H, head_dim=D, sequence_axis=0)),
     "`sequence_axis` must be a mesh axis name or None, got 0"),
    # (checked before any parameter is read: no init needed)
    ("longformer-state-noncausal", lambda: LongformerAttention(num_heads=H, head_dim=D).apply({}, 2, method="init_state"),
     "LongformerAttention.init_state is the causal form's (the decoding cache): build the layer with causal=True"),
    ("longformer-step-shape", lambda: (lambda lay: lay.apply({}, lay.apply({}, B, method="init_state"), X, method="step"))(
        LongformerAttention(num_heads=H, head_dim=D, causal=True)),
     "`x_t` must be one token [B, E] with B = 2 (the cache's), got shape (2, 6, 8)"),
    ("reformer-decode", lambda: attention.make("reformer", num_heads=2, qkv_features=8, causal=True, decode=True),
     "attention 'reformer' has no decode=True form; these have one: ("),
    ("longformer-segments-shape", _apply(LongformerAttention(num_heads=H, head_dim=D), segment_ids=IDS[:, :2]),
     "`segment_ids` must have shape [B, T]"),
    ("nystromformer-conv-even", _init(NystromformerAttention(num_heads=H, head_dim=D, conv_kernel=4)),
     "`conv_kernel` must be odd (a centred window), got 4"),
    ("nystromformer-landmarks-0", _init(NystromformerAttention(num_heads=H, head_dim=D, num_landmarks=0)),
     "`num_landmarks` must be an integer >= 1, got 0"),
    ("linformer-proj-len-0", _init(LinformerAttention(num_heads=H, head_dim=D, proj_len=0)),
     "`proj_len` must be an integer >= 1, got 0"),
    ("linformer-share-kv-int", _init(LinformerAttention(num_heads=H, head_dim=D, share_kv=1)),
     "`share_kv` must be True or False, got 1"),
    ("linformer-too-long", lambda: (lambda lay: lay.apply(lay.init(KEY, X[:, :T - 1]), X))(
        LinformerAttention(num_heads=H, head_dim=D, max_length=T - 1)), "input length 6 exceeds `max_length` = 5"),
    ("linformer-segments", _apply(LinformerAttention(num_heads=H, head_dim=D, max_length=T), segment_ids=IDS),
     "Linformer mixes the whole sequence in its sequence projections E and F; it cannot keep packed documents "
     "apart: unpack, or use one of softmax, longformer"),
    ("nystromformer-segments", _apply(NystromformerAttention(num_heads=H, head_dim=D), segment_ids=IDS),
     "Nystromformer mixes the whole sequence in its landmarks"),
    ("reformer-segments", _apply(ReformerAttention(num_heads=H, head_dim=D), segment_ids=IDS),
     "Reformer mixes the whole sequence in its hash buckets and sorted chunks"),
    # the registry: attention.make / attention.layer
    ("make-linformer-causal", lambda: attention.make("linformer", num_heads=2, qkv_features=16, causal=True),
     "attention 'linformer' has no causal=True mode (it is non-causal only)"),
    ("make-nystromformer-causal", lambda: attention.make("nystromformer", num_heads=2, qkv_features=16, causal=True),
     "attention 'nystromformer' has no causal=True mode (it is non-causal only)"),
    ("make-nystromformer-decode", lambda: attention.make("nystromformer", num_heads=2, qkv_features=16, decode=True),
     "has no decode=True form"),
    ("layer-reformer-segments", _apply(attention.layer("reformer", num_heads=2, qkv_features=8), segment_ids=IDS),
     "Reformer mixes the whole sequence"),
    ("layer-linformer-segments", _apply(attention.layer("linformer", num_heads=2, qkv_features=8, max_length=T),
                                        segment_ids=IDS), "Linformer mixes the whole sequence"),
    # the drop-in (zoo_core.attention.make): options at make, decoding, cross-attention, packing
    ("make-unknown", lambda: attention.make("nope", num_heads=2, qkv_features=8),
     "unknown attention 'nope'; choose one of ("),
    ("make-cross-graph-causal", lambda: attention.make("cross_graph", num_heads=2, qkv_features=8, causal=True),
     "'cross_graph' has no causal=True mode (it is cross-attention only)"),
    ("make-agf-decode", lambda: attention.make("agf", num_heads=2, qkv_features=8, decode=True),
     "decode=True on 'agf' needs causal=True"),
    ("layer-linear-noncausal", lambda: attention.layer("linear", num_heads=2, qkv_features=8),
     "no causal=False contract layer"),
    ("names-capability", lambda: attention.names("bidirectional"), "unknown capability ['bidirectional']"),
    ("make-option-shift", lambda: attention.make("window_graph", num_heads=2, qkv_features=8, causal=True, shift=1),
     "no option(s) ['shift']; its options are ["),
    ("make-option-typo", lambda: attention.make("agf", num_heads=2, qkv_features=8, orderr=3),
     "no option(s) ['orderr']"),
    ("make-heads-divide", lambda: attention.make("agf", num_heads=3, qkv_features=8), "divisible by `num_heads`"),
    ("make-heads-0", lambda: attention.make("agf", num_heads=0, qkv_features=8), "`num_heads` must be an integer >= 1"),
    ("make-out-features", lambda: attention.make("softmax", num_heads=2, qkv_features=8, out_features=0),
     "`out_features`"),
    ("decode-many-tokens", _decode(7, name="softmax"),
     "each call of 'softmax' takes one token [B, 1, E], got shape (2, 7, 16); these also take a prompt"),
    ("decode-prompt-dropout", _decode(7, deterministic=False), "a prompt (prefill) runs without dropout"),
    ("decode-mask", _decode(1, mask=jnp.ones((2, 1), bool)), "a self-attention step takes no mask"),
    ("decode-dropout", _decode(1, deterministic=False), "decoding steps run without dropout"),
    ("decode-noncausal-self", _decode(1, cross=True), "decode=True self-attention needs causal=True"),
    ("cross-agf", _in_module(lambda x, m: attention.make("agf", num_heads=2, qkv_features=8)(x, m)),
     "attention 'agf' has no cross-attention form; these have one: ('cross_graph', 'favor', 'linear', 'softmax')"),
    ("cross-graph-self", _in_module(lambda x, m: attention.make("cross_graph", num_heads=2, qkv_features=8)(x)),
     "'cross_graph' is cross-attention only: call it as attn(inputs_q, inputs_k)"),
    ("cross-favor-causal",
     _in_module(lambda x, m: attention.make("favor", num_heads=2, qkv_features=8, causal=True)(x, m)),
     "cross-attention is not causal"),
    ("cross-softmax-dropout",
     _in_module(lambda x, m: attention.make("softmax", num_heads=2, qkv_features=8, dropout_rate=0.1)(x, m)),
     "option(s) ['dropout_rate'] of 'softmax' apply to its self-attention form only"),
    ("cross-graph-rho-self",
     _in_module(lambda x, m: attention.make("cross_graph", num_heads=2, qkv_features=8, rho=0.5)(x)),
     "cross-attention only"),
    ("cross-favor-k-and-v", _in_module(lambda x, m: attention.make("favor", num_heads=2, qkv_features=8)(x, m, x)),
     "keys and values come from one memory"),
    ("cross-favor-kv-twice",
     _in_module(lambda x, m: attention.make("favor", num_heads=2, qkv_features=8)(x, m, inputs_kv=m)),
     "as inputs_kv or as inputs_k, not both"),
    ("cross-favor-mask", _in_module(lambda x, m: attention.make("favor", num_heads=2, qkv_features=8)(
        x, m, mask=jnp.ones((2, 7), bool))), "mask must be a [B, S] = (2, 5) key-padding mask, got shape (2, 7)"),
    ("packed-linformer", lambda: attention.make("linformer", num_heads=2, qkv_features=16, max_length=7).init(
        KEY, XA, segment_ids=np.ones((2, 7), np.int32)),
     "attention 'linformer' takes no segment_ids in its self-attention (packed sequences); these do: ["),
    ("packed-reformer-cp",
     lambda: attention.make("reformer", num_heads=2, qkv_features=16, sequence_axis="sequence"),
     "attention 'reformer' has no context-parallel form (sequence_axis); these have one: ["),
    ("packed-sequence-axis-int", lambda: attention.make("linear", num_heads=2, qkv_features=16, sequence_axis=3),
     "`sequence_axis` must be a mesh axis name or None, got 3"),
    ("packed-kv-ids-self", lambda: attention.make("linear", num_heads=2, qkv_features=16, causal=True).init(
        KEY, XA, kv_segment_ids=np.ones((2, 7), np.int32)),
     "kv_segment_ids are the memory's documents in cross-attention"),
    ("packed-cross-kv-ids-alone", lambda: attention.make("linear", num_heads=2, qkv_features=16).init(
        KEY, XA, XA[:, :5], kv_segment_ids=np.ones((2, 5), np.int32)),
     "packed cross-attention takes both `segment_ids` [B, T] and `kv_segment_ids` [B, S]"),
    # ops.masking: the one mask check
    ("mask-shape", lambda: masking.check_mask(np.ones((2, 4), bool), (2, 3)),
     "`mask` must have shape [B, T] = (2, 3), got (2, 4)"),
    ("mask-named-shape", lambda: masking.check_mask(np.ones((3,)), (2, 3), "key_mask", "[B, S]"),
     "`key_mask` must have shape [B, S] = (2, 3), got (3,)"),
    ("mask-as-bool-shape", lambda: masking.as_bool(np.ones((1, 2)), (1, 3)), "`mask` must have shape"),
    ("la-scan-segments-float", lambda: la.causal_scan(Q, Q, V, segment_ids=IDS.astype(jnp.float32)),
     "`segment_ids` must be integers"),
]


@pytest.mark.parametrize("call,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_argument_is_one_line(call, fragment):
    testing.assert_refused(call, fragment)


def test_the_table_has_unique_ids():
    ids = [r[0] for r in ROWS]
    assert len(ids) == len(set(ids)) and all(callable(r[1]) and r[2] for r in ROWS)
