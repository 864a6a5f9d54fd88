"""A real nginx on a free loopback port, serving a temporary directory.

nginx comes from Debian (`make test` installs it when missing); the configuration
is tests/remote/nginx.conf. The access log records each request's Range header,
status and bytes sent, so tests can compare the traffic with the library's plan.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def start_nginx(tmp_path_factory: pytest.TempPathFactory):
    """Start nginx serving a fresh directory; a generator that stops it when closed."""
    if NGINX is None:
        pytest.fail("nginx is not installed; `make test` installs it (apt-get install nginx)")
    prefix = tmp_path_factory.mktemp("nginx")
    root = prefix / "www"
    root.mkdir()
    port = free_port()
    template = (Path(__file__).parent / "remote" / "nginx.conf").read_text()
    conf = prefix / "nginx.conf"
    conf.write_text(template.format(root=root, port=port, prefix=prefix))
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(prefix)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"nginx exited: {proc.stderr.read().decode()}")
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("nginx did not start listening within 10 s")
    (prefix / "access.log").touch()
    yield Nginx(root, f"http://127.0.0.1:{port}", prefix / "access.log")
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    proc.stderr.close()
