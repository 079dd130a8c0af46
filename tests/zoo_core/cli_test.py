"""The command line on bad inputs: exit status 2, exactly one `error:` line, no traceback, nothing created.

Most cases run `zoo_core.main` in-process (a subprocess costs 5-10 s here); a few run the real
`python -m <package>.train` entry points, among them config mistakes on the full ListOps config, which
must be reported in seconds, before its dataset is built. Also: resuming with a changed config is refused
naming the keys, safe changes are allowed and logged, `--allow_config_change` overrides, and an edited
source file is prepared again.
"""
import functools
import json
import logging as py_logging
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from tests.environment import command_env, run_entry_in_process
from zoo_core import mlp_classifier, trainer
from zoo_core.run import log as run_log
from zoo_core.run import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOY = "tests/zoo_core/cli_configs/toy.py"
_TS = "@dimensions 2\n@classLabel true up down\n@data\n1,2,3:4,5,6:up\n3,2,1:6,5,4:down\n2,2,2:1,1,1:up\n"


def _snapshot(path) -> list[str]:
    """Every path under `path` (or [] when it does not exist)."""
    out = []
    for root, dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in dirs + files]
    return sorted(out)


def cli(argv, capfd, build_model=mlp_classifier.Model, evaluators_fn=None):
    """Runs `python -m zoo_core.train <argv>` in this process (with another architecture's `Model` and
    evaluators: its train command); returns (exit status, stdout, stderr)."""
    return run_entry_in_process("zoo_core.train", build_model, argv, capfd, evaluators_fn=evaluators_fn)


def _assert_refused(status, out, err, expected, alone=True):
    """Exit 2 with one `error:` line naming `expected`, no traceback, no config dump; `alone`: and
    nothing else printed."""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2, (status, err[-2000:])
    assert len(errors) == 1, err[-2000:]
    assert "Traceback" not in err + out and not any(line.startswith("E1") for line in err.splitlines()), err
    assert expected in errors[0], errors[0]
    assert not any(line.endswith("] config:") for line in err.splitlines()), "the config dump came first"
    if alone:
        assert [line for line in (out + err).splitlines() if line.strip()] == errors, "only the error line"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A prepared data dir (synthetic), a file, a UEA source folder, a binary and a header-only CSV."""
    root = tmp_path_factory.mktemp("cli")
    data = root / "data"
    from zoo_core.configs.core import synthetic
    c = synthetic.get_config("smoke")
    c.unlock()
    c.data.data_dir = str(data)
    trainer.prepare_data(c)
    (root / "file").write_text("not a folder\n")
    (root / "dangling_link").symlink_to(root / "no_such_target")
    (root / "uea" / "Toy").mkdir(parents=True)
    for split in ("TRAIN", "TEST"):
        (root / "uea" / "Toy" / f"Toy_{split}.ts").write_text(_TS)
    (root / "binary.csv").write_bytes(bytes(range(256)) * 8)
    (root / "header.csv").write_text("date,a,OT\n")
    (root / "empty.csv").write_bytes(b"")
    (root / "buggy.py").write_text("def get_config():\n    return undefined_name\n")
    return root


# (arguments after --config/--workdir/--data_dir, text expected in the error line). '{file}' is an existing
# file, '{root}' the fixture's folder; the default config is the synthetic smoke run.
CASES = [
    ("--config.optim.learning_rate=-1", "`optim.learning_rate` must be a finite number > 0, got -1.0"),
    ("--config.optim.learning_rate=0", "`optim.learning_rate` must be a finite number > 0"),
    ("--config.optim.learning_rate=nan", "`optim.learning_rate` must be a finite number > 0"),
    ("--config.optim.name=sgdd", "unknown optim.name 'sgdd'"),
    ("--config.schedule.name=cosine", "unknown schedule.name 'cosine'"),
    ("--config.schedule.anneal=cubic", "unknown schedule.anneal 'cubic'"),
    ("--config.optim.decay_mask=some", "unknown optim.decay_mask 'some'"),
    ("--config.optim.b1=1.5", "`optim.b1` must be in [0, 1)"),
    ("--config.optim.b2=-0.1", "`optim.b2` must be in [0, 1)"),
    ("--config.optim.weight_decay=-1", "`optim.weight_decay` must be a finite number >= 0"),
    ("--config.optim.eps=-1", "`optim.eps` must be a finite number >= 0"),
    ("--config.optim.grad_clip_norm=-1", "grad_clip_norm must be >= 0"),
    ("--config.optim.grad_accum_steps=0", "optim.grad_accum_steps must be >= 1"),
    ("--config.schedule.warmup_steps=-3", "schedule.warmup_steps must be >= 0"),
    ("--config.schedule.pct_start=0.5", "schedule.pct_start=0.5 is not used by schedule.name='constant'"),
    ("--config.total_steps=0", "total_steps must be >= 1"),
    ("--config.batch_size=0", "batch_size must be >= 1"),
    ("--config.batch_size=-4", "batch_size must be >= 1"),
    ("--config.eval_batch_size=0", "eval_batch_size must be >= 1"),
    ("--config.log_every_steps=0", "log_every_steps must be >= 1"),
    ("--config.eval_every_steps=-1", "eval_every_steps must be >= 0"),
    ("--config.checkpoint_every_steps=-1", "checkpoint_every_steps must be >= 0"),
    ("--config.eval_also_at_step=-1", "eval_also_at_step must be >= 0, got -1"),
    ("CONFIG=configs/agf", "--config configs/agf is a directory, not a config file; give one of its "
     "files, e.g. configs/agf/lra_image.py (configs/agf has: lra_image.py, lra_listops.py"),
    ("CONFIG=configs/core/:smoke", "--config configs/core/ is a directory, not a config file; give "
     "one of its files, e.g. configs/core/synthetic.py:smoke"),
    ("--config.checkpoint.keep=0", "checkpoint.keep must be >= 1"),
    ("--config.checkpoint.best_mode=median", "checkpoint.best_mode must be 'max' or 'min'"),
    ("--config.checkpoint.best_metric=accuracy", "must name an eval metric 'eval/<name>'"),
    ("--config.checkpoint.patience=-1", "checkpoint.patience must be an int >= 0"),
    ("--config.checkpoint.best_metric=eval/acuracy", "best_metric 'eval/acuracy' is not an eval metric"),
    ("--config.batch_size=1024", "batch_size 1024 exceeds the 512 training examples"),
    ("--config.model.num_classes=0", "num_classes"),
    ("--config.seed=-1", "seed must be an int in [0, 2**32)"),
    ("--config.parallel.mode=spmd", "unknown parallel.mode 'spmd'"),
    ("--config.parallel.cpu_devices=-1", "parallel.cpu_devices must be an int >= 0"),
    ("--config.parallel.sequence=3", "parallel.sequence=3 must divide the "),
    ("--config.data.packing=True", "data.packing=True packs sequence-to-sequence examples; task 'classification' "
     "has one label per example and cannot pack"),
    ("--config.data.packing_factor=0", "data.packing_factor must be an int >= 1, got 0"),
    ("--config.data.name=nope", "unknown dataset 'nope'"),
    ("--config.data.train_split=", "data.train_split must be a split name"),
    ("--config.data.train_split=train[:0%]", "data.train_split 'train[:0%]' selects no examples (train has 512)"),
    ("--config.data.eval_split=test[50%:10%]", "data.eval_split 'test[50%:10%]' selects no examples (test has 128)"),
    ("--config.data.train_split=train[abc]", "data.train_split 'train[abc]': Error parsing split 'train[abc]'"),
    ("--config.data.options.num_train=0", "num_train must be an integer >= 1"),
    ("--config.data.options.num_classes=1", "num_classes must be an integer >= 2"),
    ("--config.data.options.bogus=1", "invalid config override: bogus"),
    ("--config.data.options.seed=-1", "seed must be an int in [0, 2**32), got -1"),
    ("--config.test_split=test", "test_split='test' is not reported by this architecture's evaluators"),
    ("--config.data.data_dir={file}", "is a file; expected a directory"),
    ("--config.data.data_dir={file}/sub", "is under the file"),
    ("--config.data.data_dir=/proc/zoo_data", "could not prepare synthetic_linear in data.data_dir '/proc/zoo_data'"),
    ("--config.task.name=regression", "unknown task.name 'regression'"),
    ("--config.eval_max_examples=-1", "eval_max_examples must be >= 0"),
    ("--config.model.hidden=-4", "hidden"),
    ("--config.model.bogus=1", "invalid config override: bogus"),
    ("--config.nope=3", "invalid config override: nope"),
    ("--config.steps=3", "steps; fields of config like it: checkpoint_every_steps, eval_every_steps, log_every"),
    ("--config.optim.lr=1", "lr; config.optim has: b1, b2, decay_mask"),
    ("--config.total_steps=abc", "bad flag"),
    ("--eval_split=test", "only used with --eval_only"),
    ("--checkpoint=latest", "only used with --eval_only"),
    ("--eval_only", "no checkpoint under"),
    ("--eval_only --allow_config_change", "--allow_config_change applies to training runs"),
    ("WORKDIR={file}", "is an existing file; expected a directory"),
    ("--compilation_cache_dir={file}", "is an existing file; expected a directory (or a path to create); give a "
     "directory, or '' for no cache"),
    ("--compilation_cache_dir={file}/xla", "is a file, so no directory can be made under it"),
    ("WORKDIR={root}/dangling_link", "workdir '{root}/dangling_link' is a symbolic link to '{root}/no_such_target', "
     "which does not exist"),
    ("WORKDIR=/proc/zoo_run", "workdir '/proc/zoo_run' cannot be made: '/proc' takes no new entries"),
    ("WORKDIR={file}/run", "is a file, so no directory can be made under it"),
    ("extra_argument", "unexpected positional argument(s) 'extra_argument'"),
    ("--num_processes=2 --process_id=0", "--num_processes and --process_id need --coordinator_address"),
    ("--coordinator_address=nohost --num_processes=1 --process_id=0",
     "--coordinator_address must be host:port with a port in 1..65535, got 'nohost'"),
    ("CONFIG=none", "--config is required"),
    ("CONFIG=configs/core/synthetic.py:bogus", "unknown config argument 'bogus'"),
    ("CONFIG=configs/core/no_such_file.py", "No such file or directory"),
    ("CONFIG={root}/no_such_file.py --config.total_steps=3", "--config {root}/no_such_file.py: [Errno 2] No such"),
    ("CONFIG={file}", "the config file raised an error at {file}, line 1: SyntaxError: invalid syntax"),
    ("CONFIG={root}/buggy.py --config.seed=1",
     "raised an error at {root}/buggy.py, line 2: NameError: name 'undefined_name' is not defined"),
    ("WORKDIR=", "--workdir is empty (an unset shell variable?)"),
    (f"CONFIG={TOY}:data=uea --config.data.options.source_dir={{file}}", "source_dir"),
    (f"CONFIG={TOY}:data=uea --config.data.options.source_dir={{root}}/nowhere", "not found: put Toy/Toy_TRAIN.ts"),
    (f"CONFIG={TOY}:data=uea --config.data.options.source_dir={{root}}/uea --config.data.options.normalization=z",
     "normalization must be one of"),
    (f"CONFIG={TOY}:data=uea --config.data.options.source_dir={{root}}/uea --config.data.options.dataset=Nope",
     "dataset 'Nope' not found"),
    (f"CONFIG={TOY}:data=forecasting --config.data.options.source={{root}}", "is a directory; expected a file"),
    (f"CONFIG={TOY}:data=forecasting --config.data.options.source={{root}}/none.csv", "does not exist"),
    (f"CONFIG={TOY}:data=forecasting --config.data.options.source={{root}}/binary.csv", "is not UTF-8 text"),
    (f"CONFIG={TOY}:data=forecasting --config.data.options.source={{root}}/header.csv",
     "has a header but no data rows"),
    (f"CONFIG={TOY}:data=forecasting --config.data.options.source={{root}}/empty.csv", "is empty"),
    (f"CONFIG={TOY}:data=forecasting --config.data.options.source={{root}}/header.csv "
     "--config.data.options.horizon=0", "input_length and horizon must be >= 1"),
]


def _argv(case: str, env, workdir):
    config, work, rest = "configs/core/synthetic.py:smoke", str(workdir), []
    for token in case.format(file=env / "file", root=env).split():
        if token.startswith("CONFIG="):
            config = token[len("CONFIG="):]
        elif token.startswith("WORKDIR="):
            work = token[len("WORKDIR="):]
        else:
            rest.append(token)
    head = [] if config == "none" else ["--config", config]
    data = [] if config == "none" or "data.data_dir" in case else [f"--config.data.data_dir={env / 'data'}"]
    return [*head, "--workdir", work, *data, *rest]


def test_the_table_has_at_least_40_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("case,expected", CASES, ids=[c for c, _ in CASES])
def test_a_bad_input_exits_2_with_one_error_line_and_creates_nothing(env, tmp_path, capfd, case, expected):
    workdir = tmp_path / "run"
    before = _snapshot(env)
    status, out, err = cli(_argv(case, env, workdir), capfd)
    _assert_refused(status, out, err, expected.format(file=env / "file", root=env))
    assert not workdir.exists(), _snapshot(workdir)
    assert _snapshot(env) == before
    assert _snapshot(tmp_path) == []


def test_a_config_of_another_architecture_is_named_as_such(env, tmp_path, capfd):
    # A user's own copy (outside configs/<architecture>/): named by the fields the Model lacks.
    from agf_jax.model import Model

    mine = tmp_path / "mine" / "synthetic.py"
    mine.parent.mkdir()
    shutil.copy(ROOT / "configs" / "core" / "synthetic.py", mine)
    status, out, err = cli(_argv(f"CONFIG={mine}:smoke", env, tmp_path / "run"), capfd, build_model=Model)
    _assert_refused(status, out, err, "config.model does not fit agf_jax.model.Model: missing 1 required "
                                      "keyword-only argument: 'kind'; is the config written for another")
    assert _snapshot(tmp_path) == ["mine", "mine/synthetic.py"]


def test_a_repository_config_given_to_another_architectures_command_names_the_right_one(tmp_path, capfd):
    # configs/htgn/number_words.py's model fields fit agf_jax's Model up to its `kind`: without this check
    # the error was about `kind`, not about the command.
    from agf_jax.model import Model

    for config, build, want in [("configs/htgn/number_words.py:smoke", Model, "htgn_jax"),
                                ("configs/agf/lra_listops.py:smoke", mlp_classifier.Model, "agf_jax")]:
        status, out, err = cli(["--config", config, "--workdir", tmp_path / "run"], capfd, build_model=build)
        path = config.partition(":")[0]
        _assert_refused(status, out, err, f"{path} is a config for {want}: run it with python -m {want}.train "
                                          f"(this is {build.__module__.split('.')[0]}.train)")
    assert _snapshot(tmp_path) == []


@pytest.mark.parametrize("stop,name,status", [(KeyboardInterrupt, "Ctrl-C", 130),
                                              (main._SigtermStop, "SIGTERM", 143)], ids=["Ctrl-C", "SIGTERM"])
def test_a_signal_while_preparing_data_is_one_line_and_leaves_no_data_folder(tmp_path, capfd, monkeypatch,
                                                                             stop, name, status):
    """Ctrl-C or SIGTERM outside the training loop (which saves and exits 0 on its own): one line, status
    130 / 143, and the dataset being prepared is removed rather than left half-made. (`main` turns
    SIGTERM into `_SigtermStop` outside the loop: `_stop_on_sigterm`.)"""
    from zoo_core import data as data_lib
    from zoo_core.configs.core import synthetic

    builder_class = type(data_lib.make_builder("synthetic_linear", str(tmp_path / "probe"),
                                               **synthetic.get_config("smoke").data.options.to_dict()))

    def interrupted(self, *args, **kwargs):
        os.makedirs(self.data_dir, exist_ok=True)
        pathlib.Path(self.data_dir, "half-written.tfrecord").write_text("")
        raise stop

    monkeypatch.setattr(builder_class, "download_and_prepare", interrupted)
    data = tmp_path / "data"
    code, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", tmp_path / "run",
                          f"--config.data.data_dir={data}"], capfd)
    assert code == status, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"interrupted ({name}): stopped at once" in errors[0] and "Traceback" not in err
    assert not data.exists() and not (tmp_path / "run").exists()
    with pytest.raises(main._SigtermStop):
        main._stop_on_sigterm(15, None)


def test_a_leading_tilde_is_the_home_folder(tmp_path, capfd, monkeypatch):
    """`--workdir=~/run` reaches the program with its '~' (the shell expands it only at a word's
    start): it is the home folder, not a folder named '~' in the current one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    status, out, err = cli(["--config", f"{ROOT}/configs/core/synthetic.py:smoke", "--workdir=~/run",
                            "--config.data.data_dir=~/data"], capfd)
    assert status == 0, err[-3000:]
    assert (tmp_path / "run" / "config.json").is_file() and (tmp_path / "data" / "synthetic_linear").is_dir()
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_flags_and_exits_0(capfd, flag):
    status, out, err = cli([flag], capfd)
    assert status == 0 and err == ""
    for name in ("--config:", "--workdir:", "--[no]eval_only:", "--[no]allow_config_change:", "--config.<field>"):
        assert name in out, out


# The seq2seq decoding options (`python -m htgn_jax.train`): checked with the config, before any data is
# built or anything trained, rather than at the first evaluation.
NW = "CONFIG=configs/htgn/number_words.py:smoke"
DECODE_CASES = [
    (f"{NW} --config.decode.beam_size=0", "`config.decode.beam_size` must be an integer >= 1, got 0"),
    (f"{NW} --config.decode.beam_size=36", "beam_size=36 exceeds model.target_vocab_size - 2 = 35"),
    (f"{NW} --config.decode.length_penalty=-1", "`config.decode.length_penalty` must be a finite number >= 0"),
    (f"{NW} --config.decode.length_penalty=0.6", "greedy decoding (beam_size=1) has none"),
    (f"{NW} --config.decode.max_len=-3", "`config.decode.max_len` must be an integer >= 0, got -3"),
    (f"{NW} --config.decode.max_len=13", "max_len=13 exceeds model.max_target_len=12"),
    (f"{NW} --config.decode.max_examples=-1", "`config.decode.max_examples` must be an integer >= 0, got -1"),
    (f"{NW} --config.decode.use_cache=always", "config.decode.use_cache must be one of"),
    ("CONFIG=configs/htgn/number_words.py:attention=softmax,smoke --config.decode.use_cache=cache",
     "needs model.attention='favor'"),
    (f"{NW} --eval_only --config.decode.beam_size=0", "`config.decode.beam_size` must be an integer >= 1"),
]


def test_a_test_split_must_be_a_split_of_the_data(env, tmp_path, capfd):
    # With evaluators that report it (SAMoVAR's), a test_split is checked against the prepared splits.
    from samovar_jax import evaluation

    status, out, err = cli(_argv("--config.test_split=nosuch", env, tmp_path / "run"), capfd,
                           evaluators_fn=evaluation.evaluators_for)
    _assert_refused(status, out, err, "test_split 'nosuch' is not a split of synthetic")
    assert _snapshot(tmp_path) == []


@pytest.mark.parametrize("case,expected", DECODE_CASES, ids=[c[len(NW) + 1:] if c.startswith(NW) else c
                                                             for c, _ in DECODE_CASES])
def test_a_bad_decoding_option_is_refused_before_anything_is_built(env, tmp_path, capfd, case, expected):
    from htgn_jax import decoding
    from htgn_jax.model import Model

    workdir = tmp_path / "run"
    status, out, err = cli(_argv(case, env, workdir), capfd, build_model=Model,
                           evaluators_fn=decoding.evaluators_for)
    _assert_refused(status, out, err, expected)
    assert _snapshot(tmp_path) == []
    assert not (env / "data" / "number_words").exists(), "no data set was prepared"


# ----------------------------------------------------------------------------------------------------
# Resuming with another config.


def _train(env, workdir, capfd, *overrides):
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", workdir,
                            f"--config.data.data_dir={env / 'data'}", *overrides], capfd)
    assert status == 0, err[-3000:]
    return err


def test_resume_with_a_changed_training_field_is_refused_naming_the_keys(env, tmp_path, capfd):
    work = tmp_path / "run"
    _train(env, work, capfd)
    stored, before = (work / "config.json").read_text(), _snapshot(work)
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", work,
                            f"--config.data.data_dir={env / 'data'}", "--config.optim.learning_rate=0.1",
                            "--config.model.hidden=64", "--config.seed=3", "--config.optim.name=adam"], capfd)
    _assert_refused(status, out, err, "was trained with another config: model.hidden: 32 -> 64, "
                                      "optim.learning_rate: 0.003 -> 0.1, optim.name: 'adamw' -> 'adam', seed: 0 -> 3")
    assert "--allow_config_change" in err and "train_and_evaluate(" not in err   # the flag, not the Python API
    assert (work / "config.json").read_text() == stored and _snapshot(work) == before
    # A smoke-sized run on a full run's workdir is refused the same way (batch sizes differ).
    status, out, err = cli(["--config", "configs/core/synthetic.py", "--workdir", work,
                            f"--config.data.data_dir={env / 'data'}"], capfd)
    _assert_refused(status, out, err, "batch_size: 4 -> 16")
    # --eval_only with another model is refused too: its checkpoints mean nothing in that model (another
    # size failed inside the restore with a traceback). Another compute dtype is only another precision.
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", work, "--eval_only",
                            f"--config.data.data_dir={env / 'data'}", "--config.model.hidden=64"], capfd)
    _assert_refused(status, out, err, "were trained with another model: model.hidden: 32 -> 64")
    assert _snapshot(work) == before
    as_stored = json.loads(stored)
    trainer.check_eval_config(dict(as_stored, model=dict(as_stored["model"], dtype="bfloat16")), str(work))


def test_a_bad_eval_split_flag_is_named_as_the_flag(env, tmp_path, capfd):
    work = tmp_path / "run"
    _train(env, work, capfd)
    before = _snapshot(work)
    for split, expected in (("nosuch", "--eval_split 'nosuch' is not a split of synthetic_linear (it has: test, train)"),
                            ("test[50%:10%]", "--eval_split 'test[50%:10%]' selects no examples (test has 128)")):
        status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", work, "--eval_only",
                                f"--eval_split={split}", f"--config.data.data_dir={env / 'data'}"], capfd)
        _assert_refused(status, out, err, expected)
    # Written into the config, the same mistake names the config field.
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", work, "--eval_only",
                            "--config.data.eval_split=nosuch", f"--config.data.data_dir={env / 'data'}"], capfd)
    _assert_refused(status, out, err, "data.eval_split 'nosuch' is not a split of synthetic_linear")
    assert _snapshot(work) == before


@pytest.mark.parametrize("damage", ["truncated records", "missing records", "unreadable dataset_info.json"])
def test_damaged_prepared_data_is_one_line_naming_its_folder(env, tmp_path, capfd, damage):
    data = tmp_path / "data"
    shutil.copytree(env / "data", data)
    (info,) = data.glob("synthetic_linear/*/*/dataset_info.json")
    (record,) = info.parent.glob("*-train.array_record-*")
    if damage == "truncated records":
        os.truncate(record, 100)
    elif damage == "missing records":
        record.unlink()
    else:
        info.write_text("{")
    before = _snapshot(data)
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", tmp_path / "run",
                            f"--config.data.data_dir={data}"], capfd)
    _assert_refused(status, out, err, f"the prepared synthetic_linear in '{info.parent}' ", alone=False)
    assert "delete that folder to prepare it again" in err
    assert _snapshot(data) == before and not (tmp_path / "run").exists()


def test_a_damaged_copy_of_another_configuration_does_not_stop_a_run(env, tmp_path, capfd):
    data = tmp_path / "data"
    shutil.copytree(env / "data", data)
    (info,) = data.glob("synthetic_linear/*/*/dataset_info.json")
    other = data / "synthetic_linear" / "cfg_other" / info.parent.name
    shutil.copytree(info.parent, other)
    (other / "dataset_info.json").write_text("{")
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", tmp_path / "run",
                            f"--config.data.data_dir={data}"], capfd)
    assert status == 0, err[-3000:]


@pytest.mark.parametrize("text,expected", [('{"model": {"hid', "is not readable JSON (JSONDecodeError)"),
                                           ("[1, 2]", "holds a JSON list, not a config (a JSON object)")])
def test_a_damaged_config_json_is_one_line_on_resume_and_eval(env, tmp_path, capfd, text, expected):
    work = tmp_path / "run"
    _train(env, work, capfd)
    (work / "config.json").write_text(text)
    before = _snapshot(work)
    for extra in ([], ["--eval_only"]):
        status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", work,
                                f"--config.data.data_dir={env / 'data'}", *extra], capfd)
        _assert_refused(status, out, err, f"{work / 'config.json'} {expected}")
        assert _snapshot(work) == before and (work / "config.json").read_text() == text


def test_checkpoints_without_their_config_json_are_resumed_only_when_allowed(env, tmp_path, capfd, caplog):
    work = tmp_path / "run"
    _train(env, work, capfd)
    (work / "config.json").unlink()
    before = _snapshot(work)
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", work,
                            f"--config.data.data_dir={env / 'data'}", "--config.total_steps=4"], capfd)
    _assert_refused(status, out, err, "holds checkpoints but no config.json, so the config they were trained "
                                      "with cannot be compared")
    assert _snapshot(work) == before
    caplog.set_level(py_logging.INFO)
    _train(env, work, capfd, "--config.total_steps=4", "--allow_config_change")
    assert "config.json was missing: resuming the checkpoints with this config" in _logged(caplog)
    assert json.loads((work / "config.json").read_text())["total_steps"] == 4
    assert sorted(os.listdir(work / "checkpoints")) == ["2", "4"]


def _logged(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_safe_changes_are_allowed_and_logged(env, tmp_path, capfd, caplog):
    work = tmp_path / "run"
    _train(env, work, capfd)
    caplog.set_level(py_logging.INFO)
    _train(env, work, capfd, "--config.total_steps=4", "--config.log_every_steps=2",
                 "--config.eval_every_steps=4", "--config.checkpoint_every_steps=4", "--config.progress_bar=True",
                 "--config.checkpoint.keep=2", "--config.eval_max_examples=4")
    err = _logged(caplog)
    assert "resuming" in err and "total_steps: 2 -> 4" in err and "log_every_steps: 1 -> 2" in err
    assert sorted(os.listdir(work / "checkpoints")) == ["2", "4"]
    assert json.loads((work / "config.json").read_text())["total_steps"] == 4


def test_allow_config_change_resumes_with_the_new_values(env, tmp_path, capfd, caplog):
    work = tmp_path / "run"
    _train(env, work, capfd)
    caplog.set_level(py_logging.INFO)
    _train(env, work, capfd, "--config.optim.learning_rate=0.01", "--config.total_steps=4", "--allow_config_change")
    err = _logged(caplog)
    assert "allowed by allow_config_change" in err and "optim.learning_rate: 0.003 -> 0.01" in err
    assert json.loads((work / "config.json").read_text())["optim"]["learning_rate"] == 0.01
    assert sorted(os.listdir(work / "checkpoints")) == ["2", "4"]


def _steps(total, schedule):
    return {"total_steps": total, "schedule": {"name": schedule}}


@pytest.mark.parametrize("old,new,refused", [
    (_steps(10, "constant"), _steps(20, "constant"), []),
    (_steps(10, "warmup_rsqrt"), _steps(20, "warmup_rsqrt"), []),
    (_steps(10, "warmup_cosine"), _steps(20, "warmup_cosine"), ["total_steps"]),
    (_steps(10, "constant"), _steps(5, "constant"), ["total_steps"]),
    (_steps(10, "constant"), _steps(20, "warmup_rsqrt"), ["schedule.name", "total_steps"]),
    ({"data": {"options": {"a": 1}}, "test_split": "test"}, {"data": {"options": {"a": 2}}, "test_split": ""},
     ["data.options.a"]),
    ({"decode": {"beam_size": 4}, "checkpoint": {"best_metric": "eval/a"}},
     {"decode": {"beam_size": 1}, "checkpoint": {"best_metric": "eval/b"}}, []),
    ({"model": {"x": 1}}, {"model": {"x": 1, "y": 2}}, ["model.y"]),
    ({"model": {"x": 1}}, {"model": {"x": 1, "y": None}}, []),      # an unset placeholder = absent
    ({"model": {"x": None}}, {"model": {"x": 0}}, ["model.x"]),
])
def test_resume_changes_classifies_the_keys(old, new, refused):
    got, allowed = trainer.resume_changes(old, new)
    assert got == refused
    assert not set(got) & set(allowed)


def test_log_lines_go_through_tqdm_while_the_bar_is_shown(monkeypatch):
    from tqdm.auto import tqdm
    written = []
    monkeypatch.setattr(tqdm, "write", lambda text, file=None, end="\n": written.append(text))
    handler = py_logging.StreamHandler(sys.stderr)     # a console handler, as absl's is in a real run
    root = py_logging.getLogger()
    root.addHandler(handler)
    try:
        restore = run_log.log_through_tqdm()
        root.warning("step 3 eval: eval/accuracy=0.5")
        restore()
    finally:
        root.removeHandler(handler)
    assert handler.stream is sys.stderr
    assert any("step 3 eval" in w for w in written), written


# ----------------------------------------------------------------------------------------------------
# Prepared data keyed by content.


def test_an_edited_source_file_is_prepared_again_and_says_why(tmp_path, caplog):
    from zoo_core.configs import common
    folder = tmp_path / "src" / "Toy"
    folder.mkdir(parents=True)
    for split in ("TRAIN", "TEST"):
        (folder / f"Toy_{split}.ts").write_text(_TS)
    c = common.base_config()
    c.data.name, c.data.data_dir = "uea", str(tmp_path / "data")
    c.data.options = common.ml_collections.ConfigDict(dict(dataset="Toy", source_dir=str(tmp_path / "src"),
                                                           normalization="none"))
    first, _ = trainer.prepare_data(c)
    assert float(first[0]["inputs"][0, 0]) == 1.0
    trainer.prepare_data(c)                       # unchanged: reused, no rebuild message
    (folder / "Toy_TRAIN.ts").write_text(_TS.replace("1,2,3:4,5,6:up", "7,2,3:4,5,6:up"))
    with caplog.at_level(py_logging.INFO):
        edited, _ = trainer.prepare_data(c)
    assert float(edited[0]["inputs"][0, 0]) == 7.0
    assert any("the source files changed since they were prepared" in r.getMessage() for r in caplog.records)
    assert len([n for n in os.listdir(tmp_path / "data" / "uea") if n.startswith("cfg_")]) == 2
    # Without the source files, the newest data prepared from them with these options is used.
    for split in ("TRAIN", "TEST"):
        os.remove(folder / f"Toy_{split}.ts")
    gone, _ = trainer.prepare_data(c)
    assert float(gone[0]["inputs"][0, 0]) == 7.0


def test_a_class_count_that_does_not_match_the_data_is_refused_before_compiling(tmp_path, capfd):
    from agf_jax.model import Model
    status, out, err = cli(["--config", "configs/agf/uea.py:dataset=BasicMotions,smoke", "--workdir", tmp_path / "w",
                            f"--config.data.data_dir={tmp_path / 'data'}", "--config.model.num_classes=3"],
                           capfd, build_model=Model)
    # The class count is the prepared data set's, so this refusal comes after its build (and its log).
    _assert_refused(status, out, err, "the model has 3 outputs but uea has 4 classes: set "
                                      "--config.model.num_classes=4", alone=False)
    assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------------------------------------------
# The real entry points (subprocesses).


def _run(*args, timeout=120, env=None):
    env = command_env(**(env or {}))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.time() - t0


@pytest.mark.entry
@pytest.mark.parametrize("override,expected", [
    ("--config.optim.name=sgdd", "unknown optim.name 'sgdd'"),
    ("--config.schedule.name=cosine", "unknown schedule.name 'cosine'"),
    ("--config.checkpoint.best_metric=eval/acuracy", "best_metric 'eval/acuracy' is not an eval metric"),
])
def test_full_listops_config_mistakes_are_reported_in_seconds(tmp_path, override, expected):
    data = tmp_path / "data"
    proc, seconds = _run("agf_jax.train", "--config", "configs/agf/lra_listops.py", "--workdir", tmp_path / "w",
                         f"--config.data.data_dir={data}", override)
    _assert_refused(proc.returncode, proc.stdout, proc.stderr, expected)
    assert seconds < 30, seconds
    assert not (tmp_path / "w").exists() and not data.exists()


@pytest.mark.entry
def test_a_bad_data_option_of_the_real_forecasting_config_prints_only_its_error(tmp_path):
    # The data builder is looked up before the option fails: TFDS's warning about the not yet prepared
    # folder must not come before the error line (absl logs to stderr only in a real entry point).
    proc, _ = _run("samovar_jax.train", "--config", "configs/samovar/forecasting.py:smoke", "--workdir",
                   tmp_path / "w", f"--config.data.data_dir={tmp_path / 'data'}",
                   "--config.data.options.target=nocolumn")
    _assert_refused(proc.returncode, proc.stdout, proc.stderr, "target column 'nocolumn' not in embedded:vic_elec")
    assert _snapshot(tmp_path) == []


@pytest.mark.entry
def test_the_real_entry_point_refuses_a_file_workdir_and_a_binary_csv_source(tmp_path):
    (tmp_path / "file").write_text("x")
    proc, _ = _run("samovar_jax.train", "--config", "configs/samovar/synthetic_var.py:smoke",
                   "--workdir", tmp_path / "file", "--config.optim.learning_rate=-1")
    _assert_refused(proc.returncode, proc.stdout, proc.stderr, "optim.learning_rate")
    proc, _ = _run("samovar_jax.train", "--config", "configs/samovar/synthetic_var.py:smoke",
                   "--workdir", tmp_path / "file")
    _assert_refused(proc.returncode, proc.stdout, proc.stderr, "is an existing file; expected a directory")
    (tmp_path / "bin.csv").write_bytes(bytes(range(256)) * 8)
    proc, _ = _run("samovar_jax.train", "--config", f"configs/samovar/forecasting.py:source={tmp_path / 'bin.csv'}",
                   "--workdir", tmp_path / "w")
    _assert_refused(proc.returncode, proc.stdout, proc.stderr, "not UTF-8 text")
    assert sorted(os.listdir(tmp_path)) == ["bin.csv", "file"]


@pytest.mark.entry
def test_the_compiled_steps_go_to_the_persistent_cache(tmp_path):
    cache = tmp_path / "cache"
    env = command_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.run([sys.executable, "-m", "zoo_core.train", "--config", "configs/core/synthetic.py:smoke",
                           "--workdir", str(tmp_path / "w"), f"--compilation_cache_dir={cache}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert cache.is_dir() and any(cache.iterdir()), "nothing was written to the compilation cache"
    # The closing line once on the terminal: on stdout, not again in the log on stderr.
    assert proc.stdout.count("end of run:") == 1 and "end of run" not in proc.stderr, proc.stderr[-2000:]


def test_a_training_run_ends_with_one_summary_line_on_stdout(env, tmp_path, capfd):
    work = tmp_path / "run"
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", work,
                            f"--config.data.data_dir={env / 'data'}"], capfd)
    assert status == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("end of run: "), out
    assert "end of run" not in err, err[-2000:]   # printed once: not logged again on stderr
    assert "best eval/accuracy=" in lines[0] and f"in {work / 'best'}; latest checkpoint" in lines[0], lines[0]


def test_the_command_line_module_loads_without_jax():
    """zoo_core.run.main imports the trainer's modules (and JAX) only where a run starts, so that --help
    and a flag mistake answer at once."""
    code = "import sys, zoo_core.run.main; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=command_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_eval_only_on_a_read_only_run_prints_the_result_and_one_line_for_the_json(env, tmp_path, capfd,
                                                                                  monkeypatch, caplog):
    """A run directory the JSON cannot be written to (read-only; root ignores chmod, so the write is
    refused here as the file system would) still gets its result printed, exit 0, no traceback, and one
    warning line in the log (stderr on the command line) naming the file."""
    from zoo_core.run import metrics as metrics_lib
    work = tmp_path / "run"
    _train(env, work, capfd)
    write_json = metrics_lib.write_json

    def read_only(path, obj):
        if os.path.basename(path).startswith("eval_"):
            raise PermissionError(13, "Permission denied", path + ".tmp")
        write_json(path, obj)

    monkeypatch.setattr(metrics_lib, "write_json", read_only)
    caplog.set_level(py_logging.INFO)
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", work, "--eval_only",
                            f"--config.data.data_dir={env / 'data'}"], capfd)
    assert status == 0 and "Traceback" not in err, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["step"] == 2 and "eval/accuracy" in result
    unsaved = [r for r in caplog.records if "eval_best_test.json" in r.getMessage()]
    assert len(unsaved) == 1 and unsaved[0].levelno == py_logging.WARNING, caplog.text[-3000:]
    assert "could not be written (Permission denied)" in unsaved[0].getMessage()
    assert "\n" not in unsaved[0].getMessage()
    assert not (work / "eval_best_test.json").exists()


def test_an_error_line_starts_its_own_line_after_a_progress_bar(env, tmp_path, capfd, monkeypatch):
    """A data set that fails while its progress bars are shown (TFDS shows nested ones): the bars are
    closed first, so their text and cursor-up codes never share the `error:` line."""
    from tqdm.auto import tqdm

    from zoo_core.run import setup

    def failing(config, *, builder=None):
        outer = tqdm(total=2, desc="Generating splits...", leave=False, file=sys.stderr)
        inner = tqdm(total=40, desc="Generating train examples...", leave=False, file=sys.stderr)
        outer.update(1)
        inner.update(7)
        raise ValueError("the source file is damaged at line 3")

    monkeypatch.setattr(setup, "prepare_data", failing)
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", tmp_path / "run",
                            f"--config.data.data_dir={env / 'data'}"], capfd)
    assert status == 2, err[-2000:]
    assert "error: the source file is damaged at line 3" in err.split("\n"), repr(err[-600:])


def test_the_command_builds_the_model_task_optimiser_and_data_builder_once(env, tmp_path, capfd, monkeypatch):
    """The command checks the setup before the workdir and hands what it built to the trainer."""
    from zoo_core import data as data_lib
    from zoo_core import tasks
    from zoo_core.run import optim
    calls = {"model": 0, "task": 0, "optimizer": 0, "builder": 0}

    def counted(name, fn):
        @functools.wraps(fn)   # the command reads the factory's module
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(tasks, "make_task", counted("task", tasks.make_task))
    monkeypatch.setattr(optim, "make_optimizer", counted("optimizer", optim.make_optimizer))
    monkeypatch.setattr(data_lib, "make_builder", counted("builder", data_lib.make_builder))
    status, out, err = cli(["--config", "configs/core/synthetic.py:smoke", "--workdir", tmp_path / "run",
                            f"--config.data.data_dir={env / 'data'}", "--config.total_steps=2"], capfd,
                           build_model=counted("model", mlp_classifier.Model))
    assert status == 0, err[-3000:]
    assert calls == {"model": 1, "task": 1, "optimizer": 1, "builder": 1}



@pytest.mark.entry
def test_a_download_without_network_prints_only_its_error_line(tmp_path):
    """No connection (a refused port here, no network for a user): the `error:` line alone, without the
    INFO line 'fetching <URL>' that came before it (absl logs to stderr only in a real entry point)."""
    import socket
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, _ = _run("agf_jax.train", "--config", "configs/agf/uea.py:dataset=Heartbeat,smoke", "--workdir",
                   tmp_path / "w", f"--config.data.data_dir={tmp_path / 'data'}",
                   f"--config.data.options.base_url=http://127.0.0.1:{port}", env={"ZOO_OFFLINE": "0"})
    _assert_refused(proc.returncode, proc.stdout, proc.stderr, f"could not fetch http://127.0.0.1:{port}/Heartbeat.zip (")
    assert _snapshot(tmp_path) == []
