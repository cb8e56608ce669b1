"""`--model` takes a folder or a hub id; both backends and the launcher resolve it the same way."""

from __future__ import annotations

import pytest

from kvfork.backends.model_path import resolve_model


def test_local_folder_is_itself(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("name", ["/no/such/folder", "./missing", "not-a-hub-id", "a/b/c"])
def test_missing_folder_is_a_clear_error(name):
    with pytest.raises(FileNotFoundError, match="no model folder"):
        resolve_model(name)


def test_hub_id_unavailable_offline_names_the_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="cannot fetch no-such-org/no-such-model from the Hugging Face hub"):
        resolve_model("no-such-org/no-such-model")
