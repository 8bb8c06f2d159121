"""A loopback HTTP proxy in front of an object store, for tests and benchmarks.

It forwards every request to ``upstream`` and can add latency (``delay``),
answer the next N requests with an error (``fail_next``; 503 SlowDown unless
``error`` names another status and S3 error code), and counts the
requests it saw by method and query, so a test can tell "listed" from "read"
over real sockets.  Point a client at it with ``AWS_ENDPOINT_URL``.

    python tools/http_proxy.py --upstream http://127.0.0.1:5000 --delay 0.02
"""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import click

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}
SLOW_DOWN = (503, "SlowDown", "Please reduce your request rate.")


def error_body(code: str, message: str) -> bytes:
    """An S3 error document, as botocore parses it into ``ClientError.response["Error"]``."""
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()


class Proxy:
    def __init__(self, upstream: str, delay: float = 0.0, host: str = "127.0.0.1", port: int = 0) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.delay = delay
        self.fail_next = 0
        self.error = SLOW_DOWN  # (HTTP status, S3 error code, message) of the failed answers
        self.requests: Counter[str] = Counter()  # "GET list", "GET object", "HEAD", "PUT", ...
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                query = urlsplit(self.path).query
                kind = self.command
                if self.command == "GET":
                    kind += " list" if ("list-type" in query or "delimiter" in query or "prefix" in query) else " object"
                with proxy.lock:
                    proxy.requests[kind] += 1
                    fail = proxy.fail_next > 0
                    proxy.fail_next -= fail
                if proxy.delay:
                    time.sleep(proxy.delay)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if fail:
                    status, code, message = proxy.error
                    self._reply(status, [("Content-Type", "application/xml")], error_body(code, message))
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    # A HEAD's length is the object's, as the store said it: its body is none.
                    dropped = HOP_HEADERS | ({"content-length"} if self.command != "HEAD" else set())
                    self._reply(resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in dropped], data)
                finally:
                    conn.close()

            def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                if not any(k.lower() == "content-length" for k, _ in headers):
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="http-proxy", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Proxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def count(self, kind: str) -> int:
        with self.lock:
            return self.requests[kind]


@click.command()
@click.option("--upstream", required=True, help="The object store, e.g. http://127.0.0.1:5000")
@click.option("--delay", type=float, default=0.0, show_default=True, help="Seconds added to every request.")
@click.option("--port", type=int, default=0, help="Port to listen on [default: a free one].")
def main(upstream: str, delay: float, port: int) -> None:
    """Serve the proxy on 127.0.0.1 until interrupted."""
    proxy = Proxy(upstream, delay, port=port).start()
    click.echo(f"proxy {proxy.url} -> {upstream} (+{delay * 1000:.0f} ms)")
    try:
        proxy.thread.join()
    except KeyboardInterrupt:
        proxy.stop()


if __name__ == "__main__":
    main()
