"""A real S3 endpoint over HTTP: moto's server on 127.0.0.1 (tests/s3_server.py).
A presigned URL (its signature in the query string) loads as the file it names, and
the object is pinned to its size and ETag, through a presigned URL as through s3://."""

from __future__ import annotations

import re
import uuid

import boto3
import numpy as np
import pytest
from botocore.config import Config

import nnx_save

WEIGHTS = {"embed": np.arange(4096, dtype=np.float32).reshape(64, 64), "bias": np.ones(64, np.float32)}
OTHER = {"embed": np.zeros((64, 64), np.float32), "bias": np.ones(64, np.float32)}  # the same size


@pytest.fixture(params=["s3v4", "s3"], ids=["sigv4", "sigv2"])
def bucket(s3_server, request):
    """``(client, name)``: a fresh bucket, and a client signing URLs with either signature."""
    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(signature_version=request.param),
    )
    name = f"nnx-save-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    yield client, name
    for listed in client.list_objects_v2(Bucket=name).get("Contents", []):
        client.delete_object(Bucket=name, Key=listed["Key"])
    client.delete_bucket(Bucket=name)


def upload(client, bucket: str, tree: dict, tmp_path) -> str:
    """Save ``tree``, upload it as ``run/model.safetensors``; its presigned GET URL."""
    local = tmp_path / f"{uuid.uuid4().hex}.safetensors"
    nnx_save.save_file(tree, local)
    client.upload_file(str(local), bucket, "run/model.safetensors")
    params = {"Bucket": bucket, "Key": "run/model.safetensors"}
    return client.generate_presigned_url("get_object", Params=params, ExpiresIn=600)


def test_a_presigned_url_loads_the_file_it_names(bucket, tmp_path):
    """The URL ends in its query string, not in .safetensors; it names a file, not a
    directory whose index would be at '<url>?<query>/model.safetensors.index.json'."""
    client, name = bucket
    url = upload(client, name, WEIGHTS, tmp_path)
    assert re.search(r"/run/model\.safetensors\?.*(Signature|X-Amz-Signature)=", url), url
    tree, report = nnx_save.load_file(url, return_report=True, verify=True)
    assert sorted(tree) == ["bias", "embed"] and report.verified == ["bias", "embed"]
    for key, value in WEIGHTS.items():
        np.testing.assert_array_equal(tree[key], value)
    assert report.io.bytes_read == report.io.bytes_needed == sum(v.nbytes for v in WEIGHTS.values())
    assert sorted(nnx_save.read_header(url).tensors) == ["bias", "embed"]


def test_a_presigned_object_replaced_after_its_header_was_read_is_a_change(bucket, tmp_path):
    client, name = bucket
    url = upload(client, name, WEIGHTS, tmp_path)
    header = nnx_save.read_header(url)  # pins the size and the ETag
    assert upload(client, name, OTHER, tmp_path).split("?")[0] == url.split("?")[0]  # same size, other bytes
    with pytest.raises(nnx_save.SourceChangedError, match=re.escape(f"{url}: the object changed during the load")):
        nnx_save.load_file(header)
    np.testing.assert_array_equal(nnx_save.load_file(url)["embed"], OTHER["embed"])  # a fresh load: the new version
