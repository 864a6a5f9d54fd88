"""A server without Range support (``python -m http.server``): the error says what the
server lacks and which servers work."""

import functools
import http.server
import re
import threading

import numpy as np
import pytest

import nnx_save


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_python_http_server_is_named_as_unable_to_serve_a_checkpoint(tmp_path):
    nnx_save.save_file({"w": np.ones(4, np.float32)}, tmp_path / "w.safetensors")
    handler = functools.partial(_Quiet, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/w.safetensors"
        wanted = (
            f"{url}: range request for bytes 0-65535 got HTTP 200; the server must answer ranges with 206. "
            "HTTP 200 is the whole file: this server ignores the Range header (python -m http.server does), so it "
            "cannot serve a checkpoint, which is read by byte ranges. Serve it with one that supports ranges: nginx"
        )
        with pytest.raises(nnx_save.RemoteError, match=re.escape(wanted)):
            nnx_save.load_file(url)
    finally:
        server.shutdown()
        server.server_close()
