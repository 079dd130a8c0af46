"""The zoo as a dependency: the extras (setup.cfg and zoo_core.extras agree; a missing one is one line
naming it) and the shipped configs (`configs/...` found from any folder)."""
import configparser
import os
import re
import subprocess
import sys

import pytest

from tests.environment import ROOT, command_env
from zoo_core import configs, extras


def _setup_cfg():
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def _names(block: str) -> list[str]:
    """Distribution names of a setup.cfg requirement list (comments, versions and extras' brackets dropped)."""
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    return [re.split(r"[<>=!~\[ ]", line)[0] for line in lines if line]


def test_the_extras_of_setup_cfg_are_those_zoo_core_names():
    declared = _setup_cfg()["options.extras_require"]
    for extra, packages in extras.EXTRAS.items():
        assert sorted(_names(declared[extra])) == sorted(set(packages.values())), extra
    assert re.search(r"\[(.*)\]", declared["all"]).group(1).split(",") == [e for e in extras.EXTRAS if e != "peers"]


def test_the_core_requires_no_package_of_an_extra():
    core = set(_names(_setup_cfg()["options"]["install_requires"]))
    for extra, packages in extras.EXTRAS.items():
        assert not core & set(packages.values()), extra
    assert "ml_dtypes" not in core     # no pin below what JAX allows
    assert "configs" not in _setup_cfg()["options.packages.find"]["include"].split()


def test_a_missing_extra_is_one_line_with_the_pip_command(monkeypatch):
    real = extras.importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda n, *a: None if n == "sacrebleu" else real(n, *a))
    assert extras.missing("text") == ["sacrebleu"] and extras.missing("text", ["num2words"]) == []
    with pytest.raises(extras.MissingExtra) as e:
        extras.require("text", "the BLEU evaluation", ["sacrebleu"])
    assert str(e.value) == ("the BLEU evaluation needs the [text] extra (sacrebleu not installed): "
                            "pip install 'linear-attention-zoo[text]'")
    with pytest.raises(KeyError):
        extras.require("text", "x", ["torch"])


@pytest.mark.entry
def test_a_config_whose_extra_is_missing_stops_before_any_work(tmp_path):
    """HTGN number-words on an install without [text]: one `error:` line naming the extra, exit 2."""
    script = ("import sys; sys.modules.update(num2words=None, sacrebleu=None, sentencepiece=None)\n"
              "sys.argv = ['htgn_jax.train', '--config', 'configs/htgn/number_words.py:smoke', '--workdir', 'w']\n"
              "from htgn_jax import decoding, model\nfrom zoo_core.run import main\n"
              "main.run(model.Model, evaluators_fn=decoding.evaluators_for)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=command_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: the seq2seq evaluation (BLEU, chrF) needs the [text] extra (sacrebleu not installed): "
        "pip install 'linear-attention-zoo[text]'"]
    assert os.listdir(tmp_path) == []


def test_configs_resolve_to_the_shipped_files_unless_the_folder_has_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = configs.ROOT / "agf" / "uea.py"
    assert configs.resolve("configs/agf/uea.py:smoke") == f"{shipped}:smoke"
    assert configs.resolve("./configs/agf/uea.py") == str(shipped)
    assert configs.resolve("configs/studies/agf_order.py") == str(configs.ROOT / "studies" / "agf_order.py")
    for unchanged in ("configs/agf/nothing.py", "elsewhere/agf/uea.py", "uea.py:smoke", ""):
        assert configs.resolve(unchanged) == unchanged
    (tmp_path / "configs" / "agf").mkdir(parents=True)
    (tmp_path / "configs" / "agf" / "uea.py").write_text("")
    assert configs.resolve("configs/agf/uea.py:smoke") == "configs/agf/uea.py:smoke"   # the user's own wins


@pytest.mark.entry
def test_the_readme_commands_run_from_any_folder(tmp_path):
    """`--config configs/...` and a study file named `configs/studies/...`, run outside the checkout."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=command_env(), capture_output=True,
                              text=True, timeout=300)

    proc = run("zoo_core.train", "--config", "configs/core/synthetic.py:smoke", "--workdir", "w")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "w" / "config.json").is_file()
    proc = run("zoo_core.study", "configs/studies/agf_order.py:smoke", "--dry_run", "--workdir", "s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--config configs/agf/uea.py:" in proc.stdout
