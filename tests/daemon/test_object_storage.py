"""Datasets in object storage, against a real S3-compatible server (moto) on loopback.

Failures are made by a real HTTP proxy in front of it (tools/http_proxy.py),
which also counts the requests that reach the store."""

from __future__ import annotations

import hashlib
import logging
import pickle
import re
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefetchd.buffer_protocol import read_status
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.dataset import scan_class_folders
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources import SampleReader, open_dataset
from prefetchd import locations
from prefetchd.throttle import Throttle
from prefetchd.daemon.sources.objects import cache_entry, list_class_folders
from prefetchd.daemon.sources.storage import FsspecStorage, StorageDenied, StorageUnavailable, storage_for
from tests.conftest import load_tool
from tests.waiting import wait_for

# -- reads ------------------------------------------------------------------------------


def test_whole_and_range_reads(s3: Any) -> None:
    s3.fs.pipe_file(f"{s3.bucket}/d/shard-0.tar", b"0123456789")
    storage = storage_for(s3.url("d"))
    assert isinstance(storage, FsspecStorage)
    assert bytes(storage.read("shard-0.tar")) == b"0123456789"
    assert bytes(storage.read("shard-0.tar", 2, 3)) == b"234"
    assert isinstance(storage.read("shard-0.tar", 9, 1), bytearray)
    with pytest.raises(OSError, match=rf"^{s3.url('d')}/shard-0.tar is 10 bytes, too short for the 5 bytes at "
                                      r"byte 8 that were to be read; it was cut short"):
        storage.read("shard-0.tar", 8, 5)
    with pytest.raises(OSError, match=rf"^{s3.url('d')}/shard-0.tar is 10 bytes, too short for the 5 bytes at byte 12"):
        storage.read("shard-0.tar", 12, 5)  # past the end: no bytes come back, so its size is asked
    with pytest.raises(FileNotFoundError):
        storage.read("shard-1.tar")


def test_storage_pickles_as_its_url_and_reopens_in_the_new_process(s3: Any) -> None:
    s3.fs.pipe_file(f"{s3.bucket}/d/x.jpg", b"abc")
    storage = storage_for(s3.url("d/"))
    assert isinstance(storage, FsspecStorage) and storage.url == s3.url("d")
    clone = pickle.loads(pickle.dumps(storage))
    assert clone._fs is None  # no event loop or connection crossed over
    assert bytes(clone.read("x.jpg")) == b"abc"
    assert clone.fs is not storage.fs


def test_unknown_protocols_name_themselves() -> None:
    with pytest.raises(DatasetError, match="nosuchproto://x/y: unknown protocol 'nosuchproto'"):
        open_dataset("nosuchproto://x/y")


@pytest.mark.parametrize("url", ["ftp://nohost.invalid/data", "http://nohost.invalid/data"])
def test_a_host_that_does_not_resolve_is_a_dataset_error(url: str, fast_retries: None) -> None:
    """ftp:// connects as its filesystem is made, and aiohttp says a name that does not resolve as a
    ClientConnectorDNSError: both came out raw (socket.gaierror, ...), so a daemon given such a job died, and again
    at every restart on the same job.json (a review)."""
    with pytest.raises(DatasetError, match=rf"^cannot reach {re.escape(url)}.*still failing after 6 tries \("
                                           r"(gaierror|ClientConnectorDNSError)"):
        open_dataset(url)


# -- errors that say what to do ---------------------------------------------------------


def test_a_missing_bucket_is_named(s3: Any) -> None:
    with pytest.raises(DatasetError, match=r"s3://no-such-bucket-9f3/p: bucket 'no-such-bucket-9f3' does not exist"):
        open_dataset("s3://no-such-bucket-9f3/p")


def test_a_missing_prefix_is_named(s3: Any) -> None:
    s3.fs.pipe_file(f"{s3.bucket}/other/a/x.jpg", b"x")
    url = s3.url("imagenet")
    with pytest.raises(DatasetError, match=rf"{url}: nothing is stored under this prefix; check the URL"):
        open_dataset(url)


def test_a_prefix_without_class_folders_is_named(s3: Any) -> None:
    s3.fs.pipe_file(f"{s3.bucket}/flat/x.jpg", b"x")
    with pytest.raises(DatasetError, match=rf"{s3.url('flat')} has no class folders"):
        open_dataset(s3.url("flat"))


def test_missing_credentials_say_where_credentials_come_from(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    s3.fs.pipe_file(f"{s3.bucket}/d/a/x.jpg", b"x")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(DatasetError, match=r"no credentials found for s3://.*AWS_ACCESS_KEY_ID and "
                                           r"AWS_SECRET_ACCESS_KEY.*standard environment"):
        open_dataset(s3.url("d"))


@pytest.mark.parametrize("status, code", [(400, "ExpiredToken"), (400, "TokenRefreshRequired"),
                                          (400, "RequestExpired"), (403, "ExpiredTokenException")])
def test_expired_credentials_are_said_as_expired_not_denied(s3: Any, proxy: Any, status: int, code: str) -> None:
    """S3 answers 400 ExpiredToken when temporary credentials ran out; s3fs raises it as PermissionError,
    which read as "access denied": the user checked the bucket policy instead of refreshing the token."""
    s3.fs.pipe_file(f"{s3.bucket}/d/x.jpg", b"abc")
    storage = FsspecStorage(s3.url("d"))
    storage.read("x.jpg")  # connected
    before = proxy.count("GET object")
    proxy.error, proxy.fail_next = (status, code, "The provided token has expired."), 1000
    with pytest.raises(StorageDenied) as raised:
        storage.read("x.jpg")
    message = str(raised.value)
    assert message.startswith(f"{s3.url('d')}: the temporary credentials expired ({code}: The provided token has "
                              "expired.); refresh them"), message
    assert "access denied" not in message and "restart the daemon" in message, message
    assert proxy.count("GET object") - before == 1  # not retried: the same credentials stay expired


def test_an_invalid_session_token_is_a_credentials_problem_not_a_bad_sample(s3: Any, proxy: Any) -> None:
    """InvalidToken (a session token that is not the key's, or cut short) was raised as EINVAL, which a
    worker takes for the sample's fault: every sample was replaced until the job stopped as bad data."""
    s3.fs.pipe_file(f"{s3.bucket}/d/x.jpg", b"abc")
    storage = FsspecStorage(s3.url("d"))
    storage.read("x.jpg")
    proxy.error, proxy.fail_next = (400, "InvalidToken", "The provided token is malformed or otherwise invalid."), 1
    with pytest.raises(StorageDenied, match=rf"^{s3.url('d')}: the session token is not valid \(InvalidToken"):
        storage.read("x.jpg")


# -- retries ----------------------------------------------------------------------------


@pytest.fixture
def retry_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process's retry lines as if none had been logged yet (another test's would hold them back)."""
    monkeypatch.setattr(locations, "_retry_log", Throttle(locations.RETRY_LOG_SECONDS))


def test_transient_errors_are_retried_with_backoff(s3: Any, proxy: Any, fast_retries: None, retry_log: None,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    s3.fs.pipe_file(f"{s3.bucket}/d/x.jpg", b"abc")
    storage = FsspecStorage(s3.url("d"))
    storage.read("x.jpg")  # connected
    before = proxy.count("GET object")
    proxy.fail_next = 3
    with caplog.at_level(logging.WARNING):
        assert bytes(storage.read("x.jpg", 1, 2)) == b"bc"
    assert proxy.count("GET object") - before == 4  # three 503s, then the answer
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 1 and "Please reduce your request rate.; retry 1 of 5" in retries[0], retries


def test_an_outage_logs_one_retry_line_per_interval_and_counts_the_rest(
    s3: Any, proxy: Any, fast_retries: None, retry_log: None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    """Every read in flight retries at once in an outage: a line for each was hundreds a minute."""
    monkeypatch.setattr(locations, "_retry_log", Throttle(1.0))
    for k in range(8):
        s3.fs.pipe_file(f"{s3.bucket}/o/{k}.jpg", b"x")
    storage = FsspecStorage(s3.url("o"))
    storage.read("0.jpg")  # connected
    proxy.fail_next = 1000
    reader = ThreadPoolExecutor(8)
    with caplog.at_level(logging.WARNING):
        failed = [f.exception() for f in [reader.submit(storage.read, f"{k}.jpg") for k in range(8)]]
        assert all(isinstance(e, StorageUnavailable) for e in failed)  # 8 reads x 5 retries each
        time.sleep(1.0)
        proxy.fail_next = 1
        storage.read("0.jpg")
    reader.shutdown()
    retries = [r.getMessage() for r in caplog.records if "; retry " in r.getMessage()]
    assert 2 <= len(retries) <= 4, retries  # the outage's first, a late one (more only on a very slow machine)
    assert "other retries of this process since the last such line, not logged" in retries[-1], retries


def test_a_store_that_keeps_failing_gives_up_with_a_clear_error(s3: Any, proxy: Any, fast_retries: None) -> None:
    s3.fs.pipe_file(f"{s3.bucket}/d/x.jpg", b"abc")
    storage = FsspecStorage(s3.url("d"))
    proxy.fail_next = 1000
    with pytest.raises(StorageUnavailable, match=rf"reading {s3.url('d')}/x.jpg: still failing after 6 tries"):
        storage.read("x.jpg")


def test_an_outage_at_start_is_an_error(s3: Any, proxy: Any, fast_retries: None) -> None:
    s3.fs.pipe_file(f"{s3.bucket}/d/a/x.jpg", b"x")
    proxy.fail_next = 1000
    with pytest.raises(DatasetError, match=rf"cannot reach {s3.url('d')} .*still failing after 6 tries.*is the "
                                           r"object store reachable at http://127\.0\.0\.1:\d+ \(AWS_ENDPOINT_URL\)"):
        open_dataset(s3.url("d"))


def test_missing_objects_are_not_retried(s3: Any, proxy: Any) -> None:
    s3.fs.pipe_file(f"{s3.bucket}/d/x.jpg", b"abc")
    storage = FsspecStorage(s3.url("d"))
    storage.read("x.jpg")
    before = sum(proxy.requests.values())
    with pytest.raises(FileNotFoundError):
        storage.read("gone.jpg")
    assert sum(proxy.requests.values()) - before == 1  # one GET: no HEAD before it, no retries


class StallingStore:
    """A loopback HTTP server that answers every request with 200, a 1000-byte length and 10 bytes of the
    body, then either stops sending (``trickle=None``) or sends one byte every ``trickle`` seconds: a store
    that hangs mid-body, and one too slow to ever finish."""

    def __init__(self, trickle: float | None = None) -> None:
        import socket

        self.trickle = trickle
        self.done = threading.Event()
        self.connections = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: Any) -> None:
        with conn:
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nContent-Type: image/jpeg\r\n\r\n"
                if request.startswith(b"HEAD"):  # the size, where s3fs asks for it first
                    conn.sendall(head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
                    return
                conn.sendall(head + b"x" * 10)
                while not self.done.wait(self.trickle or 1.0):
                    if self.trickle is not None:
                        conn.sendall(b"x")
            except OSError:
                return

    def stop(self) -> None:
        self.done.set()
        self.server.close()


@pytest.fixture
def short_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Object-storage timeouts of a second or two, and retries a hundredth as long apart."""
    monkeypatch.setattr(locations, "CONNECT_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(locations, "READ_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(locations, "SAMPLE_READ_SECONDS", 2.0)
    monkeypatch.setattr(locations, "RETRY_BASE_SECONDS", 0.01)
    monkeypatch.setattr(locations, "RETRY_MAX_SECONDS", 0.05)


@pytest.mark.parametrize("trickle", [None, 0.2], ids=["hangs", "trickles"])
def test_a_store_that_hangs_mid_body_fails_the_read_in_bounded_time(s3: Any, short_timeouts: None,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    trickle: float | None) -> None:
    """s3fs's defaults: 15 s without a byte ends a request, but nothing bounds a body that trickles in (a byte
    each 0.2 s: 1000 bytes in 200 s); a worker's reads hung there while the status said nothing."""
    store = StallingStore(trickle)
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.url)
    storage = FsspecStorage(f"s3://{s3.bucket}/d")
    reading = ThreadPoolExecutor(1)
    try:
        started = time.monotonic()
        read = reading.submit(storage.read, "x.jpg")
        # 6 tries of about 1 s (hangs) or 2 s (trickles): ~12 s, and over 40 s once under a full suite's load.  90 s
        # still tells the bound from none: the trickle alone takes 200 s, the hang forever.
        error = read.exception(timeout=90)
        assert isinstance(error, StorageUnavailable), error
        assert re.search(rf"reading s3://{s3.bucket}/d/x.jpg: still failing after 6 tries \((\w*Timeout\w*)", str(error)), error
        # Each try on a connection of its own, not the hung one again: at least 5 of the 6 (one reused would leave
        # 2 or 3).  Under a full suite's load a try may fail at its 1 s connect timeout and never reach the store:
        # 5 counted twice in full runs, after 10 s more for the accept thread.
        wait_for(lambda: store.connections >= 5, 10, f"5 connections to the store ({store.connections} so far)")
        assert time.monotonic() - started < 90
    finally:
        store.stop()
        reading.shutdown(wait=False, cancel_futures=True)


# -- class folders ----------------------------------------------------------------------


def test_class_folders_under_a_prefix_are_indexed_as_imagefolder_indexes_them(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "tree"
    names = ["a/2.jpg", "a/10.JPG", "a/sub/1.png", "a/sub-b/0.jpg", "a/notes.txt", "ab/x.webp", "b/deep/er/z.jpeg",
             "b/y.bmp", "b/Y.jpg"]
    for i, name in enumerate(names):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(b"x" * (i + 1))
    url = s3.upload(local, "tree")
    remote = list_class_folders(FsspecStorage(url))
    disk = scan_class_folders(local)
    assert remote.classes == disk.classes == ("a", "ab", "b")
    assert [remote.file(i) for i in range(len(remote))] == [disk.file(i) for i in range(len(disk))]
    np.testing.assert_array_equal(remote.labels, disk.labels)
    assert remote.root == url and remote.name(0) == f"{url}/{remote.file(0)}"
    reader = SampleReader(remote, readers=4)
    got = [bytes(f.result()) for f in reader.read_ahead(range(len(remote)))]
    assert got == [(local / remote.file(i)).read_bytes() for i in range(len(remote))]
    reader.close()
    # The fingerprint follows the objects' state.
    s3.fs.pipe_file(f"{s3.bucket}/tree/a/2.jpg", b"changed")
    assert list_class_folders(FsspecStorage(url)).fingerprint != remote.fingerprint


def test_the_index_is_cached_and_a_restart_does_not_list_again(s3: Any, proxy: Any, tmp_path: Path) -> None:
    for name in ("c0/a.jpg", "c0/b.jpg", "c1/c.jpg"):
        s3.fs.pipe_file(f"{s3.bucket}/cached/{name}", b"x")
    url, cache = s3.url("cached"), tmp_path / "index-cache"
    first = open_dataset(url, index_cache=cache)
    assert proxy.count("GET list") >= 3  # the prefix, then each class
    assert cache_entry(FsspecStorage(url), cache).is_file()
    listed = proxy.count("GET list")
    again = open_dataset(url, index_cache=cache)
    assert proxy.count("GET list") == listed, "a cached index must not list again"
    assert [again.file(i) for i in range(len(again))] == [first.file(i) for i in range(len(first))]
    assert again.fingerprint == first.fingerprint and again.classes == first.classes
    s3.fs.pipe_file(f"{s3.bucket}/cached/c1/d.jpg", b"x")
    assert len(open_dataset(url, index_cache=cache)) == 3  # stale on purpose: listing is what the cache saves
    assert len(open_dataset(url, index_cache=cache, refresh_index=True)) == 4
    assert proxy.count("GET list") > listed
    assert len(open_dataset(url, index_cache=cache)) == 4  # the refreshed index replaced the old one


@pytest.fixture
def other_s3(s3: Any) -> Iterator[Any]:
    """A second S3 server, in a process of its own (moto's stores are per process): the same bucket
    name as ``s3``'s, holding other objects, as staging and production or MinIO and AWS would."""
    import s3fs

    bench = load_tool("bench_s3")
    port = bench.free_port()
    with bench.serving([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port) as endpoint:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=endpoint)
        fs.mkdir(s3.bucket)
        yield type(s3)(endpoint, s3.bucket, fs)


def test_the_index_cache_keeps_one_entry_per_endpoint(s3: Any, other_s3: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a/0.jpg", "a/1.jpg", "b/2.jpg"):
        s3.fs.pipe_file(f"{s3.bucket}/ds/{name}", b"A")
    for name in ("x/0.jpg", "y/1.jpg", "z/2.jpg", "z/3.jpg"):
        other_s3.fs.pipe_file(f"{other_s3.bucket}/ds/{name}", b"BB")
    url, cache = s3.url("ds"), tmp_path / "cache"
    on_a = open_dataset(url, index_cache=cache)
    monkeypatch.setenv("AWS_ENDPOINT_URL", other_s3.endpoint)
    on_b = open_dataset(url, index_cache=cache)
    assert (on_a.classes, len(on_a)) == (("a", "b"), 3)
    assert (on_b.classes, len(on_b)) == (("x", "y", "z"), 4), "endpoint B was given endpoint A's cached index"
    assert on_b.fingerprint != on_a.fingerprint
    assert bytes(SampleReader(on_b).read(0)) == b"BB"
    assert len(list(cache.glob("objects-*.npz"))) == 2
    # Each endpoint's entry is used again (nothing relisted: B's data changed, its index did not),
    # AWS_ENDPOINT_URL_S3 is the more specific setting, as for botocore.
    other_s3.fs.pipe_file(f"{other_s3.bucket}/ds/z/4.jpg", b"BB")
    assert open_dataset(url, index_cache=cache).fingerprint == on_b.fingerprint
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    assert open_dataset(url, index_cache=cache).fingerprint == on_a.fingerprint
    # An entry whose stored endpoint is not this one's (a copied cache folder, a hash clash) is not used.
    entry_a = cache_entry(FsspecStorage(url), cache)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    entry_b = cache_entry(FsspecStorage(url), cache)
    assert entry_b != entry_a
    entry_b.write_bytes(entry_a.read_bytes())
    relisted = open_dataset(url, index_cache=cache)
    assert (relisted.classes, len(relisted)) == (("x", "y", "z"), 5)


def test_a_cached_index_whose_objects_are_gone_asks_for_a_refresh(s3: Any, tmp_path: Path) -> None:
    s3.fs.pipe_file(f"{s3.bucket}/gone/c0/a.jpg", b"x")
    url = s3.url("gone")
    open_dataset(url, index_cache=tmp_path)
    s3.fs.rm(f"{s3.bucket}/gone/c0/a.jpg")
    with pytest.raises(DatasetError, match=r"gone/c0/a.jpg in the cached index .* again with --refresh-index"):
        open_dataset(url, index_cache=tmp_path)


def test_pack_takes_the_index_cache_and_refresh_index_as_start_does(s3: Any, tmp_path: Path) -> None:
    """The stale-listing error asks for --refresh-index, so the command it stops must have it."""
    from click.testing import CliRunner

    from prefetchd.cli import main as cli_main

    for name in ("c0/a.jpg", "c0/b.jpg", "c1/c.jpg"):
        s3.fs.pipe_file(f"{s3.bucket}/stale/{name}", b"x")
    url, cache = s3.url("stale"), tmp_path / "cache"
    first = CliRunner().invoke(cli_main, ["pack", url, str(tmp_path / "p1"), "--index-cache", str(cache)])
    assert first.exit_code == 0, first.output
    assert cache_entry(FsspecStorage(url), cache).is_file()
    s3.fs.rm(f"{s3.bucket}/stale/c0/a.jpg")
    stale = CliRunner().invoke(cli_main, ["pack", url, str(tmp_path / "p2"), "--index-cache", str(cache)])
    assert stale.exit_code == 1 and "again with --refresh-index" in stale.output
    fresh = CliRunner().invoke(cli_main, ["pack", url, str(tmp_path / "p2"), "--index-cache", str(cache),
                                          "--refresh-index"])
    assert fresh.exit_code == 0, fresh.output
    assert "packed 2 samples" in fresh.output


# -- file lists and shards in object storage --------------------------------------------


def test_a_file_list_in_s3_names_objects_relative_to_its_folder_or_by_url(s3: Any, tmp_path: Path) -> None:
    for name, body in (("imgs/b1.jpg", b"b1"), ("imgs/a1.png", b"a1"), ("imgs/with, comma.jpg", b"wc")):
        s3.fs.pipe_file(f"{s3.bucket}/ds/{name}", body)
    s3.fs.pipe_file(f"{s3.bucket}/ds/train.csv",
                    f'path,label\nimgs/b1.jpg,dog\n{s3.url("ds/imgs/a1.png")},cat\n"imgs/with, comma.jpg",dog\n'.encode())
    index = open_dataset(s3.url("ds/train.csv"))
    assert index.root == s3.url("ds") and index.classes == ("cat", "dog") and index.labels.tolist() == [1, 0, 1]
    assert [index.file(i) for i in range(3)] == ["imgs/b1.jpg", "imgs/a1.png", "imgs/with, comma.jpg"]
    reader = SampleReader(index, readers=3)
    assert [bytes(f.result()) for f in reader.read_ahead(range(3))] == [b"b1", b"a1", b"wc"]
    reader.close()
    with pytest.raises(DatasetError, match=rf"file list {s3.url('ds/val.csv')} does not exist"):
        open_dataset(s3.url("ds/val.csv"))
    # Paths written from another folder: the way out named is one a bucket's list takes (it said "or absolute",
    # which such a list then refuses: a walk).
    s3.fs.pipe_file(f"{s3.bucket}/ds/lists/elsewhere.csv", b"train/imgs/b1.jpg,dog\ntrain/imgs/a1.png,cat\n")
    with pytest.raises(DatasetError, match=r"write them relative to it, or as URLs under it$"):
        open_dataset(s3.url("ds/lists/elsewhere.csv"))


def test_a_file_list_in_s3_takes_paths_as_find_writes_them_and_refuses_climbing_out(s3: Any, proxy: Any) -> None:
    """A key is a name: ``ds/./imgs/b1.jpg`` is not ``ds/imgs/b1.jpg``, so "./" (as `find .` writes
    paths) and "a/.." are normalised; "../" would leave the list's folder and is refused."""
    for name, body in (("imgs/b1.jpg", b"b1"), ("imgs/a1.png", b"a1"), ("imgs/ sp.jpg", b"sp")):
        s3.fs.pipe_file(f"{s3.bucket}/ds/{name}", body)
    s3.fs.pipe_file(f"{s3.bucket}/ds/train.csv",
                    b'./imgs/b1.jpg,dog\nimgs/x/../a1.png,cat\n"./imgs/ sp.jpg", dog\n')
    index = open_dataset(s3.url("ds/train.csv"))
    assert [index.file(i) for i in range(3)] == ["imgs/b1.jpg", "imgs/a1.png", "imgs/ sp.jpg"]
    assert index.labels.tolist() == [1, 0, 1]
    reader = SampleReader(index, readers=3)
    assert [bytes(f.result()) for f in reader.read_ahead(range(3))] == [b"b1", b"a1", b"sp"]
    reader.close()
    s3.fs.pipe_file(f"{s3.bucket}/ds/lists/val.csv", b"../imgs/b1.jpg,dog\n")
    with pytest.raises(DatasetError, match=rf"{s3.url('ds/lists/val.csv')}:1: \.\./imgs/b1.jpg climbs out of "
                                           rf"{s3.url('ds/lists')} with '\.\.'; .* put the list in a folder above"):
        open_dataset(s3.url("ds/lists/val.csv"))
    # An unknown header, found with a request for each of the first two paths and none for the rest.
    s3.fs.pipe_file(f"{s3.bucket}/ds/kaggle.csv", b"Image,Id\n" + b"imgs/b1.jpg,w1\n" * 50)
    before = proxy.count("HEAD"), proxy.count("GET list")
    with pytest.raises(DatasetError, match=r"kaggle\.csv:1: 'Image','Id' looks like a header"):
        open_dataset(s3.url("ds/kaggle.csv"))
    assert proxy.count("HEAD") - before[0] <= 2 and proxy.count("GET list") - before[1] <= 1


def test_shards_in_s3_are_read_with_one_ranged_get_per_sample(s3: Any, proxy: Any, tmp_path: Path,
                                                                make_image: Any, fast_retries: None) -> None:
    from prefetchd.daemon.sources.shards import pack, read_packed_from

    for k, name in enumerate(["a/1.jpg", "a/2.png", "b/3.jpg", "b/4.jpg", "c/5.png"]):
        make_image(tmp_path / "src" / name, seed=k)
    local = open_dataset(tmp_path / "src")
    assert pack(local, tmp_path / "packed", shard_size=2000)["shards"] > 1
    url = s3.upload(tmp_path / "packed", "packed")
    shards = open_dataset(url)
    assert shards.root == url and shards.member_files is not None
    assert shards.classes == local.classes and shards.labels.tolist() == local.labels.tolist()
    # The files packed, shown beside a sample that does not decode, are read from the index in the bucket.
    packed_from = read_packed_from(shards)
    assert packed_from is not None and shards.name(4, packed_from).endswith(f", packed from {local.name(4)})")
    reader, source = SampleReader(shards), SampleReader(local)
    before = dict(proxy.requests)
    got = [bytes(reader.read(i)) for i in range(len(shards))]
    assert got == [bytes(source.read(i)) for i in range(len(local))]
    assert proxy.count("GET object") - before.get("GET object", 0) == len(shards)
    assert proxy.count("HEAD") == before.get("HEAD", 0)

    # `prefetchd pack` from class folders in a bucket writes the shards a local copy gives.
    remote = open_dataset(s3.upload(tmp_path / "src", "src"))
    pack(remote, tmp_path / "from-s3", shard_size=2000)
    for tar in sorted((tmp_path / "packed").glob("shard-*.tar")):
        assert (tmp_path / "from-s3" / tar.name).read_bytes() == tar.read_bytes(), tar.name
    s3.fs.rm(f"{s3.bucket}/packed/shard-000001.tar")  # found missing from one listing, at start
    with pytest.raises(DatasetError,
                       match=rf"shard {url}/shard-000001\.tar, named by .*, is missing; restore it") as gone:
        open_dataset(url)
    # pack writes only to a local folder: the advice packs there and uploads, not `prefetchd pack ... s3://`.
    assert str(gone.value).endswith(
        "pack it again from the class folders or file list it was made from, into a local folder (`prefetchd pack "
        f"<that folder or list> <local folder> --force`), and upload that folder to {url}"), gone.value
    proxy.fail_next = 1000  # a store that keeps failing stops the pack instead of packing empty members
    with pytest.raises(DatasetError, match=r"cannot pack s3://.*still failing after 6 tries"):
        pack(remote, tmp_path / "outage", shard_size=2000)


def test_a_missing_bucket_is_named_whatever_the_layout(s3: Any) -> None:
    with pytest.raises(DatasetError, match=r"bucket 'no-such-bucket-9f3' does not exist"):
        open_dataset("s3://no-such-bucket-9f3/lists/train.csv")


# -- configuration ----------------------------------------------------------------------


def test_data_is_a_location_urls_stay_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert DaemonConfig(buffer=tmp_path, data="s3://bucket/prefix/").data == "s3://bucket/prefix"
    assert DaemonConfig(buffer=tmp_path, data="rel/data").data == str(tmp_path / "rel" / "data")
    assert DaemonConfig(buffer=tmp_path, data="~/x").data == str(Path.home() / "x")


# -- end to end -------------------------------------------------------------------------

SMALL = ["--batch-size", "16", "--image-size", "32", "--workers", "2", "--epochs", "2", "--seed", "5",
         "--high-water", "4", "--low-water", "2"]


def consume(buffer: Path, n: int) -> list[tuple[int, int, list[int], str]]:
    """Every batch of two epochs as (epoch, step, indices, digest of the images); each index once per epoch."""
    from prefetchd.trainer import BufferLoader

    loader = BufferLoader(buffer, normalize=False, timeout=120)
    batches = []
    for epoch in range(2):
        seen: list[int] = []
        for batch in loader:
            assert batch.epoch == epoch
            seen.extend(batch.indices.tolist())
            images = np.ascontiguousarray(batch.images.numpy())
            batches.append((batch.epoch, batch.step, batch.indices.tolist(), hashlib.sha256(images).hexdigest()))
        assert sorted(seen) == list(range(n)), f"epoch {epoch}: not every sample exactly once"
    loader.close()
    return batches


def test_a_daemon_serves_every_layout_from_s3_as_from_disk(s3: Any, proxy: Any, shapes_data: Path, shm_dir: Path,
                                                          tmp_path: Path, start_daemon: Any) -> None:
    """Class folders, a file list and shards in the bucket: every sample once per epoch, and the
    batches of the class folders on disk with the same seed."""
    data = shapes_data / "train"
    n = len(scan_class_folders(data))
    url = s3.upload(data, "shapes/train")
    local = start_daemon(shm_dir / "local", "--data", data, *SMALL)
    from_disk = consume(shm_dir / "local", n)
    assert local.wait_exit(60) == 0, local.log

    # Listed here, with the code a daemon lists with, and cached where daemons look for it.
    assert len(open_dataset(url + "/")) == n
    listed = proxy.count("GET list")
    assert listed >= 4  # the prefix, then each class

    # The daemon uses the cached index, and an outage (the store answers 503 to everything for
    # a while) delays batches but changes none: no sample is replaced for it.  Once it is
    # producing, with 2 reads in flight, 24 failures are more than the retries of the first
    # reads: their batch fails and is built again.  Other worker and reader counts give the
    # same batches.  (An outage while it starts stops it: test_an_outage_at_start_is_an_error.)
    again = start_daemon(shm_dir / "s3-again", "--data", url, *SMALL, "--workers", "1", "--readers", "2")
    again.wait_until(lambda: (shm_dir / "s3-again" / "manifest.json").exists(), 120, "the manifest")
    proxy.fail_next = 24
    notes: set[str] = set()  # the status messages while it runs: an outage is named there, not only counted
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            status = read_status(shm_dir / "s3-again")
            notes.add(status.message if status is not None else "")
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert consume(shm_dir / "s3-again", n) == from_disk
    finally:
        watching.set()
        watcher.join()
    assert any(m.startswith("retrying: batch ") and "is the object store reachable" in m for m in notes), notes
    assert again.wait_exit(60) == 0, again.log
    assert f"indexed {url} from the cache" in again.log and proxy.count("GET list") == listed, again.log
    assert proxy.fail_next == 0 and "Please reduce your request rate.; retry 1 of 5" in again.log
    # Logged by the workers as every line of the daemon is: time, level, logger (not logging's bare last resort).
    retry_lines = [line for line in again.log.splitlines() if "; retry " in line]
    assert retry_lines and all(re.match(r"\d{4}-\d\d-\d\d [\d:,]+ WARNING +prefetchd\.locations: reading s3://", line)
                               for line in retry_lines), retry_lines
    assert "still failing after 6 tries" in again.log and "retrying in 1 s" in again.log, again.log
    status = read_status(shm_dir / "s3-again")
    assert status is not None and status.production is not None
    assert status.production.errors.replaced_samples == 0, status.production.errors

    # A file list and packed shards in the bucket: the same batches again.
    from prefetchd.daemon.sources.shards import pack

    disk = scan_class_folders(data)
    rows = "".join(f"train/{disk.file(i)},{disk.classes[disk.labels[i]]}\n" for i in range(n))
    s3.fs.pipe_file(f"{s3.bucket}/shapes/train.csv", f"path,label\n{rows}".encode())
    assert pack(disk, tmp_path / "packed", shard_size=64 * 1024)["shards"] > 2
    packed = s3.upload(tmp_path / "packed", "shapes-packed")
    for name, location in (("list", s3.url("shapes/train.csv")), ("shards", packed)):
        daemon = start_daemon(shm_dir / name, "--data", location, *SMALL)
        assert consume(shm_dir / name, n) == from_disk, name
        assert daemon.wait_exit(60) == 0, daemon.log
        assert "readers = 16 (object storage)" in daemon.log


# -- the benchmark ----------------------------------------------------------------------


def test_bench_s3_runs_end_to_end() -> None:
    """tools/bench_s3.py on tiny objects (numbers not checked): its own moto and proxy processes."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from click.testing import CliRunner

    result = CliRunner().invoke(load_tool("bench_s3").main, ["--objects", "6", "--kib", "1", "--latency", "0,5",
                                                             "--readers", "1,3"])
    assert result.exit_code == 0, result.output
    rows = [ln.split() for ln in result.output.splitlines() if ln.strip().endswith(tuple("0123456789"))]
    assert [(r[0], r[1]) for r in rows[-4:]] == [("0ms", "1"), ("0ms", "3"), ("5ms", "1"), ("5ms", "3")], result.output


def test_a_deleted_prefix_makes_the_build_wait_as_an_unmounted_folder_does(s3: Any, shapes_data: Path,
                                                                           tmp_path: Path) -> None:
    """Every object gone (a prefix deleted, to be uploaded again) read as 16 missing samples in a row: the job
    stopped as bad data (exit 4, which the unit does not restart), where a local dataset gone waits (review).
    One object missing is still that sample's fault: it is replaced."""
    from prefetchd.daemon.fill import run_task
    from prefetchd.daemon.tasks import Filled, Task, WorkerJob, failure_of

    url = s3.upload(shapes_data / "train", "gone/train")
    index = open_dataset(url)
    size = 16
    slot = tmp_path / "batch.tmp"
    slot.write_bytes(bytes(size * size * 3))

    def build_first() -> object:
        return run_task(WorkerJob(index, np.arange(len(index), dtype=np.int64), size, False, 0),
                        Task(0, str(slot), 0, size * size * 3, 0, ((0, 0),)))

    s3.fs.rm(f"{s3.bucket}/gone/train/{index.file(0)}")
    replaced = build_first()
    assert isinstance(replaced, Filled) and replaced.slots[0][1] == 1, replaced
    s3.fs.rm(f"{s3.bucket}/gone", recursive=True)
    with pytest.raises(StorageUnavailable, match=rf"the dataset root {url} is gone or empty \(deleted\?\)") as raised:
        build_first()
    assert failure_of(0, raised.value).fatal is None  # retried, the job goes on
