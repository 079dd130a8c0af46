"""Training entry point of HTGN: the shared trainer with `htgn_jax.model.Model`.

    python -m htgn_jax.train --config configs/htgn/number_words.py --workdir runs/htgn_nw
    python -m htgn_jax.train --config configs/htgn/digits.py:smoke --workdir /tmp/htgn_digits

Seq2seq configs (task.name == 'seq2seq') also decode the eval split and log eval/bleu,
eval/chrf and eval/exact_match (`htgn_jax.decoding.evaluators_for`).
"""
from htgn_jax import decoding, model
from zoo_core.run import allocator, main

if __name__ == "__main__":
    allocator.restart_with_huge_pages()   # before any work: see zoo_core.run.allocator
    main.run(model.Model, evaluators_fn=decoding.evaluators_for)
