"""HTGN on number-words translation En -> De (htgn.md §6), tiny-cpu preset (§5.12).

    python -m htgn_jax.train --config configs/htgn/number_words.py --workdir runs/htgn_number_words
    python -m htgn_jax.train --config configs/htgn/number_words.py:attention=softmax --workdir runs/nw_softmax
    python -m htgn_jax.train --config configs/htgn/number_words.py:ablation=no_graph --workdir runs/nw_no_graph
    python -m htgn_jax.train --config configs/htgn/number_words.py:smoke --workdir /tmp/nw_smoke

Arguments (`:key=value,...`): attention = favor (HTGN) | softmax (vanilla Transformer of the same
size: exact softmax attention, no graph layers, learned absolute positions); ablation = none |
no_graph | no_hrpe | no_global | no_kl | gat_v1 | gat_v2 | gat_dot | kl_distance | kl_neighbour
(htgn.md §5.7, §5.13); optimizer = adamw | lamb | ranger; beam_size (BLEU decoding, 1 = greedy);
steps; smoke; card (the HTGN card's
choices together: trig features, qk_rank = d_h / 2, ReLU after the graph convolution, alpha from the
attention's kernel scores, skip edges, DropPath 0.1 -> 0.3; docs/htgn_options.md); qk_rank, heads
(sweeps; 0 = the preset's).

Data: 50k / 2k / 2k disjoint numbers in [0, 999999] (`number_words`), eval on 'validation'
(`--config.data.eval_split=test` for the test split). Logged at every eval: eval/bleu, eval/chrf,
eval/exact_match (greedy decoding of the eval split, sacrebleu tokenize='none' on the German
morphemes), plus teacher-forced eval/token_accuracy and eval/loss.
Expected (HTGN, default 2000 steps, batch 64): eval/bleu >= 99.9 and eval/exact_match >= 0.999 on
the 2,000 validation numbers; measured 99.99 at step 500, 100.00 at steps 1000 and
1500, 99.995 (one number wrong) at step 2000; test 99.99 (README).
"""
from zoo_core.configs import common
from zoo_core.configs.htgn import common as htgn

SOURCE_VOCAB, TARGET_VOCAB = 38, 37      # number_words.vocab_sizes('en_de')
MAX_SOURCE, MAX_TARGET = 15, 12          # number_words.max_lengths('en_de', 1)
RHO = 1.27                               # mean source / target length with EOS (13.24 / 10.46)


def get_config(arg=None):
    args = htgn.htgn_args(arg, beam_size=1, steps=2000)
    c = common.base_config()
    c.total_steps = args.steps
    c.batch_size = 64
    c.eval_batch_size = 250
    c.log_every_steps = 100
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 500
    c.checkpoint.best_metric = "eval/bleu"
    htgn.set_recipe(c, optimizer=args.optimizer, learning_rate=2e-3,
                    warmup_steps=max(1, args.steps // 10))

    c.data.name = "number_words"
    c.data.eval_split = "validation"
    c.data.options.direction = "en_de"
    c.data.options.num_train = 50000
    c.data.options.num_validation = 2000
    c.data.options.num_test = 2000

    c.task.name = "seq2seq"
    c.task.label_smoothing = 0.1
    c.task.pad_id = 0

    c.model.kind = "seq2seq"
    c.model.variant = "tiny"
    c.model.source_vocab_size = SOURCE_VOCAB
    c.model.target_vocab_size = TARGET_VOCAB
    c.model.max_source_len = MAX_SOURCE
    c.model.max_target_len = MAX_TARGET
    c.model.dropout_rate = 0.1
    c.model.attention = args.attention
    if args.attention == "favor":
        if args.ablation != "no_graph":   # only the cross-graph layers read rho
            c.model.rho = RHO
        c.model.kl_weight = 1e-3
    htgn.set_favor(c, args)

    c.decode.beam_size = args.beam_size

    if args.smoke:
        common.smoke(c)
        c.data.options.num_train = 64
        c.data.options.num_validation = 16
        c.data.options.num_test = 16
        c.schedule.warmup_steps = 1
        c.model.num_layers = 1
    htgn.set_card(c, args)
    return htgn.finish(c)
