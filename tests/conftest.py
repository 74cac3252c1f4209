"""Fixtures shared by the tests that change the registry or the HAL_* environment."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

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


def pytest_configure(config):
    """Under pytest-xdist each worker's torch takes its share of the cores, not all of them: two workers of two
    threads each on two cores run slower than one worker."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


# Lines a test wants printed at the end of the run (tests/test_mutants.py: the mutation score). They travel in the
# test's report (user_properties), so they reach the terminal from a pytest-xdist worker too.
_SUMMARY: list[str] = []


@pytest.fixture
def summary_lines(request) -> Iterator[list[str]]:
    """Append a line here to have it printed in the run's terminal summary."""
    lines: list[str] = []
    yield lines
    request.node.user_properties.extend(("hal_summary", line) for line in lines)


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        _SUMMARY.extend(value for name, value in report.user_properties if name == "hal_summary")


def pytest_terminal_summary(terminalreporter, config):
    for line in _SUMMARY:
        terminalreporter.write_line(line)
