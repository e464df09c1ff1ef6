"""Fixtures shared by test modules."""

import pytest


@pytest.fixture
def keep_malloc_defaults(monkeypatch):
    """The jaxport command tunes glibc's malloc for its process; tests that call `jaxport.cli.main` in the test
    process use this to leave the test process alone."""
    from jaxport import malloc

    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: None)
