"""Which internals this installation can use, learned once, and what is lost
without each (`keras_ft/compat/registry.py`). Backups made without the real
capabilities: `test_compat.py`."""

from __future__ import annotations

import warnings

import pytest
from conftest import run_once_on

from keras_ft.compat import registry
from keras_ft.errors import CompatibilityWarning

ONCE = run_once_on("torch", "the registry alone; the backend does not matter")


@pytest.fixture
def capabilities(monkeypatch):
    """Three capabilities of a test's own, in a registry of their own; the
    checks run are counted."""
    monkeypatch.setattr(registry, "_known", {})
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    checks: list[str] = []

    def check(name, result):
        def run():
            checks.append(name)
            if isinstance(result, Exception):
                raise result
            return result

        return run

    registry.register("there", "nothing is lost")(check("there", True))
    registry.register("moved", "resumes are slower")(check("moved", False))
    registry.register("broken", "a broken check", applies=lambda: False)(
        check("broken", RuntimeError("no such attribute"))
    )
    return checks


def lost(record) -> list[str]:
    return [str(w.message) for w in record if w.category is CompatibilityWarning]


@ONCE
def test_each_check_runs_once_and_a_missing_one_warns_once(capabilities):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert registry.usable("there") and registry.usable("there")
        assert not registry.usable("moved") and not registry.usable("moved")
        assert not registry.available("broken")  # A check that raises: missing.
    assert capabilities == ["there", "moved", "broken"]
    (said,) = lost(record)
    assert "resumes are slower" in said and "its internals moved" in said
    assert "capability 'moved'" in said and "Backups and resumes still work" in said


@ONCE
def test_a_use_that_raised_turns_the_capability_off(capabilities):
    assert registry.usable("there")
    with pytest.warns(CompatibilityWarning, match="using it raised KeyError: 'x'"):
        registry.fail("there", KeyError("x"))
    assert not registry.available("there")


@ONCE
def test_probe_checks_what_applies_here(capabilities):
    with pytest.warns(CompatibilityWarning, match="capability 'moved'"):
        assert registry.probe() == {"there": True, "moved": False}
    assert "broken" not in capabilities  # Does not apply: never checked.
    assert registry.names() == ["broken", "moved", "there"]


@ONCE
def test_the_environment_turns_capabilities_off(capabilities, monkeypatch):
    monkeypatch.setenv(registry.DISABLE_ENV, " there , other")
    with pytest.warns(
        CompatibilityWarning, match=f"turned off by {registry.DISABLE_ENV}"
    ):
        assert not registry.usable("there")
    monkeypatch.setenv(registry.DISABLE_ENV, "all")
    assert not registry.available("moved") and not registry.available("there")
    monkeypatch.setenv(registry.DISABLE_ENV, "")
    assert registry.available("there")


@ONCE
def test_disabled_turns_off_inside_the_block_and_warns_again_there(capabilities):
    with pytest.warns(CompatibilityWarning):
        registry.usable("moved")  # Warned once already...
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with registry.disabled("there", "moved"):
            assert not registry.usable("there") and not registry.usable("moved")
            with registry.disabled("there"):  # Nested: changes nothing.
                assert not registry.available("there")
            assert not registry.available("there")
        assert registry.usable("there")  # On again after the block.
        assert not registry.usable("moved")  # ...and not again after it.
    assert len(lost(record)) == 2  # One for each inside the block.
    unknown = pytest.raises(ValueError, match="Unknown keras-ft capabilities")
    with unknown, registry.disabled("nope"):
        pass
