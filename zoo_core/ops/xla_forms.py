"""Forms of common operations chosen for how XLA compiles them, with the same values.

`add_to_each(x, table)` is `x + table[None]` (a table of learned position embeddings added to every
sequence of a batch). Its gradient with respect to the table is a sum over the batch axis, which
autodiff emits as a reduce over the major axis of a rank-3 array, which XLA's CPU backend runs far
slower than a dot with a ones vector computing the same sum. So the backward here is that dot; the
forward stays the plain broadcast add.

`Embed` is flax's layer of the same name with the lookup in the table's own dtype and the cast
after it, so that in a bfloat16 model the lookup's backward (a scatter-add of every token's gradient
into the table's few rows) accumulates in float32, not in bfloat16.

`Dense` and `DenseGeneral` are flax's layers of the same names (same fields, parameters and
values) computed as two-dimensional matmuls, whose gradients XLA's CPU backend runs without
transposing copies of the activations, and with the bias added by `add_bias`, whose gradient sums a
bfloat16 cotangent in float32; `heads` splits the head axis for per-head dots. `gelu` is
PyTorch's exact GELU in PyTorch's own formula, which XLA computes faster than flax's. `LayerNorm`
is flax's layer with a hand-written backward (`layer_norm`) that keeps fewer full-size arrays.

`plain(*names)` is a context manager for timing these forms against their plain counterparts (the
bfloat16 bisect of benchmarks/device_phases.py): inside it, the models and layers that ask
`is_plain(name)` while they are traced build the plain form of each named part instead (same
parameters and values). It is read at trace time, so jit the step inside it.
"""
from __future__ import annotations

__all__ = ["PLAIN_FORMS", "plain", "is_plain", "Dense", "DenseGeneral", "Embed", "LayerNorm", "layer_norm", "gelu",
           "heads", "add_to_each", "dense_group"]

import contextlib
import functools
import itertools
import math
import threading
from typing import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from flax.linen import dtypes as flax_dtypes

Array = jax.Array

_SQRT_HALF = 0.7071067811865476

# The parts `plain` can swap for their plain form, each with the same parameters and values:
#   'embed'        flax's Embed (its lookup's backward a scatter-add in the compute dtype), not `Embed`
#                  (that scatter-add in float32);
#   'layer_norm'   flax's LayerNorm (autodiff), not `LayerNorm` (a hand-written backward);
#   'add_to_each'  x + table[None] (autodiff), not `add_to_each` (a dot for the table's gradient);
#   'dense'        flax's Dense / DenseGeneral, not this module's 2-D matmul forms (also in attention);
#   'dropout'      flax's Dropout (its own random bits), not `zoo_core.ops.dropout.Dropout`;
#   'agf_backward' autodiff of AGF's plain maths, not the hand-written backward of
#                  `agf_jax.ops.agf_with_orthogonality` (its optimisation barrier and variadic reduce).
PLAIN_FORMS = ("embed", "layer_norm", "add_to_each", "dense", "dropout", "agf_backward")

_plain_state = threading.local()


@contextlib.contextmanager
def plain(*names: str) -> Iterator[None]:
    """Within the block, the parts `names` (of `PLAIN_FORMS`) are traced in their plain form.

    For timing a step with some of the zoo's forms swapped out (the bfloat16 bisect); models and
    layers ask `is_plain(name)` when they are traced, so build and jit the step inside the block.
    JAX caches a jitted function's trace by its argument types, not by this setting: a function
    object jitted and called before the block keeps its forms when called again inside it (jit a
    new one there). Nested blocks add their names; a bad or repeated name raises ValueError before
    the block runs.
    """
    for name in names:
        if name not in PLAIN_FORMS:
            raise ValueError(f"`plain` must be one of {PLAIN_FORMS}, got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"`plain` names a part twice: {names}")
    before = getattr(_plain_state, "names", frozenset())
    _plain_state.names = before | frozenset(names)
    try:
        yield
    finally:
        _plain_state.names = before


def is_plain(name: str) -> bool:
    """Whether part `name` (of `PLAIN_FORMS`) is to be traced in its plain form (see `plain`)."""
    if name not in PLAIN_FORMS:
        raise ValueError(f"`plain` must be one of {PLAIN_FORMS}, got {name!r}")
    return name in getattr(_plain_state, "names", frozenset())


def heads(x: Array, axis: int = 2) -> list[Array]:
    """Splits the head axis: `[B, T, H, D]` -> H arrays `[B, T, D]` (any rank, any `axis`).

    Per-head products are cheaper on XLA's CPU backend as one dot per head on these: an einsum
    batched over (B, H) of `[B, T, H, D]` operands makes it transpose every operand to
    `[B, H, D, T]` first (a copy of each), while a dot batched over the leading axes alone runs on
    the arrays as they are. Split the heads before the elementwise work, so that each per-head
    operand is written contiguous by the fusion that produces it. `jnp.split`'s gradient is one
    concatenation (H slices' gradients would be H zero-padded full-size arrays summed).
    """
    return [jnp.squeeze(p, axis) for p in jnp.split(x, x.shape[axis], axis=axis)]


def gelu(x: Array) -> Array:
    """PyTorch's exact `nn.GELU` / `F.gelu`, in PyTorch's own formula 0.5 x (1 + erf(x / sqrt 2)).

    `flax.linen.gelu(approximate=False)` computes 0.5 x erfc(-x / sqrt 2) instead; XLA's erfc is a
    two-branch approximation with an exp and was 3x slower than erf (forward and backward). The two
    agree to 1e-6 absolute (float32 rounding of the 1 + erf sum; |y| < 1e-3 for x < -3.1 there).
    """
    x = jnp.asarray(x)
    return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(_SQRT_HALF, x.dtype)))


@jax.custom_vjp
def add_to_each(x: Array, table: Array) -> Array:
    """`x + table` broadcast over the leading (batch) axis: x `[B, ...]`, table `x.shape[1:]`.

    Same value, dtype promotion and gradient as `x + table[None]`; only the table's gradient is
    computed differently (see the module docstring): summed in float32 (at least) and rounded once,
    so for a bfloat16 table it is the float32 sum rounded, not a bfloat16 running sum.
    """
    if jnp.shape(table) != jnp.shape(x)[1:]:
        raise ValueError(f"table shape {jnp.shape(table)} must be x's shape without the batch axis, "
                         f"{jnp.shape(x)[1:]}")
    return x + table[None]


def _fwd(x, table):
    # Residuals: only the two dtypes (as zero scalars); g carries the shapes.
    return add_to_each(x, table), (jnp.zeros((), x.dtype), jnp.zeros((), table.dtype))


def _bwd(res, g):
    x_zero, table_zero = res
    # Accumulated in float32 at least (float64 stays float64), rounded once to the table's dtype;
    # HIGHEST: on TPUs a float32 dot otherwise rounds its operands to bfloat16.
    total = jnp.einsum("b,b...->...", jnp.ones(g.shape[:1], g.dtype), g,
                       precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.promote_types(g.dtype, jnp.float32))
    return g.astype(x_zero.dtype), total.astype(table_zero.dtype)


add_to_each.defvjp(_fwd, _bwd)


@jax.custom_vjp
def add_bias(y: Array, bias: Array) -> Array:
    """`y + bias` over y's last axis, the bias in its parameter dtype: y `[..., F]`, bias `[F]`.

    The value is flax's (the bias cast to y's dtype, then added); only the bias's gradient differs: the
    sum of y's cotangent over every leading axis (each token of the batch) is taken in float32 at least
    and rounded once to the bias's dtype, where autodiff of the cast-then-add sums a bfloat16
    cotangent in bfloat16 (benchmarks.precision: 3e-2 off float64 over 16K tokens).
    """
    if jnp.shape(bias) != jnp.shape(y)[-1:]:
        raise ValueError(f"bias shape {jnp.shape(bias)} must be y's last axis, {jnp.shape(y)[-1:]}")
    return y + bias.astype(y.dtype)


def _bias_fwd(y, bias):
    return add_bias(y, bias), jnp.zeros((), bias.dtype)


def _bias_bwd(bias_zero, g):
    total = jnp.sum(g, axis=tuple(range(g.ndim - 1)), dtype=jnp.promote_types(g.dtype, jnp.float32))
    return g, total.astype(bias_zero.dtype)


add_bias.defvjp(_bias_fwd, _bias_bwd)


def _flat_init(init, flat_shape):
    """`init` called on `flat_shape`, reshaped to the parameter's shape (flax's DenseGeneral does
    the same, so that fan-in based initialisers see `[fan_in, fan_out]`)."""

    def wrapped(rng, shape, dtype=jnp.float32):
        value = init(rng, flat_shape, dtype)
        if isinstance(value, meta.AxisMetadata):
            return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
        return jnp.reshape(value, shape)
    return wrapped


class DenseGeneral(nn.DenseGeneral):
    """`flax.linen.DenseGeneral` (same fields, parameters, initial values and outputs) computed as
    one two-dimensional matmul: x `[..., *in]` -> `[N, prod(in)] @ [prod(in), prod(out)]`.

    For x `[B, T, E]` and a kernel `[E, H, D]` the kernel's gradient is a dot contracting B and T
    with two free axes on the other side; XLA's CPU backend canonicalises such a dot by transposing
    the operands into fresh copies (`[E, B*T]`) before the matmul, while a dot of two matrices
    contracting their major axis runs on the arrays as they are. Measured on the AGF ListOps step
    (one core): 40 ms per `[32, 2000, 64]` copy, 0.26 s of the step's 2.4 s. The reshapes are free.

    Only trailing contracted axes (`axis=-1` or `(-2, -1)`, ...) and no `batch_dims`; anything else
    is refused.
    """

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        batch_dims = (self.batch_dims,) if isinstance(self.batch_dims, int) else self.batch_dims
        n = len(axes)
        if tuple(batch_dims) or sorted(a % inputs.ndim for a in axes) != list(
                range(inputs.ndim - n, inputs.ndim)):
            raise ValueError(f"xla_forms.DenseGeneral contracts trailing axes only and has no "
                             f"batch_dims, got axis={self.axis}, batch_dims={self.batch_dims}")
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        in_shape = tuple(inputs.shape[inputs.ndim - n:])
        fan_in, fan_out = math.prod(in_shape), math.prod(features)
        kernel = self.param("kernel", _flat_init(self.kernel_init, (fan_in, fan_out)),
                            in_shape + features, self.param_dtype)
        bias = (self.param("bias", _flat_init(self.bias_init, (fan_out,)), features,
                           self.param_dtype) if self.use_bias else None)
        return _layer_matmul(self, inputs, kernel, bias, n)


class Dense(nn.Dense):
    """`flax.linen.Dense` (same fields, parameters and values) as one two-dimensional matmul: the
    leading axes of x `[..., E]` are merged first (see `DenseGeneral` for why)."""

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        return _layer_matmul(self, inputs, kernel, bias, 1)


def matmul(inputs: Array, kernel: Array, n: int = 1, dot_general=jax.lax.dot_general, precision=None,
           bias=None) -> Array:
    """inputs `[..., *in]` (n trailing axes contracted) times kernel `[prod(in), F]` (plus bias `[F]`)
    -> `[..., F]`, as one two-dimensional matmul of `[N, prod(in)]` (`DenseGeneral` says why). When a
    leading axis but the first is split over an Explicit mesh axis (a sequence split along T under
    `jax.make_mesh`'s default axes), merging them would move data, so the dot contracts the axes as
    they are: the same values."""
    lead = inputs.ndim - n
    spec = tuple(getattr(getattr(jax.typeof(inputs), "sharding", None), "spec", ()) or ())
    if any(s is not None for s in spec[1:lead]):
        kernel = kernel.reshape(inputs.shape[lead:] + kernel.shape[-1:])
        y = dot_general(inputs, kernel, ((tuple(range(lead, inputs.ndim)), tuple(range(n))), ((), ())),
                        precision=precision)
        return y if bias is None else add_bias(y, bias)
    y = dot_general(inputs.reshape(-1, kernel.shape[0]), kernel, (((1,), (0,)), ((), ())), precision=precision)
    if bias is not None:
        y = add_bias(y, bias)
    return y.reshape(inputs.shape[:lead] + kernel.shape[-1:])


def _layer_matmul(layer, inputs: Array, kernel: Array, bias, n: int) -> Array:
    """`layer`'s (a `Dense` / `DenseGeneral`) output for its kernel `[*in, *out]` and bias `[*out]` (or
    None), contracting the n trailing axes of inputs `[..., *in]` (`matmul`)."""
    inputs, kernel, _ = layer.promote_dtype(inputs, kernel, bias, dtype=layer.dtype)
    features = kernel.shape[n:]
    fan_in, fan_out = math.prod(inputs.shape[inputs.ndim - n:]), math.prod(features)
    dot_general = (layer.dot_general_cls() if layer.dot_general_cls is not None
                   else layer.dot_general or jax.lax.dot_general)
    y = matmul(inputs, kernel.reshape(fan_in, fan_out), n, dot_general, layer.precision,
               None if bias is None else bias.reshape(fan_out))
    return y.reshape(inputs.shape[:inputs.ndim - n] + features)


def _contracted(layer) -> int:
    """How many trailing input axes a `Dense` / `DenseGeneral` contracts."""
    return 1 if isinstance(layer, Dense) else len((layer.axis,) if isinstance(layer.axis, int) else layer.axis)


_SHARED_FIELDS = ("dtype", "param_dtype", "precision", "dot_general", "dot_general_cls", "promote_dtype",
                  "use_bias")


def dense_group(x: Array, layers) -> tuple[Array, ...]:
    """`tuple(layer(x) for layer in layers)` for `Dense` / `DenseGeneral` layers reading the same x.

    On the CPU (`jax.lax.platform_dependent`) the layers run as one matmul, x `[N, E]` times their
    kernels side by side `[E, F_1 + F_2 + ...]`, then split: the weight gradient is then one dot
    x^T [dY_1 | dY_2 | ...], which XLA's CPU backend runs much faster per column at the summed width
    than as narrow separate dots that each stream the N rows of x (four `[64, 64]` weight gradients
    over 64K rows: 4 x 12.3 ms against 27.6 ms at width 256), and x's gradient one dot. Each column
    is the same dot product over E as in its own layer. Elsewhere each layer's own matmul, the
    program unchanged. When the layers are initialising (their parameters do not exist yet), are
    not all this module's with the same dtypes, precision and bias setting, each layer is called.

    Args:
      x: `[..., *in]`, the input of every layer.
      layers: this module's `Dense` / `DenseGeneral` layers, bound (submodules of the caller).

    Returns:
      a tuple of each layer's output `[..., *out_i]`.
    """
    layers = tuple(layers)
    n = _contracted(layers[0])
    shared = {tuple(getattr(layer, f) for f in _SHARED_FIELDS) for layer in layers}
    if (not all(isinstance(layer, (Dense, DenseGeneral)) for layer in layers) or len(shared) > 1
            or len({_contracted(layer) for layer in layers}) > 1 or layers[0].is_initializing()):
        return tuple(layer(x) for layer in layers)
    params = [meta.unbox(layer.variables["params"]) for layer in layers]
    kernels = [p["kernel"] for p in params]
    biases = [p.get("bias") for p in params]

    def separate(x, kernels, biases):
        return tuple(_layer_matmul(layer, x, k, b, n) for layer, k, b in zip(layers, kernels, biases))

    def together(x, kernels, biases):
        layer = layers[0]
        lead = x.shape[:x.ndim - n]
        fan_in = math.prod(x.shape[x.ndim - n:])
        widths = [math.prod(k.shape[n:]) for k in kernels]
        kernel = jnp.concatenate([k.reshape(fan_in, w) for k, w in zip(kernels, widths)], axis=1)
        kernel = kernel.reshape(x.shape[x.ndim - n:] + (sum(widths),))            # [*in, sum F_i]
        bias = None if biases[0] is None else jnp.concatenate([b.reshape(w) for b, w in zip(biases, widths)])
        y = _layer_matmul(layer, x, kernel, bias, n)                                    # [..., sum F_i]
        ys = jnp.split(y, list(itertools.accumulate(widths[:-1])), axis=-1)
        return tuple(y.reshape(lead + k.shape[n:]) for y, k in zip(ys, kernels))

    return jax.lax.platform_dependent(x, kernels, biases, cpu=together, default=separate)


class Embed(nn.Embed):
    """`flax.linen.Embed` (same fields, parameters and values) that gathers rows of the table in its
    parameter dtype and casts them to `dtype` afterwards: ids `[...]` int -> `[..., features]`.

    The gradient of a gather is a scatter-add into the table. Flax casts the table to `dtype` first,
    so a bfloat16 model's scatter-add runs in bfloat16: on a GPU, XLA emits a bfloat16 atomic add as
    a compare-and-swap loop, which serialises when many tokens share few rows (ListOps: 64,000
    tokens x 64 features into 16 rows). Here it accumulates in float32. Rounding a gathered row is
    rounding the table's row, so the values are the same bit for bit.
    """

    def __call__(self, inputs: Array) -> Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        table = jnp.asarray(self.embedding)
        out_dtype = self.dtype if self.dtype is not None else table.dtype
        if self.num_embeddings == 1:
            return jnp.broadcast_to(table, inputs.shape + (self.features,)).astype(out_dtype)
        return jnp.take(table, inputs, axis=0).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x: Array, scale: Array, bias: Array, epsilon: float) -> Array:
    """Layer normalisation over the last axis: `(x - mean) / sqrt(var + epsilon) * scale + bias`.

    x `[..., E]`, scale and bias `[E]`; the statistics and the result in float32 at least (as
    flax's `LayerNorm`: the variance is E[x^2] - E[x]^2, clipped at 0). The backward is written
    out (`jax.custom_vjp`): it keeps x-hat and the `[..., 1]` inverse deviation, where autodiff of
    flax's form kept two full-size arrays (x - mean and the broadcast product rsqrt * scale) and
    XLA's CPU backend wrote the broadcasts to memory.
    """
    return _layer_norm_fwd(x, scale, bias, epsilon)[0]


def _layer_norm_fwd(x, scale, bias, epsilon):
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(xf * xf, axis=-1, keepdims=True) - mean * mean)
    inv = jax.lax.rsqrt(var + epsilon)
    xhat = (xf - mean) * inv
    y = xhat * scale.astype(xf.dtype) + bias.astype(xf.dtype)
    return y, (xhat, inv, scale, jnp.zeros((), x.dtype), jnp.zeros((), bias.dtype))


def _layer_norm_bwd(epsilon, res, dy):
    xhat, inv, scale, x_zero, bias_zero = res
    dy = dy.astype(xhat.dtype)
    lead = tuple(range(dy.ndim - 1))
    dbias = jnp.sum(dy, axis=lead)
    dscale = jnp.sum(dy * xhat, axis=lead)
    g = dy * scale.astype(xhat.dtype)
    dx = inv * (g - jnp.mean(g, axis=-1, keepdims=True)
                - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    return dx.astype(x_zero.dtype), dscale.astype(scale.dtype), dbias.astype(bias_zero.dtype)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class LayerNorm(nn.LayerNorm):
    """`flax.linen.LayerNorm` (same fields, parameters and values up to float32 rounding) computed
    by `layer_norm`, whose hand-written backward moves fewer bytes.

    Only the default axes, scale and bias, fast variance, float32 statistics and no cross-device
    statistics (the zoo's uses); anything else is refused.
    """

    @nn.compact
    def __call__(self, x: Array, *, mask: Array | None = None) -> Array:
        unsupported = dict(mask=mask is not None, reduction_axes=self.reduction_axes != -1,
                           feature_axes=self.feature_axes != -1, use_bias=not self.use_bias,
                           use_scale=not self.use_scale, use_fast_variance=not self.use_fast_variance,
                           axis_name=self.axis_name is not None,
                           axis_index_groups=self.axis_index_groups is not None,
                           force_float32_reductions=not self.force_float32_reductions)
        bad = [name for name, is_bad in unsupported.items() if is_bad]
        if bad:
            raise ValueError(f"xla_forms.LayerNorm supports flax's defaults only; got a different {bad}")
        features = jnp.shape(x)[-1]
        scale = self.param("scale", self.scale_init, (features,), self.param_dtype)
        bias = self.param("bias", self.bias_init, (features,), self.param_dtype)
        dtype = flax_dtypes.canonicalize_dtype(x, scale, bias, dtype=self.dtype)
        return layer_norm(x, scale, bias, self.epsilon).astype(dtype)
