"""One compiled executable per operation, made on first use
(`keras_ft/backend/jit_cache.py`)."""

from __future__ import annotations

from conftest import run_once_on

from keras_ft.backend import jit_cache

ONCE = run_once_on("torch", "a cache; the backend does not matter")


@ONCE
def test_each_operation_is_made_once_and_reused(monkeypatch):
    monkeypatch.setattr(jit_cache, "_compiled", {})
    made = []

    def make(name):
        def factory():
            made.append(name)
            return object()

        return factory

    first = jit_cache.compiled("copy", make("copy"))
    assert jit_cache.compiled("copy", make("copy again")) is first
    other = jit_cache.compiled("finite", make("finite"))
    assert other is not first and made == ["copy", "finite"]
