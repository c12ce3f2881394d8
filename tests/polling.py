"""Waiting on other processes in multi-process tests: there is no event to wait on across
processes, so these tests poll, each wait bounded in time and named."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_for(what: str, condition: Callable, deadline_s: float, *, interval_s: float = 0.1,
             detail: Callable[[], str] | None = None):
    """Poll `condition()` until it returns something truthy and return that; after `deadline_s`
    fail the test naming `what`, followed by `detail()` (the daemons' logs, say)."""
    end = time.monotonic() + deadline_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > end:
            pytest.fail(f"gave up after {deadline_s:g} s waiting for {what}" + (f"\n{detail()}" if detail else ""))
        time.sleep(interval_s)
