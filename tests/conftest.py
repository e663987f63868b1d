"""Every test gets its own private state directory, so tests never touch the user's real one."""
import pytest


@pytest.fixture(autouse=True)
def private_state_dir(tmp_path, monkeypatch):
    path = tmp_path / "state"
    monkeypatch.setenv("HGTRAIN_STATE_DIR", str(path))
    return path
