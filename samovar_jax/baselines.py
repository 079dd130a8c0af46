"""DLinear (Zeng, Chen, Zhang & Xu, "Are Transformers Effective for Time Series Forecasting?", AAAI 2023).

The LTSF baseline of SAMoVAR's Table 1 (samovar.md §9, §11). The input window is split by a moving
average into a trend and a seasonal (remainder) part (the paper's Eq. for series decomposition,
Autoformer's `series_decomp`):

    trend = AvgPool_k(pad(x)),   seasonal = x - trend,

where `pad` repeats the first and last values (k - 1) // 2 times on each side, so the trend has the
input's length for odd k. Each part is mapped from L_I input steps to the horizon by one linear layer
along time, shared by all channels or one per channel (`individual`), and the two forecasts are added:

    y[:, c] = W_s^(c) seasonal[:, c] + b_s^(c) + W_t^(c) trend[:, c] + b_t^(c).

There is no normalisation (DLinear works on the StandardScaler-scaled data of the LTSF loaders).
Initialisation: PyTorch's nn.Linear default, U(-1/sqrt(L_I), 1/sqrt(L_I)) for weights and biases, as
in the official code.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo_core import checks

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------

def moving_average(x: Array, kernel_size: int) -> Array:
    """Edge-replicated moving average along time (Autoformer/DLinear `moving_avg`, stride 1).

    Args:
      x: [B, L, C] series.
      kernel_size: k >= 1 (odd k keeps the length L; even k gives L - 1, as the reference).

    Returns:
      [B, L - (k + 1) % 2, C]: mean of x over each window of k steps of the padded series.
    """
    half = (kernel_size - 1) // 2
    padded = jnp.concatenate([jnp.repeat(x[:, :1], half, axis=1), x, jnp.repeat(x[:, -1:], half, axis=1)], axis=1)
    # A windowed sum (not a cumulative-sum difference, whose rounding grows with L).
    sums = jax.lax.reduce_window(padded, jnp.zeros((), padded.dtype), jax.lax.add, (1, kernel_size, 1), (1, 1, 1),
                                 "VALID")
    return sums / kernel_size


def series_decomposition(x: Array, kernel_size: int) -> tuple[Array, Array]:
    """(seasonal, trend) = (x - moving_average(x), moving_average(x)); x [B, L, C], odd kernel_size."""
    trend = moving_average(x, kernel_size)
    return x - trend, trend


def time_linear(x: Array, kernel: Array, bias: Array) -> Array:
    """Linear map along time, shared or per channel.

    Args:
      x: [B, L, C].
      kernel: [L, H] (shared) or [C, L, H] (per channel).
      bias: [H] or [C, H].

    Returns:
      [B, H, C].
    """
    if kernel.ndim == 2:
        return jnp.einsum("blc,lh->bhc", x, kernel) + bias[:, None]
    return jnp.einsum("blc,clh->bhc", x, kernel) + jnp.swapaxes(bias, 0, 1)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------

class TimeLinear(nn.Module):
    """`kernel` [L, H] and `bias` [H] (shared), or [C, L, H] and [C, H] (`channels` > 0, per channel).

    Attributes:
      input_len: L.
      horizon: H.
      channels: 0 for one map shared by all channels, else C (one map per channel).
    """
    input_len: int
    horizon: int
    channels: int = 0
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        bound = 1.0 / math.sqrt(self.input_len)
        init = nn.initializers.uniform(2 * bound)
        lead = (self.channels,) if self.channels else ()
        shifted = lambda key, shape, dtype: init(key, shape, dtype) - jnp.asarray(bound, dtype)  # noqa: E731
        self.kernel = self.param("kernel", shifted, lead + (self.input_len, self.horizon), self.param_dtype)
        self.bias = self.param("bias", shifted, lead + (self.horizon,), self.param_dtype)

    def __call__(self, x: Array) -> Array:
        """[B, L, C] -> [B, H, C]."""
        x, kernel, bias = nn.dtypes.promote_dtype(x, self.kernel, self.bias, dtype=self.dtype)
        return time_linear(x, kernel, bias)


class DLinear(nn.Module):
    """DLinear forecaster with the zoo's batch/output contract.

    Batch keys: `inputs` float [B, L_I, C]; `target` [B, horizon, C_t] is read by the task, not here.
    Returns `({'forecast': [B, horizon, C_t]} (float32), {})`: the last C_t channels are forecast.

    Attributes:
      num_channels: C, input series.
      input_len: L_I.
      horizon: forecast length H.
      num_targets: C_t; 0 -> all channels.
      kernel_size: moving-average window (25 in the paper); odd.
      individual: one pair of linear maps per channel instead of one shared pair.
      dtype, param_dtype: compute and parameter dtypes (names accepted); the forecast is float32.
    """
    num_channels: int
    input_len: int
    horizon: int
    num_targets: int = 0
    kernel_size: int = 25
    individual: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        self.check_fields()
        super().__post_init__()

    def check_fields(self) -> None:
        """Boundary checks of the fields (also called by `samovar_jax.model.Model`)."""
        for name in ("num_channels", "input_len", "horizon", "kernel_size"):
            checks.check_int(name, getattr(self, name), 1)
        if self.kernel_size % 2 == 0:
            checks.fail(f"`kernel_size` must be odd (the trend keeps the input length), got {self.kernel_size}")
        checks.check_choice("num_targets", self.num_targets, range(self.num_channels + 1))
        for name in ("dtype", "param_dtype"):
            try:
                getattr(self, name) is None or jnp.dtype(getattr(self, name))
            except TypeError:
                checks.fail(f"`{name}` must be a dtype or its name, got {getattr(self, name)!r}")

    def setup(self):
        kw = dict(dtype=None if self.dtype is None else jnp.dtype(self.dtype),
                  param_dtype=jnp.dtype(self.param_dtype))
        channels = self.num_channels if self.individual else 0
        self.seasonal = TimeLinear(self.input_len, self.horizon, channels, **kw, name="seasonal")
        self.trend = TimeLinear(self.input_len, self.horizon, channels, **kw, name="trend")

    def __call__(self, batch: dict, *, train: bool = False) -> tuple[dict, dict]:
        """Forecast of the next `horizon` steps.

        Args:
          batch: {'inputs': [B, L_I, C]} (other keys are ignored).
          train: unused by the model (no dropout); accepted for the trainer's signature.

        Returns:
          ({'forecast': [B, horizon, C_t]}, {}).
        """
        del train  # DLinear has no dropout or auxiliary loss
        if not isinstance(batch, dict) or "inputs" not in batch:
            checks.fail("`batch` must be a dict with key 'inputs' [B, L_I, C]")
        x = jnp.asarray(batch["inputs"])
        if x.ndim != 3 or x.shape[1:] != (self.input_len, self.num_channels):
            checks.fail(f"`batch['inputs']` must be [B, input_len={self.input_len}, num_channels="
                        f"{self.num_channels}], got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            checks.fail(f"`batch['inputs']` must be floating point, got {x.dtype}")
        seasonal, trend = series_decomposition(x.astype(jnp.promote_types(x.dtype, jnp.float32)), self.kernel_size)
        y = self.seasonal(seasonal) + self.trend(trend)
        c_t = self.num_targets or self.num_channels
        return {"forecast": y[:, :, -c_t:].astype(jnp.float32)}, {}
