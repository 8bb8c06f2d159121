"""Imported by the worker server alone, as the last of its preloads (``workers.forkserver_preload``): an import
is the only code multiprocessing runs in its forkserver, and this one makes the server volunteer for the kernel's
OOM killer.  Its workers inherit that from the fork on, before they unpickle their job and volunteer once more
themselves (``workers.worker_main``), and a server started again after its death volunteers again.

Before, a worker was the controller's equal for the OOM killer until its own code began (after it unpickled its
job), and the server always was: in a memory cgroup that runs out as both workers have just been replaced, the
kernel would take the controller, the largest of equals, and the job die without a word.  The server's death
ends its workers' reports at once (``worker_health.SERVER_GONE``), which the controller counts and says as OOM
kills, and the next worker start starts a new server.  The controller must not import this module: it would
volunteer itself (``workers.oom_order_lost`` says where a daemon starts with its score too high already)."""

from prefetchd.daemon.workers import volunteer_for_oom_killer

volunteer_for_oom_killer()
