"""What a process makes once, on first use (`keras_ft/once.py`)."""

from __future__ import annotations

from conftest import run_once_on

from keras_ft import once

ONCE = run_once_on("torch", "a cache; the backend does not matter")


@ONCE
def test_each_operation_is_made_once_and_reused(monkeypatch):
    monkeypatch.setattr(once, "_made", {})
    made = []

    def make(name):
        def factory():
            made.append(name)
            return object()

        return factory

    first = once.made_once("copy", make("copy"))
    assert once.made_once("copy", make("copy again")) is first
    other = once.made_once("finite", make("finite"))
    assert other is not first and made == ["copy", "finite"]
