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
from zoo_core.data import fetch, uea

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
    assert not cache.exists() or _listing(cache) == []
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
    assert _listing(os.path.join(data_dir, "downloads")) == []
    assert uea._zip_members("Bad", ["Bad/Bad_TRAIN.ts", "Bad_TEST.ts"]) == {
        "Bad/Bad_TRAIN.ts": "Bad_TRAIN.ts", "Bad_TEST.ts": "Bad_TEST.ts"}
