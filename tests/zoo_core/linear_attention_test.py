"""The shared causal linear-attention kernels: every form equal, state carry, NaN-safe masking."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from zoo_core.ops import linear_attention as la
from zoo_core.testing import F32_SIMPLE, F64, assert_forms_agree, exported_program, while_loops

B, H, D, M = 2, 2, 4, 3


def _inputs(t, seed=0, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kq, (B, t, H, D), dtype), jax.random.normal(kk, (B, t, H, D), dtype),
            jax.random.normal(kv, (B, t, H, M), dtype))


def _oracle(q, k, v, mask=None):
    """Token loop in float64 numpy: num_t = sum_{s<=t, valid} (q_t.k_s) v_s."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    valid = np.ones(q.shape[:2], bool) if mask is None else np.asarray(mask)
    num = np.zeros(q.shape[:3] + (v.shape[-1],))
    den = np.zeros(q.shape[:3])
    for t in range(q.shape[1]):
        for s in range(t + 1):
            w = np.einsum("bhd,bhd->bh", q[:, t], k[:, s]) * valid[:, s, None] * valid[:, t, None]
            num[:, t] += w[..., None] * v[:, s]
            den[:, t] += w
    return num, den


# Compiled once per form and shape: run eagerly, each form compiles dozens of one-op programs (most of
# this file's time). Eager == jit is checked for every layer in tests/contract_test.py.
_parallel = jax.jit(la.causal_parallel, static_argnames="denominator")
_chunked = jax.jit(la.causal_chunked, static_argnames=("chunk_size", "denominator"))
_batched = jax.jit(la.causal_chunked_batched, static_argnames=("chunk_size", "denominator"))
_scan = jax.jit(la.causal_scan, static_argnames="denominator")


def _all_forms(q, k, v, mask=None, denominator=True):
    out = {"parallel": _parallel(q, k, v, mask=mask, denominator=denominator)}
    for c in (1, 3, 16):
        out[f"chunked({c})"] = _chunked(q, k, v, chunk_size=c, mask=mask, denominator=denominator)[:2]
        out[f"batched({c})"] = _batched(q, k, v, chunk_size=c, mask=mask, denominator=denominator)[:2]
    out["scan"] = _scan(q, k, v, mask=mask, denominator=denominator)[:2]
    return out


@pytest.mark.parametrize("t", [1, 7, 16])
@pytest.mark.parametrize("denominator", [False, True])
def test_forms_match_oracle(t, denominator):
    q, k, v = _inputs(t)
    mask = jnp.arange(t)[None, :] < jnp.array([[t], [max(1, t - 2)]])
    forms = _all_forms(q, k, v, mask, denominator)
    num, den = _oracle(q, k, v, mask)
    forms = {"oracle": (num, den if denominator else None), **forms}
    assert_forms_agree(forms, **F32_SIMPLE)


def test_step_loop_and_state_carry():
    q, k, v = _inputs(7, seed=1)
    ys, dens, state = [], [], la.init_state(B, H, D, M, denominator=True)
    step = jax.jit(la.causal_step)
    for t in range(7):
        y, d, state = step(state, q[:, t], k[:, t], v[:, t])
        ys.append(y)
        dens.append(d)
    num_a, den_a, s_a = _chunked(q[:, :3], k[:, :3], v[:, :3], chunk_size=2, denominator=True)
    num_b, den_b, s_b = _scan(q[:, 3:], k[:, 3:], v[:, 3:], state=s_a, denominator=True)
    full = _chunked(q, k, v, chunk_size=4, denominator=True)
    num_c, den_c, s_c = _batched(q[:, :5], k[:, :5], v[:, :5], chunk_size=2, denominator=True)
    num_d, den_d, s_d = _batched(q[:, 5:], k[:, 5:], v[:, 5:], chunk_size=3, state=s_c, denominator=True)
    assert_forms_agree({
        "chunked": full,
        "batched": _batched(q, k, v, chunk_size=4, denominator=True),
        "batched split": (jnp.concatenate([num_c, num_d], 1), jnp.concatenate([den_c, den_d], 1), s_d),
        "step": (jnp.stack(ys, 1), jnp.stack(dens, 1), state),
        "split": (jnp.concatenate([num_a, num_b], 1), jnp.concatenate([den_a, den_b], 1), s_b),
    }, **F32_SIMPLE)


@pytest.mark.parametrize("bad", [np.nan, 1e30])
def test_padding_and_future_cannot_change_valid_outputs(bad):
    t = 7
    q, k, v = _inputs(t, seed=2)
    mask = jnp.arange(t)[None, :] < jnp.array([[7], [4]])
    clean = _all_forms(q, k, v, mask)
    # Padding (batch row 1, positions 4..6) holds `bad` in q, k and v.
    pad = ~mask[:, :, None, None]
    dirty = _all_forms(jnp.where(pad, bad, q), jnp.where(pad, bad, k), jnp.where(pad, bad, v), mask)
    for name in clean:
        np.testing.assert_array_equal(np.asarray(dirty[name][0]), np.asarray(clean[name][0]), err_msg=name)
    # The future (position 5 of every row, unmasked) holds `bad`: outputs before 5 are unchanged.
    fut = (jnp.arange(t) == 5)[None, :, None, None]
    dirty = _all_forms(jnp.where(fut, bad, q), jnp.where(fut, bad, k), jnp.where(fut, bad, v))
    clean = _all_forms(q, k, v)
    for name in clean:
        np.testing.assert_array_equal(np.asarray(dirty[name][0])[:, :5], np.asarray(clean[name][0])[:, :5],
                                      err_msg=name)
        if np.isnan(bad):   # a NaN input still reaches its own and later outputs
            assert np.all(np.isnan(np.asarray(dirty[name][0])[:, 5:])), name


def test_accumulates_in_float32_for_bf16_inputs():
    q, k, v = _inputs(7, dtype=jnp.bfloat16)
    for form in (la.causal_chunked, la.causal_chunked_batched):
        num, den, state = form(q, k, v, chunk_size=3, denominator=True)
        assert num.dtype == den.dtype == state.num.dtype == state.den.dtype == jnp.float32


def test_gradients_float64():
    with jax.enable_x64(True):
        q, k, v = (x.astype(jnp.float64) for x in _inputs(5, seed=3))
        mask = jnp.arange(5)[None, :] < jnp.array([[5], [3]])

        def f(fn):
            return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
        def grad(fn):
            return jax.jit(jax.grad(f(fn), argnums=(0, 1, 2)))(q, k, v)
        grads = {
            "parallel": grad(lambda *a: la.causal_parallel(*a, mask=mask)[0]),
            # chunk 2 carries the state with the scan, chunk 3 with the prefix sum
            "chunked": grad(lambda *a: la.causal_chunked(*a, chunk_size=2, mask=mask)[0]),
            "chunked(3)": grad(lambda *a: la.causal_chunked(*a, chunk_size=3, mask=mask)[0]),
            "batched(2)": grad(lambda *a: la.causal_chunked_batched(*a, chunk_size=2, mask=mask)[0]),
            "scan": grad(lambda *a: la.causal_scan(*a, mask=mask)[0]),
        }
        assert_forms_agree(grads, **F64)
        for c in (2, 3):
            check_grads(jax.jit(lambda *a, c=c: la.causal_chunked(*a, chunk_size=c, mask=mask)[0]), (q, k, v),
                        order=1, modes=("rev",))
        check_grads(jax.jit(lambda *a: la.causal_chunked_batched(*a, chunk_size=2, mask=mask)[0]), (q, k, v),
                    order=1, modes=("rev",))


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("denominator", [False, True])
def test_both_ways_of_carrying_the_chunk_state_agree(chunk, denominator, monkeypatch):
    # On the CPU causal_chunked picks the prefix sum or the scan by the size of the states; run both here.
    q, k, v = _inputs(13, seed=4)
    kq, kd = jax.random.split(jax.random.PRNGKey(5))
    state = la.LinearState(jax.random.normal(kq, (B, H, D, M)),
                           jax.random.normal(kd, (B, H, D)) if denominator else None)
    mask = jnp.arange(13)[None, :] < jnp.array([[13], [9]])
    outs = {}
    for prefix in (False, True):
        monkeypatch.setattr(la, "_prefix_sum_fits", lambda *_, p=prefix: p)
        # A new function each time, so that jit traces again under the patched choice.
        run = jax.jit(lambda *a: la.causal_chunked(*a, chunk_size=chunk, state=state, mask=mask,
                                                   denominator=denominator))
        outs[f"prefix={prefix}"] = run(q, k, v)
    outs["batched"] = _batched(q, k, v, chunk_size=chunk, state=state, mask=mask, denominator=denominator)
    assert_forms_agree(outs, **F32_SIMPLE)


def _chunked_train_program(heads: int, chunk: int, platform: str) -> str:
    """The exported forward + backward of `causal_chunked` (with denominator and mask)."""
    x = jax.ShapeDtypeStruct((2, 64, heads, 4), jnp.float32)
    mask = jax.ShapeDtypeStruct((2, 64), jnp.bool_)

    def loss(q, k, v, mask):
        num, den, _ = la.causal_chunked(q, k, v, chunk_size=chunk, mask=mask, denominator=True)
        return jnp.sum(num) + jnp.sum(den)
    return exported_program(jax.grad(loss, argnums=(0, 1, 2)), x, x, x, mask, platform=platform)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_accelerator_program_has_no_loop_and_does_not_grow_with_heads(platform):
    # Chunk 1 (n D M > T (D + M)) takes the scan over chunks on the CPU; an accelerator never loops.
    assert while_loops(_chunked_train_program(2, 1, "cpu")) > 0
    dots = set()
    for heads in (2, 8):
        for chunk in (1, 16):
            program = _chunked_train_program(heads, chunk, platform)
            assert while_loops(program) == 0, (heads, chunk)
            dots.add(program.count("stablehlo.dot_general"))
    assert len(dots) == 1, dots

