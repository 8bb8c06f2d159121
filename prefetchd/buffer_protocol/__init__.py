"""The contract between the daemon (writer) and the trainer (reader).

Stdlib, numpy, msgpack and psutil (is a pid the live daemon: ownership.py) only; no torch, no pickle
anywhere.  SPEC.md is the normative text.
"""

from prefetchd.buffer_protocol.batch import (
    HEADER,
    HEADER_FORMAT,
    HEADER_SIZE,
    MAGIC,
    PAGE_SIZE,
    VERSION,
    BatchLayout,
    BatchMeta,
    MappedBatch,
    map_batch,
    not_of_stream,
    parse_batch,
)
from prefetchd.buffer_protocol.errors import ProtocolError
from prefetchd.buffer_protocol.job_request import BadJobRequest, JobRequest
from prefetchd.buffer_protocol.layout import (
    DEFAULT_CONSUMER,
    batch_name,
    check_consumer,
    consumer_lock_name,
    list_batches,
    list_consumer_locks,
    list_consumers,
    list_temp_files,
    parse_batch_name,
    progress_name,
    stream_dir,
)
from prefetchd.buffer_protocol.manifest import Manifest
from prefetchd.buffer_protocol.ownership import (BufferBusy, DaemonLock, DaemonOwner, alive_since, consumer_held,
                                                 daemon_owner, daemon_pid, lock_holders, pid_named, same_pid_namespace,
                                                 take_lock, why_no_owner, writer_alive, writer_named)
from prefetchd.buffer_protocol.progress import Progress
from prefetchd.buffer_protocol.status import (
    BadFile,
    ConsumerStatus,
    Errors,
    JobResult,
    Position,
    Production,
    Quantiles,
    Rates,
    RemoteNode,
    RemoteStatus,
    RunningJob,
    State,
    Status,
    StorageWait,
    StreamStatus,
    Totals,
    TrainerStatus,
    WorkerStall,
)
from prefetchd.buffer_protocol.status_file import read_status, readable_status, write_status
from prefetchd.buffer_protocol.writer import PendingBatch, RoomNotYet, SlotFiller, SpareFiles, write_batch

__all__ = [
    "HEADER", "HEADER_FORMAT", "HEADER_SIZE", "MAGIC", "PAGE_SIZE", "VERSION",
    "DEFAULT_CONSUMER", "check_consumer", "consumer_lock_name", "list_consumer_locks", "list_consumers", "progress_name",
    "BadJobRequest", "BatchLayout", "BatchMeta", "BufferBusy", "DaemonLock", "JobRequest", "MappedBatch", "Manifest",
    "PendingBatch", "Progress", "ProtocolError", "RoomNotYet", "SlotFiller", "SpareFiles", "alive_since", "batch_name", "consumer_held",
    "DaemonOwner", "daemon_owner", "daemon_pid", "list_batches", "lock_holders", "pid_named", "same_pid_namespace", "take_lock",
    "why_no_owner", "writer_alive", "writer_named",
    "list_temp_files", "map_batch", "not_of_stream", "parse_batch", "parse_batch_name", "read_status", "readable_status",
    "stream_dir", "write_batch", "write_status",
    "BadFile", "ConsumerStatus", "Errors", "JobResult", "Position", "Production", "Quantiles", "Rates", "RemoteNode", "RemoteStatus", "RunningJob", "State",
    "Status", "StorageWait", "StreamStatus", "Totals", "TrainerStatus", "WorkerStall",
]
