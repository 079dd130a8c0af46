"""`synthetic_var`: random VAR(p) series, the synthetic experiment of SAMoVAR (Fig. 4; samovar.md §10).

Each example is one series x_0 .. x_{L-1} in R^C, L = L_I + L_P, of a freshly drawn VAR(p):

    x_t = sum_{j=1}^{p} A_j x_{t-j} + eps_t,   eps_t ~ N(0, noise_std^2 I),   t >= p,

whose first p values are N(0, 1). 'inputs' is x_0 .. x_{L_I-1} and 'target' x_{L_I} .. x_{L-1}.
Exactly as in the released generator (`visualization/dataset.py`):
  * train: p ~ U{1..3} (paper) or U{1..2} (code), A_j ~ U(-0.5, 0.5)^{C x C};
    validation: p ~ U{3..5} (paper) or U{3..4} (code), A_j ~ U(-0.25, 0.25)^{C x C};
  * no burn-in and no stationarity check (about 1.7% of train VARs are explosive);
  * values are clipped to +-clip_value only after the whole series is generated, and non-finite values
    set to 0; no normalisation;
  * the recursion runs in float32 with float64 noise, as the reference does.

Random numbers follow the reference bit for bit: NumPy's legacy global RNG is seeded with `seed` (the
notebook's 2025) and draws the first order; sample i is then generated from the legacy RNG re-seeded with
i (one uniform draw, the p initial rows, the p matrices, the L - p noise rows), and the NEXT sample's order
is drawn from that same re-seeded stream (the notebook ran joblib sequentially, so the per-sample seeding
leaked into the order draws; this is what reproduces its order counts, train {1: 10,059, 2: 9,941} and
validation {3: 993, 4: 1,007} with protocol='code'). Validation sample i reuses seed i
(+ `validation_seed_offset`, 0 in the reference), so its initial values equal train sample i's.

Only the order sets differ between `protocol='paper'` ({1,2,3} / {3,4,5}, the paper's text) and
`protocol='code'` ({1,2} / {3,4}, what the released code draws because `randint`'s bound is exclusive).

Features: 'inputs' float32 [L_I, C], 'target' float32 [L_P, C], 'coefficients' float32 [p_max, C, C]
(coefficients[j - 1] = A_j, zero for j > order; p_max = 5 (paper) or 4 (code) for both splits) and
'order' int64. Splits 'train' and 'validation'.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow_datasets as tfds

from zoo_core.data import base

# Per protocol and split: (lowest order, highest order) inclusive, and the coefficient half-range.
PROTOCOLS = {
    "paper": {"train": ((1, 3), 0.5), "validation": ((3, 5), 0.25)},
    "code": {"train": ((1, 2), 0.5), "validation": ((3, 4), 0.25)},
}


@dataclasses.dataclass
class SyntheticVarConfig(tfds.core.BuilderConfig):
    protocol: str = "paper"
    num_channels: int = 2
    input_length: int = 64
    pred_length: int = 1
    num_train: int = 20000
    num_validation: int = 2000
    noise_std: float = 0.05
    clip_value: float = 15.0
    seed: int = 2025
    validation_seed_offset: int = 0


def max_order(protocol: str) -> int:
    """The largest order over both splits: the leading size of 'coefficients'."""
    return max(hi for (_, hi), _ in PROTOCOLS[protocol].values())


def _draw_parameters(orders_range, coef_range, num, length, channels, rng, seed_offset):
    """Sequentially replays the reference's RNG calls (see the module docstring).

    Args:
      orders_range: (lo, hi) inclusive order range.
      coef_range: half-width r of U(-r, r) for the coefficients.
      num: number of series.
      length: L = L_I + L_P.
      channels: C.
      rng: legacy `np.random.RandomState` seeded with the run seed (advanced in place: the next
        split continues from it, as the reference's global RNG does).
      seed_offset: added to the sample index to form the per-sample seed.

    Returns:
      orders int64 [num]; initial float32 [num, p_hi, C] (rows >= order unused); coefficients float32
      [num, p_hi, C, C] (zero beyond order); noise float64 [num, length, C] (zero for t < order).
    """
    lo, hi = orders_range
    orders = np.zeros(num, np.int64)
    initial = np.zeros((num, hi, channels), np.float32)
    coefficients = np.zeros((num, hi, channels, channels), np.float32)
    noise = np.zeros((num, length, channels), np.float64)
    for i in range(num):
        p = int(rng.randint(lo, hi + 1))
        orders[i] = p
        rng.seed(i + seed_offset)
        rng.rand()  # the reference's length-resampling coin (p_down = p_up = 0: no effect)
        initial[i, :p] = rng.normal(0.0, 1.0, size=(p, channels))
        coefficients[i, :p] = rng.uniform(-coef_range, coef_range, size=(p, channels, channels))
        noise[i, p:] = rng.normal(0.0, 1.0, size=(length - p, channels))
    return orders, initial, coefficients, noise


def simulate(orders, initial, coefficients, noise, *, noise_std: float, clip_value: float) -> np.ndarray:
    """Runs the VAR recursion for a batch of series, vectorised over the batch.

    Args:
      orders: int [N], the order p of each series.
      initial: float32 [N, P, C], the first p values of each series (rows >= p ignored).
      coefficients: float32 [N, P, C, C], A_j at index j - 1, zero beyond p.
      noise: float64 [N, L, C] standard normal draws, used for t >= p.
      noise_std: scale of the noise.
      clip_value: final clipping bound.

    Returns:
      float32 [N, L, C]: the clipped series (non-finite values replaced by 0).
    """
    n, length, channels = noise.shape
    p_max = coefficients.shape[1]
    x = np.zeros((n, length, channels), np.float32)
    x[:, :p_max] = initial[:, :min(p_max, length)]
    orders = np.asarray(orders)
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(1, length):
            active = orders <= t
            if not active.any():
                continue
            # The reference accumulates A_j x_{t-j} in float32, then adds float64 noise and rounds.
            acc = np.zeros((n, channels), np.float32)
            for j in range(min(p_max, t)):
                acc += np.einsum("nij,nj->ni", coefficients[:, j], x[:, t - 1 - j])
            value = (acc.astype(np.float64) + noise_std * noise[:, t]).astype(np.float32)
            x[:, t] = np.where(active[:, None], value, x[:, t])
        np.clip(x, -clip_value, clip_value, out=x)
    x[~np.isfinite(x)] = 0.0
    return x


def generate(config: SyntheticVarConfig) -> dict[str, dict[str, np.ndarray]]:
    """All examples of both splits as arrays: {'train': {'inputs': [N, L_I, C], ...}, 'validation': ...}."""
    c = config
    length = c.input_length + c.pred_length
    p_max = max_order(c.protocol)
    rng = np.random.RandomState(c.seed)
    out = {}
    for split, num, offset in (("train", c.num_train, 0), ("validation", c.num_validation,
                                                            c.validation_seed_offset)):
        orders_range, coef_range = PROTOCOLS[c.protocol][split]
        orders, initial, coefs, noise = _draw_parameters(orders_range, coef_range, num, length,
                                                         c.num_channels, rng, offset)
        series = simulate(orders, initial, coefs, noise, noise_std=c.noise_std, clip_value=c.clip_value)
        padded = np.zeros((num, p_max, c.num_channels, c.num_channels), np.float32)
        padded[:, :coefs.shape[1]] = coefs
        out[split] = {
            "inputs": series[:, :c.input_length],
            "target": series[:, c.input_length:],
            "coefficients": padded,
            "order": orders,
        }
    return out


class SyntheticVar(base.GeneratorBuilder):
    """Random VAR(p) forecasting: 'inputs' [L_I, C] -> 'target' [L_P, C], with the true coefficients."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [SyntheticVarConfig(name="default")]

    def _info(self):
        c = self.builder_config
        p_max = max_order(c.protocol)
        return base.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
                "inputs": tfds.features.Tensor(shape=(c.input_length, c.num_channels), dtype=np.float32),
                "target": tfds.features.Tensor(shape=(c.pred_length, c.num_channels), dtype=np.float32),
                "coefficients": tfds.features.Tensor(shape=(p_max, c.num_channels, c.num_channels),
                                                     dtype=np.float32),
                "order": tfds.features.Scalar(dtype=np.int64),
            }),
        )

    def _split_generators(self, dl_manager):
        data = generate(self.builder_config)
        return {split: self._generate_examples(arrays) for split, arrays in data.items()}

    def _generate_examples(self, arrays):
        for i in range(len(arrays["order"])):
            yield i, {
                "inputs": arrays["inputs"][i],
                "target": arrays["target"][i],
                "coefficients": arrays["coefficients"][i],
                "order": int(arrays["order"][i]),
            }


def make_builder(data_dir: str, **options) -> tfds.core.DatasetBuilder:
    """Builder of `synthetic_var`.

    Options (defaults = the paper's Fig. 4 setting): protocol ('paper' | 'code'), num_channels (C = 2),
    input_length (L_I = 64), pred_length (L_P = 1), num_train (20000), num_validation (2000),
    noise_std (0.05), clip_value (15), seed (2025, the notebook's), validation_seed_offset (0: validation
    sample i reuses train seed i, as the reference does).

    Raises:
      ValueError: an unknown option or an invalid value (named).
    """
    config = base.config_from_options(SyntheticVarConfig, options, dataset="synthetic_var")
    if config.protocol not in PROTOCOLS:
        raise ValueError(f"synthetic_var: protocol must be one of {sorted(PROTOCOLS)}, got {config.protocol!r}")
    for name in ("num_channels", "input_length", "pred_length", "num_train", "num_validation"):
        if int(getattr(config, name)) < 1:
            raise ValueError(f"synthetic_var: {name} must be >= 1, got {getattr(config, name)!r}")
    if config.input_length + config.pred_length <= max_order(config.protocol):
        raise ValueError(f"synthetic_var: input_length + pred_length must exceed the largest order "
                         f"{max_order(config.protocol)}")
    if not (math.isfinite(config.noise_std) and config.noise_std >= 0
            and math.isfinite(config.clip_value) and config.clip_value > 0):
        raise ValueError("synthetic_var: noise_std must be a finite number >= 0 and clip_value a finite "
                         f"number > 0, got {config.noise_std!r}, {config.clip_value!r}")
    last_seed = config.validation_seed_offset + config.num_validation - 1   # validation sample i's seed
    if last_seed >= 2**32:
        raise ValueError(f"synthetic_var: validation_seed_offset + num_validation - 1 must stay below 2**32 "
                         f"(NumPy's seed range), got {last_seed}")
    return SyntheticVar(data_dir=data_dir, config=config, file_format="array_record")
