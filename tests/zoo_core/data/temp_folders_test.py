"""Preparing and reading a dataset leaves nothing in the system temp folder (TFDS's builders made an
empty `tmp*tfds` folder each, looking for the dataset on TFDS's bucket)."""
import importlib
import os
import tempfile

import pytest

from zoo_core import data as data_lib

CONFIGS = ("zoo_core.configs.agf.lra_listops", "zoo_core.configs.samovar.synthetic_var", "zoo_core.configs.htgn.number_words")


@pytest.mark.parametrize("module", CONFIGS)
def test_preparation_leaves_no_temp_folders(module, tmp_path, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))   # gettempdir() caches its first answer
    assert tempfile.gettempdir() == str(temp) and os.listdir(temp) == []
    config = importlib.import_module(module).get_config("smoke")
    d = config.data
    options = d.options.to_dict()
    # As a run does it: the setup check's builder, the preparing one, one made again to read it.
    data_lib.check_options(d.name, str(tmp_path / "data"), options)
    data_lib.make_builder(d.name, str(tmp_path / "data"), **options).download_and_prepare()
    builder = data_lib.make_builder(d.name, str(tmp_path / "data"), **options)
    builder.download_and_prepare()
    source = builder.as_data_source(d.train_split)
    source[0], source[len(source) - 1]
    assert os.listdir(temp) == []
