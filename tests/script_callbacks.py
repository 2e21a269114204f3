"""Callbacks the resume scripts share (tests/*_script.py import it from
their own folder)."""

from __future__ import annotations

import os
import signal

import keras

import keras_ft


class Unsaved(keras.callbacks.Callback):
    """A test's probe: nothing of it is to be carried across a restart (and
    so nothing to warn of)."""

    def get_state(self) -> dict:
        return {}

    def set_state(self, state: dict) -> None:
        pass


class KillAt(Unsaved):
    """SIGKILLs the process at the end of batch `at` = (epoch, batches
    into it), once the backups in flight are committed (an exact point)."""

    def __init__(self, at: tuple[int, int] | None):
        super().__init__()
        self.at, self.epoch = at, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.at == (self.epoch, batch + 1):
            keras_ft.wait_for_backups()
            os.kill(os.getpid(), signal.SIGKILL)
