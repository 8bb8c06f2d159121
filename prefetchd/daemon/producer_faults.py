"""The producer's faults of the workers that build its batches: a local worker that died or hung, the local
workers given up, and a slice the Ray cluster handed back or could not start (``Producer``'s, as a mixin: the
controller's loop is in producer.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prefetchd.daemon.bad_samples import BadSamples
from prefetchd.daemon.builds import Builds
from prefetchd.daemon.errors import BadDataError, DaemonError
from prefetchd.daemon.pool import Worker, WorkerPool, with_heartbeat
from prefetchd.daemon.producer_status import STATUS_SECONDS
from prefetchd.daemon.remote import RemotePool
from prefetchd.daemon.remote.messages import Died, Hung, StartDied, StartHung
from prefetchd.daemon.tasks import Filled, Task, WriteFailed
from prefetchd.daemon.wakeup import Wakeup
from prefetchd.daemon.worker_health import WorkerHealth

log = logging.getLogger("prefetchd.daemon.producer")  # the producer's log, as it always was


class WorkerFaults:
    """What the producer does when a worker, local or on the Ray cluster, dies or hangs."""

    # Set by Producer.__init__.
    wake: Wakeup
    health: WorkerHealth
    builds: Builds
    bad: BadSamples
    pool: WorkerPool
    remote: RemotePool | None
    workers_wanted: int
    fatal: str | None
    fatal_error: type[DaemonError]

    if TYPE_CHECKING:  # the producer's
        @property
        def local_given_up(self) -> str: ...
        def _complete(self, task: Task, result: Filled | WriteFailed) -> None: ...
        def _write_status(self) -> None: ...

    def _replace_worker(self, worker: Worker, hung: bool = False) -> None:
        """Requeue a dead (or ``hung``, killed) worker's tasks and start another, unless stopping or too many
        died lately (``WorkerHealth.replace``).  A file that killed workers again and again is a bad sample
        (``WorkerHealth.died``): replaced, or the job stops over it."""
        if self.wake.stop_signal is not None:
            return
        crashed = None if hung else self.health.died(worker)
        self.builds.requeue(list(worker.tasks.values()))
        self.builds.tell_queued(self.health.crashed_items)  # the dead one's tasks, queued again, too
        if crashed is not None and (verdict := self.bad.replaced(*crashed)) is not None:
            self.fatal, self.fatal_error = verdict, BadDataError
            return
        if self.local_given_up:  # one that died in the same wait as the one after which the local workers went
            return
        too_many = self.health.replace(worker)
        if too_many is not None:
            self._local_workers_end(too_many)

    def _local_workers_end(self, why: str) -> None:
        """Too many local workers died lately (``WorkerHealth.replace``: ``why``).  Beside a Ray cluster (--ray) not
        given up, the cluster builds alone for the rest of the job: the local workers left are stopped and their
        tasks queued again for it, as a --workers 0 job's are; the mirror of ``RemotePool.give_up``: local workers
        die for this box's own reasons (the OOM killer, a hook's native module broken here only) while the nodes
        build on.  Else nothing else builds, and the job stops."""
        remote = self.remote
        if remote is None or remote.given_up:
            self.fatal = why
            return
        for worker in list(self.pool.workers):
            self.pool.kill(worker, self._complete)
            self.builds.requeue(list(worker.tasks.values()))
        self.pool.size = self.workers_wanted = 0
        remote.local_workers_given_up(why)
        log.warning("the local workers are given up for this job, the Ray cluster at %s builds alone (%s): %s",
                    remote.address, "connected" if remote.connected else "not connected yet: production waits for it",
                    why)

    def _remote_fault(self, task: Task, fault: Hung | Died) -> None:
        """A slice the cluster handed back because it hung there (its Ray workers killed), or because it killed the
        Ray worker building it: judged and queued again as a local worker's task is (``_check_hangs``,
        ``_replace_worker``), unless its task hung too often or its file is one too many bad ones."""
        if isinstance(fault, Hung):
            why = self.health.hung_remotely(task, fault.sample, fault.seconds)
            if why is not None and self.fatal is None:
                self.fatal = why
            if self.fatal is None:
                self.builds.requeue([task])
            return
        crashed = self.health.died_remotely(task, fault.sample, fault.how)
        self.builds.requeue([task])
        self.builds.tell_queued(self.health.crashed_items)
        if crashed is not None and (verdict := self.bad.replaced(*crashed)) is not None and self.fatal is None:
            self.fatal, self.fatal_error = verdict, BadDataError

    def _ray_start_fault(self, fault: StartDied | StartHung, task: Task | None) -> None:
        """A Ray worker died before its first image, or a slice did not begin in --worker-start-timeout (the bridge
        submits the slice again either way): counted; where the cluster's workers all die so
        (``WorkerHealth.ray_start_died``) or that slice never begins (``WorkerHealth.ray_start_hung``), the local
        workers build alone for the rest of the job (``RemotePool.give_up``), or with none (--workers 0) the job
        stops.  The cluster's workers fail where the local ones do not (a hook module, or prefetchd, missing or
        broken on the nodes): with local workers the trainer goes on, slower, and the status says why."""
        assert self.remote is not None
        if isinstance(fault, StartHung):
            why = self.health.ray_start_hung(task, fault.seconds, self.remote.slices) if task is not None else None
        else:
            why = self.health.ray_start_died(task, fault.node, fault.how, fault.text, self.remote.slices)
        if why is None or self.fatal is not None:
            return
        if not self.workers_wanted:
            self.fatal = why
            return
        remote = self.remote  # the bridge's stop takes seconds: the status goes on meanwhile
        with_heartbeat(lambda: remote.give_up(why, self.builds.requeue), self._write_status, STATUS_SECONDS)

    def _check_hangs(self) -> None:
        """Kill each worker that has made no progress for --task-timeout and retry its tasks on a new one, so
        that its batch is built as ever; or stop the job, where that task hung too often (``WorkerHealth``).
        A slice at the Ray cluster that makes no progress is said alike; the bridge hands it back itself."""
        for worker in self.health.hung(self.remote.stalled_slice() if self.remote is not None else None):
            why = self.health.kill(worker, self._complete)
            if why is not None and self.fatal is None:
                self.fatal = why
            if self.fatal is not None:  # that, or a result the worker sent before it was killed
                return
            self._replace_worker(worker, hung=True)
