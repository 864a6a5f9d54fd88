"""moto's S3 server on 127.0.0.1: a real S3 endpoint over HTTP that s3fs talks to, as
s3fs's own CI does.

Run as a script it is the server: it listens on a port the kernel picks (so parallel
test processes never race for one), prints ``PORT <n>`` once it listens, and serves
until its standard input closes — so it stops with the test process however that ends.
:func:`start_s3` launches it and is a generator that stops it when closed.
"""

from __future__ import annotations

import http.client
import logging
import os
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

START_TIMEOUT = 60.0  # moto imports botocore's service models: seconds on a busy machine


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT

    @property
    def options(self) -> dict[str, str]:
        """fsspec's ``s3`` options (``fsspec.config.conf["s3"]``) for this server."""
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}


def _read_port(proc: subprocess.Popen, deadline: float) -> int | None:
    """The port of the server's ``PORT <n>`` line, waited for until ``deadline``;
    None if the server exited or said nothing by then (it is killed)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if selector.select(timeout=left):
                line = proc.stdout.readline()
                if line.startswith("PORT "):
                    return int(line.split()[1])
                if not line:  # the server exited
                    break
    proc.kill()
    proc.wait(timeout=10)
    return None


def _stop(proc: subprocess.Popen) -> None:
    if proc.stdin is not None:
        proc.stdin.close()  # the server's signal to stop
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


def _check_serving(port: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/")  # S3's ListBuckets, over HTTP
        assert connection.getresponse().status == 200
    finally:
        connection.close()


def start_s3():
    """Start moto's S3 server; a generator that yields an :class:`S3Server` and stops it."""
    # The server's stderr goes to a file: a pipe that nobody reads could fill and block it.
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
        try:
            port = _read_port(proc, time.monotonic() + START_TIMEOUT)
            if port is None:
                log.seek(0)
                said = log.read()[-2000:].decode(errors="replace")
                pytest.fail(f"moto's S3 server did not start within {START_TIMEOUT} s (exit {proc.returncode}): {said}")
            _check_serving(port)
            yield S3Server(f"http://127.0.0.1:{port}")
        finally:
            _stop(proc)


def main() -> None:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(f"PORT {server.get_host_and_port()[1]}", flush=True)
    os.dup2(2, 1)  # anything printed later goes to the log, not to a pipe nobody reads
    sys.stdin.read()  # until the test process closes it (or ends)
    server.stop()


if __name__ == "__main__":
    main()
