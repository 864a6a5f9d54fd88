"""A real nginx on a loopback port the kernel picks, serving a temporary directory.

nginx comes from Debian (`make test` installs it when missing); the configuration
is tests/remote/nginx.conf; the fixture is in tests/conftest.py. The access log records each request's Range header,
status and bytes sent, so tests can compare the traffic with the library's plan.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


@dataclass
class LogLine:
    method: str
    uri: str
    range: str
    status: int
    bytes_sent: int
    agent: str


@dataclass
class Nginx:
    root: Path
    url: str
    log: Path

    def requests(self) -> list[LogLine]:
        out = []
        for line in self.log.read_text().splitlines():
            method, uri, rest = line.split(" ", 2)
            rest, agent = rest.rsplit(' "', 1)
            rng, status, sent = rest.rsplit(" ", 2)
            out.append(LogLine(method, uri, rng.strip('"'), int(status), int(sent), agent.rstrip('"')))
        return out

    def clear_log(self) -> None:
        self.log.write_text("")


def _listening_socket() -> socket.socket:
    """A socket listening on 127.0.0.1 at a port the kernel picks; nginx inherits it
    (its ``NGINX`` variable, as in a binary upgrade), so no other process can take
    the port between choosing it and nginx listening on it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    sock.set_inheritable(True)
    return sock


def _wait_until_serving(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Until nginx answers an HTTP request (a connection alone proves nothing: the
    inherited socket accepts into its backlog before nginx runs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"nginx exited: {proc.stderr.read().decode()}")
        connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=1)
        try:
            connection.request("HEAD", "/")
            connection.getresponse()  # any HTTP answer (403 for the directory): nginx is serving
            return
        except OSError:
            time.sleep(0.05)
        finally:
            connection.close()
    proc.kill()
    pytest.fail(f"nginx did not answer within {timeout} s")


def start_nginx(tmp_path_factory: pytest.TempPathFactory):
    """Start nginx serving a fresh directory; a generator that stops it when closed."""
    if NGINX is None:
        pytest.fail("nginx is not installed; `make test` installs it (apt-get install nginx)")
    prefix = tmp_path_factory.mktemp("nginx")
    root = prefix / "www"
    root.mkdir()
    sock = _listening_socket()
    port = sock.getsockname()[1]
    template = (Path(__file__).parent / "remote" / "nginx.conf").read_text()
    conf = prefix / "nginx.conf"
    conf.write_text(template.format(root=root, port=port, prefix=prefix))
    env = {**os.environ, "NGINX": f"{sock.fileno()};"}
    with sock:
        proc = subprocess.Popen(
            [NGINX, "-c", str(conf), "-p", str(prefix)], stderr=subprocess.PIPE, pass_fds=[sock.fileno()], env=env
        )
    url = f"http://127.0.0.1:{port}"
    _wait_until_serving(proc, url, timeout=10)
    (prefix / "access.log").write_text("")  # without the request that proved nginx serves
    yield Nginx(root, url, prefix / "access.log")
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    proc.stderr.close()
