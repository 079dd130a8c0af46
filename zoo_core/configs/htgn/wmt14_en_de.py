"""HTGN base-mt on WMT'14 English -> German from user-provided text (htgn.md §5.12 base-mt, §6).

    python -m htgn_jax.train --config configs/htgn/wmt14_en_de.py:source_dir=/data/wmt14 --workdir runs/htgn_wmt
    python -m htgn_jax.train --config configs/htgn/wmt14_en_de.py:source_dir=/data/wmt14,smoke --workdir /tmp/wmt_smoke

WMT14 cannot be downloaded offline: `source_dir` must hold train.{en,de}, dev.{en,de} (e.g.
newstest2013) and test.{en,de} (newstest2014), one aligned sentence per line (see
`zoo_core.data.wmt`); without it the run stops with the dataset's one-line error (exit 2). A joint
32k SentencePiece vocabulary is trained while preparing; source, target and output embeddings
are shared. Arguments: source_dir; attention = favor | softmax; ablation (as number_words);
optimizer = adamw | lamb | ranger; beam_size (default 4; GNMT length penalty 0.6 when > 1; smoke: at
most 2); steps; smoke; card (the HTGN card's
choices together: trig features, qk_rank = d_h / 2, ReLU after the graph convolution, alpha from the
attention's kernel scores, skip edges, DropPath 0.1 -> 0.3; docs/htgn_options.md); qk_rank, heads
(sweeps; 0 = the preset's).

Evaluation: BLEU on dev (newstest2013) every 5,000 steps selects the best checkpoint; newstest2014
is then scored once with the training command plus `--eval_only --eval_split=test`.

Expected: a GPU/TPU-scale run (base-mt, 100k steps of 256 x 256-token batches); the spec
records no reference BLEU for HTGN (the model card has no results), so BLEU on newstest2014
is reported against the softmax baseline trained with the same config (`attention=softmax`).
"""
from zoo_core.configs import common
from zoo_core.configs.htgn import common as htgn

VOCAB_SIZE = 32000
MAX_LENGTH = 256


def get_config(arg=None):
    args = htgn.htgn_args(arg, source_dir="", beam_size=4, steps=100000)
    c = common.base_config()
    c.total_steps = args.steps
    c.batch_size = 256
    c.eval_batch_size = 64
    c.log_every_steps = 100
    c.eval_every_steps = 5000
    c.checkpoint_every_steps = 5000
    c.checkpoint.best_metric = "eval/bleu"
    # Vaswani: peak d^-0.5 * warmup^-0.5 with d = 512, warm-up 4000 steps (htgn.md §5.9).
    htgn.set_recipe(c, optimizer=args.optimizer, learning_rate=512 ** -0.5 * 4000 ** -0.5,
                    warmup_steps=4000)

    c.data.name = "wmt14_en_de"
    c.data.eval_split = "validation"        # dev: the best checkpoint is chosen here, not on test
    c.data.options.source_dir = args.source_dir
    c.data.options.vocab_size = VOCAB_SIZE
    c.data.options.max_length = MAX_LENGTH

    c.task.name = "seq2seq"
    c.task.label_smoothing = 0.1
    c.task.pad_id = 0

    c.model.kind = "seq2seq"
    c.model.variant = "base"
    c.model.source_vocab_size = VOCAB_SIZE
    c.model.target_vocab_size = VOCAB_SIZE
    c.model.share_embeddings = True
    c.model.max_source_len = MAX_LENGTH
    c.model.max_target_len = MAX_LENGTH
    c.model.dropout_rate = 0.1
    c.model.attention = args.attention
    if args.attention == "favor":
        if args.ablation != "no_graph":   # only the cross-graph layers read rho
            c.model.rho = 1.0
        c.model.kl_weight = 1e-3
        c.model.attention_dropout = 0.1
        htgn.set_favor(c, args)
        if not c.model.get("use_graph_conv", True):
            c.model.attention_dropout = 0.0

    c.decode.beam_size = args.beam_size

    if args.smoke:
        common.smoke(c)
        c.model.variant = "tiny"
        c.model.num_layers = 1
        c.data.options.vocab_size = 256
        c.data.options.max_length = 64
        c.model.source_vocab_size = c.model.target_vocab_size = 256
        c.model.max_source_len = c.model.max_target_len = 64
        c.data.options.max_vocab_sentences = 10000
        c.decode.beam_size = min(args.beam_size, 2)
        c.schedule.warmup_steps = 1
    # GNMT's length penalty ranks beam hypotheses; greedy decoding (beam_size=1) has none to rank.
    c.decode.length_penalty = 0.6 if c.decode.beam_size > 1 else 0.0
    htgn.set_card(c, args)
    return htgn.finish(c)
