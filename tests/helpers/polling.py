"""Waiting in tests for something another thread or process makes true: polled, failing with
what was waited for once a limit has passed (a limit, never a pause)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_for(what: str, ready: Callable[[], bool], timeout: float, every: float = 0.1) -> float:
    """Poll until ``ready()``, every ``every`` seconds; the seconds it took. Fails naming ``what``
    after ``timeout``."""
    start = time.monotonic()
    while not ready():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what}: not within {timeout:g}s")
        time.sleep(every)
    return time.monotonic() - start
