"""Imported by the worker server alone, as the last of its preloads (``workers.forkserver_preload``): an import
is the only code multiprocessing runs in its forkserver, and this one makes the server volunteer for the kernel's
OOM killer.  Its workers inherit that from the fork on, before they unpickle their job and volunteer once more
themselves (``workers.worker_main``), and a server started again after its death volunteers again.

Before, a worker was the controller's equal for the OOM killer until its own code began, and the server
always: in a memory cgroup that ran out as both workers had just been replaced, the kernel took the controller,
the largest process, and the job died without a word (a 400 MiB cgroup, under a full test suite's load).  The
server's death ends its workers' reports at once (``worker_health.SERVER_GONE``), which the controller counts and
says as OOM kills, and the next worker start starts a new server.  The controller must not import this module."""

from prefetchd.daemon.workers import volunteer_for_oom_killer

volunteer_for_oom_killer()
