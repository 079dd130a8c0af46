"""The softmax baseline's kernels: every form equal (XLA, fused, chunked by map and all at once),
NaN-safe padding and future, float32 statistics, float64 gradients, and the programs exported for
accelerators (no loop over chunks; the GPU takes `jax.nn.dot_product_attention`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from agf_jax import softmax as sm
from zoo_core.testing import BF16, F32_SIMPLE, F64, assert_forms_agree, exported_program, while_loops

B, T, H, D = 2, 7, 2, 8
CHUNKS = (1, 3, 16)


def _inputs(t=T, seed=0, dtype=np.float32, m=D):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, t, H, w)).astype(dtype) for w in (D, D, m))


def _mask(t=T):
    return np.arange(t)[None, :] < np.array([[t], [t - 3]])


def _drop(w, index):
    """A pure weight dropout whose mask depends on the chunk index, as the layers' is."""
    keep = jax.random.bernoulli(jax.random.fold_in(jax.random.key(3), index), 0.7, w.shape)
    return jnp.where(keep, w / 0.7, 0.0)


@jax.jit
def _causal_forms(q, k, v, mask):
    out = {"parallel": sm.softmax_parallel(q, k, v, mask=mask, causal=True),
           "fused": sm.softmax_fused(q, k, v, mask=mask, causal=True),
           "scan": sm.softmax_scan(q, k, v, cache=sm.init_cache(B, q.shape[1], H, D, v.shape[-1]),
                                   mask=mask)[0]}
    for c in CHUNKS:
        out[f"chunked({c})"] = sm.softmax_chunked(q, k, v, chunk_size=c, mask=mask)
        out[f"batched({c})"] = sm.softmax_chunked_batched(q, k, v, chunk_size=c, mask=mask)
    return out


@jax.jit
def _bidirectional_forms(q, k, v, mask):
    return {"parallel": sm.softmax_parallel(q, k, v, mask=mask),
            "fused": sm.softmax_fused(q, k, v, mask=mask)}


def _valid_rows(out, mask):
    return {name: np.where(np.asarray(mask)[:, :, None, None], np.asarray(o), 0.0) for name, o in out.items()}


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("m", [D, 4])   # values narrower than keys: the fused form falls back to XLA
def test_forms_agree_with_the_formula(masked, m):
    q, k, v = _inputs(m=m)
    mask = _mask() if masked else None
    valid = np.ones((B, T), bool) if mask is None else mask
    logits = np.einsum("bthd,bshd->bhts", q.astype(np.float64), k) / np.sqrt(D)
    for causal, forms in ((True, _causal_forms), (False, _bidirectional_forms)):
        allowed = valid[:, None, None, :] & (np.tril(np.ones((T, T), bool)) if causal else True)
        w = np.exp(np.where(allowed, logits, -np.inf) - np.where(allowed, logits, -np.inf).max(-1, keepdims=True))
        want = np.einsum("bhts,bshm->bthm", w / w.sum(-1, keepdims=True), v)
        out = forms(q, k, v, mask)
        assert all(o.dtype == jnp.float32 for o in out.values())
        # padded rows have no meaning in the formula; every form gives them the same numbers anyway
        assert_forms_agree(out, **F32_SIMPLE)
        assert_forms_agree({"formula": _valid_rows({"": want}, valid)[""], **_valid_rows(out, valid)},
                           **F32_SIMPLE)


def test_chunked_forms_draw_the_same_dropout():
    q, k, v = _inputs(seed=1)
    mask = _mask()
    run = jax.jit(lambda *a: {f"{name}({c})": f(*a, chunk_size=c, mask=mask, dropout=_drop)
                              for c in CHUNKS for name, f in (("map", sm.softmax_chunked),
                                                              ("batched", sm.softmax_chunked_batched))})
    out = run(q, k, v)
    assert_forms_agree({name: o for name, o in out.items() if "(1)" in name}, **F32_SIMPLE)
    assert_forms_agree({name: o for name, o in out.items() if "(3)" in name}, **F32_SIMPLE)
    # one chunk of every row: the parallel form's dropout (index 0) draws the same mask
    want = jax.jit(lambda *a: sm.softmax_parallel(*a, mask=mask, causal=True, dropout=_drop))(q, k, v)
    assert_forms_agree({"parallel": want, "map": out["map(16)"], "batched": out["batched(16)"]},
                       **F32_SIMPLE)


@pytest.mark.parametrize("bad", [np.nan, 1e30])
def test_padding_and_future_change_no_output(bad):
    q, k, v = _inputs(seed=2)
    mask = _mask()
    pad = ~mask[:, :, None, None]
    clean = _valid_rows(_causal_forms(q, k, v, mask), mask)
    dirty = _valid_rows(_causal_forms(*(np.where(pad, np.float32(bad), x) for x in (q, k, v)), mask), mask)
    for name in clean:
        np.testing.assert_array_equal(dirty[name], clean[name], err_msg=name)
    both = (_bidirectional_forms(q, k, v, mask),
            _bidirectional_forms(*(np.where(pad, np.float32(bad), x) for x in (q, k, v)), mask))
    for name in both[0]:
        np.testing.assert_array_equal(*(_valid_rows(o, mask)[name] for o in both), err_msg=name)
    # The future (position 4, unmasked) holds `bad` in k and v: rows 0..3 are unchanged.
    fut = (np.arange(T) == 4)[None, :, None, None]
    clean = _causal_forms(q, k, v, None)
    dirty = _causal_forms(q, np.where(fut, np.float32(bad), k), np.where(fut, np.float32(bad), v), None)
    for name in clean:
        np.testing.assert_array_equal(np.asarray(dirty[name])[:, :4], np.asarray(clean[name])[:, :4], err_msg=name)
        if np.isnan(bad):   # a NaN still reaches its own and every later output
            assert np.all(np.isnan(np.asarray(dirty[name])[:, 4:])), name


def test_bf16_inputs_keep_float32_statistics_and_output():
    q, k, v = _inputs(seed=3)
    mask = _mask()
    want = sm.softmax_parallel(q, k, v, mask=mask, causal=True)
    low = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    for name, form in (("fused", lambda *a: sm.softmax_fused(*a, mask=mask, causal=True)),
                       ("batched", lambda *a: sm.softmax_chunked_batched(*a, chunk_size=3, mask=mask))):
        got = jax.jit(form)(*low)
        assert got.dtype == jnp.float32, name
        np.testing.assert_allclose(*(_valid_rows({"": o}, mask)[""] for o in (got, want)), **BF16,
                                   err_msg=name)


def _masked_grad(form, q, k, v, keep):
    loss = lambda *a: jnp.sum(jnp.where(keep, jnp.sin(form(*a)), 0.0))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def test_gradients_float32_through_dot_product_attention():
    # float32 takes jax.nn.dot_product_attention's own backward; float64 takes the XLA form
    q, k, v = _inputs(seed=5)
    mask = _mask()
    keep = mask[:, :, None, None]
    assert_forms_agree({
        "parallel": _masked_grad(lambda *a: sm.softmax_parallel(*a, mask=mask, causal=True), q, k, v, keep),
        "fused": _masked_grad(lambda *a: sm.softmax_fused(*a, mask=mask, causal=True), q, k, v, keep),
    }, **F32_SIMPLE)


def test_gradients_float64():
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x, jnp.float64) for x in _inputs(t=5, seed=4))
        mask = jnp.asarray(_mask(5))
        keep = mask[:, :, None, None]

        forms = {"parallel": lambda *a: sm.softmax_parallel(*a, mask=mask, causal=True),
                 "fused": lambda *a: sm.softmax_fused(*a, mask=mask, causal=True),
                 "chunked": lambda *a: sm.softmax_chunked(*a, chunk_size=2, mask=mask),
                 "batched": lambda *a: sm.softmax_chunked_batched(*a, chunk_size=2, mask=mask)}
        assert_forms_agree({name: _masked_grad(f, q, k, v, keep) for name, f in forms.items()}, **F64)
        for name in ("fused", "batched"):
            check_grads(jax.jit(forms[name]), (q, k, v), order=1, modes=("rev",), **F64)


def _train_program(form, platform, dtype=jnp.float32, **kw):
    x = jax.ShapeDtypeStruct((2, 256, 4, 16), dtype)
    mask = jax.ShapeDtypeStruct((2, 256), jnp.bool_)

    def loss(q, k, v, mask):
        return jnp.sum(form(q, k, v, mask=mask, **kw))
    return exported_program(jax.grad(loss, argnums=(0, 1, 2)), x, x, x, mask, platform=platform)


@pytest.mark.parametrize("dropout", [None, _drop])
def test_accelerator_programs_have_no_loop_over_chunks(dropout):
    chunked = dict(chunk_size=64, dropout=dropout)
    assert while_loops(_train_program(sm.softmax_chunked, "cpu", **chunked)) > 0
    for platform in ("cuda", "tpu"):
        assert while_loops(_train_program(sm.softmax_chunked, platform, **chunked)) == 0, platform


def test_packed_accelerator_programs_have_no_loop_over_chunks():
    """segment_ids take the XLA forms on every platform (the fused one has none): still no loop there."""
    chunked = dict(chunk_size=64, segment_ids=np.repeat(np.arange(1, 5, dtype=np.int32), 64)[None].repeat(2, 0))
    assert while_loops(_train_program(sm.softmax_chunked, "cpu", **chunked)) > 0
    for platform in ("cuda", "tpu"):
        assert while_loops(_train_program(sm.softmax_chunked, platform, **chunked)) == 0, platform


def _logit_dots(program: str) -> set:
    """The operand element types of the program's dot_generals."""
    return {line.split(":")[-1].split("->")[0].strip() for line in program.splitlines()
            if "stablehlo.dot_general" in line}


def test_gpu_program_takes_dot_product_attention_in_the_input_dtype():
    # jax.nn.dot_product_attention keeps bf16 operands (cuDNN's, or its XLA form's with float32
    # statistics); the XLA form of the other platforms casts to float32 first.
    for form, kw in ((sm.softmax_parallel, dict(causal=True)), (sm.softmax_chunked, dict(chunk_size=64))):
        gpu = _logit_dots(_train_program(form, "cuda", jnp.bfloat16, **kw))
        cpu = _logit_dots(_train_program(form, "cpu", jnp.bfloat16, **kw))
        assert gpu and all("bf16" in ops for ops in gpu), gpu
        assert cpu and not any("bf16" in ops for ops in cpu), cpu
        if jax.default_backend() == "gpu":   # cuDNN is only detectable on a GPU host
            assert "cudnn" in _train_program(form, "cuda", jnp.bfloat16, **kw), form.__name__


@pytest.mark.parametrize("masked", [False, True])
def test_a_gpu_host_without_cudnn_falls_back_to_the_xla_form(masked, monkeypatch):
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(t=8, seed=6))
    mask = _mask(8) if masked else None
    want = jax.jit(lambda *a: sm.softmax_fused(*a, mask=mask, causal=True))(q, k, v)
    if jax.default_backend() != "gpu":   # the cuDNN attempt raises here and is caught
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = jax.jit(lambda *a: sm.softmax_fused(*a, mask=mask, causal=True))(q, k, v)
    valid = np.ones((B, 8), bool) if mask is None else mask
    np.testing.assert_allclose(*(_valid_rows({"": o}, valid)[""] for o in (got, want)), **BF16)



def test_the_layer_without_dropout_takes_the_fused_path_on_a_gpu():
    # In bf16 the fused path's attention dots keep bf16 operands; the XLA form's are float32.
    from agf_jax.layers import SoftmaxAttention

    layer = SoftmaxAttention(num_heads=2, head_dim=8, dropout_rate=0.1, dtype=jnp.bfloat16)
    x = np.ones((2, 16, 16), np.float32)
    params = layer.init(jax.random.PRNGKey(0), x)
    rngs = {"dropout": jax.random.PRNGKey(1)}

    def dots(deterministic):
        def apply(p, x):
            return layer.apply(p, x, deterministic=deterministic, rngs=rngs)[0]
        return _logit_dots(exported_program(apply, params, x, platform="cuda"))

    assert not any("f32" in ops for ops in dots(True)), dots(True)
    assert any("f32" in ops for ops in dots(False)), dots(False)   # dropout keeps the XLA form


def test_decoding_past_the_cache_is_an_error_where_the_length_is_concrete():
    q, k, v = _inputs(t=3)
    cache = sm.init_cache(B, 2, H, D)
    for t in range(2):
        cache, y = sm.softmax_step(cache, q[:, t], k[:, t], v[:, t])
        assert np.all(np.isfinite(np.asarray(y)))
    with pytest.raises(ValueError, match=r"cache has 2 slots .* sample\(s\) \[0, 1\] would write token 3"):
        sm.softmax_step(cache, q[:, 2], k[:, 2], v[:, 2])
    # A padded token is not written: the full cache still takes it, and only sample 1's real token raises.
    sm.softmax_step(cache, q[:, 2], k[:, 2], v[:, 2], append=np.array([False, False]))
    with pytest.raises(ValueError, match=r"sample\(s\) \[1\] would write token 3"):
        sm.softmax_step(cache, q[:, 2], k[:, 2], v[:, 2], append=np.array([False, True]))
    # The scan counts the tokens it writes: 3 into 2 slots raises, 2 valid of 3 (a padded one) fits.
    with pytest.raises(ValueError, match=r"cache has 2 slots .* would write token 3"):
        sm.softmax_scan(q, k, v, cache=sm.init_cache(B, 2, H, D))
    y, final = sm.softmax_scan(q, k, v, cache=sm.init_cache(B, 2, H, D), mask=np.array([[1, 1, 0], [1, 0, 1]]))
    assert final.length.tolist() == [2, 2] and np.all(np.isfinite(np.asarray(y)))
    with pytest.raises(ValueError, match=r"init the cache with max_length >= the tokens you decode"):
        sm.check_room(cache)


def _full_cache_error(message):
    """The error of a write past the cache: `ValueError` eagerly; under jit (a traced length) the host
    callback's `ValueError`, which jax re-raises as a `JaxRuntimeError` ending with the same line."""
    return pytest.raises((ValueError, jax.errors.JaxRuntimeError), match=message)


def test_decoding_past_the_cache_under_jit_is_the_same_error_not_nan():
    """Issue 43: under jit the overflowing token used to return NaN silently (a6dca18)."""
    q, k, v = _inputs(t=3)
    step = jax.jit(sm.softmax_step)
    cache = sm.init_cache(B, 2, H, D)
    for t in range(2):
        cache, y = step(cache, q[:, t], k[:, t], v[:, t])
        assert np.all(np.isfinite(np.asarray(y)))
    with _full_cache_error(r"ValueError: softmax decoding: the key/value cache has 2 slots \(the max_length "
                           r"given at init.* sample\(s\) \[0, 1\] would write token 3"):
        jax.block_until_ready(step(cache, q[:, 2], k[:, 2], v[:, 2]))
    # A padded token writes nothing: a full cache still takes it under jit.
    _, y = step(cache, q[:, 2], k[:, 2], v[:, 2], append=jnp.array([False, False]))
    assert np.all(np.isfinite(np.asarray(y)))
    # The scan's steps are traced even when it is called eagerly with a traced cache.
    with _full_cache_error(r"cache has 2 slots .* would write token 3"):
        jax.block_until_ready(jax.jit(lambda c: sm.softmax_scan(q, k, v, cache=c))(sm.init_cache(B, 2, H, D)))


def test_dropin_decoding_past_its_init_length_is_an_error():
    from zoo_core import attention

    dec = attention.make("softmax", num_heads=H, qkv_features=16, causal=True, decode=True)
    x = jnp.ones((B, 3, 16))
    variables = dec.init(jax.random.PRNGKey(0), x)
    params, cache = variables["params"], variables["cache"]
    for _ in range(3):
        y, state = dec.apply({"params": params, "cache": cache}, x[:, :1], mutable=["cache"])
        cache = state["cache"]
        assert np.all(np.isfinite(np.asarray(y)))
    with pytest.raises(ValueError, match=r"cache has 3 slots \(the max_length given at init"):
        dec.apply({"params": params, "cache": cache}, x[:, :1], mutable=["cache"])
    # The same error under jit, where the cache length is traced (it was NaN, issue 43).
    step = jax.jit(lambda c, x: dec.apply({"params": params, "cache": c}, x, mutable=["cache"]))
    with _full_cache_error(r"cache has 3 slots \(the max_length given at init"):
        jax.block_until_ready(step(cache, x[:, :1]))
