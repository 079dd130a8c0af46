"""Every config file loads with ':smoke', is locked, and names a known dataset, task, optimiser and model."""
import importlib
import pathlib

import pytest

from zoo_core import data as data_lib
from zoo_core import tasks, trainer
from zoo_core.configs import common
from zoo_core.run import optim

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILDERS = {
    "core": ("zoo_core.mlp_classifier", "Model"),
    "agf": ("agf_jax.model", "Model"),
    "samovar": ("samovar_jax.model", "Model"),
    "htgn": ("htgn_jax.model", "Model"),
}
# configs/<folder>/common.py holds the pieces the folder's configs share; every other file is a config.
CONFIG_FILES = sorted(p for p in (ROOT / "configs").glob("*/*.py") if p.name not in ("__init__.py", "common.py")
                      and p.parent.name in BUILDERS)


def test_there_are_configs_for_every_folder_that_exists():
    assert {p.parent.name for p in CONFIG_FILES} == {
        d.name for d in (ROOT / "configs").iterdir() if d.is_dir() and d.name in BUILDERS
        and any(f.name != "__init__.py" for f in d.glob("*.py"))}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_config_loads_and_builds(path):
    module = importlib.import_module(f"zoo_core.configs.{path.parent.name}.{path.stem}")
    assert "python -m" in (module.__doc__ or ""), "the config docstring gives its command line"
    c = module.get_config("smoke")
    assert c.is_locked
    assert c.total_steps <= 5, "smoke runs are seconds long"
    assert c.data.name in data_lib.DATASETS
    tasks.make_task(c)
    optim.make_optimizer(c)
    module_name, attr = BUILDERS[path.parent.name]
    getattr(importlib.import_module(module_name), attr)(**c.model.to_dict())
    full = module.get_config()
    assert full.total_steps >= c.total_steps
    trainer.validate_config(c)
    trainer.validate_config(full)
    optim.make_optimizer(full)
    with pytest.raises(ValueError, match="unknown config argument"):
        module.get_config("no_such_option=1")
    with pytest.raises(ValueError, match="config argument 'smoke' is given twice"):
        module.get_config("smoke,smoke=false")
    for config in (c, full):   # the size preset is written out: every model field is a config field
        assert "variant" not in config.model, "common.finish writes the variant's fields explicitly"
        assert set(config.data.options) >= set(common.data_option_defaults(config.data.name))
        assert "decode" in config and "test_split" in config


@pytest.mark.parametrize("arg", [None, "smoke", "beam_size=1", "beam_size=1,smoke", "beam_size=3,smoke",
                                 "attention=softmax,smoke"])
@pytest.mark.parametrize("name", ["number_words", "wmt14_en_de"])
def test_seq2seq_configs_give_decoding_options_the_trainer_accepts(name, arg):
    # The evaluator's checks (htgn_jax.decoding.decode_options) would refuse the run before training.
    from htgn_jax import decoding

    c = importlib.import_module(f"zoo_core.configs.htgn.{name}").get_config(arg)
    options = decoding.decode_options(c)
    if arg and "beam_size=1" in arg:
        assert options["beam_size"] == 1 and options["length_penalty"] == 0.0


# Config arguments that change which model fields apply, per config folder (each also without them).
FIELD_ARGS = {
    "core": [],
    "agf": ["attention=softmax"],
    "htgn": ["attention=softmax", "ablation=no_graph", "ablation=no_hrpe", "ablation=kl_distance"],
    "samovar": ["kind=lintrans", "kind=fixedvar", "kind=dlinear"],
}


def _field_cases():
    for path in CONFIG_FILES:
        module = importlib.import_module(f"zoo_core.configs.{path.parent.name}.{path.stem}")
        for arg in ["smoke", *FIELD_ARGS[path.parent.name]]:
            try:
                module.get_config(arg)
            except ValueError:   # not an argument of this config (e.g. kind=dlinear on synthetic_var)
                continue
            yield pytest.param(module, arg, id=f"{path.parent.name}/{path.stem}:{arg}")


@pytest.mark.parametrize("module, arg", list(_field_cases()))
def test_every_model_field_is_written_and_builds_the_same_model(module, arg, monkeypatch):
    """`finish` writes every constructor field (`--config.model.<any field>=...` reaches it), and the
    model built from the written config is the one built before the fields were written out."""
    import dataclasses

    import jax.numpy as jnp
    c = module.get_config(arg)
    build = importlib.import_module(BUILDERS[module.__name__.split(".")[2]][0]).Model
    after = build(**c.model.to_dict())
    fields = [f.name for f in dataclasses.fields(after) if f.name not in ("parent", "name")]
    assert set(fields) <= set(c.model), sorted(set(fields) - set(c.model))
    monkeypatch.setattr(common, "complete_model_fields", lambda model, build: model)
    before = build(**module.get_config(arg).model.to_dict())
    norm = lambda name, v: jnp.dtype(v) if name.endswith("dtype") and v is not None else v   # noqa: E731
    assert type(before) is type(after)
    assert {n: norm(n, getattr(before, n)) for n in fields} == {n: norm(n, getattr(after, n)) for n in fields}


def test_unset_model_fields_are_typed_placeholders_a_flag_can_set():
    from agf_jax import model as agf_model
    from zoo_core.configs.agf import uea
    c = uea.get_config("dataset=JapaneseVowels,attention=softmax")
    assert c.model.basis is None and c.model.param_dtype == "float32" and c.model.dtype is None
    with c.unlocked():
        c.model.dtype = "bfloat16"
    assert agf_model.Model(**c.model.to_dict()).dtype == jnp_dtype("bfloat16")
    with pytest.raises(ValueError, match="apply only to attention='agf'"):
        with c.unlocked():
            c.model.basis = "chebyshev"
        agf_model.Model(**c.model.to_dict())
    with pytest.raises(TypeError):   # a placeholder keeps its type: order is an int
        c.model.order = "five"
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        agf_model.Model(**{**uea.get_config("dataset=JapaneseVowels").model.to_dict(), "dtype": "float8"})


def jnp_dtype(name):
    import jax.numpy as jnp
    return jnp.dtype(name)


@pytest.mark.parametrize("arg", ["smoke", "smoke,attention=softmax", "attention=softmax", None])
def test_every_size_is_a_config_field_the_model_reads(arg):
    """`--config.model.num_layers=3` (the README's example) reaches the model of every AGF config."""
    from agf_jax import model as agf_model
    for path in CONFIG_FILES:
        if path.parent.name != "agf":
            continue
        c = importlib.import_module(f"zoo_core.configs.agf.{path.stem}").get_config(arg)
        with c.unlocked():
            c.model.num_layers = 3
            c.model.num_heads = 4
        m = agf_model.Model(**c.model.to_dict())
        assert (m.num_layers, m.num_heads) == (3, 4), path.stem


def test_the_uea_head_width_follows_d_model_and_heads_unless_given():
    from agf_jax import model as agf_model
    from zoo_core.configs.agf import uea
    c = uea.get_config("dataset=JapaneseVowels")
    assert c.model.head_dim is None and c.model.d_model == 512 and c.model.num_heads == 8
    with c.unlocked():
        c.model.num_heads = 4
    assert agf_model.Model(**c.model.to_dict()).num_heads == 4
    with c.unlocked():
        c.model.head_dim = 32
    assert agf_model.Model(**c.model.to_dict()).head_dim == 32


def test_the_uea_table_keeps_the_reference_settings():
    from zoo_core.configs.agf import uea
    c = uea.get_config("dataset=SpokenArabicDigits")
    assert (c.optim.name, c.model.basis, c.model.order, c.model.ortho_weight) == ("adam", "jacobi", 4, 0.5)
    c = uea.get_config("dataset=PEMS-SF")
    assert c.total_steps == 400 * 17 and c.optim.name == "radam"
    c = uea.get_config("dataset=Heartbeat,attention=softmax")
    assert c.model.basis is None and c.model.attention_dropout == 0.1   # unset: the filter is off
    assert uea.get_config("dataset=Heartbeat,smoke").data.options.dataset == "Heartbeat"   # never swapped
    with pytest.raises(ValueError, match="choose one of"):
        uea.get_config("dataset=Nope")


def test_uea_configs_evaluate_when_the_reference_harness_does():
    """mvts_transformer validates after the first epoch, every val_interval = 2 epochs and the last;
    the best of those is the reported metric, so evaluating more often would flatter it."""
    from zoo_core.configs.agf import uea
    for dataset, epoch in (("JapaneseVowels", 17), ("BasicMotions", 3)):
        c = uea.get_config(f"dataset={dataset}")
        evals = [s // epoch for s in range(1, c.total_steps + 1) if trainer.is_eval_step(c, s)]
        assert evals == [1] + list(range(2, 101, 2))


def test_lra_configs_select_the_checkpoint_on_the_dev_split():
    """The harness keeps the best dev checkpoint and reports it on test (agf.md §3.1)."""
    from zoo_core.configs.agf import lra_image, lra_listops, lra_pathfinder, lra_retrieval, lra_text
    for module in (lra_listops, lra_retrieval, lra_image, lra_pathfinder):
        assert module.get_config().data.eval_split == "validation", module.__name__
    assert lra_text.get_config().data.eval_split == "test"   # LRA's IMDB task has no dev split


def test_htgn_configs_never_select_a_checkpoint_on_test():
    from zoo_core.configs.htgn import digits, number_words, wmt14_en_de
    assert wmt14_en_de.get_config("source_dir=/data").data.eval_split == "validation"
    assert number_words.get_config().data.eval_split == "validation"
    c = digits.get_config()      # test is its only held-out split: no best checkpoint at all
    assert c.data.eval_split == "test" and c.checkpoint.best_metric == ""


def test_a_smoke_forecast_config_refuses_sizes_it_would_ignore():
    from zoo_core.configs.samovar import forecasting
    with pytest.raises(ValueError, match="smoke runs use horizon 8"):
        forecasting.get_config("smoke,horizon=192")
