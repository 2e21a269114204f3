"""keras-ft's events on Python's `logging`: routed, silenced, never twice."""

from __future__ import annotations

import io
import logging
import os
import time
import warnings

import keras
import pytest
from conftest import make_data, make_model

import keras_ft
from keras_ft import events


class Kept(logging.Handler):
    def __init__(self, level=logging.NOTSET):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def of(self, kind):
        return [r for r in self.records if r.name == f"keras_ft.{kind}"]


@pytest.fixture
def kept():
    """A handler on `keras_ft`, taken away after the test."""
    handler = Kept()
    root = logging.getLogger("keras_ft")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def silenced():
    """Levels set on kinds' loggers, set back after the test."""
    changed = {}

    def silence(kind, level=logging.CRITICAL):
        named = logging.getLogger(f"keras_ft.{kind}")
        changed.setdefault(named, named.level)
        named.setLevel(level)

    yield silence
    for named, level in changed.items():
        named.setLevel(level)


def interrupted(backup_dir, epochs=2):
    """A backup left by a fit() that stopped after `epochs` epochs."""
    x, y = make_data()

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch + 1 == epochs:
                raise KeyboardInterrupt

    callback = keras_ft.BackupAndRestore(backup_dir, verbose=0)
    with pytest.raises(KeyboardInterrupt):
        make_model().fit(
            x, y, epochs=5, batch_size=16, verbose=0, callbacks=[callback, Stop()]
        )
    keras_ft.wait_for_backups()  # fit() raised: nothing waited for the write.
    return x, y


def damage_newest(backup_dir):
    (newest,) = sorted(p for p in backup_dir.rglob("ckpt-*") if p.is_dir())[-1:]
    with open(newest / "metadata.json", "r+b") as f:
        f.seek(2)
        f.write(b"\x00")


def resume(backup_dir, x, y, **kwargs):
    model = make_model()
    callback = keras_ft.BackupAndRestore(backup_dir, **kwargs)
    model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[callback])


def test_without_a_handler_the_restore_line_is_printed_once(tmp_path, capsys):
    x, y = interrupted(str(tmp_path))
    capsys.readouterr()
    resume(str(tmp_path), x, y)
    lines = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("BackupAndRestore: restored")
    ]
    assert len(lines) == 1, lines


def test_a_handler_on_keras_ft_takes_the_events_and_the_lines(tmp_path, capsys, kept):
    x, y = interrupted(str(tmp_path))
    commits = kept.of("save")
    assert len(commits) == 2 and all(r.levelno == logging.INFO for r in commits)
    assert "committed" in commits[-1].getMessage()
    assert "epoch 2, batch 0, step 8" in commits[-1].getMessage()
    capsys.readouterr()
    kept.records.clear()
    resume(str(tmp_path), x, y)
    restored = [
        r for r in kept.of("restore") if "BackupAndRestore: restored" in r.getMessage()
    ]
    assert len(restored) == 1 and restored[0].levelno == logging.INFO
    assert "resuming at epoch 3/3" in restored[0].getMessage()
    # Routed: not printed as well.
    assert "BackupAndRestore" not in capsys.readouterr().out


def test_verbose_0_logs_without_printing(tmp_path, capsys, kept):
    x, y = interrupted(str(tmp_path))
    resume(str(tmp_path), x, y, verbose=0)
    assert len(kept.of("restore")) == 1
    logging.getLogger("keras_ft").removeHandler(kept)
    x, y = interrupted(str(tmp_path / "again"))
    capsys.readouterr()
    resume(str(tmp_path / "again"), x, y, verbose=0)
    assert "BackupAndRestore" not in capsys.readouterr().out


def test_a_silenced_kind_is_neither_logged_nor_printed(
    tmp_path, capsys, kept, silenced
):
    silenced("restore")
    x, y = interrupted(str(tmp_path))
    capsys.readouterr()
    resume(str(tmp_path), x, y)
    assert kept.of("restore") == []
    assert "BackupAndRestore: restored" not in capsys.readouterr().out
    assert len(kept.of("save")) >= 1  # Other kinds go on.


def test_a_warning_goes_to_the_handler_instead_of_warnings(tmp_path, kept):
    """A damaged newest checkpoint: the fallback is a warning of kind
    `restore`, logged once, and not raised as a Python warning too."""
    x, y = interrupted(str(tmp_path), epochs=3)
    damage_newest(tmp_path)
    kept.records.clear()
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        resume(str(tmp_path), x, y)
    fallbacks = [r for r in kept.of("restore") if r.levelno == logging.WARNING]
    assert len(fallbacks) == 1 and "Falling back" in fallbacks[0].getMessage()
    assert not [w for w in raised if "Falling back" in str(w.message)]


def test_without_a_handler_a_warning_is_a_python_warning(tmp_path):
    x, y = interrupted(str(tmp_path), epochs=3)
    damage_newest(tmp_path)
    with pytest.warns(UserWarning, match="Falling back"):
        resume(str(tmp_path), x, y)


def test_a_handler_above_its_level_does_not_take_the_line(tmp_path, capsys):
    """A handler for warnings only leaves the INFO lines printed."""
    handler = Kept(logging.WARNING)
    logging.getLogger("keras_ft").addHandler(handler)
    try:
        x, y = interrupted(str(tmp_path))
        capsys.readouterr()
        resume(str(tmp_path), x, y)
    finally:
        logging.getLogger("keras_ft").removeHandler(handler)
    assert "BackupAndRestore: restored" in capsys.readouterr().out
    assert handler.records == []


def test_a_root_handler_does_not_stop_the_printed_line(tmp_path, capsys):
    handler = Kept()
    root = logging.getLogger()
    root.addHandler(handler)
    level = logging.getLogger("keras_ft").level
    logging.getLogger("keras_ft").setLevel(logging.INFO)
    try:
        x, y = interrupted(str(tmp_path))
        capsys.readouterr()
        resume(str(tmp_path), x, y)
    finally:
        root.removeHandler(handler)
        logging.getLogger("keras_ft").setLevel(level)
    assert "BackupAndRestore: restored" in capsys.readouterr().out
    assert any(r.name == "keras_ft.restore" for r in handler.records)


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="'saves'"):
        events.log("saves", "x")
    assert set(events.KINDS) >= {
        "restore", "save", "fallback", "lease", "preemption", "stall", "tier",
    }  # fmt: skip


def test_a_short_transfer_draws_nothing_and_is_logged_at_its_end(kept):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    shown = events.Progress("restore", "keras-ft: downloading x", 4 << 20,
                            after=3600, stream=terminal)  # fmt: skip
    shown.add(1 << 20)
    shown.add(3 << 20)  # Whole: over, once.
    shown.close()
    assert terminal.getvalue() == ""
    (record,) = kept.of("restore")
    assert record.getMessage().startswith("keras-ft: downloading x: 4 MB in ")


def test_where_a_tiered_restore_reads_from_is_logged(tmp_path, kept):
    bucket = f"memory://events-tier-{os.getpid()}-{time.monotonic_ns()}"
    local = str(tmp_path / "ssd")
    x, y = make_data()

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt

    def fit(*callbacks):
        backup = keras_ft.BackupAndRestore(
            bucket, local_dir=local, local_save_freq=3, verbose=0
        )
        make_model().fit(x, y, epochs=3, batch_size=16, verbose=0,
                         callbacks=[backup, *callbacks])  # fmt: skip

    with pytest.raises(KeyboardInterrupt):
        fit(Stop())
    keras_ft.wait_for_backups()
    kept.records.clear()
    fit()
    (record,) = kept.of("tier")
    assert record.getMessage().startswith(f"restoring from the local tier {local}")


def test_a_long_restore_from_disk_draws_its_progress(tmp_path, monkeypatch):
    from keras_ft.checkpoint.store import CheckpointStore

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(events, "PROGRESS_AFTER", 0.0)  # Long enough here.
    terminal = Terminal()
    store = CheckpointStore(str(tmp_path / "chief"), progress=terminal)
    big = os.urandom(3 << 20)
    store.save(lambda staging: staging.write_file("big.bin", [big]), {"step": 1})
    _, metadata, _ = store.latest_good_read(lambda checkpoint, progress: None)
    assert metadata["step"] == 1
    (line,) = [ln for ln in terminal.getvalue().split("\n") if ln]
    last = line.split("\r")[-1]
    assert last.startswith("keras-ft: reading ckpt-00000001 [")
    assert "] 3 MB/3 MB" in last


def test_a_notice_said_once_per_process(monkeypatch):
    monkeypatch.setattr(events, "_said", set())
    assert events.first_time("nondeterminism", "jax")
    assert not events.first_time("nondeterminism", "jax")
    assert events.first_time("nondeterminism", "torch")  # Another key,
    assert events.first_time("best effort", "jax")  # or another kind.
