"""Test-wide setup: 8 simulated CPU devices before jax is imported, strict warnings
(pyproject), derandomized hypothesis, no address but loopback for object stores, and
the servers the remote-source tests share (nginx, moto's S3), one per test process."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# pytest-xdist's workers start with COLUMNS=80 and LINES=24 in their environment, which a
# serial run has not: progress bars would be drawn 80 wide there and 100 (the fallback) here.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

# s3fs is installed (for the local S3 server): an s3:// URL that no test points at
# moto must never reach a cloud address, nor a developer's credentials. botocore's
# credential chain would ask the instance metadata address; its default endpoint is
# AWS. Here both are off or on loopback (port 9: discard, nothing listens), for this
# process and every process it starts.
for _name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
    os.environ.pop(_name, None)
os.environ.update(
    AWS_EC2_METADATA_DISABLED="true",
    AWS_ACCESS_KEY_ID="testing",
    AWS_SECRET_ACCESS_KEY="testing",
    AWS_DEFAULT_REGION="us-east-1",
    AWS_CONFIG_FILE=os.devnull,
    AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    AWS_ENDPOINT_URL="http://127.0.0.1:9",
)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from nginx_server import start_nginx  # noqa: E402
from s3_server import start_s3  # noqa: E402

settings.register_profile(
    "nnx_save",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
settings.load_profile("nnx_save")


@pytest.fixture(scope="session")
def nginx(tmp_path_factory):
    """A real nginx serving a fresh directory on 127.0.0.1 (tests/nginx_server.py)."""
    yield from start_nginx(tmp_path_factory)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (tests/s3_server.py), started on first use."""
    yield from start_s3()


def pytest_collection_modifyitems(config, items):
    """For `make test`'s parallel run (pytest-xdist, ``--dist loadgroup``): each test
    file is one unit of work, so its module fixtures are built once; the tests that
    start several JAX processes are one unit, run one after another on one worker
    (their session fixtures serve them all, and two clusters at once would only
    compete for the cores), and it is scheduled first, being the longest."""
    for item in items:
        group = "multiprocess" if item.get_closest_marker("multiprocess") else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: not item.get_closest_marker("multiprocess"))  # stable: the rest keeps its order
