"""Kill a training with SIGKILL, start it again: keras-ft and Keras side by side.

Run with `keras-ft demo` (or `make demo`). Each training runs in its own
process, on data made here, and is killed with SIGKILL as a crash or the
out-of-memory killer would kill it:

1. once without interruption, for reference;
2. killed in the middle of an epoch and started again, with
   `keras_ft.BackupAndRestore` and with `keras.callbacks.BackupAndRestore`
   (both backing up every few batches): how many steps were trained twice,
   and whether the result equals the uninterrupted run;
3. killed while a backup is being written, and started again: is the backup
   still loadable?

Only this summary is printed: the training processes' framework logs are
silenced, and each phase shows a progress bar.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

EPOCHS, SAMPLES, BATCH_SIZE, SAVE_FREQ = 6, 1280, 32, 10
STEPS_PER_EPOCH = SAMPLES // BATCH_SIZE
TOTAL = EPOCHS * STEPS_PER_EPOCH
_LINE = "KERAS_FT_DEMO "


_SAY = threading.Lock()  # A commit is reported from the writer's thread.


def _say(kind: str, **fields) -> None:
    line = _LINE + json.dumps({"kind": kind, **fields}) + "\n"
    with _SAY:
        sys.stdout.write(line)
        sys.stdout.flush()


def _model() -> Any:
    """~0.65 M parameters: a backup of ~8 MB with Adam's moments."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(768, activation="relu"),
            keras.layers.Dense(768, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    return model


def _train(backup_dir: str, callback: str, seconds_per_batch: float) -> None:
    """The training process: an ordinary script with one of the callbacks."""
    import keras
    import numpy as np

    import keras_ft

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 64)).astype("float32")
    y = (x @ rng.normal(size=(64, 1))).astype("float32")
    model = _model()
    callbacks: list = []

    class Report(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            _say("begin", step=_step(self.model))

        def on_train_batch_end(self, batch, logs=None):
            time.sleep(seconds_per_batch)  # A bigger model's pace.
            _say("step", step=_step(self.model))

    if callback == "keras-ft":

        class Saves(keras_ft.CheckpointListener):
            def before_save(self, epoch, step):
                _say("save", step=step)

            def after_commit(self, path, epoch, step):
                _say("saved", step=step)

        callbacks.append(
            keras_ft.BackupAndRestore(
                backup_dir, save_freq=SAVE_FREQ, listeners=[Saves()], verbose=0
            )
        )
    elif callback == "keras":
        save_weights = model.save_weights

        def announced(*args, **kwargs):  # Keras' callback saves through this.
            _say("save", step=_step(model))
            save_weights(*args, **kwargs)
            _say("saved", step=_step(model))

        model.save_weights = announced
        callbacks.append(keras.callbacks.BackupAndRestore(backup_dir, SAVE_FREQ))
    try:
        model.fit(
            x, y, epochs=EPOCHS, batch_size=BATCH_SIZE, verbose=0,
            callbacks=[*callbacks, Report()],
        )  # fmt: skip
    except Exception as e:  # Shown by the parent: what a user would see.
        _say("failed", error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()])
    _say("done", step=_step(model), weights=weights.tobytes().hex())


def _train_on_request() -> None:
    """A training process started ahead: imports, then waits for its run."""
    import keras  # noqa: F401  (The start-up the parent overlaps.)

    import keras_ft  # noqa: F401

    line = sys.stdin.readline()
    if line:  # Nothing when the demo ends: this process was not needed.
        request = json.loads(line)
        _train(request["backup_dir"], request["callback"],
               request["seconds_per_batch"])  # fmt: skip


def _step(model) -> int:
    return (
        int(model.optimizer.iterations.numpy())
        if hasattr(model.optimizer.iterations, "numpy")
        else int(model.optimizer.iterations)
    )


class Run:
    """One training process, followed through its report lines."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self.events: list[dict] = []

    def next_event(self) -> dict | None:
        for line in self.process.stdout:
            if line.startswith(_LINE):
                try:
                    event = json.loads(line[len(_LINE) :])
                except ValueError:
                    continue  # Cut short by the kill.
                self.events.append(event)
                return event
        return None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        # What it printed before it died is still in the pipe.
        while select.select([self.process.stdout], [], [], 0)[0]:
            if self.next_event() is None:
                break

    def finish(self, bar: Bar) -> dict:
        while (event := self.next_event()) is not None:
            if event["kind"] == "step":
                bar.show(event["step"])
        self.process.wait()
        last = self.events[-1] if self.events else {"kind": "failed", "error": "?"}
        if last["kind"] not in ("done", "failed"):
            last = {"kind": "failed", "error": f"exit status {self.process.returncode}"}
        return last

    def first(self, kind: str) -> dict | None:
        return next((e for e in self.events if e["kind"] == kind), None)

    def last(self, kind: str) -> dict | None:
        return next((e for e in reversed(self.events) if e["kind"] == kind), None)


class Launcher:
    """Starts each training in a process that has already imported Keras.

    The next process is started while the current training runs, so its
    framework start-up overlaps the training instead of following it.
    """

    def __init__(self, seconds_per_batch: float):
        self.seconds_per_batch = seconds_per_batch
        self.spare = self._start()

    @staticmethod
    def _start() -> subprocess.Popen:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
        return subprocess.Popen(
            [sys.executable, "-m", "keras_ft.demo", "--train-on-request"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip

    def run(self, backup_dir: str, callback: str) -> Run:
        process, self.spare = self.spare, self._start()
        request = {"backup_dir": backup_dir, "callback": callback,
                   "seconds_per_batch": self.seconds_per_batch}  # fmt: skip
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.close()
        except BrokenPipeError:
            pass  # It died starting up: `finish()` reports its exit status.
        return Run(process)

    def close(self) -> None:
        self.spare.kill()  # It has only imported: nothing to end cleanly.
        self.spare.wait()


class Bar:
    def __init__(self, label: str):
        self.label = label
        self.tty = sys.stdout.isatty()

    def show(self, step: int, note: str = "") -> None:
        if not self.tty:
            return
        filled = int(30 * min(step, TOTAL) / TOTAL)
        text = (
            f"   {self.label:<16} [{'#' * filled}{'.' * (30 - filled)}] {step}/{TOTAL}"
        )
        print(f"\r{text} {note}".ljust(100), end="", flush=True)

    def done(self, text: str) -> None:
        if self.tty:
            print("\r" + " " * 100 + "\r", end="")
        print(f"   {self.label:<16} {text}")


def _position(step: int) -> str:
    return f"epoch {step // STEPS_PER_EPOCH + 1}, batch {step % STEPS_PER_EPOCH}"


def _crash_and_resume(
    launcher: Launcher, root: str, callback: str, label: str, reference: dict,
    kill_at: int | None, in_save: bool,
) -> bool:  # fmt: skip
    """Runs, kills (at a step, or during a save after it), runs again."""
    backup_dir = os.path.join(root, f"{callback}-{'save' if in_save else 'step'}")
    bar = Bar(label)
    for attempt in range(10):
        run = launcher.run(backup_dir, callback)
        while (event := run.next_event()) is not None:
            if event["kind"] == "step":
                bar.show(event["step"])
                if not in_save and event["step"] >= kill_at:
                    break
            if in_save and event["kind"] == "save" and event["step"] >= kill_at:
                time.sleep(random.uniform(0.0, 0.004))
                break
        run.kill()
        save, saved = run.last("save"), run.last("saved")
        landed = save is not None and (saved is None or saved["step"] < save["step"])
        if not in_save or landed or attempt == 9:
            break
        shutil.rmtree(backup_dir, ignore_errors=True)  # Try again, afresh.
    killed_step = run.last("step")["step"] if run.last("step") else 0
    if not in_save:
        where = f"killed at step {killed_step} ({_position(killed_step)})"
    elif landed:
        where = f"killed during the save at step {save['step']}"
    else:
        where = f"killed at step {killed_step}, between saves (10 tries missed them)"
    again = launcher.run(backup_dir, callback)
    result = again.finish(bar)
    begin = again.first("begin")
    if result["kind"] == "failed":
        bar.done(f"{where}; started again: fit() FAILED: {result['error']}")
        return False
    resumed_at = begin["step"] if begin else 0
    run = result["step"] - resumed_at
    same = result["weights"] == reference["weights"]
    equal = "bitwise equal to" if same else "differ from"
    bar.done(
        f"{where}; started again at step {resumed_at}, trained {run} more steps "
        f"(an exact resume: {TOTAL - resumed_at}); ended at step {result['step']}, "
        f"weights {equal} the uninterrupted run."
    )
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keras-ft demo", description=__doc__)
    parser.add_argument(
        "--train-on-request", action="store_true", help=argparse.SUPPRESS
    )
    parser.add_argument("--seconds-per-batch", type=float, default=0.005)
    parser.add_argument(
        "--kill-at-step", type=int, default=None,
        help="Optimizer step to SIGKILL the training at (default: random, mid-epoch).",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.train_on_request:
        _train_on_request()
        return 0
    kill_at = args.kill_at_step or random.randrange(
        2 * STEPS_PER_EPOCH + 3, 3 * STEPS_PER_EPOCH - 3
    )
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    print(
        f"keras-ft demo ({backend}): {EPOCHS} epochs of {STEPS_PER_EPOCH} steps, a "
        f"backup every {SAVE_FREQ} steps; each training in its own process, killed "
        "with SIGKILL as a crash would.\n"
    )
    launcher = Launcher(args.seconds_per_batch)
    try:
        with tempfile.TemporaryDirectory() as root:
            print("1. Uninterrupted, for reference")
            bar = Bar("no callback")
            reference = launcher.run(os.path.join(root, "reference"), "none").finish(
                bar
            )
            bar.done(f"{reference['step']} optimizer steps.")
            print(f"\n2. Killed mid-epoch at step {kill_at}, then started again")
            exact = _crash_and_resume(launcher, root, "keras-ft", "keras-ft",
                                      reference, kill_at, False)  # fmt: skip
            _crash_and_resume(launcher, root, "keras", "Keras' callback",
                              reference, kill_at, False)  # fmt: skip
            print("\n3. Killed while a backup is being written, then started again")
            survived = _crash_and_resume(launcher, root, "keras-ft", "keras-ft",
                                         reference, kill_at, True)  # fmt: skip
            _crash_and_resume(launcher, root, "keras", "Keras' callback",
                              reference, kill_at, True)  # fmt: skip
    finally:
        launcher.close()
    ok = exact and survived
    print(
        "\nResult: keras-ft "
        + ("resumed both times at the last backup and ended bit for bit where the "
           "uninterrupted run did." if ok else "did NOT match the uninterrupted run.")
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
