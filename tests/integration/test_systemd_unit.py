"""systemd/prefetchd@.service and systemd/example.toml: systemd-analyze accepts the
unit (and does report a broken copy), the directives the service relies on are
there, its ExecStart matches the CLI, and the example config plans the buffer
within the unit's memory limit."""

from __future__ import annotations

import dataclasses
import re
import shutil
import stat
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from prefetchd.buffer_protocol import BatchLayout
from prefetchd.daemon.cli import start
from prefetchd.daemon.config import DaemonConfig, load_toml
from prefetchd.daemon.errors import EXIT_BAD_DATA, EXIT_BUFFER_BUSY, EXIT_USAGE
from prefetchd.daemon.buffer_dir import prepare_buffer
from prefetchd.daemon.sources.index_cache import UNIT_CACHE_DIRECTORY

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD / "prefetchd@.service"
EXAMPLE = SYSTEMD / "example.toml"
INSTALLED_BINARY = "/usr/local/bin/prefetchd"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
# The unit's sizing comment: the controller and fork server (torch imported), and each worker
# (~100 MiB measured at 224 px plus ImageNet's 42 MiB index); 15 workers unless the config says.
FIXED_MIB = 768
WORKER_MIB = 142
ASSUMED_WORKERS = 15


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value assigned (systemd allows repeats), continuation lines joined."""
    sections: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    lines = iter(text.splitlines())
    for line in lines:
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines).strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        sections[section][key.strip()].append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def value(unit: dict[str, dict[str, list[str]]], key: str, section: str = "Service") -> str:
    values = unit[section].get(key)
    assert values, f"{UNIT.name}: [{section}] has no {key}="
    return values[-1]


def test_required_directives(unit: dict[str, dict[str, list[str]]]) -> None:
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "KillMode": "mixed",
        "Restart": "on-failure",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "RemoveIPC": "no",
        "MemorySwapMax": "0",
        "CacheDirectory": "prefetchd",  # $CACHE_DIRECTORY: the default index cache, writable under ProtectSystem
    }
    for key, want in expected.items():
        assert value(unit, key) == want, key
    # Exits that a restart cannot mend: bad configuration, bad data, a buffer another daemon owns.
    assert set(value(unit, "RestartPreventExitStatus").split()) == {str(c) for c in (EXIT_USAGE, EXIT_BAD_DATA, EXIT_BUFFER_BUSY)}
    assert int(value(unit, "WatchdogSec")) >= 10  # the loop wakes every second; leave room for a slow turn
    # '-': the daemon creates the buffer; a missing path would fail the start with 226/NAMESPACE.
    assert "-/dev/shm/%i" in unit["Service"]["ReadWritePaths"]
    assert re.fullmatch(r"\d+[KMGT]?", value(unit, "MemoryMax"))
    assert "DynamicUser" not in unit["Service"]  # implies RemoveIPC=yes, which deletes the buffer on stop
    assert value(unit, "WantedBy", "Install") == "multi-user.target"


def test_the_cache_directory_config_show_names_is_the_units(unit: dict[str, dict[str, list[str]]]) -> None:
    """`prefetchd config --show` run outside the unit names where the unit's daemon keeps its index cache."""
    assert Path("/var/cache") / value(unit, "CacheDirectory") == UNIT_CACHE_DIRECTORY


def test_exec_start_names_the_instance_buffer_and_config_with_real_flags(unit: dict[str, dict[str, list[str]]]) -> None:
    argv = value(unit, "ExecStart").split()
    assert argv[:2] == [INSTALLED_BINARY, "start"]
    # Trainers of the prefetchd group read the buffer: the unit asks for group access itself,
    # so that no config can forget it.
    assert argv[-1] == "--group-access"
    args = dict(zip(argv[2:-1:2], argv[3:-1:2]))
    assert args == {"--buffer": "/dev/shm/%i", "--config": "/etc/prefetchd/%i.toml"}
    flags = {opt for param in start.params for opt in param.opts}
    assert set(args) | {"--group-access"} <= flags, f"ExecStart uses flags `prefetchd start` does not have: {set(args) - flags}"


def test_the_sandbox_lets_the_daemon_create_its_group_buffer(unit: dict[str, dict[str, list[str]]], tmp_path: Path) -> None:
    """--group-access makes the buffer setgid (trainers' files belong to the group); systemd's
    RestrictSUIDSGID=yes denies that bit on directories too, and the start would fail with EPERM."""
    buffer = tmp_path / "bf"
    prepare_buffer(buffer, group_access=True)
    assert buffer.stat().st_mode & stat.S_ISGID
    assert "--group-access" in value(unit, "ExecStart").split()
    assert unit["Service"].get("RestrictSUIDSGID", ["no"])[-1] != "yes"


def test_memory_max_holds_the_example_configs_buffer(unit: dict[str, dict[str, list[str]]]) -> None:
    # DESIGN: the high-water mark and the service's memory limit are planned together.
    cfg = load_toml(EXAMPLE)
    assert "high_water" in cfg, "the example must set high_water: the machine-sized default ignores MemoryMax="
    batch = BatchLayout.plan(cfg["batch_size"], cfg["image_size"], cfg["image_size"]).file_len
    workers = cfg.get("workers", ASSUMED_WORKERS)
    need = cfg["high_water"] * batch + (FIXED_MIB + workers * WORKER_MIB) * 2**20
    limit = value(unit, "MemoryMax")
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    limit_bytes = int(limit.rstrip("KMGT")) * units.get(limit[-1], 1)
    assert need < limit_bytes, f"MemoryMax={limit} is below the {need / 2**30:.2f} GiB the example config plans"


def test_example_config_and_each_commented_example_are_valid(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    DaemonConfig(buffer=Path("/dev/shm/bf"), **load_toml(EXAMPLE))
    commented = re.findall(r"^# ?([a-z_]+ = .+?)(?:\s+#.*)?$", text, flags=re.M)
    assert len(commented) >= 10
    for line in commented:
        extra = ("\nworld_size = 8" if line.startswith("ranks") else '\nray = "auto"' if line.startswith("ray_builds")
                 else "")
        config = tmp_path / "bf.toml"
        config.write_text(f"{text}\n{line}{extra}\n")
        DaemonConfig(buffer=Path("/dev/shm/bf"), **load_toml(config))  # ConfigError on a bad key or value


def test_the_example_config_shows_every_key() -> None:
    """It said "a commented key shows its default or an example", and six keys were not there (a walk of the docs
    against the commands); the two the unit's ExecStart gives are named instead."""
    text = EXAMPLE.read_text()
    shown = set(re.findall(r"^(?:# ?)?([a-z_]+) = ", text, flags=re.M))
    from_the_unit = {"buffer", "group_access"}
    missing = {f.name for f in dataclasses.fields(DaemonConfig)} - shown - from_the_unit
    assert not missing, f"example.toml shows no {sorted(missing)}"
    assert all(f"`{key}`" in text for key in from_the_unit)


def verify(unit_text: str, directory: Path) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify` an instance of ``unit_text`` installed as a template in ``directory``."""
    (directory / UNIT.name).write_text(unit_text)
    return subprocess.run(
        [str(ANALYZE), "verify", "--man=no", str(directory / "prefetchd@bf.service")],
        capture_output=True, text=True, timeout=60,
    )


def runnable(text: str) -> str:
    """The unit pointing at this environment's prefetchd: verify checks that ExecStart exists."""
    binary = Path(sys.executable).parent / "prefetchd"
    if not binary.exists():
        pytest.skip(f"no prefetchd entry point next to {sys.executable}")
    assert INSTALLED_BINARY in text
    return text.replace(INSTALLED_BINARY, str(binary))


def problems(result: subprocess.CompletedProcess[str]) -> list[str]:
    # verify also loads the units ours depends on (multi-user.target, ...); their complaints are not ours.
    return [line for line in (result.stdout + result.stderr).splitlines() if "prefetchd" in line]


@needs_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    result = verify(runnable(UNIT.read_text()), tmp_path)
    assert result.returncode == 0 and problems(result) == [], result.stdout + result.stderr


@needs_analyze
@pytest.mark.parametrize(
    ("change", "reported"),
    [
        (("KillMode=mixed", "KilMode=mixed"), "Unknown key"),
        (("Type=notify", "Type=notifyy"), "Failed to parse service type"),
        (("WatchdogSec=30", "WatchdogSec=thirty"), "Failed to parse sec value"),
    ],
)
def test_systemd_analyze_verify_reports_a_broken_unit(change: tuple[str, str], reported: str, tmp_path: Path) -> None:
    text = runnable(UNIT.read_text())
    assert change[0] in text
    result = verify(text.replace(change[0], change[1], 1), tmp_path)
    assert any(reported in line for line in problems(result)), result.stdout + result.stderr


@needs_analyze
def test_systemd_analyze_verify_reports_a_missing_binary(tmp_path: Path) -> None:
    result = verify(UNIT.read_text().replace(INSTALLED_BINARY, str(tmp_path / "no-such-prefetchd")), tmp_path)
    assert result.returncode != 0 and any("not executable" in line for line in problems(result))


@needs_analyze
def test_sandbox_exposure_stays_low(tmp_path: Path) -> None:
    (tmp_path / UNIT.name).write_text(runnable(UNIT.read_text()))
    result = subprocess.run(
        [str(ANALYZE), "security", "--offline=yes", "--no-pager", str(tmp_path / "prefetchd@bf.service")],
        capture_output=True, text=True, timeout=60,
    )
    match = re.search(r"Overall exposure level for prefetchd@bf\.service: (\d+\.\d+)", result.stdout + result.stderr)
    if match is None and "offline" in result.stderr:
        pytest.skip(f"this systemd-analyze has no --offline security review: {result.stderr.strip()}")
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= 2.5, f"the sandbox was loosened:\n{result.stdout}"
