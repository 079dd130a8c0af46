"""Downloads of the data sets the configs need: verified before anything lands in the cache.

`fetch(url, dest_dir)` downloads `url` into a hidden temporary file inside `dest_dir`, checks it (the
byte count against the server's Content-Length, a zip archive's CRCs, the expected member files, the
SHA-256 where one is published) and only then renames it into place, atomically: an interrupted,
truncated or damaged download leaves nothing under its final name, and the temporary file is removed.
A file already in place is used as it is (it was verified when it was stored).

The cache folder is `downloads/` under the data dir (`data.data_dir`, else $ZOO_DATA_DIR, else
~/.cache/linear_attention_zoo; see `downloads_dir`), one sub-folder per source (`uea/`, `ETT-small/`, ...).

Every failure, offline included, is a `FetchError` (a ValueError) of one line:
`could not fetch <URL> (<reason>); put <files> in <folder> (or pass source_dir=DIR)`, which the
training commands print as `error: ...`. Setting $ZOO_OFFLINE=1 makes every fetch fail at once with
that line (no connection is tried), for machines without network and for tests.

Only the standard library is used (urllib, zipfile, hashlib); no new dependency.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import socket
import tempfile
import urllib.error
import urllib.request
import zipfile
from typing import Callable, Optional

from absl import logging

DOWNLOADS = "downloads"
ENV_OFFLINE = "ZOO_OFFLINE"
TIMEOUT_S = 60.0
_BLOCK = 1 << 20


class FetchError(ValueError):
    """A download that did not reach the cache; the message is one line saying what to do instead.

    The data sets re-raise it as a plain ValueError, whose line the training commands print as it is
    (they prefix the type name of any other exception)."""


def downloads_dir(data_dir: Optional[str] = None) -> str:
    """The download cache: `<data dir>/downloads` (data dir as `pipeline.resolve_data_dir`)."""
    from zoo_core.data import pipeline  # pipeline imports grain; only needed here
    return os.path.join(pipeline.resolve_data_dir(data_dir), DOWNLOADS)


def offline() -> bool:
    """True when $ZOO_OFFLINE is set to anything but '', '0' or 'false'."""
    return os.environ.get(ENV_OFFLINE, "").strip().lower() not in ("", "0", "false")


def one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _reason(error: BaseException) -> str:
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    if isinstance(error, urllib.error.URLError):
        return one_line(error.reason)
    if isinstance(error, http.client.IncompleteRead):
        return f"truncated download: the connection closed after {len(error.partial)} more bytes"
    if isinstance(error, (socket.timeout, TimeoutError)):
        return "timed out"
    return one_line(f"{type(error).__name__}: {error}")


def check_zip(path: str, expect: Optional[Callable[[list[str]], None]] = None) -> list[str]:
    """The member names of zip archive `path` after checking every member's CRC and, with `expect`,
    the names (`expect(names)` raises ValueError saying what is missing).

    Raises:
      ValueError: not a zip archive, a damaged member, or `expect`'s complaint.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
            names = archive.namelist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as e:
        raise ValueError(f"not a readable zip archive: {one_line(e)}") from None
    if bad is not None:
        raise ValueError(f"damaged zip archive: member {bad!r} fails its CRC check")
    if expect is not None:
        expect(names)
    return names


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def fetch(url: str, dest_dir: str, *, name: Optional[str] = None, sha256: Optional[str] = None,
          expect: Optional[Callable[[str], None]] = None, put: str = "",
          timeout: float = TIMEOUT_S) -> str:
    """Downloads `url` to `dest_dir/name` (default: the URL's last path part) unless it is there.

    Args:
      url: what to download (http, https or file URL).
      dest_dir: the cache folder; made if missing.
      name: the file name in `dest_dir`.
      sha256: the published checksum (hex), checked when given.
      expect: called with the temporary file's path after the byte count and checksum checks; raises
        ValueError (one line) when the content is not what the caller needs. A '.zip' name is checked
        as a zip archive (every CRC) before `expect`.
      put: what to do without the download, the part of the message after ';' (default: put <name>
        in <dest_dir>).
      timeout: seconds a connection or read may wait.

    Returns:
      The path of the verified file.

    Raises:
      FetchError: one line, `could not fetch <url> (<reason>); <put>`; nothing is left in `dest_dir`.
    """
    name = name or os.path.basename(url.split("?")[0].rstrip("/")) or "download"
    path = os.path.join(dest_dir, name)
    put = put or f"put {name} in {dest_dir}"
    if os.path.isfile(path):
        return path

    def fail(reason: str) -> FetchError:
        return FetchError(f"could not fetch {url} ({reason}); {put}")

    if offline():
        raise fail(f"offline: ${ENV_OFFLINE} is set")
    made = _missing_folders(dest_dir)
    try:
        os.makedirs(dest_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=dest_dir)
    except OSError as e:
        raise fail(f"cannot write the cache folder: {one_line(e)}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                request = urllib.request.Request(url, headers={"User-Agent": "linear-attention-zoo"})
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    expected = response.headers.get("Content-Length")
                    # Once the server answers: without network the error line is all that is printed.
                    logging.info("fetching %s%s into %s", url,
                                 f" ({int(expected):,} bytes)" if (expected or "").isdigit() else "", dest_dir)
                    received = 0
                    for block in iter(lambda: response.read(_BLOCK), b""):
                        out.write(block)
                        received += len(block)
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
                raise fail(_reason(e)) from None
        if expected is not None and expected.isdigit() and received != int(expected):
            raise fail(f"truncated download: {received} of {int(expected)} bytes")
        if received == 0:
            raise fail("the server sent an empty file")
        if sha256 is not None and sha256_of(tmp) != sha256.lower():
            raise fail(f"SHA-256 {sha256_of(tmp)[:16]}... differs from the published {sha256[:16]}...")
        try:
            if name.endswith(".zip"):
                check_zip(tmp)
            if expect is not None:
                expect(tmp)
        except ValueError as e:
            raise fail(one_line(e)) from None
        os.replace(tmp, path)
        logging.info("fetched %s (%d bytes, checked)", path, received)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        for folder in made:   # the folders this call made, innermost first, if still empty
            try:
                os.rmdir(folder)
            except OSError:
                break
        raise
    return path


def _missing_folders(folder: str) -> list[str]:
    """`folder` and its missing parents, innermost first (what `os.makedirs(folder)` would make)."""
    missing = []
    folder = os.path.abspath(folder)
    while folder and not os.path.exists(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return missing


def extract(archive: str, dest: str, members: dict[str, str]) -> str:
    """Extracts zip members into the new folder `dest`, atomically: `members` maps a member name to
    its file name in `dest`; they are written into a temporary sibling folder that is then renamed.

    Returns:
      `dest`.
    """
    if os.path.isdir(dest):
        return dest
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", suffix=".part", dir=parent)
    try:
        with zipfile.ZipFile(archive) as z:
            for member, out_name in members.items():
                with z.open(member) as src, open(os.path.join(tmp, out_name), "wb") as out:
                    shutil.copyfileobj(src, out, _BLOCK)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isdir(dest):   # another process's extraction won the race: use it
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
