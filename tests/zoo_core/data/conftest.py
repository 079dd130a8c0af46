"""The data tests never reach the network: every fetch fails at once as offline ($ZOO_OFFLINE), except in
tests that serve their files from a local HTTP server (fetch_test.py clears it)."""
import pytest

from zoo_core.data import fetch


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv(fetch.ENV_OFFLINE, "1")
