"""Object-storage reads per second for one worker, by reads in flight (``--readers``).

Starts moto's S3 server on loopback (``pip install 'prefetchd[test]'``), uploads
``--objects`` objects of ``--kib`` KiB, puts tools/http_proxy.py in front of it
with ``--latency`` ms added to every request (a real bucket answers small GETs in
tens of ms), then reads every object through prefetchd's own ``SampleReader``
(the worker's reader: FsspecStorage, retries, read-ahead pool) once per setting.
Server and proxy run in processes of their own, so that the reader's process
measures only itself.

    python tools/bench_s3.py --latency 20 --readers 1,4,16,32
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefetchd.daemon.dataset import SampleIndex  # noqa: E402
from prefetchd.daemon.sources import SampleReader  # noqa: E402
from prefetchd.daemon.sources.storage import FsspecStorage  # noqa: E402
from prefetchd.launch import stops_cleanly  # noqa: E402


def flat_index(url: str, names: list[str]) -> SampleIndex:
    blobs = [n.encode() for n in names]
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return SampleIndex(url, ("c",), np.frombuffer(b"".join(blobs), dtype=np.uint8), offsets,
                       np.zeros(len(blobs), dtype=np.int64), "bench")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serving(cmd: list[str], port: int) -> Iterator[str]:
    """Run ``cmd`` until it listens on ``port``; stop it afterwards."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise click.ClickException(f"{' '.join(cmd)} did not start listening on {port}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@click.command()
@click.option("--objects", type=int, default=256, show_default=True)
@click.option("--kib", type=int, default=110, show_default=True, help="Object size (an ImageNet JPEG is ~110 KiB).")
@click.option("--latency", "latencies", default="0,20", show_default=True, help="Milliseconds added per request, comma-separated.")
@click.option("--readers", "readers_list", default="1,4,16,32", show_default=True, help="Reads in flight, comma-separated.")
@stops_cleanly
def main(objects: int, kib: int, latencies: str, readers_list: str) -> None:
    port = free_port()
    with serving([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port) as upstream:
        run(upstream, objects, kib, latencies, readers_list)


def run(upstream: str, objects: int, kib: int, latencies: str, readers_list: str) -> None:
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=upstream)
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("bench")
    payload = os.urandom(kib << 10)
    names = [f"c/{i:06d}.jpg" for i in range(objects)]
    for name in names:
        fs.pipe_file(f"bench/data/{name}", payload)
    index = flat_index("s3://bench/data", names)
    click.echo(f"{objects} objects of {kib} KiB on moto {upstream}; one process, prefetchd's SampleReader")
    click.echo(f"{'latency':>8} {'readers':>8} {'reads/s':>9} {'MiB/s':>7}")
    for latency in (float(v) for v in latencies.split(",")):
        port = free_port()
        proxy_cmd = [sys.executable, str(Path(__file__).with_name("http_proxy.py")), "--upstream", upstream,
                     "--delay", str(latency / 1000), "--port", str(port)]
        with serving(proxy_cmd, port) as proxy:
            os.environ["AWS_ENDPOINT_URL"] = proxy
            for readers in (int(v) for v in readers_list.split(",")):
                reader = SampleReader(index, readers=readers)
                reader.storage = FsspecStorage(index.root)  # a new client on this proxy, as a new worker makes
                for f in reader.read_ahead(range(min(8, objects))):  # connect, warm the pool
                    f.result()
                start = time.perf_counter()
                got = sum(len(f.result()) for f in reader.read_ahead(range(objects)))
                seconds = time.perf_counter() - start
                reader.close()
                assert got == objects * len(payload)
                click.echo(f"{latency:>6.0f}ms {readers:>8} {objects / seconds:>9.0f} {got / seconds / 2**20:>7.1f}")


if __name__ == "__main__":
    main()
