"""prefetchd.daemon.config: validation, the TOML file, and machine-sized defaults."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from prefetchd.daemon import config as config_mod
from prefetchd.daemon.config import FIELDS, DaemonConfig, fill_defaults, load_toml, usable_cores, usable_cpus
from prefetchd.daemon.cgroup_limits import cgroup_oom_kills, cpu_quota, memory_limit, memory_room, quota_cpus
from prefetchd.daemon.errors import ConfigError
from prefetchd.oom import oom_kills
from tests.cgroups import cgroup_v1, in_cgroup, oom_killed_in

MiB = 2**20
GiB = 2**30

# -- DaemonConfig ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("split", "test"),
        ("batch_size", 0),
        ("batch_size", -3),
        ("batch_size", 2.0),
        ("batch_size", "64"),
        ("image_size", True),  # bool is an int to Python, not to us
        ("image_size", 4),
        ("workers", 0),
        ("seed", -1),
        ("val_fraction", 1.5),
        ("val_fraction", "0.1"),
        ("epochs", 0),
        ("reset", 1),
        ("data", 5),  # a location is a string (or a path)
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ConfigError) as exc:
        DaemonConfig(buffer=tmp_path, **{key: value})
    assert key in str(exc.value)
    assert ("true" if value is True else repr(value)) in str(exc.value)  # as TOML and JSON spell it


def test_good_values_are_kept(tmp_path: Path) -> None:
    cfg = DaemonConfig(buffer=tmp_path, data=tmp_path / "d", split="val", val_fraction=0.2, batch_size=7,
                       image_size=8, workers=1, high_water=3, low_water=0, seed=2**63 - 1, epochs=1, reset=True)
    assert (cfg.split, cfg.batch_size, cfg.image_size, cfg.high_water, cfg.low_water) == ("val", 7, 8, 3, 0)
    assert DaemonConfig(buffer=tmp_path, val_fraction=0).val_fraction == 0  # an int where a float goes
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(("low", "high"), [(5, 5), (6, 5), (64, 2)])
def test_low_water_must_be_below_high_water(tmp_path: Path, low: int, high: int) -> None:
    with pytest.raises(ConfigError) as exc:
        DaemonConfig(buffer=tmp_path, low_water=low, high_water=high)
    assert "low_water" in str(exc.value) and "high_water" in str(exc.value)
    assert str(low) in str(exc.value) and str(high) in str(exc.value)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="bind-mounts a folder (root)")
def test_a_buffer_inside_the_dataset_through_a_bind_mount_is_refused(tmp_path: Path) -> None:
    """The dataset's folder bind-mounted elsewhere: no symlink to resolve, so the buffer was made inside the dataset
    and the start failed on it as a class folder, exit 1, leaving it there (a walk with odd paths)."""
    data, mount = tmp_path / "data", tmp_path / "mnt"
    (data / "cats").mkdir(parents=True)
    mount.mkdir()
    subprocess.run(["mount", "--bind", str(data), str(mount)], check=True)
    try:
        for buffer in (mount / "bf", mount / "cats" / "bf"):
            with pytest.raises(ConfigError, match=f"buffer {buffer} is inside the dataset {data}"):
                DaemonConfig(buffer=buffer, data=str(data))
        assert DaemonConfig(buffer=tmp_path / "bf", data=str(data)).buffer == tmp_path / "bf"
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_missing_buffer() -> None:
    with pytest.raises(ConfigError, match="buffer"):
        DaemonConfig()
    with pytest.raises(ConfigError, match="buffer"):
        DaemonConfig(data=Path("/data"))


def test_a_buffer_inside_a_local_dataset_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "cats").mkdir(parents=True)
    (tmp_path / "link").symlink_to(data)
    for buffer in (data / "bf", data / "cats" / "bf", data, tmp_path / "link" / "bf"):
        with pytest.raises(ConfigError) as refused:
            DaemonConfig(buffer=buffer, data=str(data))
        assert f"buffer {buffer} is inside the dataset {data}, whose folders the daemon reads as classes" \
            in str(refused.value)
    with pytest.raises(ConfigError, match="is inside the dataset"):  # a job submitted to a daemon: the same rule
        dataclasses.replace(DaemonConfig(buffer=data / "bf"), data=str(data))
    # Beside it (a longer name is no folder of it), and a dataset in object storage: kept.
    assert DaemonConfig(buffer=tmp_path / "data2", data=str(data)).buffer == tmp_path / "data2"
    assert DaemonConfig(buffer=data / "bf", data="s3://bucket/data").data == "s3://bucket/data"


def test_batch_bytes_hold_the_images(tmp_path: Path) -> None:
    cfg = DaemonConfig(buffer=tmp_path, batch_size=16, image_size=32)
    assert cfg.batch_bytes >= 16 * 32 * 32 * 3 + 2 * 16 * 8
    assert cfg.batch_bytes % 4096 == 0
    assert DaemonConfig(buffer=tmp_path, batch_size=32, image_size=32).batch_bytes > cfg.batch_bytes


# -- load_toml ------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_dash_and_underscore_keys(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", 'batch-size = 64\nimage_size = 96\nhigh-water = 8\nlow_water = 3\nsplit = "val"\n'
                                     "val-fraction = 0.25\nreset = true\n")
    assert load_toml(cfg) == {"batch_size": 64, "image_size": 96, "high_water": 8, "low_water": 3,
                              "split": "val", "val_fraction": 0.25, "reset": True}


def test_unknown_key_lists_allowed_keys(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", "batch_size = 64\nbatchsize = 32\n")
    with pytest.raises(ConfigError) as exc:
        load_toml(cfg)
    msg = str(exc.value)
    assert "batchsize" in msg and str(cfg) in msg
    for name in FIELDS:
        assert name in msg


@pytest.mark.parametrize(("line", "hint"), [
    ("batch_sise = 64", " unknown key 'batch_sise' (did you mean 'batch_size'?); allowed keys are "),
    ("batch-sise = 64", " unknown key 'batch-sise' (did you mean 'batch-size'?); allowed keys are "),  # as it was written
    ("high_watermark = 8", " unknown key 'high_watermark' (did you mean 'high_water'?); allowed keys are "),
    ("zzzz = 1", " unknown key 'zzzz'; allowed keys are "),  # nothing close: no guess
])
def test_an_unknown_key_names_the_closest_config_key(tmp_path: Path, line: str, hint: str) -> None:
    """A typo'd key was answered with the 36 allowed keys alone, to look through for the one meant."""
    with pytest.raises(ConfigError, match=re.escape(hint)):
        load_toml(write(tmp_path / "c.toml", line + "\n"))


@pytest.mark.parametrize("text", ["batch_size = 8\nbatch-size = 9\n", "batch-size = 9\nbatch_size = 8\n"])
def test_one_key_in_both_spellings_is_refused(tmp_path: Path, text: str) -> None:
    """Either spelling is a key; with both, the file would say two things and the later win silently."""
    with pytest.raises(ConfigError, match=r"c\.toml: 'batch_size' is set twice \(batch_size and batch-size\)"):
        load_toml(write(tmp_path / "c.toml", text))


@pytest.mark.parametrize(
    ("line", "key"),
    [('batch_size = "big"', "batch_size"), ("image-size = 1.5", "image"), ("seed = -4", "seed"),
     ("split = 'test'", "split"), ("reset = 1", "reset"), ("buffer = 3", "buffer"), ("workers = true", "workers"),
     ("epochs = [1, 2]", "epochs"), ("[data]\nroot = 'x'", "data")],
)
def test_wrong_type_names_file_and_key(tmp_path: Path, line: str, key: str) -> None:
    cfg = write(tmp_path / "my-daemon.toml", line + "\n")
    with pytest.raises(ConfigError) as exc:
        load_toml(cfg)
    assert str(cfg) in str(exc.value)
    assert key in str(exc.value)


@pytest.mark.parametrize(("line", "said"), [("workers = true", "workers = true: expected int"),
                                            ("high_water = 1979-05-27T07:32:00Z",
                                             "high_water = 1979-05-27T07:32:00+00:00: expected int"),
                                            ("seed = 07:32:00", "seed = 07:32:00: expected int"),
                                            # What the number counts, where a size was written with its unit.
                                            ("max_buffer_bytes = '2GB'", "max_buffer_bytes = '2GB': expected int "
                                             "(a number of bytes, 2147483648 for 2 GiB)"),
                                            ("min_free_mb = '1G'", "min_free_mb = '1G': expected int (MiB)")])
def test_a_wrong_value_is_quoted_as_toml_spells_it(tmp_path: Path, line: str, said: str) -> None:
    """Not as Python does: ``True``, ``datetime.datetime(1979, 5, 27, 7, 32, tzinfo=datetime.timezone.utc)``."""
    cfg = write(tmp_path / "c.toml", line + "\n")
    with pytest.raises(ConfigError) as exc:
        DaemonConfig(buffer=tmp_path, **load_toml(cfg))
    assert said in str(exc.value), exc.value


def test_relative_paths_resolve_against_the_config_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write(tmp_path / "etc" / "prefetchd.toml", 'data = "imgs/train"\nbuffer = "../shm/bf"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    values = load_toml(cfg)
    assert isinstance(values["data"], str) and isinstance(values["buffer"], Path)  # data is a location
    assert Path(values["data"]).resolve() == (tmp_path / "etc" / "imgs" / "train").resolve()
    assert values["buffer"].resolve() == (tmp_path / "shm" / "bf").resolve()


def test_relative_config_path_still_resolves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Absolute, as data always was: `config --show` printed index_cache = "etc/cache", relative to the working
    directory, which read back from another folder's file names another folder (review)."""
    write(tmp_path / "etc" / "prefetchd.toml", 'data = "imgs"\nindex_cache = "cache"\n')
    monkeypatch.chdir(tmp_path)
    values = load_toml(Path("etc/prefetchd.toml"))
    assert values["data"] == str(tmp_path / "etc" / "imgs")
    assert values["index_cache"] == tmp_path / "etc" / "cache"


def test_absolute_paths_are_kept(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", 'data = "/srv/imagenet"\nbuffer = "/dev/shm/bf"\n')
    assert load_toml(cfg) == {"data": "/srv/imagenet", "buffer": Path("/dev/shm/bf")}


def test_urls_in_a_config_file_are_kept_verbatim(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", 'data = "s3://bucket/imagenet/train/"\n')
    assert load_toml(cfg) == {"data": "s3://bucket/imagenet/train"}


@pytest.mark.parametrize("text", ["batch_size = \n", "batch_size = 1\nbatch_size = 2\n", "[[[", "x = 'unclosed\n"])
def test_invalid_toml(tmp_path: Path, text: str) -> None:
    cfg = write(tmp_path / "broken.toml", text)
    with pytest.raises(ConfigError, match="not valid TOML") as exc:
        load_toml(cfg)
    assert str(cfg) in str(exc.value)


def test_a_config_file_that_never_ends_is_refused_after_a_mebibyte() -> None:
    """--config /dev/zero read until memory ran out (4.6 GB in 6 s, a review)."""
    with pytest.raises(ConfigError, match=r"^config file /dev/zero is larger than 1.0 MiB, which no prefetchd "
                                          "configuration is"):
        load_toml(Path("/dev/zero"))


def test_non_utf8_toml_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "latin1.toml"
    cfg.write_bytes('data = "/srv/caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as exc:
        load_toml(cfg)
    assert str(cfg) in str(exc.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as exc:
        load_toml(tmp_path / "nope.toml")
    assert str(tmp_path / "nope.toml") in str(exc.value)


def test_empty_file_is_no_values(tmp_path: Path) -> None:
    assert load_toml(write(tmp_path / "empty.toml", "# nothing\n")) == {}


def test_loaded_values_make_a_config(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", 'buffer = "bf"\nbatch-size = 16\nseed = 9\n')
    config = DaemonConfig(**load_toml(cfg))
    assert config.buffer == tmp_path / "bf" and config.batch_size == 16 and config.seed == 9


# -- fill_defaults ---------------------------------------------------------------------


def test_usable_cores_are_the_affinity_and_usable_cpus_their_count() -> None:
    """What `taskset`, a cpuset or AllowedCPUs= leaves this process, not the machine's core count: the default
    workers, the demo's and the bench's counts, and the cores the bench pins its contenders to."""
    allowed = os.sched_getaffinity(0)
    assert usable_cores() == allowed and usable_cpus() == len(allowed) >= 1
    last = max(allowed)
    os.sched_setaffinity(0, {last})
    try:
        assert usable_cores() == {last} and usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 1), (3, 2), (64, 63)])
def test_default_workers(shm_buffer: Path, monkeypatch: pytest.MonkeyPatch, cpus: int, workers: int) -> None:
    monkeypatch.setattr(config_mod, "usable_cores", lambda: set(range(cpus)))
    monkeypatch.setattr(config_mod, "cpu_quota", lambda: None)
    cfg, notes = fill_defaults(DaemonConfig(buffer=shm_buffer))
    assert cfg.workers == workers
    assert any(n.startswith(f"workers = {workers}") for n in notes)


def test_default_workers_on_this_machine(shm_buffer: Path) -> None:
    cfg, _ = fill_defaults(DaemonConfig(buffer=shm_buffer))
    assert cfg.workers == max(1, quota_cpus(len(os.sched_getaffinity(0)), cpu_quota()) - 1)


def cgroup_files(tmp_path: Path, cgroup: str, mounts: list[str], files: dict[str, str]) -> tuple[str, str]:
    """A /proc/self/cgroup, a /proc/self/mountinfo of ``mounts`` ("ROOT POINT FSTYPE OPTIONS") and the cgroup
    files they lead to, all under ``tmp_path``; their two paths, for ``cpu_quota``."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "cgroup").write_text(cgroup)
    lines = []
    for k, mount in enumerate(mounts):
        root, point, fstype, options = mount.split()
        lines.append(f"{30 + k} 23 0:{28 + k} {root} {tmp_path / point.lstrip('/')} rw,relatime - {fstype} {fstype} "
                     f"{options}")
    (tmp_path / "mountinfo").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


@pytest.mark.parametrize(("case", "quota"), [
    ("v2, the unit's own", 1.5), ("v2, its slice's, tighter", 0.5), ("v2, no limit", None),
    ("v2 in a container's namespace", 4.0), ("v1, cpu and cpuacct", 2.0), ("v1, none (-1)", None),
    ("hybrid: v2 without the cpu controller, v1 with it", 3.0), ("no cgroup files", None),
])
def test_the_cpu_quota_is_the_tightest_of_the_cgroup_and_those_above_it(tmp_path: Path, case: str,
                                                                      quota: float | None) -> None:
    """docker run --cpus, a Kubernetes CPU limit and CPUQuota= leave every core in the affinity: counted alone,
    a pod limited to 4 CPUs on a 64-core host got 63 workers."""
    v2_unit = "sys/fs/cgroup/system.slice/prefetchd@bf.service/cpu.max"
    setups = {
        "v2, the unit's own": ("0::/system.slice/prefetchd@bf.service\n", ["/ /sys/fs/cgroup cgroup2 rw"],
                               {v2_unit: "150000 100000\n", "sys/fs/cgroup/system.slice/cpu.max": "max 100000\n"}),
        "v2, its slice's, tighter": ("0::/system.slice/prefetchd@bf.service\n", ["/ /sys/fs/cgroup cgroup2 rw"],
                                     {v2_unit: "150000 100000\n", "sys/fs/cgroup/system.slice/cpu.max": "50000 100000"}),
        "v2, no limit": ("0::/user.slice\n", ["/ /sys/fs/cgroup cgroup2 rw"], {"sys/fs/cgroup/user.slice/cpu.max":
                                                                                "max 100000\n"}),
        # A container sees its own cgroup as / (its namespace's root), mounted at /sys/fs/cgroup.
        "v2 in a container's namespace": ("0::/\n", ["/ /sys/fs/cgroup cgroup2 rw"],
                                          {"sys/fs/cgroup/cpu.max": "400000 100000\n"}),
        "v1, cpu and cpuacct": ("5:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
                                ["/ /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct",
                                 "/ /sys/fs/cgroup/memory cgroup rw,memory"],
                                {"sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
                                 "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
                                 "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                                 "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"}),
        "v1, none (-1)": ("1:cpu:/\n", ["/ /sys/fs/cgroup/cpu cgroup rw,cpu"],
                          {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"}),
        "hybrid: v2 without the cpu controller, v1 with it": (
            "1:cpu:/job\n0::/job\n", ["/ /sys/fs/cgroup/cpu cgroup rw,cpu", "/ /sys/fs/cgroup/unified cgroup2 rw"],
            {"sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "300000\n", "sys/fs/cgroup/cpu/job/cpu.cfs_period_us": "100000\n",
             "sys/fs/cgroup/unified/job/cgroup.procs": ""}),
        "no cgroup files": ("0::/\n", ["/ /sys/fs/cgroup cgroup2 rw"], {}),
    }
    cgroup, mountinfo = cgroup_files(tmp_path, *setups[case])
    assert cpu_quota(cgroup, mountinfo) == quota
    assert cpu_quota(str(tmp_path / "absent"), mountinfo) is None  # not Linux, or no /proc: no limit known


MiB = 1 << 20


@pytest.mark.parametrize(("case", "room", "limit"), [
    ("v2: the limit less what is used, page cache it may drop not counted", 1024 - (700 - 300), 1024),
    ("v2: its slice's, tighter", 100, 500), ("v2: no limit", None, None),
    ("v1: the container's", 2048 - (1500 - 1000), 2048), ("v1: no limit", None, None),
    ("v2: above its limit (reclaim pending)", 0, 100),
])
def test_the_memory_room_is_the_tightest_limit_less_use_of_the_cgroup_and_those_above_it(
        tmp_path: Path, case: str, room: int | None, limit: int | None) -> None:
    """docker run --memory, a pod's memory limit and MemoryMax= leave the host's free memory in /proc/meminfo, while
    the batches' tmpfs pages count against the cgroup: a high-water mark sized from the host's memory got the
    daemon OOM-killed."""
    unit = "sys/fs/cgroup/system.slice/prefetchd@bf.service/"
    v2 = ("0::/system.slice/prefetchd@bf.service\n", ["/ /sys/fs/cgroup cgroup2 rw"])
    setups = {
        "v2: the limit less what is used, page cache it may drop not counted": (*v2, {
            unit + "memory.max": f"{1024 * MiB}\n", unit + "memory.current": f"{700 * MiB}\n",
            unit + "memory.stat": f"anon 1\nfile 2\ninactive_file {300 * MiB}\nactive_file 3\n"}),
        "v2: its slice's, tighter": (*v2, {
            unit + "memory.max": f"{1024 * MiB}\n", unit + "memory.current": f"{100 * MiB}\n",
            "sys/fs/cgroup/system.slice/memory.max": f"{500 * MiB}\n",
            "sys/fs/cgroup/system.slice/memory.current": f"{400 * MiB}\n"}),
        "v2: no limit": (*v2, {unit + "memory.max": "max\n", unit + "memory.current": f"{700 * MiB}\n"}),
        "v1: the container's": ("4:memory:/\n1:cpu:/\n", ["/docker/abc /sys/fs/cgroup/memory cgroup rw,memory"], {
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{2048 * MiB}\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{1500 * MiB}\n",
            "sys/fs/cgroup/memory/memory.stat": f"cache 5\ninactive_file 7\ntotal_inactive_file {1000 * MiB}\n"}),
        "v1: no limit": ("4:memory:/job\n", ["/ /sys/fs/cgroup/memory cgroup rw,memory"], {
            "sys/fs/cgroup/memory/job/memory.limit_in_bytes": "9223372036854771712\n",
            "sys/fs/cgroup/memory/job/memory.usage_in_bytes": f"{1500 * MiB}\n"}),
        "v2: above its limit (reclaim pending)": (*v2, {
            unit + "memory.max": f"{100 * MiB}\n", unit + "memory.current": f"{120 * MiB}\n"}),
    }
    cgroup, mountinfo = cgroup_files(tmp_path, *setups[case])
    assert memory_room(cgroup, mountinfo) == (None if room is None else room * MiB)
    assert memory_limit(cgroup, mountinfo) == (None if limit is None else limit * MiB)


@pytest.mark.parametrize(("cores", "quota", "cpus"), [(64, None, 64), (64, 4.0, 4), (64, 1.5, 2), (64, 0.2, 1),
                                                      (2, 8.0, 2), (4, 3.0000000001, 3)])
def test_a_quota_keeps_as_many_cpus_busy_as_it_allows_at_least_one(cores: int, quota: float | None, cpus: int) -> None:
    assert quota_cpus(cores, quota) == cpus


def config_in_cgroup(controller: str, limits: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`prefetchd config ARGS` in a real cgroup v1 of ``controller`` of its own, with ``limits`` written."""
    with cgroup_v1(controller, limits) as group:
        return subprocess.run(in_cgroup(group, [sys.executable, "-m", "prefetchd", "config", *args]),
                              capture_output=True, text=True, timeout=120)


def test_a_process_in_a_cgroup_with_a_cpu_quota_counts_the_quota_not_the_cores(shm_buffer: Path) -> None:
    """A real cgroup v1 quota of half a CPU (the v2 file is read alike, from the unit tests' fake trees)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    run = config_in_cgroup("cpu", {"cpu.cfs_quota_us": "50000"}, "--show", "--buffer", str(shm_buffer))  # of 100000 us
    assert run.returncode == 0, run.stderr
    workers = next(line for line in run.stdout.splitlines() if line.startswith("workers ="))
    cores = len(os.sched_getaffinity(0))
    assert workers == (f"workers = 1  # default: 1 usable CPU: a CPU quota of 0.5 of the {cores} cores it may "
                       "run on"), workers


def test_a_cgroups_oom_kills_are_its_own(tmp_path: Path) -> None:
    """A worker the OOM killer takes is told by its cgroup's count: another cgroup's kills (another container, a
    test's cgroup) leave it as it was, where the machine's count rises."""
    cgroup, mountinfo = cgroup_files(tmp_path, "0::/svc\n", ["/ /sys/fs/cgroup cgroup2 rw"], {
        "sys/fs/cgroup/svc/memory.events": "low 0\nhigh 0\nmax 9\noom 3\noom_kill 2\noom_group_kill 0\n"})
    assert cgroup_oom_kills(cgroup, mountinfo) == 2
    cgroup, mountinfo = cgroup_files(tmp_path / "v1", "4:memory:/docker/abc\n",
                                     ["/ /sys/fs/cgroup/memory cgroup rw,memory"], {
        "sys/fs/cgroup/memory/docker/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"})
    assert cgroup_oom_kills(cgroup, mountinfo) == 5
    assert cgroup_oom_kills(cgroup, str(tmp_path / "absent")) is None

    before_here, before_machine = cgroup_oom_kills(), oom_kills()
    with cgroup_v1("memory", {"memory.limit_in_bytes": str(64 << 20)}) as group:
        oom_killed_in(group)
        inside = subprocess.run(in_cgroup(group, [sys.executable, "-c", "from prefetchd.daemon.cgroup_limits import "
                                                  "cgroup_oom_kills; print(cgroup_oom_kills())"]),
                                capture_output=True, text=True, timeout=60)
    assert inside.stdout.strip() == "1", inside.stdout + inside.stderr
    assert (oom_kills() or 0) > (before_machine or 0)
    if before_here is not None:  # this cgroup v1's own count: the other cgroup's kill is not in it
        assert cgroup_oom_kills() == before_here


def test_the_machines_oom_kills_are_read_from_vmstat(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 12\noom_kill 7\nnr_zone_active_anon 3\n")
    assert oom_kills(str(vmstat)) == 7
    vmstat.write_text("nr_free_pages 12\n")  # a kernel before 4.13
    assert oom_kills(str(vmstat)) is None and oom_kills(str(tmp_path / "absent")) is None


def test_a_daemon_in_a_cgroup_with_a_memory_limit_sizes_its_high_water_mark_from_it(shm_buffer: Path) -> None:
    """A real cgroup v1 limit of 1 GiB: a quarter of it holds 6 batches of 36.8 MiB, where the host's memory
    held the 64 a default is at most."""
    run = config_in_cgroup("memory", {"memory.limit_in_bytes": str(1 << 30)}, "--show", "--buffer", str(shm_buffer),
                           "--batch-size", "256")
    assert run.returncode == 0, run.stderr
    line = next(line for line in run.stdout.splitlines() if line.startswith("high_water ="))
    match = re.fullmatch(r"high_water = (\d+)  # default: batches of 36\.8 MiB: at most half the free tmpfs above the "
                         r"--min-free-mb floor, a quarter "
                         r"of the memory this daemon's cgroup may still take \((\d+\.\d) (MiB|GiB)\), 64 batches", line)
    assert match is not None, line
    room = float(match[2]) * (1 << (30 if match[3] == "GiB" else 20))
    assert 0.5 * (1 << 30) < room <= 1 << 30  # what the process itself uses is less than half the limit
    assert abs(int(match[1]) - room / 4 / (36.75 * MiB)) < 1.05  # the room as shown, to 0.1 MiB or GiB


def test_a_high_water_mark_whose_batches_exceed_the_memory_limit_is_refused(shm_buffer: Path) -> None:
    """64 batches of 9.2 MiB in a 512 MiB container: its workers, then the daemon itself, were OOM-killed at the
    first batches, a healthy file blamed for the workers' deaths on the way."""
    args = ["--buffer", str(shm_buffer), "--batch-size", "64", "--image-size", "224"]
    run = config_in_cgroup("memory", {"memory.limit_in_bytes": str(512 << 20)}, *args, "--high-water", "64")
    assert run.returncode == 2, run.stdout + run.stderr
    assert ("high_water 64 x 9.2 MiB batches need 588.8 MiB of tmpfs pages, which count against the daemon's memory "
            "cgroup, but its limit is 512.0 MiB (docker run --memory, a Kubernetes memory limit, MemoryMax=): the "
            "kernel would kill it as the buffer fills; lower --high-water (27 leaves half of it to the daemon's "
            "processes), or raise the limit") in run.stderr
    run = config_in_cgroup("memory", {"memory.limit_in_bytes": str(512 << 20)}, *args, "--high-water", "27")
    assert run.returncode == 0 and "configuration is valid" in run.stdout, run.stdout + run.stderr


def test_default_index_cache_is_shown_where_it_resolves(shm_buffer: Path, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """`config --show` prints the cache folder a start would use, not "(unset)"; an explicit one is kept."""
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "systemd-cache"))
    cfg, notes = fill_defaults(DaemonConfig(buffer=shm_buffer))
    assert cfg.index_cache == tmp_path / "systemd-cache"
    assert f"index_cache = {tmp_path / 'systemd-cache'} ($CACHE_DIRECTORY, from systemd)" in notes
    cfg, notes = fill_defaults(DaemonConfig(buffer=shm_buffer, index_cache=tmp_path / "mine"))
    assert cfg.index_cache == tmp_path / "mine" and not any(n.startswith("index_cache") for n in notes)
    monkeypatch.delenv("CACHE_DIRECTORY")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg, notes = fill_defaults(DaemonConfig(buffer=shm_buffer))
    note = next(n for n in notes if n.startswith("index_cache = "))
    assert note.startswith(f"index_cache = {tmp_path / 'xdg' / 'prefetchd'} (this user's cache folder; the systemd"), note


def test_a_private_temp_index_cache_is_not_called_this_users_cache_folder(shm_buffer: Path, homeless: None) -> None:
    """A uid with no account gets a cache folder of the run's own, removed at its exit; the note called it "this
    user's cache folder", as if its indexes were kept (a walk as such a uid)."""
    cfg, notes = fill_defaults(DaemonConfig(buffer=shm_buffer))
    note = next(n for n in notes if n.startswith("index_cache = "))
    assert note.startswith(f"index_cache = {cfg.index_cache} (a folder of this run's own, removed at its exit: "
                           "this uid has no account"), note
    assert "this user's cache folder" not in note and "set $XDG_CACHE_HOME or --index-cache to keep" in note
    assert cfg.index_cache is not None
    cfg.index_cache.rmdir()


def test_the_free_space_floor_by_filesystem_size() -> None:
    mib = 1 << 20
    # 5 % from 1.25 GiB up, 64 MiB below it, a tenth below 640 MiB, and never 0 (an 8 MiB tmpfs: 0.8 MiB).
    assert [config_mod.default_min_free_mb(size * mib) for size in (8, 64, 600, 1000, 24 * 1024)] == [1, 6, 60, 64, 1228]


def _expected_high(cfg: DaemonConfig, fs: os.statvfs_result, ram: int) -> tuple[int, int]:
    """(high_water, the cap that half the free tmpfs alone allows), by the documented rule."""
    total, free = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize
    min_free = config_mod.default_min_free_mb(total) << 20
    budget = min(0.5 * max(0, free - min_free), 0.25 * ram)
    return int(max(2, min(64, budget // cfg.batch_bytes))), int(0.5 * free // cfg.batch_bytes)


@pytest.mark.parametrize(("batch_size", "image_size"), [(128, 224), (128, 1792), (256, 2048), (4096, 4096)])
def test_default_high_water_on_a_real_tmpfs(shm_buffer: Path, batch_size: int, image_size: int) -> None:
    cfg = DaemonConfig(buffer=shm_buffer, batch_size=batch_size, image_size=image_size)
    before = _expected_high(cfg, os.statvfs(shm_buffer), psutil.virtual_memory().available)
    filled, notes = fill_defaults(cfg)
    after = _expected_high(cfg, os.statvfs(shm_buffer), psutil.virtual_memory().available)
    high = filled.high_water
    assert high is not None and 2 <= high <= 64
    assert high in (before[0], after[0])  # free memory may move a little between the snapshots
    if high > 2:  # 2 is the floor; the daemon's capacity check refuses what does not fit
        assert high <= max(before[1], after[1])
        assert high * cfg.batch_bytes <= 0.5 * os.statvfs(shm_buffer).f_bavail * os.statvfs(shm_buffer).f_frsize * 1.01
    assert filled.low_water == high // 2
    assert any(n.startswith(f"high_water = {high} ") for n in notes)


def _fake_machine(monkeypatch: pytest.MonkeyPatch, total: int, free: int, ram: int) -> None:
    frsize = 4096
    fake = SimpleNamespace(f_blocks=total // frsize, f_bavail=free // frsize, f_frsize=frsize)
    monkeypatch.setattr(config_mod.os, "statvfs", lambda path: fake)
    monkeypatch.setattr(config_mod.psutil, "virtual_memory", lambda: SimpleNamespace(available=ram))


@pytest.mark.parametrize(
    ("total", "free", "ram", "min_free_mb", "high"),
    [
        # 1 GiB tmpfs: floor 64 MiB (5% is less), half of the other 960 MiB over 19.28 MB batches
        (1 * GiB, 1 * GiB, 1000 * GiB, 64, int(480 * MiB // 19279872)),
        # RAM binds: a quarter of 400 MiB
        (100 * GiB, 100 * GiB, 400 * MiB, 5120, int(100 * MiB // 19279872)),
        # plenty of both: capped at 64
        (100 * GiB, 100 * GiB, 1000 * GiB, 5120, 64),
        # almost full tmpfs: the floor of 2
        (1 * GiB, 80 * MiB, 1000 * GiB, 64, 2),
        # min-free above free space: budget 0, still 2
        (1 * GiB, 10 * MiB, 1000 * GiB, 64, 2),
        # Docker's 64 MiB /dev/shm: a floor of a tenth (6 MiB), not 64 MiB, leaves the 2 batches room
        (64 * MiB, 64 * MiB, 1000 * GiB, 6, 2),
        # 640 MiB and up: 5%, at least 64 MiB
        (640 * MiB, 640 * MiB, 1000 * GiB, 64, int(288 * MiB // 19279872)),
    ],
)
def test_default_high_water_arithmetic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, total: int, free: int, ram: int, min_free_mb: int, high: int
) -> None:
    _fake_machine(monkeypatch, total, free, ram)
    cfg = DaemonConfig(buffer=tmp_path, batch_size=128, image_size=224)
    assert cfg.batch_bytes == 19279872  # the sizes above assume this batch
    filled, notes = fill_defaults(cfg)
    assert filled.min_free_mb == min_free_mb
    assert filled.high_water == high
    assert filled.low_water == high // 2
    if high > 2:
        assert high * cfg.batch_bytes <= 0.5 * free


def test_explicit_min_free_enters_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, 2 * GiB, 2 * GiB, 1000 * GiB)
    cfg = DaemonConfig(buffer=tmp_path, batch_size=128, image_size=224, min_free_mb=1024)
    filled, notes = fill_defaults(cfg)
    assert filled.min_free_mb == 1024
    assert filled.high_water == int(512 * MiB // 19279872)
    assert not any(n.startswith("min_free_mb") for n in notes)


def test_every_default_has_a_note(shm_buffer: Path) -> None:
    cfg = DaemonConfig(buffer=shm_buffer)
    filled, notes = fill_defaults(cfg)
    sized = ("workers", "min_free_mb", "high_water", "low_water", "index_cache")
    assert len(notes) == len(sized)
    for name in sized:
        value = getattr(filled, name)
        assert value is not None
        assert sum(n.startswith(f"{name} = {value}") for n in notes) == 1, notes
    # what was not a default is left as it was
    for f in dataclasses.fields(cfg):
        if f.name not in sized:
            assert getattr(filled, f.name) == getattr(cfg, f.name)


def test_explicit_values_are_kept(shm_buffer: Path) -> None:
    cfg = DaemonConfig(buffer=shm_buffer, workers=5, high_water=100, low_water=99, min_free_mb=0,
                       index_cache=shm_buffer / "cache")
    filled, notes = fill_defaults(cfg)
    assert filled == cfg
    assert notes == []


@pytest.mark.parametrize(("high", "low"), [(10, 5), (1, 0), (3, 1), (100, 50)])
def test_low_water_defaults_to_half_an_explicit_high_water(shm_buffer: Path, high: int, low: int) -> None:
    filled, notes = fill_defaults(DaemonConfig(buffer=shm_buffer, high_water=high, workers=1, min_free_mb=64,
                                               index_cache=shm_buffer / "cache"))
    assert (filled.high_water, filled.low_water) == (high, low)
    assert notes and all(n.startswith("low_water") for n in notes)


# -- augmentation options ------------------------------------------------------------------


def test_augmentation_is_off_by_default(tmp_path: Path) -> None:
    cfg = DaemonConfig(buffer=tmp_path)
    assert (cfg.color_jitter, cfg.scale_jitter, cfg.transform, cfg.scale_jitter_bounds) == (None, None, None, None)


def test_augmentation_values_are_kept(tmp_path: Path) -> None:
    cfg = DaemonConfig(buffer=tmp_path, color_jitter=0.4, scale_jitter=" 256, 480", transform="my.pkg:aug")
    assert (cfg.color_jitter, cfg.scale_jitter_bounds, cfg.transform) == (0.4, (256, 480), "my.pkg:aug")
    assert DaemonConfig(buffer=tmp_path, image_size=64, scale_jitter="64,64").scale_jitter_bounds == (64, 64)
    assert DaemonConfig(buffer=tmp_path, color_jitter=0).color_jitter == 0


@pytest.mark.parametrize(("values", "words"), [
    ({"color_jitter": -0.1}, ["color_jitter", "-0.1", "at least 0"]),
    ({"color_jitter": "0.4"}, ["color_jitter", "expected float"]),
    ({"scale_jitter": "256"}, ["scale_jitter", "'256'", "MIN,MAX", "256,480"]),
    ({"scale_jitter": "256,480,512"}, ["scale_jitter", "MIN,MAX"]),
    ({"scale_jitter": "a,b"}, ["scale_jitter", "MIN,MAX"]),
    ({"scale_jitter": "480,256"}, ["scale_jitter", "MIN <= MAX"]),
    ({"scale_jitter": "0,0", "image_size": 8}, ["scale_jitter", "MIN <= MAX"]),
    ({"scale_jitter": "200,480"}, ["scale_jitter", "image_size (224)", "224"]),
    ({"scale_jitter": 256}, ["scale_jitter", "expected str"]),
    ({"split": "val", "color_jitter": 0.4}, ["color_jitter", "train split only", "val"]),
    ({"split": "val", "scale_jitter": "256,480"}, ["scale_jitter", "train split only"]),
    ({"transform": "mypkg.aug"}, ["transform", "'mypkg.aug'", "package.module:callable"]),
    ({"transform": ":fn"}, ["transform", "package.module:callable"]),
    ({"transform": "mod:"}, ["transform", "package.module:callable"]),
])
def test_bad_augmentation_values_say_what_to_do(tmp_path: Path, values: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        DaemonConfig(buffer=tmp_path, **values)  # type: ignore[arg-type]
    for word in words:
        assert word in str(exc.value)


def test_a_val_daemon_may_have_a_hook(tmp_path: Path) -> None:
    assert DaemonConfig(buffer=tmp_path, split="val", transform="pkg:fn").transform == "pkg:fn"


def test_augmentation_keys_in_toml(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", 'color-jitter = 0.4\nscale_jitter = "256,480"\ntransform = "pkg.aug:rand"\n')
    values = load_toml(cfg)
    assert values == {"color_jitter": 0.4, "scale_jitter": "256,480", "transform": "pkg.aug:rand"}
    assert DaemonConfig(buffer=tmp_path, **values).scale_jitter_bounds == (256, 480)
    bad = write(tmp_path / "bad.toml", "scale_jitter = [256, 480]\n")
    with pytest.raises(ConfigError, match="scale_jitter"):
        load_toml(bad)


def test_augmentation_key_names_every_optional_augmentation(tmp_path: Path) -> None:
    assert DaemonConfig(buffer=tmp_path).augmentation == ""
    cfg = DaemonConfig(buffer=tmp_path, color_jitter=0.4, scale_jitter="256, 480", transform="my.pkg:aug")
    assert cfg.augmentation == "color_jitter=0.4;scale_jitter=256,480;transform=my.pkg:aug"
    assert DaemonConfig(buffer=tmp_path, color_jitter=0.2).augmentation != DaemonConfig(buffer=tmp_path, color_jitter=0.4).augmentation


@pytest.mark.parametrize("ranks", ["2", "0-3", "1,x"])
def test_ranks_outside_the_world_are_refused_when_the_config_is_made(tmp_path: Path, ranks: str) -> None:
    with pytest.raises(ConfigError, match="ranks"):
        DaemonConfig(buffer=tmp_path, world_size=2, ranks=ranks)
    assert DaemonConfig(buffer=tmp_path, world_size=2, ranks="1").local_ranks == (1,)


@pytest.mark.parametrize(("world_size", "ranks", "said"), [
    (2, "1-0", "the range 1-0 runs backwards; write 0-1"),
    (1, "0-1", "(world_size 1, the default: set --world-size to the job's number of ranks)"),
    (4, "0-5", "every rank must be in 0-3 (world_size 4)"),
])
def test_a_wrong_ranks_value_says_what_is_wrong_with_it(tmp_path: Path, world_size: int, ranks: str, said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        DaemonConfig(buffer=tmp_path, world_size=world_size, ranks=ranks)
    assert said in str(raised.value)


@pytest.mark.parametrize(("world_size", "ranks"), [(65536, None), (1024, "0-256"), (1024, "0-99,200-399"),
                                               (65536, "0-65535")])
def test_one_daemon_produces_at_most_a_boxs_ranks(tmp_path: Path, world_size: int, ranks: str | None) -> None:
    """Each rank is a folder and an fd the daemon keeps: a group member's job.json with world_size 65536 made
    65,536 folders and stalled the heartbeat.  A daemon takes at most MAX_LOCAL_RANKS, and says how to split."""
    from prefetchd.daemon.config import MAX_LOCAL_RANKS

    with pytest.raises(ConfigError) as raised:
        DaemonConfig(buffer=tmp_path, world_size=world_size, ranks=ranks)
    assert f"at most {MAX_LOCAL_RANKS} ranks" in str(raised.value) and "pass --ranks with this box's ranks" in str(raised.value)
    assert len(DaemonConfig(buffer=tmp_path, world_size=world_size, ranks=f"0-{MAX_LOCAL_RANKS - 1}").local_ranks) == MAX_LOCAL_RANKS
    assert DaemonConfig(buffer=tmp_path, world_size=MAX_LOCAL_RANKS).local_ranks == tuple(range(MAX_LOCAL_RANKS))


def test_a_rank_range_past_the_world_is_refused_before_it_is_counted(tmp_path: Path) -> None:
    """A range is checked against the world before its ranks are listed: 0-999999999 would fill the memory."""
    with pytest.raises(ConfigError, match=r"every rank must be in 0-7 \(world_size 8\)"):
        DaemonConfig(buffer=tmp_path, world_size=8, ranks="0-999999999999")


def test_readmes_table_of_start_flags_names_each_flag_with_its_default() -> None:
    """The table is written by hand beside DaemonConfig: every flag is in it once, a fixed default is the
    dataclass's, and the machine-sized ones say what the help says."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("`prefetchd start` flags", 1)[1].split("\n\n", 2)[1]
    rows = dict(re.findall(r"^\| `(--[a-z-]+)[^`]*` \| ([^|]+) \|", table, re.M))
    flags = {"--" + f.name.replace("_", "-"): f for f in dataclasses.fields(DaemonConfig)}
    assert set(rows) - {"--config", "--log-level"} == set(flags)  # those two are start's own, not the config's
    for flag, field in flags.items():
        if isinstance(field.default, (int, float)) and not isinstance(field.default, bool):
            assert rows[flag].strip() == str(field.default).removesuffix(".0"), flag
    assert rows["--readers"].startswith(f"{config_mod.URL_READERS} for a URL")
    assert rows["--min-free-mb"].startswith(f"{config_mod.MIN_FREE_SHARE:.0%} of the filesystem, ≥ {config_mod.MIN_FREE_MB}")


def test_the_data_help_names_every_file_list_suffix() -> None:
    """A .txt list is read as a file list too (docs/SOURCES.md); --data's help named .csv/.tsv alone."""
    from prefetchd.daemon.sources.filelist import LIST_SUFFIXES

    assert f"a {'/'.join(LIST_SUFFIXES)} file list" in FIELDS["data"].metadata["help"]


def test_only_a_refused_thread_or_process_is_told_as_a_limit() -> None:
    import errno

    from prefetchd.daemon.errors import out_of_processes

    for exc in (RuntimeError("can't start new thread"), BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")):
        said = out_of_processes(exc)
        assert said is not None and said.startswith(f"cannot start another thread or process ({exc})"), said
    for exc in (RuntimeError("another"), OSError(errno.ENOSPC, "No space left on device"), ValueError("x")):
        assert out_of_processes(exc) is None



def test_the_process_limit_is_said_with_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker server's death under `ulimit -u 9` named "ulimit -u" but neither its value nor --workers (a walk
    under OS limits); it says what a refused thread says."""
    import resource

    from prefetchd.daemon.errors import processes_taken

    monkeypatch.setattr(resource, "getrlimit", lambda which: (9, 9) if which == resource.RLIMIT_NPROC else (0, 0))
    said = processes_taken()
    assert said.startswith("the processes and threads allowed, this user's limit of 9 (ulimit -u), or its cgroup's "
                           "pids.max, are taken;") and said.endswith("or lower --workers"), said


@pytest.mark.parametrize(("flag", "value", "said"), [("--epochs", "1000001", "--epochs 1000001: must be at most 1000000"),
                                                     ("--color-jitter", "3.5e38", "--color-jitter 3.5e+38: must be at most 1000")])
def test_settings_past_what_a_job_can_run_are_refused_at_start(flag: str, value: str, said: str) -> None:
    """--epochs past the last epoch a batch's name holds was accepted, and the daemon died with an internal error
    as it built ahead into epoch 1,000,000; a colour jitter past float32's range failed every image as undecodable
    (a walk of extreme values)."""
    result = subprocess.run([sys.executable, "-m", "prefetchd", "start", "--buffer", "/dev/shm/never", "--data",
                             "/nonexistent", flag, value], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and said in result.stderr, result.stderr
