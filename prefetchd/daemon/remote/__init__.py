"""Remote producers: slices of batches built on a Ray cluster beside the local workers (``--ray``).

The controller's tasks (a batch's temp file, its slot offsets and a list of
(slot, sample index)) go to the local workers *and* to a Ray cluster, whichever
has room; both run ``fill.run_task``, the same decode/augment code, so a
batch is bit-identical wherever it was built::

    controller ──Task──► bridge process ──remote()──► Ray worker on any node
        ▲                    │                          run_task(job, task, sink=rows)
        │                    │◄── uint8 rows, labels ───┘  (object store)
        └──Filled────────────┘  write rows into the temp file's slots (SlotFiller)

The controller keeps everything it owns today: the manifest, progress, flow
control, begin/commit/abort of every batch, deletion, status and the lock.  Ray
supplies compute only.  The job (sample index, options) goes to the object store
once per job (``ray.put``); each task carries a reference to it, and a Ray
worker keeps the job it last read (``_job_here``).

A node that cannot read the dataset builds nothing: when a node with CPUs joins,
the bridge runs a task pinned to it (the node's ``ray.io/node-id`` label) that
reads a few samples spread over the split, ones the daemon's box reads, and each
Ray worker runs the same check before its first slice; it also checks that the node
runs the daemon's prefetchd version and imports the job's transform hook.  A node that
fails (no mount, no credentials, no prefetchd or another version, no hook module) is
named in a warning and in the status, and slices carry a label selector that excludes it.

Why a bridge process and not Ray calls in the controller: a Ray driver whose
cluster disappears blocks in its next call to the cluster (tried here: a 2-node
``cluster_utils.Cluster`` shut down under a driver left it hanging in
``.remote()``/``cluster_resources()`` for more than 40 s), and a driver whose
local raylet dies is ended by Ray.  The bridge is the Ray driver; the controller
talks to it over a pipe, like a worker, and never blocks on the cluster.  The
bridge fills the slots of the temp files it is given exactly as a local worker
does: it is the fill side of the batch writer (``buffer_protocol.writer``).

Faults.  A slice whose Ray worker or node died is submitted again by the bridge
(``MAX_ATTEMPTS`` times, then handed back to the controller, which queues it
for whoever has room); a slice outstanding ``STRAGGLER_FACTOR`` times longer
than the median is started a second time, and the first result wins.  The
local workers' guarantees hold here too (``worker_health``): each slice is a
streaming Ray task that says when it has begun, and one that has not come back
--task-timeout after that is cancelled, its Ray workers killed, and handed back
as hung (``Hung``); one that has not begun --worker-start-timeout after it was
submitted (its Ray worker's start blocks: a hook's module whose import never
returns there) is cancelled, its Ray worker killed, and submitted again, the
controller told (``StartHung``), which ends the cluster's part after
``MAX_TASK_HANGS`` of one slice in a row while the cluster builds nothing;
the one that has gone longest without progress (or without beginning) is
reported a quarter of the
way there (``Stalled``, in the bridge's ``Report``), and the controller says it
as a local worker's stall (the status's ``worker_stall``: a trainer waits on).
One that hung or lost its worker is built an item at a time from then on,
saying each sample first (a replacement too), so that its next hang names the
file and its next death is counted on that file (``Died``).  A Ray
worker that dies before its first image blames no file: the bridge submits its
slice again and tells the controller (``StartDied``), which ends the cluster's
part when more than ``MAX_WORKER_RESTARTS`` die so in a row while the
cluster builds nothing, as the restart limit does for local workers: the local
workers build the rest of the job alone (``RemotePool.give_up``: the bridge
stopped, its slices queued again, no reconnection), or with --workers 0 the
job stops.  Since a batch is a pure function of (seed, epoch, step, rank) nothing is lost or
duplicated.  The slices of a build the controller cancels (a rewind) are
forgotten by the bridge at its word (``Cancel``): answered at once and never
written after, since the build's temp file goes once they are answered.  A
bridge that dies, or reports nothing for ``SILENT_SECONDS`` (the cluster is
gone), is replaced every ``RECONNECT_SECONDS``; meanwhile its slices go back
to the queue and the local workers build them alone.

The pieces, each a module: ``pool.py`` the controller's side (``RemotePool``), which starts the bridge
and feeds it; ``messages.py`` what the two say over the pipe; ``bridge.py`` the bridge process
(``bridge_main``, and the ``Bridge``'s loop), with ``connect.py`` (``ray.init``, and why it failed),
``bridge_slices.py`` (the slices in flight: submitted, again, handed back, forgotten; each submission a
``slice_copy.py`` ``SliceCopy``), ``bridge_nodes.py`` (the nodes, their probes, the report) and
``bridge_rows.py`` (a node's build checked against the box's, and written into the temp file); ``task.py``
what runs on the Ray workers (``build_slice``, ``probe_node``).
"""

from prefetchd.daemon.remote.pool import RemotePool

__all__ = ["RemotePool"]
