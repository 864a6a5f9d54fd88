"""The nginx fixture for the remote-source tests (see tests/nginx_server.py)."""

import pytest
from nginx_server import start_nginx


@pytest.fixture(scope="session")
def nginx(tmp_path_factory):
    yield from start_nginx(tmp_path_factory)
