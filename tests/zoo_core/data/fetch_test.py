"""Downloads against a local HTTP server serving small archives in the real layouts (zoo_core.data.fetch):
UEA per-data-set zips, ETT CSVs and an LRA release archive; a broken zip, a truncated download and a
refused connection each give one line and leave nothing in the cache."""
import http.server
import io
import os
import socket
import threading
import zipfile

import numpy as np
import pytest

from zoo_core import data as zoo_data
from zoo_core.data import fetch, forecasting, uea

TS = """@problemName {name}
@dimensions 2
@classLabel true a b
@data
1,2,3:4,5,6:a
3,2,1:6,5,4:b
"""


def _zip(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buffer.getvalue()


def _uea_zip(name: str, folder: bool) -> bytes:
    prefix = f"{name}/" if folder else ""
    return _zip({f"{prefix}{name}_TRAIN.ts": TS.format(name=name).encode(),
                 f"{prefix}{name}_TEST.ts": TS.format(name=name).encode()})


class _Handler(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    truncated: dict[str, int] = {}   # path -> Content-Length announced (more than is sent)

    def do_GET(self):  # noqa: N802 - http.server's name
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(self.truncated.get(self.path, len(body))))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    class Handler(_Handler):
        files, truncated = {}, {}

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", Handler
    httpd.shutdown()
    httpd.server_close()


def _listing(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


@pytest.fixture(autouse=True)
def online(monkeypatch):
    monkeypatch.delenv(fetch.ENV_OFFLINE, raising=False)


def test_fetch_verifies_then_renames(server, tmp_path):
    url, handler = server
    handler.files["/a.zip"] = _zip({"x.txt": b"x"})
    path = fetch.fetch(f"{url}/a.zip", str(tmp_path / "cache"))
    assert path == str(tmp_path / "cache" / "a.zip") and _listing(tmp_path / "cache") == ["a.zip"]
    handler.files["/a.zip"] = b"changed"   # cached: not fetched again
    assert fetch.fetch(f"{url}/a.zip", str(tmp_path / "cache")) == path
    handler.files["/b.bin"] = b"payload"
    digest = "239f59ed55e737c77147cf55ad0c1b030b6d7ee748a7426952f9b852d5a935e5"
    assert fetch.sha256_of(fetch.fetch(f"{url}/b.bin", str(tmp_path / "c2"), sha256=digest)) == digest


@pytest.mark.parametrize("case", ["broken_zip", "truncated", "checksum", "missing_member", "http_404", "refused",
                                  "offline"])
def test_a_failed_fetch_is_one_line_and_leaves_nothing(case, server, tmp_path, monkeypatch):
    url, handler = server
    cache = tmp_path / "cache"
    good = _zip({"x.txt": b"x" * 1000})
    options = {}
    if case == "broken_zip":
        handler.files["/f.zip"] = good[:40] + b"\0" * 20 + good[60:]
        reason = "zip"
    elif case == "truncated":
        handler.files["/f.zip"] = good
        handler.truncated["/f.zip"] = len(good) + 500
        reason = "truncated"
    elif case == "checksum":
        handler.files["/f.zip"] = good
        options["sha256"] = "0" * 64
        reason = "SHA-256"
    elif case == "missing_member":
        handler.files["/f.zip"] = good
        options["expect"] = lambda path: uea._zip_members("Toy", fetch.check_zip(path))
        reason = "no Toy_TRAIN.ts at its root or in Toy/"
    elif case == "http_404":
        reason = "HTTP 404"
    elif case == "refused":
        with socket.socket() as s:   # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        reason = "refused"
    else:
        monkeypatch.setenv(fetch.ENV_OFFLINE, "1")
        reason = "offline"
    with pytest.raises(fetch.FetchError) as e:
        fetch.fetch(f"{url}/{'f.zip' if case != 'http_404' else 'none.zip'}", str(cache),
                    put=f"put f.zip in {cache} (or pass source_dir=DIR)", **options)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"could not fetch {url}/"), message
    assert reason in message and message.endswith(f"; put f.zip in {cache} (or pass source_dir=DIR)"), message
    assert not cache.exists()   # not even the folder it made
    handler.truncated.clear()


@pytest.mark.parametrize("folder", [False, True])
def test_uea_fetched_on_first_use_from_base_url(folder, server, tmp_path):
    url, handler = server
    handler.files["/uea/Toy.zip"] = _uea_zip("Toy", folder)
    data_dir = str(tmp_path / "data")
    b = zoo_data.make_builder("uea", data_dir, dataset="Toy", base_url=f"{url}/uea")
    b.download_and_prepare()
    assert b.info.splits["train"].num_examples == 2 and uea.class_names(b) == ["a", "b"]
    cache = os.path.join(data_dir, "downloads", "uea")
    assert _listing(cache) == ["Toy.zip", "Toy/Toy_TEST.ts", "Toy/Toy_TRAIN.ts"]
    # Cached: no server needed, and the builder is the same one (keyed by the files' contents, not the URL).
    del handler.files["/uea/Toy.zip"]
    again = zoo_data.make_builder("uea", data_dir, dataset="Toy", base_url=f"{url}/uea")
    assert again.is_prepared() and again.builder_config.name == b.builder_config.name


def test_uea_offline_error_names_url_and_folder(server, tmp_path, monkeypatch):
    url, _ = server
    monkeypatch.setenv(fetch.ENV_OFFLINE, "1")
    data_dir = str(tmp_path / "data")
    with pytest.raises(ValueError) as e:
        zoo_data.check_options("uea", data_dir, {"dataset": "Toy", "base_url": f"{url}/uea"})
    folder = os.path.join(data_dir, "downloads", "uea")
    message = str(e.value)
    assert "\n" not in message
    assert f"could not fetch {url}/uea/Toy.zip (offline" in message
    assert message.endswith(f"put Toy/Toy_TRAIN.ts and Toy/Toy_TEST.ts in {folder} (or pass source_dir=DIR)")
    with pytest.raises(ValueError, match="base_url must be"):
        zoo_data.make_builder("uea", data_dir, dataset="Toy", base_url="ftp://x")


def test_uea_broken_archive_leaves_nothing(server, tmp_path):
    url, handler = server
    handler.files["/uea/Bad.zip"] = _zip({"Bad_TRAIN.ts": b"x"})   # no Bad_TEST.ts
    data_dir = str(tmp_path / "data")
    with pytest.raises(ValueError, match=r"no Bad_TEST\.ts at its root or in Bad/"):
        zoo_data.make_builder("uea", data_dir, dataset="Bad", base_url=f"{url}/uea")
    assert not os.path.exists(os.path.join(data_dir, "downloads"))
    assert uea._zip_members("Bad", ["Bad/Bad_TRAIN.ts", "Bad_TEST.ts"]) == {
        "Bad/Bad_TRAIN.ts": "Bad_TRAIN.ts", "Bad_TEST.ts": "Bad_TEST.ts"}


def test_uea_archive_with_a_malformed_ts_is_not_cached(server, tmp_path):
    """A zip that passes its CRCs but holds a .ts that does not parse: one line naming the member and
    line, nothing cached, so the next run fetches again (the bad files were cached and failed every run)."""
    url, handler = server
    bad = TS.format(name="Odd").replace("3,2,1:6,5,4:b", "3,2,1:6,5:b")   # dimensions of different lengths
    handler.files["/uea/Odd.zip"] = _zip({"Odd_TRAIN.ts": bad.encode(), "Odd_TEST.ts": TS.format(name="Odd").encode()})
    data_dir = str(tmp_path / "data")
    with pytest.raises(ValueError) as e:
        zoo_data.make_builder("uea", data_dir, dataset="Odd", base_url=f"{url}/uea")
    message = str(e.value)
    assert "\n" not in message and f"could not fetch {url}/uea/Odd.zip (Odd_TRAIN.ts, line 6: " in message, message
    assert str(tmp_path) not in message.split(";")[0], message   # the member, not a temporary path
    assert not os.path.exists(os.path.join(data_dir, "downloads"))
    handler.files["/uea/Odd.zip"] = _uea_zip("Odd", folder=False)   # fixed on the server: fetched again
    b = zoo_data.make_builder("uea", data_dir, dataset="Odd", base_url=f"{url}/uea")
    assert b.builder_config.dataset == "Odd"


def test_a_bad_file_in_the_uea_cache_names_what_to_delete(tmp_path):
    data_dir = tmp_path / "data"
    folder = data_dir / "downloads" / "uea" / "Odd"
    folder.mkdir(parents=True)
    (folder / "Odd_TRAIN.ts").write_text(TS.format(name="Odd").replace("3,2,1:6,5,4:b", "3,2,1:6,5:b"))
    (folder / "Odd_TEST.ts").write_text(TS.format(name="Odd"))
    with pytest.raises(ValueError) as e:
        zoo_data.make_builder("uea", str(data_dir), dataset="Odd", base_url="")
    assert str(e.value).startswith(f"{folder / 'Odd_TRAIN.ts'}, line 6: "), e.value
    assert str(e.value).endswith(f"; {folder} is in the download cache: delete it and {folder}.zip to fetch Odd "
                                 "again"), e.value


def _ett_csv(rows: int) -> bytes:
    start = np.datetime64("2016-07-01T00:00")
    values = np.round(np.sin(np.arange(rows)[:, None] * 0.01 + np.arange(7)), 3)
    lines = [forecasting.ETT_HEADER] + [
        f"{str(start + np.timedelta64(i, 'h')).replace('T', ' ')}:00," + ",".join(map(str, v))
        for i, v in enumerate(values)]
    return ("\n".join(lines) + "\n").encode()


def _ett_row_changed(rows: int, row: int, change) -> bytes:
    """`_ett_csv(rows)` with its data row `row` (0 = the first after the header) replaced by `change(row)`."""
    lines = _ett_csv(rows).decode().split("\n")
    lines[row + 1] = change(lines[row + 1])
    return "\n".join(lines).encode()


def test_ett_fetched_into_csv_dir_on_first_use(server, tmp_path):
    url, handler = server
    handler.files["/ett/ETTh2.csv"] = _ett_csv(sum(forecasting._ETT_HOUR_ROWS))
    from zoo_core.configs.samovar import ett
    c = ett.get_config(f"smoke,dataset=ETTh2,csv_dir={tmp_path / 'ETT-small'}")
    options = {**c.data.options.to_dict(), "base_url": f"{url}/ett"}
    builder = zoo_data.check_options("forecasting", str(tmp_path / "data"), options)
    assert _listing(tmp_path / "ETT-small") == ["ETTh2.csv"]
    builder.download_and_prepare()
    assert builder.info.metadata["columns"] == forecasting.ETT_HEADER.split(",")[1:]
    del handler.files["/ett/ETTh2.csv"]   # present: not fetched again
    zoo_data.check_options("forecasting", str(tmp_path / "data"), options)


@pytest.mark.parametrize("body, reason", [
    (_ett_csv(100), "ETTh1.csv has 100 rows; the ETT split uses 14400"),
    (b"a,b\n1,2\n", "does not start with the ETT header"),
    (_ett_csv(14400)[:-5], "ends in the middle of a line"),
    # Well-formed, but every run would fail on it (it was cached, and read again by every run).
    (_ett_row_changed(14400, 5, lambda row: row.split(",")[0] + ",nan," + ",".join(row.split(",")[2:])),
     "1 NaN/inf value(s) in ETTh1.csv, first in column 'HUFL' at data row 5"),
    (_ett_row_changed(14400, 5, lambda row: row.replace("2016-07", "2016-06")),
     "the 'date' column of ETTh1.csv goes back in time at data row 5"),
], ids=["short", "header", "cut", "nan", "backwards"])
def test_ett_bad_download_leaves_nothing(body, reason, server, tmp_path):
    url, handler = server
    handler.files["/ett/ETTh1.csv"] = body
    from zoo_core.configs.samovar import ett
    c = ett.get_config(f"smoke,csv_dir={tmp_path / 'ETT-small'}")
    options = {**c.data.options.to_dict(), "base_url": f"{url}/ett"}
    with pytest.raises(ValueError) as e:
        zoo_data.check_options("forecasting", str(tmp_path / "data"), options)
    assert "\n" not in str(e.value) and reason in str(e.value)
    assert str(e.value).endswith(f"put ETTh1.csv (ETDataset's ETT-small) in {tmp_path / 'ETT-small'} "
                                 "(or pass --config.data.options.source=PATH)")
    assert not (tmp_path / "ETT-small").exists()


def test_uea_smoke_reads_its_own_data_set_through_the_users_data_options(server, tmp_path, monkeypatch, capsys):
    """A `:smoke` run of a data set that is not shipped trains on that data set, fetched from the mirror
    into the data dir the user gives, as the full run does; it never swaps the data set (it trained on
    JapaneseVowels instead, ignoring both options, when the default URL was unreachable)."""
    url, handler = server
    handler.files["/mirror/Heartbeat.zip"] = _uea_zip("Heartbeat", folder=True)
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "default"))
    from zoo_core.configs.agf import uea as uea_config
    c = uea_config.get_config("dataset=Heartbeat,smoke")
    assert c.data.options.dataset == "Heartbeat" and capsys.readouterr().err == ""
    options = {**c.data.options.to_dict(), "base_url": f"{url}/mirror"}
    data_dir = tmp_path / "mine"
    builder = zoo_data.check_options("uea", str(data_dir), options)
    assert builder.builder_config.dataset == "Heartbeat"
    assert _listing(data_dir / "downloads" / "uea") == ["Heartbeat.zip", "Heartbeat/Heartbeat_TEST.ts",
                                                        "Heartbeat/Heartbeat_TRAIN.ts"]
    assert not (tmp_path / "default").exists()
    # Offline and not cached, the smoke run stops on its own data set with the fetch's one line.
    monkeypatch.setenv(fetch.ENV_OFFLINE, "1")
    with pytest.raises(ValueError, match=r"^uea: Heartbeat is not shipped .* could not fetch .*Heartbeat.zip") as e:
        zoo_data.check_options("uea", str(tmp_path / "other"), options)
    # The line named 11 unrelated data sets that an installed sktime shipped (485 characters).
    words = str(e.value).replace(f"{url}/mirror/Heartbeat.zip", "URL").replace(str(tmp_path / "other"), "DIR")
    assert len(words) < 250, words


def test_lra_archive_fetched_then_prepared(server, tmp_path, capsys):
    from tests.zoo_core.data.lra_prepare_test import lra_release
    from zoo_core.data import lra_prepare
    url, handler = server
    handler.files["/lra/lra_release.gz"] = open(lra_release(tmp_path / "a.gz"), "rb").read()
    out, data_dir = tmp_path / "lra", tmp_path / "data"
    argv = ["--archive", f"{url}/lra/lra_release.gz", "--out", str(out), "--data_dir", str(data_dir)]
    assert lra_prepare.main(argv) == 0
    assert _listing(data_dir / "downloads") == ["lra/lra_release.gz"]
    assert sorted(os.listdir(out)) == ["listops", "pathfinder", "retrieval"]
    # A truncated download: one line, nothing in the cache or the output folder.
    handler.files["/lra/cut.gz"] = handler.files["/lra/lra_release.gz"]
    handler.truncated["/lra/cut.gz"] = len(handler.files["/lra/cut.gz"]) + 100
    argv = ["--archive", f"{url}/lra/cut.gz", "--out", str(tmp_path / "o2"), "--data_dir", str(data_dir)]
    capsys.readouterr()
    assert lra_prepare.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: could not fetch {url}/lra/cut.gz (truncated"), err
    assert _listing(data_dir / "downloads") == ["lra/lra_release.gz"] and not (tmp_path / "o2").exists()
    handler.truncated.clear()


def test_an_lra_download_cut_short_at_the_source_is_dropped_from_the_cache(server, tmp_path, capsys):
    """The server sends a cut archive whole (its Content-Length is the cut size): the download checks
    pass, the archive does not read. One line, removed from the cache, so the next run fetches it again
    (it was cached, and every run read the same cut file)."""
    from tests.zoo_core.data.lra_prepare_test import lra_release
    from zoo_core.data import lra_prepare
    url, handler = server
    whole = open(lra_release(tmp_path / "a.gz"), "rb").read()
    handler.files["/lra/lra_release.gz"] = whole[:len(whole) // 2]
    out, data_dir = tmp_path / "lra", tmp_path / "data"
    argv = ["--archive", f"{url}/lra/lra_release.gz", "--out", str(out), "--data_dir", str(data_dir)]
    capsys.readouterr()
    assert lra_prepare.main(argv) == 2
    err = capsys.readouterr().err
    cached = data_dir / "downloads" / "lra" / "lra_release.gz"
    assert err.count("\n") == 1 and err.startswith(f"error: {cached}: not a readable tar archive ("), err
    assert err.endswith("; removed it from the download cache (the next run fetches it again)\n"), err
    assert _listing(data_dir / "downloads") == []
    assert not out.exists() or os.listdir(out) == []
    handler.files["/lra/lra_release.gz"] = whole
    assert lra_prepare.main(argv) == 0
    assert sorted(os.listdir(out)) == ["listops", "pathfinder", "retrieval"]


def test_download_command_fetches_ahead(server, tmp_path, capsys):
    from zoo_core.data import download
    url, handler = server
    handler.files["/uea/Toy.zip"] = _uea_zip("Toy", folder=False)
    handler.files["/ett/ETTh1.csv"] = _ett_csv(sum(forecasting._ETT_HOUR_ROWS))
    data_dir = str(tmp_path / "data")
    assert download.main(["uea", "Toy", "Nope", "--data_dir", data_dir, "--base_url", f"{url}/uea"]) == 2
    out, err = capsys.readouterr()
    assert out.strip() == f"Toy: {os.path.join(data_dir, 'downloads', 'uea', 'Toy')}"
    assert err.count("\n") == 1 and err.startswith("error: Nope: ") and "HTTP 404" in err
    assert download.main(["ett", "ETTh1", "--data_dir", data_dir, "--base_url", f"{url}/ett"]) == 0
    assert _listing(os.path.join(data_dir, "ETT-small")) == ["ETTh1.csv"]
    # What the runs then read, with the network gone.
    del handler.files["/uea/Toy.zip"], handler.files["/ett/ETTh1.csv"]
    assert zoo_data.make_builder("uea", data_dir, dataset="Toy").builder_config.dataset == "Toy"


@pytest.mark.parametrize("flag, under, expected", [
    ("--data_dir", "", "is an existing file; expected a directory"),
    ("--data_dir", "/sub", "is a file, so no directory can be made under it"),
    ("--csv_dir", "", "is an existing file; expected a directory"),
    ("$ZOO_DATA_DIR", "", "is an existing file; expected a directory"),
])
def test_download_into_a_file_is_one_error_line(flag, under, expected, tmp_path, capsys, monkeypatch):
    """A file given as the data folder: one line saying it is a file, exit 2 (each data set's fetch
    error advised putting the data in a folder under that file)."""
    from zoo_core.data import download
    (tmp_path / "file").write_text("")
    path = f"{tmp_path / 'file'}{under}"
    argv = ["ett", "ETTh1"] + ([] if flag.startswith("$") else [flag, path])
    if flag.startswith("$"):
        monkeypatch.setenv("ZOO_DATA_DIR", path)
    with pytest.raises(SystemExit) as e:
        download.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: {flag} {path!r} ") and expected in err, err
    assert sorted(os.listdir(tmp_path)) == ["file"]
