"""URLs are told apart by the response, not by their names:
a presigned URL keeps its query string, paths are joined by the URL's rules, and a
``.bin`` at a URL is a :class:`~nnx_save.NotSafetensorsError` as it is on disk.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import nnx_save

TREE = {f"t{i}": np.full((256,), float(i), np.float32) for i in range(4)}


def same(loaded: dict[str, np.ndarray]) -> bool:
    return loaded.keys() == TREE.keys() and all(np.array_equal(loaded[k], v) for k, v in TREE.items())


def test_a_presigned_file_url_keeps_its_query(nginx):
    nnx_save.save_file(TREE, nginx.root / "signed.safetensors")
    assert same(nnx_save.load_file(f"{nginx.url}/signed.safetensors?X-Amz-Signature=abc&X-Amz-Expires=60"))


def test_an_index_url_with_a_query_reads_its_files(nginx):
    nnx_save.save_file(TREE, nginx.root / "signed_index", max_shard_size=2048)
    assert same(nnx_save.load_file(f"{nginx.url}/signed_index/model.safetensors.index.json?download=true"))
    assert same(nnx_save.load_file(f"{nginx.url}/signed_index?download=true"))  # a directory URL, query kept


def test_a_bin_url_is_not_safetensors(nginx, tmp_path):
    torch_pickle = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19." + bytes(64)  # protocol 2: torch.save's magic number
    (tmp_path / "pytorch_model.bin").write_bytes(torch_pickle)
    (nginx.root / "pytorch_model.bin").write_bytes(torch_pickle)
    with pytest.raises(nnx_save.NotSafetensorsError) as on_disk:
        nnx_save.read_header(tmp_path / "pytorch_model.bin")
    with pytest.raises(nnx_save.NotSafetensorsError, match=re.escape(f"{nginx.url}/pytorch_model.bin: this is")) as e:
        nnx_save.read_header(f"{nginx.url}/pytorch_model.bin")
    assert e.value.format == on_disk.value.format
