"""The model `kvfork clients` serves: written once per shape, and stored at every --kv-cache-dtype, so the real
clients run against quantized KV state too (`kvfork clients --kv-cache-dtype int4`)."""

import json
from pathlib import Path

import pytest
from backend_fixtures import fresh, load, release_all

from kvfork.backends import create_backend
from kvfork.backends.base import KVStorage
from kvfork.tools.clients.model import CONTEXT, SHAPE, write_tiny_long_model


@pytest.fixture(scope="module")
def clients_model(tmp_path_factory, tiny_model_dir) -> Path:
    return write_tiny_long_model(tmp_path_factory.mktemp("clients") / "model", Path(tiny_model_dir("llama")))


def test_a_folder_of_another_shape_is_written_anew_and_one_of_this_shape_kept(tmp_path, tiny_model_dir):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(SHAPE, head_dim=16, num_attention_heads=4)))
    write_tiny_long_model(folder, Path(tiny_model_dir("llama")))
    config = json.loads((folder / "config.json").read_text())
    assert {k: config[k] for k in SHAPE} == SHAPE and config["max_position_embeddings"] == CONTEXT
    written = (folder / "model.safetensors").stat().st_mtime_ns
    write_tiny_long_model(folder, Path(tiny_model_dir("llama")))
    assert (folder / "model.safetensors").stat().st_mtime_ns == written


@pytest.mark.parametrize("dtype,group", [("int8", 32), ("int8", 64), ("int4", 64), ("fp8", 64)])
def test_the_clients_model_is_served_at_every_kv_cache_dtype(clients_model, backend_name, dtype, group):
    if backend_name == "mlx" and dtype == "fp8":
        pytest.skip("fp8 is a torch storage")
    held = {}
    for stored in ("auto", dtype):
        b = create_backend(backend_name)
        b.set_kv_storage(KVStorage.named(stored, group))
        load(b, str(clients_model))
        session, _ = fresh(b, list(range(1, 300)))
        held[stored] = b.session_bytes(session)
        release_all(b, session)
    assert held[dtype] < held["auto"] / 2  # float32 weights: 16 bits or fewer an element, with the groups' scales
