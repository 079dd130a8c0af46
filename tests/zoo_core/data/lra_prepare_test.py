"""`python -m zoo_core.data.lra_prepare`: LRA's release archive (and IMDB, CIFAR-10) in their own layouts,
made small here, become the folders the LRA builders read, with no TensorFlow; a URL is fetched first."""
import io
import os
import tarfile

import numpy as np
import pytest

from zoo_core import data as zoo_data
from zoo_core.data import lra_prepare

LISTOPS = "Source\tTarget\n( ( [MAX 2 9 ] ) )\t9\n( ( [MIN 2 9 ] ) )\t2\n"


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def _tar_gz(path, files: dict[str, bytes]) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def lra_release(path, prefix="lra_release/lra_release/", num_images=20) -> str:
    """A small lra_release.gz: listops-1000, tsv_data and pathfinder32/curv_contour_length_14."""
    files = {f"{prefix}listops-1000/basic_{s}.tsv": LISTOPS.encode() for s in ("train", "val", "test")}
    for name in ("train", "eval", "test"):
        files[f"{prefix}tsv_data/new_aan_pairs.{name}.tsv"] = b"1.0\tid1\tid2\tab c\tde f\n0.0\tx\ty\tgh\tij\n"
    pf = f"{prefix}pathfinder32/curv_contour_length_14/"
    meta = []
    for i in range(num_images):
        files[f"{pf}imgs/0/sample_{i}.png"] = _png(np.full((32, 32), i, np.uint8))
        meta.append(f"imgs/0 sample_{i}.png 0 {i % 2} 0.0 1 2")
    files[f"{pf}metadata/0.npy"] = ("\n".join(meta) + "\n").encode()
    files[f"{prefix}pathfinder64/curv_contour_length_14/metadata/0.npy"] = b"ignored"
    return _tar_gz(path, files)


def test_archive_to_builders(tmp_path, capsys):
    archive = lra_release(tmp_path / "lra_release.gz")
    out = tmp_path / "lra"
    assert lra_prepare.main(["--archive", archive, "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["listops", "pathfinder", "retrieval"]
    assert sorted(os.listdir(out / "retrieval")) == ["test.tsv", "train.tsv", "validation.tsv"]
    printed = capsys.readouterr().out
    assert f"retrieval: --config.data.options.source_dir={out / 'retrieval'}" in printed
    data_dir = str(tmp_path / "data")
    b = zoo_data.make_builder("lra_retrieval", data_dir, source_dir=str(out / "retrieval"), max_length=8)
    b.download_and_prepare()
    assert {s: b.info.splits[s].num_examples for s in ("train", "validation", "test")} == {
        "train": 2, "validation": 2, "test": 2}
    b = zoo_data.make_builder("lra_pathfinder", data_dir, source_dir=str(out / "pathfinder"))
    b.download_and_prepare()
    sizes = {s: b.info.splits[s].num_examples for s in ("train", "validation", "test")}
    assert sizes == {"train": 16, "validation": 2, "test": 2}
    pixels = sorted(int(r["inputs"][0]) for s in sizes for r in b.as_data_source(s))
    assert pixels == list(range(20))   # every image once, its pixels kept
    record = b.as_data_source("train")[0]
    assert record["label"] == record["inputs"][0] % 2
    b = zoo_data.make_builder("lra_listops", data_dir, source_dir=str(out / "listops"))
    b.download_and_prepare()
    assert b.info.splits["test"].num_examples == 2
    # Run again: every task is there, nothing is rewritten.
    assert lra_prepare.main(["--archive", archive, "--out", str(out)]) == 0
    assert "exists; skipped" in capsys.readouterr().out


def test_archive_without_lra_layout_fails_in_one_line_and_writes_nothing(tmp_path, capsys):
    archive = _tar_gz(tmp_path / "other.tar.gz", {"x/readme.txt": b"hello"})
    assert lra_prepare.main(["--archive", archive, "--out", str(tmp_path / "out"), "--tasks", "retrieval"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no new_aan_pairs.train.tsv" in err and err.startswith("error: ")
    assert os.listdir(tmp_path / "out") == [] if (tmp_path / "out").exists() else True
    assert lra_prepare.main(["--out", str(tmp_path / "o2"), "--tasks", "text"]) == 2
    assert "needs --imdb" in capsys.readouterr().err


@pytest.mark.parametrize("out, expected", [
    ("{file}", "is an existing file; expected a directory"),
    ("{file}/lra", "is a file, so no directory can be made under it"),
    ("", "is empty"),
], ids=["a file", "under a file", "empty"])
def test_an_out_that_cannot_be_a_folder_is_one_error_line(out, expected, tmp_path, capsys):
    archive = lra_release(tmp_path / "lra_release.gz", num_images=2)
    (tmp_path / "file").write_text("")
    out = out.format(file=tmp_path / "file")
    with pytest.raises(SystemExit) as e:
        lra_prepare.main(["--archive", archive, f"--out={out}", "--tasks", "listops"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --out {out!r} ") and expected in err, err
    assert sorted(os.listdir(tmp_path)) == ["file", "lra_release.gz"]


def test_imdb_and_cifar(tmp_path):
    imdb = _tar_gz(tmp_path / "aclImdb_v1.tar.gz", {
        "aclImdb/train/pos/0_9.txt": b"great\nfilm", "aclImdb/train/neg/1_2.txt": b"bad<br />film",
        "aclImdb/test/pos/2_8.txt": b"fine", "aclImdb/test/neg/3_1.txt": b"dull",
        "aclImdb/train/unsup/4_0.txt": b"ignored"})
    rng = np.random.default_rng(0)
    batches = {}
    for name, n in [*[(f"data_batch_{i}.bin", 4) for i in range(1, 6)], ("test_batch.bin", 3)]:
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        images = rng.integers(0, 256, (n, 3 * 1024), dtype=np.uint8)
        batches[f"cifar-10-batches-bin/{name}"] = np.concatenate([labels[:, None], images], 1).tobytes()
    cifar = _tar_gz(tmp_path / "cifar-10-binary.tar.gz", batches)
    out = tmp_path / "lra"
    assert lra_prepare.main(["--imdb", imdb, "--cifar", cifar, "--out", str(out)]) == 0
    assert (out / "text" / "train.tsv").read_bytes() in (b"1\tgreat film\n0\tbad<br />film\n",
                                                          b"0\tbad<br />film\n1\tgreat film\n")
    with np.load(out / "image" / "train.npz") as z:
        first = np.frombuffer(batches["cifar-10-batches-bin/data_batch_1.bin"][:3073], np.uint8)
        assert z["inputs"].shape == (18, 32, 32, 3) and z["label"][0] == first[0]
        np.testing.assert_array_equal(z["inputs"][0, :, :, 1].ravel(), first[1 + 1024:1 + 2048])   # green plane
    data_dir = str(tmp_path / "data")
    b = zoo_data.make_builder("lra_image", data_dir, source_dir=str(out / "image"))
    b.download_and_prepare()
    assert {s: b.info.splits[s].num_examples for s in ("train", "validation", "test")} == {
        "train": 18, "validation": 2, "test": 3}
    b = zoo_data.make_builder("lra_text", data_dir, source_dir=str(out / "text"), max_length=16)
    b.download_and_prepare()
    assert set(b.info.splits) == {"train", "test"}


@pytest.mark.parametrize("prefix", ["lra_release/", "lra_release/lra_release/"])
def test_split_80_10_10_and_layout_prefixes(prefix, tmp_path):
    archive = lra_release(tmp_path / "a.gz", prefix=prefix, num_images=10)
    written = lra_prepare.prepare_archive(archive, str(tmp_path / "out"), ("pathfinder",), log=lambda *_: None)
    assert written == [str(tmp_path / "out" / "pathfinder")]
    idx = lra_prepare.split_80_10_10(10)
    assert [len(idx[s]) for s in ("train", "validation", "test")] == [8, 1, 1]
    assert sorted(np.concatenate(list(idx.values()))) == list(range(10))
