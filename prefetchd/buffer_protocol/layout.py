"""The buffer directory: its fixed file names, how they are listed and parsed, and where each rank's
stream lives.  The JSON documents in it are ``manifest``'s, ``progress``'s, ``job_request``'s and
``status``'s (its file ``status_file``'s), each written and read through ``json_files``; who owns the buffer is
``ownership``'s.

::

    <buffer>/
      daemon.lock                 flock()ed by the one daemon that owns the buffer; holds its pid
      manifest.json               what the daemon produces (written by the daemon)
      progress.json               next (epoch, step) the trainer needs (written by the trainer)
      progress.NAME.json          the same for consumer NAME, when several trainers share the buffer
      progress[.NAME].json.lock   flock()ed by the one trainer reading as that consumer
      status.json                 fill, rates, errors, heartbeat (written by the daemon)
      job.json                    a job a trainer asks the daemon to produce (written by trainers)
      job.accepted.json           the daemon's copy of the job it accepted, which a restart resumes
      e000000-s00000000.batch     finished batches, named by (epoch, step)
      e000000-s00000001.tmp       a batch being built; never read
      rank-00001/                 with world_size > 1: one stream directory per rank, each holding
                                  that rank's manifest.json, progress.json and batches

Every JSON document carries ``format`` and ``version`` and is replaced
atomically (``json_files.write_json``), so a reader sees the old or the new
document, never a mix.
"""

from __future__ import annotations

import numbers
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from prefetchd.buffer_protocol.errors import ProtocolError, user_name

# What the public functions take for a directory: a str as well as a Path.
Dir = str | os.PathLike[str]


# How a folder is opened to work in it through its fd (``at``): never through a link.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def at(path: Path, dir_fd: int | None) -> str | Path:
    """What to pass to an ``os`` call with ``dir_fd``: the name in that folder where an fd is given, else the path.

    The daemon goes through a stream folder's fd (``Stream``): with --group-access a member of the group may
    rename the buffer's entries and put a link to a folder of the daemon's user under a ``rank-*`` name, and a
    path looked up again would then lead there, where a name looked up in the fd's folder cannot.
    ``path`` stays what messages show."""
    return path.name if dir_fd is not None else path


LOCK_NAME = "daemon.lock"
MANIFEST_NAME = "manifest.json"
PROGRESS_NAME = "progress.json"
STATUS_NAME = "status.json"
JOB_NAME = "job.json"
ACCEPTED_JOB_NAME = "job.accepted.json"  # the daemon's copy of the request it accepted last
DOCUMENT_KINDS = ("manifest", "progress", "status", "job")  # each document's format is prefetchd.<kind>
BATCH_SUFFIX = ".batch"
TEMP_MARK = ".tmp"
SPARE_PREFIX = "spare-"  # a consumed batch file kept for reuse (writer.SpareFiles)
# The mode of what a trainer (or `prefetchd submit`) writes in a buffer: its progress, its consumer lock,
# job.json.  The daemon, the buffer's owner, reads them: through the buffer's group where they are another
# member's (--group-access: the folder's setgid gives them its group), or as others where a root trainer
# made them.  Set whatever the writer's umask: under 077 they were 0600, and a service daemon could read
# none, so it never saw a trainer move.  Only the owner writes them (a lock file is locked read-only); the
# buffer's own mode (0700, or 2770) keeps everyone else out.
TRAINER_FILE_MODE = 0o644

_BATCH_RE = re.compile(r"e(\d{6})-s(\d{8})\.batch", re.ASCII)
MAX_EPOCH = 10**6 - 1
MAX_STEP = 10**8 - 1
_TEMP_RE = re.compile(r"^(e\d{6}-s\d{8}\.tmp|spare-\d{8}\.tmp|.+\.json\.tmp-\d+-[0-9a-f]+)$")


# Several trainers (a sweep, an ensemble) may read one stream; each is a consumer with its own
# progress file.  The default consumer ("") keeps progress.json, so a single trainer names none.
DEFAULT_CONSUMER = ""
CONSUMER_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,32}", re.ASCII)
_NAMED_PROGRESS_RE = re.compile(r"progress\.([A-Za-z0-9_-]{1,32})\.json", re.ASCII)


def check_consumer(name: str) -> str:
    """``name`` if it may name a consumer ("" for the default one); ValueError saying why not."""
    if name == DEFAULT_CONSUMER or (isinstance(name, str) and CONSUMER_NAME_RE.fullmatch(name)):
        return name
    raise ValueError(f"consumer name {name!r}: use 1 to 32 letters, digits, '_' or '-' (e.g. 'trial-3'), "
                     "or leave it out for the default consumer")


def progress_name(consumer: str = DEFAULT_CONSUMER) -> str:
    """The progress file of ``consumer``: progress.json for the default one, progress.NAME.json otherwise."""
    return PROGRESS_NAME if check_consumer(consumer) == DEFAULT_CONSUMER else f"progress.{consumer}.json"


# Every consumer's progress file of a stream folder, as a shell pattern for messages ("remove those files").
PROGRESS_PATTERN = "progress*.json"

CONSUMER_LOCK_SUFFIX = ".lock"


def consumer_lock_name(consumer: str = DEFAULT_CONSUMER) -> str:
    """The file the trainer reading as ``consumer`` holds ``flock`` on: its progress file's name + .lock."""
    return progress_name(consumer) + CONSUMER_LOCK_SUFFIX


def is_consumer_lock(file_name: str) -> bool:
    return file_name.endswith(CONSUMER_LOCK_SUFFIX) and consumer_of(file_name.removesuffix(CONSUMER_LOCK_SUFFIX)) is not None


def consumer_of(file_name: str) -> str | None:
    """The consumer whose progress file is called ``file_name``; None for any other name."""
    if file_name == PROGRESS_NAME:
        return DEFAULT_CONSUMER
    m = _NAMED_PROGRESS_RE.fullmatch(file_name)
    return m[1] if m else None


def list_consumers(directory: Dir) -> list[str]:
    """The consumers with a progress file in ``directory`` (a stream directory), sorted."""
    return list(consumer_files(directory))


def consumer_files(directory: Dir, dir_fd: int | None = None) -> dict[str, int]:
    """``list_consumers``, each with its progress file's inode number as the listing gives it (no stat): a
    writer replaces the file by a rename (``json_files.replace_file``), which gives it a new one."""
    return dict(sorted((consumer, entry.inode()) for consumer, entry in consumer_entries(directory, dir_fd)))


def consumer_entries(directory: Dir, dir_fd: int | None = None) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Each consumer with a progress file in ``directory`` (listed through its fd ``dir_fd`` where given), with
    the file's entry in the listing, in the listing's order; nothing where ``directory`` is not there."""
    if dir_fd is None and not os.path.isdir(directory):
        return
    with os.scandir(directory if dir_fd is None else dir_fd) as entries:
        for entry in entries:
            consumer = consumer_of(entry.name)
            if consumer is not None:
                yield consumer, entry


def list_consumer_locks(directory: Dir) -> list[Path]:
    """The consumers' lock files in ``directory`` (links and folders under their names left out)."""
    with os.scandir(directory) as entries:
        return sorted(Path(e.path) for e in entries if is_consumer_lock(e.name) and not e.is_dir(follow_symlinks=False))


STREAM_PREFIX = "rank-"
STREAM_RE = re.compile(r"rank-\d{5}", re.ASCII)


def stream_dir(buffer: Dir, rank: int, world_size: int) -> Path:
    """Where rank ``rank``'s manifest, progress and batches live.

    One rank keeps the flat layout; with several, each rank has its own directory
    so trainers of different ranks never see each other's files.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: a job has at least one rank")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return Path(buffer) if world_size == 1 else Path(buffer) / f"{STREAM_PREFIX}{rank:05d}"


def stream_dirs(buffer: Dir) -> list[Path]:
    """The rank stream directories in ``buffer``, in rank order; a link under such a name is none."""
    return sorted(d for d in Path(buffer).glob(f"{STREAM_PREFIX}*") if d.is_dir() and not d.is_symlink())


def owning_buffer(directory: Dir) -> Path:
    """The buffer whose daemon owns ``directory``: its parent for a rank's stream directory, one with a daemon.lock,
    or, without one, one that others than its owner may write without a sticky bit (a --group-access buffer, 2770):
    a member of its group may remove the lock, and the rank-NNNNN folder of theirs beside it was taken for a buffer
    of their own, whose manifest and batches the readers' owner checks (``check_owned``) then passed."""
    directory = Path(directory)
    if STREAM_RE.fullmatch(directory.name) and ((directory.parent / LOCK_NAME).exists()
                                                or _shared_folder(directory.parent)):
        return directory.parent
    return directory


def _shared_folder(folder: Path) -> bool:
    """Whether others than the owner of ``folder`` may rename, and remove, what is in it."""
    try:
        mode = os.stat(folder).st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH)) and not mode & stat.S_ISVTX


# -- whose files a reader takes ------------------------------------------------------------------------------------
# Only the daemon writes manifests, status and batches, as the owner of the buffer's folder.  With --group-access a
# member of the buffer's group may rename files and folders of their own in under those names (also a whole
# rank-NNNNN folder of theirs, with a manifest and batches in it), so a reader takes a file, and a stream folder,
# from the buffer folder's owner only (SPEC rule 7).


def check_stream_folder(folder: Dir, owner: int | None = None) -> os.stat_result:
    """The lstat of stream folder ``folder``; ProtocolError unless it is a folder (not a link) of ``owner`` (by
    default the owner of its buffer), naming both owners and what to do."""
    folder = Path(folder)
    buffer = owning_buffer(folder)
    owner = os.stat(buffer).st_uid if owner is None else owner
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ProtocolError(f"{folder}: is {'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'not a folder'}, not "
                            f"the stream folder {user_name(owner)} (the daemon's user, owner of {buffer}) made; remove it "
                            "and restart the daemon, which makes its own")
    if st.st_uid != owner:
        raise ProtocolError(f"{folder}: belongs to {user_name(st.st_uid)}, not to {user_name(owner)} who owns the buffer "
                            f"{buffer} and makes its stream folders: someone else (a member of the buffer's group?) "
                            f"put it there, and the trainer reads nothing from it; remove it (`rm -r {folder}`) and "
                            "restart the daemon, which makes its own")
    return st


def check_owned(path: Dir, uid: int, what: str) -> None:
    """ProtocolError unless ``uid`` (the owner of the file at ``path`` that a reader opened: its fstat) is the owner
    of the buffer's folder, who writes its ``what``; one in a stream folder of someone else names that folder."""
    path = Path(path)
    buffer = owning_buffer(path.parent)
    owner = os.stat(buffer).st_uid
    if uid == owner:
        return
    if path.parent != buffer:
        check_stream_folder(path.parent, owner)
    raise ProtocolError(f"{path}: belongs to {user_name(uid)}, not to {user_name(owner)} who owns the buffer {buffer} and "
                        f"writes its {what}: someone else (a member of the buffer's group?) put it there; remove it")


# The longest path the protocol makes below a buffer, in bytes: a named consumer's progress file's temp name in a
# rank's stream folder (rank-00000/progress.NAME.json.tmp-PID-HEX, PID at most 2**22 on Linux).
LONGEST_ENTRY = len(f"{STREAM_PREFIX}00000/progress.{'n' * 32}.json{TEMP_MARK}-{2**22}-{'0' * 8}")
NAME_MAX = 255  # bytes of one file name: every Linux filesystem a buffer lives on (tmpfs, ext4, xfs)
PATH_MAX = 4096  # bytes of a path the kernel takes, its closing NUL included


def unfit_buffer_path(buffer: str | os.PathLike[str]) -> str | None:
    """Why no daemon can keep a buffer at ``buffer``, whatever is there, and what to do; None where it can.  An
    empty path (an unset variable: ``--buffer "$BUF"``) was the working folder, batches and all among the user's
    files; a name past NAME_MAX was a traceback in every command but start; a path that leaves no room below it
    for the buffer's files started a daemon that failed every batch ("File name too long") and retried for good
    (a walk with odd paths)."""
    text = os.fspath(buffer)
    if not text:
        return "an empty path (an unset variable?); pass the buffer folder, e.g. /dev/shm/bf"
    long = next((part for part in Path(text).parts if len(os.fsencode(part)) > NAME_MAX), None)
    if long is not None:
        return (f"the name {long[:40]}... is {len(os.fsencode(long))} bytes long, more than the {NAME_MAX} a file "
                "name may have; pick a shorter one")
    size = len(os.fsencode(os.path.abspath(text)))
    if size + 1 + LONGEST_ENTRY >= PATH_MAX:
        return (f"the path is {size} bytes long, and the daemon's files in it take up to {LONGEST_ENTRY + 1} more, "
                f"past the {PATH_MAX - 1} bytes a path may have; pick a shorter one")
    return None


def batch_name(epoch: int, step: int) -> str:
    """The file name of batch (``epoch``, ``step``); ValueError outside what a name holds, TypeError for a
    non-integer (1.5 failed in the format, "Unknown format code 'd'")."""
    if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in (epoch, step)):
        raise TypeError(f"epoch {epoch!r} / step {step!r}: a batch is named by two integers")
    if not (0 <= epoch <= MAX_EPOCH and 0 <= step <= MAX_STEP):
        raise ValueError(f"epoch {epoch} / step {step} outside what a batch name holds (0-{MAX_EPOCH} / 0-{MAX_STEP})")
    return f"e{epoch:06d}-s{step:08d}{BATCH_SUFFIX}"


def spare_name(n: int) -> str:
    """The name of the daemon's ``n``-th spare: a consumed batch's file kept for a later batch (``writer.SpareFiles``)."""
    return f"{SPARE_PREFIX}{n:08d}{TEMP_MARK}"


def parse_batch_name(name: str) -> tuple[int, int] | None:
    m = _BATCH_RE.fullmatch(name)
    return (int(m[1]), int(m[2])) if m else None


def list_batches(buffer: Dir, dir_fd: int | None = None) -> dict[tuple[int, int], Path]:
    """Finished batch files in ``buffer`` (listed through its fd ``dir_fd`` where given) by (epoch, step)."""
    found: dict[tuple[int, int], Path] = {}
    if dir_fd is None and not os.path.isdir(buffer):
        return found
    with os.scandir(buffer if dir_fd is None else dir_fd) as entries:
        for entry in entries:
            key = parse_batch_name(entry.name)
            # Only regular files: a directory, FIFO or link under a batch's name is never one,
            # and deleting it as a consumed batch would fail.
            if key is not None and entry.is_file(follow_symlinks=False):
                found[key] = Path(buffer) / entry.name
    return found


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one a write in progress uses (``list_temp_files``)."""
    return TEMP_MARK in name and _TEMP_RE.match(name) is not None


def list_temp_files(buffer: Dir) -> Iterator[Path]:
    """Leftovers of writes that never finished (a killed daemon's)."""
    with os.scandir(buffer) as entries:
        for entry in entries:
            # Not a directory: unlinking one fails, and a directory is nobody's half-written file.
            if is_temp_name(entry.name) and not entry.is_dir(follow_symlinks=False):
                yield Path(entry.path)
