"""Tests for the downloader, against a local HTTP server on 127.0.0.1 only.

The server runs in a thread, serves files from a temporary directory, honours
``Range: bytes=N-`` (unless told not to) and can cut a response short to
simulate an interrupted download. No test touches the network.
"""

import hashlib
import http.server
import json
import re
import threading
from pathlib import Path

import pytest

from driftlab.data.download import (
    NOT_DOWNLOADABLE,
    REGISTRY,
    ChecksumMismatchError,
    DownloadError,
    RemoteFile,
    dataset_names,
    download,
    file_checksum,
)
from driftlab.errors import ConfigError
from driftlab.owned_folder import MANIFEST_FILE


class _Server:
    """A tiny file server with Range support and fault injection, for one test."""

    def __init__(self, root: Path):
        self.root = root
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.ignore_range = False
        self.cut_after: int | None = None  # close the next response after this many body bytes
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # http.server's naming
                server.requests.append((self.path, self.headers.get("Range")))
                file = server.root / self.path.lstrip("/")
                if not file.is_file():
                    self.send_error(404, "Not Found")
                    return
                data = file.read_bytes()
                match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if match and not server.ignore_range:
                    start = int(match.group(1))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                    body = data[start:]
                else:
                    self.send_response(200)
                    body = data
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if server.cut_after is not None:
                    body, server.cut_after = body[: server.cut_after], None
                    self.close_connection = True
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """urllib honours *_proxy variables; requests to the local server must not leave the machine."""
    for variable in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    with _Server(root) as server:
        yield server


def _publish(server: _Server, name: str, content: bytes, algorithm="sha256") -> RemoteFile:
    (server.root / name).write_bytes(content)
    return RemoteFile(name, (server.url + name,), algorithm, hashlib.new(algorithm, content).hexdigest())


CONTENT = bytes(range(256)) * 1000  # 256,000 bytes


def test_download_verifies_and_renames(served, tmp_path):
    remote = _publish(served, "data.bin", CONTENT, "md5")
    other = _publish(served, "labels.bin", b"labels")
    paths = download("toy", tmp_path / "out", progress=False, registry={"toy": (remote, other)})
    assert [p.name for p in paths] == ["data.bin", "labels.bin"]
    assert paths[0].read_bytes() == CONTENT and not (tmp_path / "out" / "data.bin.part").exists()


def test_present_verified_file_is_not_fetched_again(served, tmp_path):
    remote = _publish(served, "data.bin", CONTENT)
    out = tmp_path / "out"
    download("toy", out, progress=False, registry={"toy": (remote,)})
    served.requests.clear()
    download("toy", out, progress=False, registry={"toy": (remote,)})
    assert served.requests == []


def test_resume_sends_range_and_appends_to_part(served, tmp_path):
    remote = _publish(served, "data.bin", CONTENT)
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.bin.part").write_bytes(CONTENT[:100_000])
    (path,) = download(
        "toy", out, progress=False, registry={"toy": (remote,)}, force=True
    )  # a .part not listed as ours
    assert served.requests == [("/data.bin", "bytes=100000-")]
    assert path.read_bytes() == CONTENT


def test_interrupted_download_keeps_part_and_rerun_resumes(served, tmp_path):
    remote = _publish(served, "data.bin", CONTENT)
    out = tmp_path / "out"
    served.cut_after = 70_000
    with pytest.raises(DownloadError) as info:
        download("toy", out, progress=False, registry={"toy": (remote,)})
    message = str(info.value)
    assert "data.bin" in message and served.url + "data.bin" in message
    assert "70000 bytes are kept" in message and "resume" in message and "driftlab data download toy" in message
    assert (out / "data.bin.part").stat().st_size == 70_000 and not (out / "data.bin").exists()
    (path,) = download("toy", out, progress=False, registry={"toy": (remote,)})
    assert served.requests[-1] == ("/data.bin", "bytes=70000-") and path.read_bytes() == CONTENT


def _download_over_a_part(served, tmp_path, part: bytes) -> Path:
    """The file, downloaded into a folder that already holds ``part`` as its .part (not listed as ours: force)."""
    remote = _publish(served, "data.bin", CONTENT)
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.bin.part").write_bytes(part)
    (path,) = download("toy", out, progress=False, registry={"toy": (remote,)}, force=True)
    return path


def test_server_ignoring_range_restarts_from_zero(served, tmp_path):
    served.ignore_range = True
    # a .part that would corrupt the file if appended to
    assert _download_over_a_part(served, tmp_path, b"x" * 5000).read_bytes() == CONTENT


def test_complete_part_answered_416_is_verified_and_kept(served, tmp_path):
    assert _download_over_a_part(served, tmp_path, CONTENT).read_bytes() == CONTENT


def test_checksum_mismatch_names_file_expected_actual_and_touches_nothing_else(served, tmp_path):
    good = _publish(served, "data.bin", CONTENT)
    bad = RemoteFile("data.bin", good.urls, "sha256", "0" * 64)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user file")
    with pytest.raises(ChecksumMismatchError) as info:
        download("toy", out, progress=False, registry={"toy": (bad,)})
    message = str(info.value)
    assert "data.bin" in message and "0" * 64 in message and hashlib.sha256(CONTENT).hexdigest() in message
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_FILE, "keep.txt"]  # only the corrupt .part was removed


def test_existing_file_with_wrong_checksum_is_reported_not_deleted(served, tmp_path):
    remote = _publish(served, "data.bin", CONTENT)
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.bin").write_bytes(b"something else")
    with pytest.raises(ChecksumMismatchError, match="left untouched"):
        download("toy", out, progress=False, registry={"toy": (remote,)})
    assert (out / "data.bin").read_bytes() == b"something else" and served.requests == []


def test_404_names_url_and_status_then_next_mirror_is_tried(served, tmp_path):
    remote = _publish(served, "data.bin", CONTENT)
    missing = RemoteFile("data.bin", (served.url + "missing.bin",), "sha256", remote.checksum)
    with pytest.raises(DownloadError, match=r"missing.bin: HTTP 404") as info:
        download("toy", tmp_path / "a", progress=False, registry={"toy": (missing,)})
    assert "retry" in str(info.value)
    mirrored = RemoteFile("data.bin", (served.url + "missing.bin", served.url + "data.bin"), "sha256", remote.checksum)
    (path,) = download("toy", tmp_path / "b", progress=False, registry={"toy": (mirrored,)})
    assert path.read_bytes() == CONTENT


def test_unreachable_server_is_a_download_error(tmp_path):
    with _Server(tmp_path) as server:
        url = server.url  # the port is closed once the server stops
    remote = RemoteFile("x.bin", (url + "x.bin",), "md5", "0" * 32)
    with pytest.raises(DownloadError, match="network error"):
        download("toy", tmp_path / "out", progress=False, registry={"toy": (remote,)}, timeout=5)


def test_progress_goes_to_stderr(served, tmp_path, capsys):
    remote = _publish(served, "data.bin", CONTENT)
    download("toy", tmp_path / "out", progress=True, registry={"toy": (remote,)})
    captured = capsys.readouterr()
    assert captured.out == "" and "data.bin" in captured.err and "100%" in captured.err


def test_unknown_and_not_downloadable_names(tmp_path):
    with pytest.raises(DownloadError, match="unknown data set 'imagenet'.*cifar10"):
        download("imagenet", tmp_path)
    with pytest.raises(DownloadError, match="LEAF"):
        download("femnist", tmp_path)
    assert not any(tmp_path.iterdir())


def test_registry_entries_are_well_formed():
    assert {"mnist", "fashion_mnist", "emnist", "cifar10", "cifar100", "shakespeare", "stackoverflow"} <= set(REGISTRY)
    assert not set(REGISTRY) & set(NOT_DOWNLOADABLE)
    assert dataset_names() == sorted(REGISTRY)
    for name, files in REGISTRY.items():
        assert len({f.filename for f in files}) == len(files), name
        for remote in files:
            assert all(url.endswith(remote.filename) or remote.filename == "input.txt" for url in remote.urls)
    # The names the loaders expect are the names downloaded.
    assert REGISTRY["cifar10"][0].filename == "cifar-10-binary.tar.gz"
    assert REGISTRY["cifar100"][0].filename == "cifar-100-binary.tar.gz"
    assert REGISTRY["emnist"][0].filename == "gzip.zip"


def test_remote_file_rejects_bad_checksums_and_schemes():
    with pytest.raises(ValueError, match="32 lower-case hex"):
        RemoteFile("a", ("https://example.org/a",), "md5", "abc")
    with pytest.raises(ValueError, match="http"):
        RemoteFile("a", ("file:///etc/passwd",), "md5", "0" * 32)


def test_file_checksum(tmp_path):
    (tmp_path / "f").write_bytes(CONTENT)
    assert file_checksum(tmp_path / "f", "md5") == hashlib.md5(CONTENT).hexdigest()


def test_a_users_file_of_a_name_it_would_write_is_refused_untouched_unless_forced(served, tmp_path):
    remote = _publish(served, "data.bin", CONTENT)
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.bin.part").write_bytes(
        b"the user's own notes"
    )  # not listed as driftlab's: never appended to or deleted
    with pytest.raises(ConfigError) as info:
        download("toy", out, progress=False, registry={"toy": (remote,)})
    assert str(info.value) == (
        f"{out} already holds data.bin.part, not written by driftlab (or changed since); nothing was written: "
        "choose another --to directory, or pass --force to replace it"
    )
    assert sorted(p.name for p in out.iterdir()) == ["data.bin.part"] and served.requests == []
    assert (out / "data.bin.part").read_bytes() == b"the user's own notes"
    # --force: the .part is taken over (resumed from its 20 bytes, so the checksum fails and the .part, now listed as
    # driftlab's, is deleted); then a rerun into what is now driftlab's own folder fetches the file whole
    with pytest.raises(ChecksumMismatchError):
        download("toy", out, progress=False, registry={"toy": (remote,)}, force=True)
    assert served.requests == [("/data.bin", "bytes=20-")] and not (out / "data.bin.part").exists()
    (path,) = download("toy", out, progress=False, registry={"toy": (remote,)})
    assert path.read_bytes() == CONTENT
    assert json.loads((out / MANIFEST_FILE).read_text())["files"] == {
        n: "driftlab data download" for n in ("data.bin", "data.bin.part")
    }


def test_data_download_command_refuses_with_the_fix_and_takes_force(served, tmp_path, monkeypatch, capsys):
    from driftlab import cli
    from driftlab.data import registry as data_sets

    remote = _publish(served, "data.bin", CONTENT)
    monkeypatch.setattr(data_sets, "downloads", lambda: {"toy": (remote,)})
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.bin.part").write_bytes(CONTENT[:1000])
    assert cli.main(["data", "download", "toy", "--to", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"driftlab: error: {out} already holds data.bin.part") and "--force" in error
    assert (out / "data.bin.part").read_bytes() == CONTENT[:1000]
    assert cli.main(["data", "download", "toy", "--to", str(out), "--force"]) == 0  # resumed from the 1000 bytes
    assert (out / "data.bin").read_bytes() == CONTENT and served.requests == [("/data.bin", "bytes=1000-")]
