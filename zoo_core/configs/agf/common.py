"""AGF's two reference harnesses, written into a config by `set_lra` and `set_uea`.

The LRA configs (configs/agf/lra_<task>.py) state the reference's best filter for their task
(agf.md §3 tables) and configs/agf/uea.py holds the UEA table; each `get_config` follows the style of
configs/common.py (parse_arg, base_config, set_lra / set_uea, finish). Their config arguments:

  smoke              a seconds-long run (2 steps, tiny model, tiny data; see `common.smoke`)
  attention=softmax  the vanilla Transformer baseline at the same size and budget (no filter, no
                     orthogonality regulariser)
  attention=NAME     any self-attention of the zoo's registry (`zoo_core.attention.names('self')`,
                     e.g. favor, linear, window_graph) at the same size and budget, with its own
                     defaults; its options as (name, value) pairs:
                     --config.model.attention_options="(('num_features', 64),)"
  graph_filter=uvt|svd  AGF's Table 6 ablations (docs/agf_options.md): the singular values
                     fixed at one, or learnable from one, with no polynomial filter (the
                     orthogonality regulariser is kept)
  source_dir=DIR     the data set's files: UEA the archive's .ts files (else shipped, cached or
                     fetched); LRA text / retrieval / image / pathfinder the folder that
                     `python -m zoo_core.data.lra_prepare` wrote (docs/data.md); the same as
                     --config.data.options.source_dir=DIR

Harness settings (agf.md §3.1, §3.2):
  LRA  AdamW(b2 0.999, eps 1e-6, no weight decay), lr 1e-4 under the reference's
       OneCycleLR(anneal_strategy='linear', pct_start=warmup/steps) step for step: lr/25 rising to lr
       at step warmup-1, then falling to lr/2.5e5, and beta1 cycled 0.95 -> 0.85 -> 0.95 (torch's
       default cycle_momentum overwrites AdamW's beta1 = 0.9); dropout 0.1, D=64, 2 heads x 32,
       2 layers, MEAN pooling; per-task batch, warm-up, steps and eval interval from the table.
  UEA  RAdam (Adam for SpokenArabicDigits), lr 1e-3 constant, batch 16, grad-norm clip 4.0, no weight
       decay, 100 epochs (PEMS-SF 400), d_model 512, 8 heads, d_ff 2048, 2 layers, dropout 0.1,
       learnable positions, seed 666. Evaluated on TEST after epochs 1, 2, 4, 6, ..., the last
       (mvts_transformer's val_interval 2 plus its first epoch); the metric is the best of these.
       One deviation: an "epoch" is ceil(N / 16) full batches of a reshuffled, repeated stream
       (JapaneseVowels: 17 x 16 = 272 series for N = 270), where PyTorch's DataLoader ends each
       pass with a short batch; every series is still seen once per pass on average.
"""
from __future__ import annotations

import ml_collections

from agf_jax import model as agf_model
from agf_jax.validation import GRAPH_FILTERS
from zoo_core.configs import common
from zoo_core.configs.tasks import lra, uea
from zoo_core.data import uea as uea_data

# agf.md §3.1 table: batch, warm-up, train steps, eval every.
LRA_HARNESS = {
    "listops": dict(batch_size=32, warmup=1000, steps=5000, eval_every=50),
    "text": dict(batch_size=32, warmup=8000, steps=20000, eval_every=500),
    "retrieval": dict(batch_size=32, warmup=800, steps=30000, eval_every=300),
    "image": dict(batch_size=256, warmup=175, steps=35000, eval_every=175),
    "pathfinder": dict(batch_size=256, warmup=312, steps=62400, eval_every=312),
}
UEA_SEED = 666


def _check_attention(args) -> None:
    """attention is a registry self-attention name (read now), graph_filter one of AGF's."""
    names = agf_model.attentions()
    if args.attention not in names:
        raise ValueError(f"config argument attention={args.attention!r}; choose one of "
                         f"{', '.join(names)}")
    if args.graph_filter not in GRAPH_FILTERS:
        raise ValueError(f"config argument graph_filter={args.graph_filter!r}; choose one of "
                         f"{', '.join(GRAPH_FILTERS)}")
    if args.graph_filter != "agf" and args.attention != "agf":
        raise ValueError(f"config argument graph_filter={args.graph_filter!r} applies only to "
                         f"attention=agf (got attention={args.attention!r})")


def lra_args(arg) -> ml_collections.ConfigDict:
    """The `:args` of an LRA config."""
    args = common.parse_arg(arg, smoke=False, attention="agf", graph_filter="agf", source_dir="")
    _check_attention(args)
    return args


def set_lra(c: ml_collections.ConfigDict, task: str, args, *, order: int, alpha: float, beta: float,
            reg: float) -> ml_collections.ConfigDict:
    """Writes the AGF_LRA harness of `task` with the Jacobi filter (order K, alpha, beta) and
    gamma = reg into `c` (from `common.base_config()`); `args` from `lra_args`."""
    if task not in LRA_HARNESS:
        raise ValueError(f"unknown LRA task {task!r}; known: {', '.join(LRA_HARNESS)}")
    h = LRA_HARNESS[task]
    facts = lra.set_data(c, task, smoke=args.smoke)
    if args.source_dir:   # every file-based task reads source_dir (ListOps: LRA's listops-1000 folder)
        c.data.options.source_dir = args.source_dir
    c.seed = 0
    c.total_steps = h["steps"]                 # the harness's num_train_steps
    c.batch_size = h["batch_size"]
    c.eval_batch_size = h["batch_size"]
    c.parallel.cpu_devices = 0                 # one per core: this step is mostly elementwise work
    c.log_every_steps = 50
    c.eval_every_steps = h["eval_every"]       # the harness's eval_frequency
    c.checkpoint_every_steps = 1000
    c.checkpoint.best_metric = "eval/accuracy"  # best dev checkpoint under workdir/best
    c.optim.name = "adamw"
    c.optim.learning_rate = 1e-4
    c.optim.b2, c.optim.eps = 0.999, 1e-6
    c.optim.weight_decay = 0.0
    c.schedule.name = "one_cycle"              # torch's OneCycleLR, as the harness
    c.schedule.anneal = "linear"
    c.schedule.pct_start = h["warmup"] / h["steps"]
    c.schedule.div_factor = 25.0
    c.schedule.final_div_factor = 1e4
    c.schedule.cycle_momentum = True           # torch's default: beta1 0.95 -> 0.85 -> 0.95

    m = c.model
    m.kind = "lra_retrieval" if task == "retrieval" else "lra_classifier"
    m.variant = "lra"                          # D=64, MLP 128, 2 heads x 32, 2 layers
    m.num_classes = facts["classes"]
    m.vocab_size = facts["vocab_size"]         # token 0 is padding (mask = inputs != 0)
    m.max_len = lra.pow2_at_least(facts["length"])   # position table rounded up to 2^k
    m.attention = args.attention
    m.dropout_rate = 0.1
    m.pooling = "mean"                         # the harness's MEAN over all positions
    if args.attention == "agf":
        m.graph_filter = args.graph_filter
        if args.graph_filter == "agf":
            m.basis = "jacobi"                 # every best_agf.sh line uses --poly_type jacobi
            m.order = order                    # K
            m.alpha = float(alpha)
            m.beta = float(beta)
        m.ortho_weight = float(reg)            # gamma = --reg, applied inside each layer
    elif args.attention == "softmax":
        m.attention_dropout = 0.1              # the harness's softmax attention dropout
    if args.smoke:
        common.smoke(c)
        c.schedule.pct_start = 1.0             # both smoke steps rise (lr/25, then lr)
        m.variant = "tiny"                     # D=16, 2 heads x 8
    return c


def finish(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`common.finish` with AGF's size presets. For the UEA classifier head_dim stays derived
    (d_model // num_heads, as the reference) unless given, so that overriding d_model or num_heads
    alone stays consistent."""
    derived = ("head_dim",) if c.model.kind == "uea_classifier" else ()
    return common.finish(c, agf_model.VARIANTS, build=agf_model.Model, derived=derived)


def uea_args(arg, **defaults) -> ml_collections.ConfigDict:
    """The `:args` of the UEA config (`defaults` adds the config's own, e.g. dataset)."""
    args = common.parse_arg(arg, smoke=False, attention="agf", graph_filter="agf", source_dir="",
                            **defaults)
    _check_attention(args)
    return args


def set_uea(c: ml_collections.ConfigDict, dataset: str, args, *, basis: str, order: int,
            alpha: float | None = None, beta: float | None = None, fix_i: bool, eta: float,
            epochs: int = 100, optimizer: str = "radam") -> ml_collections.ConfigDict:
    """Writes the AGF_UEA harness of `dataset` (a key of `configs.tasks.uea.DATASETS`) into `c`.

    Args:
      c: a config from `common.base_config()`.
      dataset: UEA dataset name.
      args: from `uea_args` (smoke, attention, graph_filter, source_dir). A smoke run trains on
        `dataset` and reads it as the full run does (the data options, a fetch on first use).
      basis, order, alpha, beta: the filter (alpha/beta only for 'jacobi').
      fix_i: the reference's --fixI (c_0 frozen at 1); without it c_0 = tanh(theta_0) starts at 0.
      eta: gamma, the weight of the orthogonality regulariser.
      epochs: training epochs.
      optimizer: 'radam' (the harness) or 'adam' (SpokenArabicDigits).
    """
    if (basis == "jacobi") != (alpha is not None and beta is not None):
        raise ValueError(f"alpha and beta are given exactly for basis='jacobi'; got basis={basis!r}, "
                         f"alpha={alpha!r}, beta={beta!r}")
    facts = uea.set_data(c, dataset, source_dir=args.source_dir)
    c.data.options.base_url = uea_data.BASE_URL   # where a data set that is not shipped is fetched from
    c.seed = UEA_SEED                        # the harness's global seed
    c.batch_size = 16
    c.eval_batch_size = 64                   # evaluation only: any size gives the same numbers
    epoch = uea.steps_per_epoch(dataset, c.batch_size)
    c.total_steps = epochs * epoch
    c.log_every_steps = epoch
    c.eval_every_steps = 2 * epoch           # the harness's val_interval = 2 epochs ...
    c.eval_also_at_step = epoch              # ... plus the first epoch (best + last reported)
    c.checkpoint_every_steps = 10 * epoch
    c.checkpoint.best_metric = "eval/accuracy"  # the best-epoch model under workdir/best
    c.optim.name = optimizer
    c.optim.learning_rate = 1e-3             # constant (no lr schedule in the harness)
    c.optim.weight_decay = 0.0
    c.optim.grad_clip_norm = 4.0
    c.schedule.name = "constant"

    m = c.model
    m.kind = "uea_classifier"
    m.variant = "uea"                        # d_model 512, d_ff 2048, 8 heads x 64, 2 layers
    m.num_classes = facts["classes"]
    m.feat_dim = facts["channels"]
    m.max_len = facts["length"]              # = the data option max_length (flatten head size)
    m.attention = args.attention
    m.dropout_rate = 0.1
    m.activation = "gelu"
    m.pos_encoding = "learnable"
    if args.attention == "agf":
        m.graph_filter = args.graph_filter
        if args.graph_filter == "agf":
            m.basis = basis
            m.order = order                  # K
            if basis == "jacobi":
                m.alpha = float(alpha)
                m.beta = float(beta)
            m.learn_c0 = not fix_i           # no --fixI: c_0 = tanh(theta_0), filter 0 at init
        m.ortho_weight = float(eta)          # gamma = --eta on the layer-mean regulariser
    elif args.attention == "softmax":
        m.attention_dropout = 0.1            # nn.MultiheadAttention(dropout=0.1) of the baseline
    if args.smoke:
        common.smoke(c)
        m.variant = "tiny"                   # d_model 16, 2 heads x 8
    return c
