"""Tell systemd how the daemon is doing: readiness, a status line, watchdog pings
and stopping (the ``sd_notify(3)`` protocol, for ``Type=notify`` units).

Written with the standard library instead of a dependency: the protocol is one
``AF_UNIX`` datagram of ``KEY=value`` lines per message, sent to the socket named
in ``$NOTIFY_SOCKET``, and the bindings on PyPI either need libsystemd to build
(``systemd-python``) or are a thin wrapper of these same few lines.

What systemd puts in the environment of the process it starts::

    NOTIFY_SOCKET     /run/systemd/notify, or "@name" for an abstract socket
    WATCHDOG_USEC     WatchdogSec= in microseconds; unset without a watchdog
    WATCHDOG_PID      the pid the watchdog pings must come from
    SYSTEMD_EXEC_PID  the pid systemd started (systemd >= 248)

``Notifier.from_env()`` reads them once and removes the first three from
``os.environ`` (``sd_notify``'s ``unset_environment``): the decode workers are
child processes that inherit the environment, and a child that believes it is
the service would ping the watchdog for a controller that may be hung, or, under
``NotifyAccess=all``, announce readiness or take over ``MAINPID``.  For the same
reason a process whose pid is not ``SYSTEMD_EXEC_PID`` (a daemon started by a
trainer that itself runs as a service) stays silent.

Nothing here raises into the daemon: a socket that points nowhere is reported
once and notifications are switched off; without ``$NOTIFY_SOCKET`` every call
is a no-op.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Callable, MutableMapping

from prefetchd.buffer_protocol import Production, Status
from prefetchd.words import counted

log = logging.getLogger(__name__)

# Removed from the environment once read (SYSTEMD_EXEC_PID stays: children compare against it).
ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
MAX_STATUS_CHARS = 1024  # `systemctl status` shows one line; keep the datagram small
# systemd reads its socket from its event loop; a full queue is momentary.  READY=1 and
# STOPPING=1 are worth a short wait (a lost READY=1 fails the start), the rest is not.
CRITICAL_RETRIES = 20
CRITICAL_RETRY_SECONDS = 0.005

# errno values that mean nobody will ever read what we send to that address.
_NOWHERE = {
    errno.ENOENT: "no such socket",
    errno.ECONNREFUSED: "nothing is listening on it",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is not a directory",
}


class Notifier:
    """Sends ``sd_notify`` messages; create it with :meth:`from_env`.

    Call :meth:`ready` once the buffer can be used, :meth:`status` about once a
    second, :meth:`watchdog` on every turn of the main loop (it sends at most one
    ping per half watchdog interval) and :meth:`stopping` when shutting down.
    """

    def __init__(
        self,
        address: str | None,
        watchdog_usec: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address  # as written in NOTIFY_SOCKET
        self._target: str | None = None
        self._interval = watchdog_usec / 1e6 if watchdog_usec else None
        self._clock = clock
        self._sock: socket.socket | None = None
        self._last_ping: float | None = None
        self._ready = False
        self._stopping = False
        self._warned: set[int] = set()
        if address is None:
            return
        if address.startswith("/"):
            self._target = address
        elif address.startswith("@") and len(address) > 1:
            self._target = "\0" + address[1:]  # Linux abstract namespace
        else:
            log.warning(
                "NOTIFY_SOCKET=%s is neither a socket path nor an abstract socket (@name); "
                "prefetchd cannot notify systemd over it and will not try", address,
            )

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None, *, unset: bool = True) -> Notifier:
        """A notifier for the socket systemd gave this process (a no-op one if none).

        With ``unset`` the variables are removed from ``environ`` (default
        ``os.environ``, which also updates the C environment children inherit).
        """
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        usec_text = env.get("WATCHDOG_USEC")
        watchdog_pid = env.get("WATCHDOG_PID")
        exec_pid = env.get("SYSTEMD_EXEC_PID")
        if unset:
            for name in ENV_VARS:
                env.pop(name, None)
        pid = os.getpid()
        if address and exec_pid and exec_pid.isdigit() and int(exec_pid) != pid:
            log.info(
                "NOTIFY_SOCKET=%s belongs to pid %s (SYSTEMD_EXEC_PID), not to this process (pid %d): "
                "not notifying systemd", address, exec_pid, pid,
            )
            address = None
        watchdog_usec: int | None = None
        if address and usec_text:
            if not usec_text.isdigit() or int(usec_text) == 0:
                log.warning("ignoring WATCHDOG_USEC=%r: expected a positive number of microseconds", usec_text)
            elif watchdog_pid and watchdog_pid != str(pid):
                log.debug("WATCHDOG_PID=%s is not this process (pid %d): not pinging the watchdog", watchdog_pid, pid)
            else:
                watchdog_usec = int(usec_text)
        return cls(address, watchdog_usec)

    # -- state ------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether messages are being sent (a socket is set and has not failed)."""
        return self._target is not None

    @property
    def watchdog_interval(self) -> float | None:
        """The unit's WatchdogSec= in seconds, or None when no watchdog is expected."""
        return self._interval if self.enabled else None

    # -- messages ---------------------------------------------------------------

    def ready(self, status: str) -> bool:
        """READY=1: the buffer can be used; ``systemctl start`` returns and units ordered after this one start.

        Only the first call sends READY=1; later ones (the next job of a daemon that
        serves jobs) just update the status line.
        """
        if self._ready:
            return self.status(status)
        self._ready = self._send(f"READY=1\nSTATUS={_one_line(status)}\nMAINPID={os.getpid()}", critical=True)
        return self._ready

    def status(self, text: str) -> bool:
        """STATUS=: the line `systemctl status` shows."""
        return self._send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        """WATCHDOG=1, at most once per half watchdog interval; cheap to call on every loop."""
        if self._interval is None or self._target is None:
            return False
        now = self._clock()
        if self._last_ping is not None and now - self._last_ping < self._interval / 2:
            return False
        if not self._send("WATCHDOG=1"):
            return False
        self._last_ping = now
        return True

    def stopping(self, status: str | None = None) -> bool:
        """STOPPING=1: the daemon is shutting down on its own or on a signal.

        Only the first call sends STOPPING=1 (so every exit path may call it); later
        ones just update the status line.
        """
        if self._stopping:
            return self.status(status) if status is not None else False
        text = "STOPPING=1" if status is None else f"STOPPING=1\nSTATUS={_one_line(status)}"
        self._stopping = self._send(text, critical=True)
        return self._stopping

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- sending ----------------------------------------------------------------

    def _send(self, message: str, *, critical: bool = False) -> bool:
        if self._target is None:
            return False
        data = message.encode("utf-8", "replace")
        try:
            if self._sock is None:
                # One unconnected socket, sendto() each time: systemd may recreate its
                # socket (daemon-reexec), and a connected datagram socket would go stale.
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            for _ in range(CRITICAL_RETRIES if critical else 1):
                try:
                    self._sock.sendto(data, self._target)
                    return True
                except BlockingIOError:
                    if critical:
                        time.sleep(CRITICAL_RETRY_SECONDS)
            log.debug("systemd's notify socket is busy; dropped %r", message.split("\n", 1)[0])
            return False
        except OSError as exc:
            self._failed(exc)
            return False

    def _failed(self, exc: OSError) -> None:
        reason = _NOWHERE.get(exc.errno or 0)
        if reason is not None:
            log.warning(
                "NOTIFY_SOCKET=%s points nowhere (%s): systemd will not see READY=1, the status line "
                "or watchdog pings, so a Type=notify unit would time out; is the unit Type=notify and "
                "does prefetchd run as its main process? Not notifying any more",
                self.address, reason,
            )
            self._target = None
            self.close()
        elif exc.errno not in self._warned:
            self._warned.add(exc.errno or 0)
            log.warning("cannot notify systemd at NOTIFY_SOCKET=%s: %s (will keep trying)", self.address, exc)


def _one_line(text: str) -> str:
    # A newline would start a new KEY=value assignment: a status text must not send WATCHDOG=1.
    return " ".join(str(text).split())[:MAX_STATUS_CHARS]


def status_line(status: Status) -> str:
    """The one-line summary of ``Producer.status()`` for STATUS=, e.g.
    ``filling 12/32 batches, 850 img/s, trainer at epoch 1 step 40 (3.2 batches/s, waits 2% for data)``.

    A status without a production (waiting for a job, starting) is summed up by its message.
    """
    p = status.production
    if p is None:
        return status.message or str(status.state)
    parts = [
        f"{status.state} {p.waiting}/{p.high_water} batches",
        f"{p.rates.samples_per_s:.0f} img/s",
        _trainers(p),
    ]
    for count, noun in (
        (p.errors.undecodable_files, "bad file"),
        (p.errors.worker_restarts, "worker restart"),
        (p.errors.worker_hangs, "hung worker"),
        (p.errors.write_failures, "failed build"),
    ):
        if count:
            parts.append(counted(count, noun))
    if p.errors.progress_file:
        parts.append("progress file ignored")
    line = ", ".join(parts)
    return f"{line}; {status.message}" if status.message else line


def _trainers(p: Production) -> str:
    """Where the trainer is (the slowest one of a daemon serving several ranks) and how it fares, in the words of
    `prefetchd status` (status_view): "no trainer yet" before one wrote progress, "left" once it closed its loader."""
    if p.no_trainer_yet:
        return f"no trainer yet (the buffer starts at epoch {p.progress.epoch} step {p.progress.step})"
    served = [s for s in p.streams if not s.no_trainer_yet]  # ranks whose trainer has written progress
    ranks = [s.progress for s in served]
    slowest = min(ranks or [p.progress], key=lambda pos: (pos.epoch, pos.step))
    where = f"epoch {slowest.epoch} step {slowest.step}"
    count = f"{len(served)} of {len(p.streams)}" if len(served) < len(p.streams) else f"{len(served)}"
    text = f"{count} trainers, slowest at {where}" if len(p.streams) > 1 else f"trainer at {where}"
    consumed = p.rates.consumed_batches_per_s
    details = [f"{consumed:.1f} batches/s"] if consumed > 0 else []
    shares = [pos.trainer_wait_share for pos in ranks or [slowest] if pos.trainer_wait_share is not None]
    if shares:
        details.append(f"waits {max(shares):.0%} for data")
    left = sum(s.all_left for s in served)  # closed its loader, its process gone or not (a notebook's kernel)
    gone = (sum(s.trainer.alive is False and not s.all_left for s in served) if p.streams
            else int(p.trainer.alive is False))  # a status without streams
    for n, word in ((left, "left"), (gone, "gone")):
        if n:
            details.append(word if len(p.streams) <= 1 else f"{n} {word}")
    consumers = [c for st in p.streams for c in st.consumers]
    if any(len(st.consumers) > 1 for st in p.streams):  # trainers share a stream: how many, how many hold batches
        details.append(f"{len(consumers)} consumers, {sum(c.holding for c in consumers)} holding")
    return f"{text} ({', '.join(details)})" if details else text


__all__ = ["Notifier", "status_line"]
