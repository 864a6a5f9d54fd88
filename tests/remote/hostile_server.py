"""A lying HTTP server on 127.0.0.1 for the hostile-server tests.

It serves named objects (bytes) with real range support; a ``lie`` callable may
rewrite each answer before it is sent: status, headers, body, or a trickle delay
between bytes. Every request's headers are recorded. Loopback only; stops with the
test (``with HostileServer(...) as server``).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Answer:
    """One response: what the honest server would send, for ``lie`` to rewrite."""

    status: int
    headers: dict[str, str]
    body: bytes
    chunked: bool = False  # send the body with Transfer-Encoding: chunked (no Content-Length)
    trickle_s: float = 0.0  # pause before each byte of the body
    delay_s: float = 0.0  # pause before the status line
    stall_after: int | None = None  # send this many bytes of the body, then pause stall_s (and send the rest)
    stall_s: float = 0.0


@dataclass
class Request:
    number: int
    path: str
    headers: dict[str, str] = field(default_factory=dict)


def honest(objects: dict[str, bytes], path: str, range_header: str, etag: str | None) -> Answer:
    data = objects.get(path)
    if data is None:
        return Answer(404, {"Content-Length": "0"}, b"")
    m = re.fullmatch(r"bytes=(\d+)-(\d+)", range_header)
    if not m:
        return Answer(200, {"Content-Length": str(len(data))}, data)
    begin, end = int(m.group(1)), min(int(m.group(2)), len(data) - 1)
    body = data[begin : end + 1]
    headers = {"Content-Range": f"bytes {begin}-{end}/{len(data)}", "Content-Length": str(len(body))}
    if etag:
        headers["ETag"] = etag
    return Answer(206, headers, body)


class HostileServer:
    """``objects``: path -> bytes (mutable: tests replace objects mid-load).
    ``lie(request, answer) -> answer``: rewrite an answer (default: honest)."""

    def __init__(self, objects: dict[str, bytes], lie: Callable[[Request, Answer], Answer] | None = None) -> None:
        self.objects, self.lie = objects, lie or (lambda req, ans: ans)
        self.requests: list[Request] = []
        self.etags: dict[str, str] = {}  # path -> ETag sent (default: none)
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with server.lock:
                    req = Request(len(server.requests) + 1, self.path, dict(self.headers.items()))
                    server.requests.append(req)
                answer = honest(server.objects, self.path, self.headers.get("Range", ""), server.etags.get(self.path))
                answer = server.lie(req, answer)
                time.sleep(answer.delay_s)
                self.send_response(answer.status)
                for k, v in answer.headers.items():
                    if not (answer.chunked and k.lower() == "content-length"):
                        self.send_header(k, v)
                if answer.chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._body(answer)

            def _body(self, answer: Answer) -> None:
                if answer.stall_after is not None:
                    self._chunk(answer.body[: answer.stall_after], answer.chunked)
                    time.sleep(answer.stall_s)
                    answer = dataclasses.replace(answer, body=answer.body[answer.stall_after :], stall_after=None)
                if answer.trickle_s:
                    for i in range(len(answer.body)):
                        time.sleep(answer.trickle_s)
                        self._chunk(answer.body[i : i + 1], answer.chunked)
                else:
                    for i in range(0, len(answer.body), 1 << 20):
                        self._chunk(answer.body[i : i + (1 << 20)], answer.chunked)
                if answer.chunked:
                    self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def _chunk(self, data: bytes, chunked: bool) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                self.wfile.flush()

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # clients that give up on a lying answer break the connection on purpose

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HostileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
