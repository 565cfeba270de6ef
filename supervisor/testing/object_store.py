"""A real S3-compatible HTTP server on this machine, for the tests, the benchmarks and the demo: moto's standalone
server (as Ray's own test suite uses), in a process of its own on a free port, reached through s3fs over HTTP as a
bucket would be. In front of it a small TCP proxy can be switched to answer every request with 503 (an outage of
the store), so that tests see retries at work; `down()` makes it so until `up()`, and `down_at(marker)` from the
first request that names `marker` (a key: the outage begins at an exact moment of a job, such as a rank's upload).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from supervisor.testing.local_cluster import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
_UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class S3Server:
    """moto's server with one bucket; `env` points s3fs (boto) at it through the proxy."""

    def __init__(self, bucket: str = "relaunch"):
        self.bucket = bucket
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.proxy = _Proxy(self.port)
        try:
            self._wait()
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/{bucket}", method="PUT")
            urllib.request.urlopen(req, timeout=10).close()
        except BaseException:
            self.shutdown()
            raise

    @property
    def endpoint(self) -> str:
        """Through the proxy (which `down()` breaks)."""
        return f"http://127.0.0.1:{self.proxy.port}"

    @property
    def direct_endpoint(self) -> str:
        """Straight to moto: for measurements."""
        return f"http://127.0.0.1:{self.port}"

    def env(self, direct: bool = False) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.direct_endpoint if direct else self.endpoint}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def down(self) -> None:
        self.proxy.fail()

    def down_at(self, marker: str) -> None:
        """Go down at the first request that names `marker` (that request is cut, never served), until `up()`."""
        self.proxy.trigger = marker.encode()

    def up(self) -> None:
        self.proxy.trigger, self.proxy.failing = None, False

    def _wait(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/moto-api/", timeout=2).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not start on port {self.port}") from None
                time.sleep(0.2)

    def shutdown(self) -> None:
        self.proxy.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _Proxy:
    """Forwards TCP connections to `target`; while `failing`, answers each new connection with a 503 (those open
    when it began failing are cut: a client's pooled connections would otherwise go on working). A client's bytes
    that hold `trigger` start the failing instead of being forwarded."""

    def __init__(self, target: int):
        self.target, self.failing = target, False
        self.trigger: bytes | None = None
        self.open: set[socket.socket] = set()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self.failing:
            with client:
                client.settimeout(2)
                try:
                    client.recv(65536)
                    client.sendall(_UNAVAILABLE)
                except OSError:
                    pass
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            client.close()
            return
        self.open |= {client, upstream}
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream, self._triggered)
        self.open -= {client, upstream}

    def _triggered(self, data: bytes) -> bool:
        """Whether `data` (from a client) starts the outage; then it fails, and `data` is not forwarded."""
        if self.trigger is None or self.trigger not in data:
            return False
        self.trigger = None
        self.fail()
        return True

    def fail(self) -> None:
        self.failing = True
        for s in list(self.open):
            _close(s)

    def close(self) -> None:
        self.sock.close()
        self.fail()


def _pipe(src: socket.socket, dst: socket.socket, stop=lambda data: False) -> None:
    try:
        while (data := src.recv(1 << 16)) and not stop(data):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _close(src)
        _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def apply_env(server: S3Server, direct: bool = False) -> None:
    """Point this process (and the processes it starts) at the server."""
    os.environ.update(server.env(direct))
