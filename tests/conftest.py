"""Fixtures shared by the tests that change the registry or the HAL_* environment."""

from __future__ import annotations

import pytest

from hal.registry import get_registry, unregister_device

SELECTION_ENV = ("HAL_DEVICE", "HAL_ATTENTION_BACKEND", "HAL_PREFILL_BACKEND", "HAL_DECODE_BACKEND")


@pytest.fixture
def restore_registry():
    """Drop what a test registered and reload. Request it before monkeypatch: it must be torn down after."""
    before = set(get_registry().extra)
    yield
    for name in set(get_registry().extra) - before:
        unregister_device(name)
    get_registry(reload=True)


@pytest.fixture
def clean_hal_env(restore_registry, monkeypatch):
    """No HAL_* selection variable, no plugin filter, no Triton interpreter."""
    for name in (*SELECTION_ENV, "HAL_PLUGINS", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def cpu_only(clean_hal_env, monkeypatch):
    """Only the cpu plugin loads."""
    monkeypatch.setenv("HAL_PLUGINS", "cpu")
    assert sorted(get_registry(reload=True).devices) == ["cpu"]


# Lines a test wants printed at the end of the run (tests/test_mutants.py: the mutation score).
SUMMARY_LINES = pytest.StashKey[list]()


@pytest.fixture
def summary_lines(request) -> list[str]:
    """Append a line here to have it printed in the run's terminal summary."""
    return request.config.stash.setdefault(SUMMARY_LINES, [])


def pytest_terminal_summary(terminalreporter, config):
    for line in config.stash.get(SUMMARY_LINES, []):
        terminalreporter.write_line(line)
