"""What jobs of other users may name: JobPolicy on real paths and links, and the owner
the protocol reads from job.json.  (tests/integration/test_job_owner.py runs it with real users.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from prefetchd.buffer_protocol import VERSION, JobRequest, ProtocolError
from prefetchd.buffer_protocol.layout import JOB_NAME
from prefetchd.daemon.config import DaemonConfig, load_toml
from prefetchd.daemon.dataset import SampleIndex
from prefetchd.daemon.errors import ConfigError
from prefetchd.daemon.job_inbox import JobInbox
from prefetchd.daemon.job_policy import JobPolicy, check_files_inside
from prefetchd.daemon.sources.filelist import read_file_list
from prefetchd.locations import inside
from prefetchd.synthetic import make_shapes_dataset

OTHER = os.geteuid() + 4242  # a uid that is not the daemon's


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name in ("allowed/train/a", "allowed/train/b", "secret/train/a", "allowed2"):
        (tmp_path / "tree" / name).mkdir(parents=True)
    return tmp_path / "tree"


def policy(tree: Path, **own: object) -> JobPolicy:
    """The daemon's rules; its buffer, like a job's, is outside every dataset of ``tree``, as a buffer must be."""
    return JobPolicy.of(DaemonConfig(buffer=tree.parent / "bf", **own))  # type: ignore[arg-type]


def job(tree: Path, **settings: object) -> DaemonConfig:
    return DaemonConfig(buffer=tree.parent / "bf", **settings)  # type: ignore[arg-type]


def test_the_daemons_own_user_is_not_limited(tree: Path) -> None:
    assert policy(tree).confine(job(tree, data=str(tree / "secret"), transform="x.y:z"), os.geteuid())[1] is None


def test_by_default_another_users_job_may_name_no_data_and_no_hook(tree: Path) -> None:
    with pytest.raises(ConfigError) as data:
        policy(tree).confine(job(tree, data=str(tree / "allowed/train")), OTHER)
    assert "allowed_data" in str(data.value) and "none is set" in str(data.value) and f"uid {OTHER}" in str(data.value)
    with pytest.raises(ConfigError) as hook:
        policy(tree, allowed_data=(str(tree / "allowed"),)).confine(job(tree, data=str(tree / "allowed"), transform="x.y:z"), OTHER)
    assert "allowed_transforms" in str(hook.value) and "'x.y:z'" in str(hook.value)
    # Both at once are both said: the submitter who fixed the one named met the other next (a review).
    with pytest.raises(ConfigError) as both:
        policy(tree).confine(job(tree, data=str(tree / "allowed/train"), transform="x.y:z"), OTHER)
    said = str(both.value)
    assert said.count("job.json belongs to") == 1 and "its transform 'x.y:z' is not in allowed_transforms" in said
    assert "; and its data " in said and "is not inside a root of allowed_data (none is set)" in said, said


def test_hooks_are_allowed_by_exact_name_only(tree: Path) -> None:
    rules = policy(tree, allowed_transforms=("aug.ment:flip",), allowed_data=(str(tree / "allowed"),))
    assert rules.confine(job(tree, data=str(tree / "allowed"), transform="aug.ment:flip"), OTHER)[1] is not None
    for near in ("aug.ment:flop", "aug.ment:flip2", "aug:flip"):
        with pytest.raises(ConfigError, match="allowed_transforms"):
            rules.confine(job(tree, data=str(tree / "allowed"), transform=near), OTHER)


def test_data_must_resolve_inside_an_allowed_root(tree: Path) -> None:
    rules = policy(tree, allowed_data=(str(tree / "allowed"),))
    assert rules.confine(job(tree, data=str(tree / "allowed/train")), OTHER)[1] == (str(tree / "allowed"),)
    (tree / "allowed/escape").symlink_to(tree / "secret/train")
    refused = [str(tree / "allowed/escape"), str(tree / "allowed/train/../../secret/train"), str(tree / "allowed2"),
               str(tree)]
    for data in refused:
        with pytest.raises(ConfigError, match="allowed_data"):
            rules.confine(job(tree, data=data), OTHER)


def test_a_linked_allowed_root_is_compared_resolved(tree: Path) -> None:
    (tree / "link-to-allowed").symlink_to(tree / "allowed")
    rules = policy(tree, allowed_data=(str(tree / "link-to-allowed"),))
    assert rules.confine(job(tree, data=str(tree / "allowed/train")), OTHER)[1] == (str(tree / "allowed"),)


def test_a_confined_job_reads_its_data_by_the_path_that_was_checked(tree: Path) -> None:
    """A link the submitter owns, pointing into an allowed root at the check and at their own tree after it:
    the daemon opened ``data`` by the link again, and indexed and published whatever it pointed at then."""
    (tree / "mine").mkdir()
    (tree / "mine/flip").symlink_to(tree / "allowed/train")
    checked, roots = policy(tree, allowed_data=(str(tree / "allowed"),)).confine(
        job(tree, data=str(tree / "mine/flip")), OTHER)
    assert roots == (str(tree / "allowed"),) and checked.data == str(tree / "allowed/train")
    (tree / "mine/flip").unlink()
    (tree / "mine/flip").symlink_to(tree / "secret/train")
    assert os.path.realpath(checked.data) == str(tree / "allowed/train")
    # The daemon's own user and its own data are not confined: they run as given.
    own = job(tree, data=str(tree / "mine/flip"))
    assert policy(tree).confine(own, os.geteuid()) == (own, None)


def test_urls_are_allowed_by_whole_prefix_without_dot_segments(tree: Path) -> None:
    rules = policy(tree, allowed_data=("s3://bucket/data/", "http://127.0.0.1:8099/pub", str(tree / "allowed")))
    url_roots = ("s3://bucket/data", "http://127.0.0.1:8099/pub")  # as the config normalises them
    assert rules.confine(job(tree, data="s3://bucket/data/train"), OTHER)[1] == url_roots  # its files are checked too
    assert rules.confine(job(tree, data="s3://bucket/data"), OTHER)[1] == url_roots
    for data in ("s3://bucket/data2", "s3://bucket", "s3://other/data/train", "gs://bucket/data/train"):
        with pytest.raises(ConfigError, match="allowed_data"):
            rules.confine(job(tree, data=data), OTHER)
    # An HTTP client resolves them: under the root by prefix, outside it once fetched.
    for data in ("http://127.0.0.1:8099/pub/../priv/train", "http://127.0.0.1:8099/pub/%2e%2E/priv",
                 "http://127.0.0.1:8099/pub/./x/../../priv", "s3://bucket/data/../secret"):
        with pytest.raises(ConfigError, match="has a '.' or '..' segment"):
            rules.confine(job(tree, data=data), OTHER)


def test_a_refusal_does_not_say_where_a_link_points(tree: Path) -> None:
    """The daemon may resolve a link in a folder the submitter cannot read: its target is not theirs to learn."""
    (tree / "allowed2/hidden").symlink_to(tree / "secret/train")
    with pytest.raises(ConfigError, match="after resolving symbolic links") as refused:
        policy(tree, allowed_data=(str(tree / "allowed"),)).confine(job(tree, data=str(tree / "allowed2/hidden")), OTHER)
    assert str(tree / "secret") not in str(refused.value)


def test_the_daemons_own_data_and_hook_pass(tree: Path) -> None:
    rules = policy(tree, data=str(tree / "secret"), transform="x.y:z")
    assert rules.confine(job(tree, data=str(tree / "secret"), transform="x.y:z", seed=3), OTHER)[1] is None


def test_a_file_list_naming_files_outside_the_roots_is_refused(tmp_path: Path) -> None:
    make_shapes_dataset(tmp_path / "allowed", classes=2, train_per_class=2, val_per_class=1, seed=1)
    make_shapes_dataset(tmp_path / "secret", classes=2, train_per_class=2, val_per_class=1, seed=2)
    inner = sorted((tmp_path / "allowed/train").rglob("*.*"))
    outer = sorted((tmp_path / "secret/train").rglob("*.*"))
    roots = (str(tmp_path / "allowed"),)
    good = tmp_path / "allowed/good.csv"
    good.write_text("".join(f"{p},{p.parent.name}\n" for p in inner))
    check_files_inside(read_file_list(str(good)), str(good), roots)
    bad = tmp_path / "allowed/bad.csv"
    bad.write_text("".join(f"{p},{p.parent.name}\n" for p in inner + outer[:1]))
    with pytest.raises(ConfigError, match="allowed_data") as exc:
        check_files_inside(read_file_list(str(bad)), str(bad), roots)
    assert str(outer[0]) in str(exc.value) and str(exc.value).startswith(f"{bad}: sample file ")  # the list, named


def test_a_url_file_list_naming_objects_past_its_root_is_refused(tree: Path) -> None:
    """A list in a bucket names objects relative to its folder: '..' there is read past the allowed root."""
    roots = ("http://127.0.0.1:8099/pub",)

    def index(*names: str) -> SampleIndex:
        blob = b"".join(n.encode() for n in names)
        offsets = np.cumsum([0, *(len(n.encode()) for n in names)]).astype(np.int64)
        return SampleIndex("http://127.0.0.1:8099/pub/lists", ("a",), np.frombuffer(blob, np.uint8), offsets,
                           np.zeros(len(names), np.int64), "fp")

    check_files_inside(index("a/1.jpg", "a/2.jpg"), "http://127.0.0.1:8099/pub/lists/l.csv", roots)
    for bad in ("../../priv/x.jpg", "a/%2e%2e/%2e%2e/%2e%2e/priv/x.jpg"):
        with pytest.raises(ConfigError, match="outside allowed_data"):
            check_files_inside(index("a/1.jpg", bad), "http://127.0.0.1:8099/pub/lists/l.csv", roots)


def test_inside_compares_whole_components() -> None:
    assert inside("/data/x", "/data") and inside("/data", "/data") and inside("/data/x", "/")
    assert not inside("/data2/x", "/data") and not inside("/dat", "/data")


def test_allow_lists_come_from_toml_lists_and_are_checked(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('allowed_data = ["datasets", "s3://b/p/"]\nallowed-transforms = ["m.n:f"]\n')
    values = load_toml(cfg)
    built = DaemonConfig(buffer=tmp_path / "bf", **values)
    assert built.allowed_data == (str(tmp_path / "datasets"), "s3://b/p")  # relative to the file, as paths are
    assert built.allowed_transforms == ("m.n:f",)
    for text, key in (('allowed_data = "/one"', "allowed_data"), ("allowed_transforms = [1]", "allowed_transforms"),
                      ('allowed_transforms = ["nocolon"]', "allowed_transforms")):
        cfg.write_text(text + "\n")
        with pytest.raises(ConfigError, match=key):
            DaemonConfig(buffer=tmp_path / "bf", **load_toml(cfg))


def test_job_request_reads_its_files_owner_and_refuses_hard_links(tmp_path: Path) -> None:
    request = JobRequest({"data": "/x"})
    request.write(tmp_path)
    read = JobRequest.read(tmp_path)
    assert read is not None and read.owner == os.geteuid() and read.job_id == request.job_id
    assert "owner" not in (tmp_path / JOB_NAME).read_text()  # who wrote it is the file's, not the document's say
    os.link(tmp_path / JOB_NAME, tmp_path / "other-name")
    with pytest.raises(ProtocolError, match="2 links"):
        JobRequest.read(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give job.json another owner")
def test_a_malformed_job_json_under_the_running_jobs_id_is_answered_as_its_writers(shapes_data: Path,
                                                                                   tmp_path: Path) -> None:
    """Any member of the buffer's group may write job.json, under any job_id: status.json names the running job's
    id.  A malformed one under it was answered with that job's submitter as its own (job_result.submitter), as if
    the user whose job runs had sent it."""
    buffer = tmp_path / "bf"
    buffer.mkdir()
    inbox = JobInbox(buffer, DaemonConfig(buffer=buffer), ignore_current=False)
    request = JobRequest({"data": str(shapes_data / "train"), "batch_size": 4})
    request.write(buffer)
    running = inbox.poll(None)
    assert running is not None and inbox.pending_owner == os.geteuid()
    inbox.answer(inbox.pending_id, True, "producing", inbox.pending_owner)  # as the daemon does once it starts
    inbox.accepted(running)
    inbox.settle()
    (buffer / JOB_NAME).write_text(json.dumps({"format": "prefetchd.job", "version": VERSION,
                                               "job_id": request.job_id, "settings": 5}))
    os.chown(buffer / JOB_NAME, OTHER, OTHER)
    assert inbox.poll(running) is None
    result = inbox.result
    assert result is not None and (result.job_id, result.accepted) == (request.job_id, False), result
    assert result.submitter == OTHER, result
    running_job = inbox.running_job()
    assert running_job is not None and running_job.submitter == os.geteuid()  # the job that runs is still its own
