"""A fault-injecting HTTP proxy in front of nginx, for retry tests.

Each request is forwarded to the upstream; a ``plan`` callable decides, per request
number, to pass it through, answer 503, drop the connection before answering, or
send a truncated body. Loopback only; stops with the test.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultyProxy:
    def __init__(self, upstream_port: int, plan: Callable[[int, str], str]) -> None:
        self.upstream_port, self.plan = upstream_port, plan
        self.count = 0
        self.lock = threading.Lock()
        self.faults: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with proxy.lock:
                    proxy.count += 1
                    n = proxy.count
                action = proxy.plan(n, self.headers.get("Range", ""))
                if action == "drop":
                    proxy.faults.append(action)
                    self.close_connection = True
                    self.connection.close()
                    return
                if action == "503":
                    proxy.faults.append(action)
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                try:
                    conn.request(
                        "GET",
                        self.path,
                        headers={k: v for k, v in self.headers.items() if k.lower() in ("range", "accept-encoding")},
                    )
                    resp = conn.getresponse()
                    body = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding"):
                        self.send_header(k, v)
                self.end_headers()
                if action == "truncate":
                    proxy.faults.append(action)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # the faults we inject break connections on purpose

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
