"""Kill-fuzz: SIGKILL real trainings at random moments, then try to resume.

Each trial starts a training process that backs up after every batch (into a
fresh directory), kills it with SIGKILL at a random moment after its first
backup was committed (the child reports it; `--from-start` measures from the
start of training instead), and then loads the backup into a new model exactly
as a restart does at train begin. Counted per callback (keras-ft, Keras'
`BackupAndRestore`, Keras' `OrbaxCheckpoint` if orbax-checkpoint is installed):

- resumed: the backup loaded, at or after the last step the process reported
  as backed up (`lost` counts the batches between, which a kill during a save
  costs);
- fresh: nothing had been backed up yet, and nothing loaded (correct);
- failed: loading raised, or nothing loaded although a backup had been made
  (training would silently start over).

Usage:
    python benchmarks/kill_fuzz.py --trials 200 --backend jax
    python benchmarks/kill_fuzz.py --trials 40 --backend tensorflow --callback keras
    python benchmarks/kill_fuzz.py --trials 100 --callback all   # + OrbaxCheckpoint
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# A child that has not reached its kill window by then is stuck: its threads'
# stacks are dumped and the trial counts as failed ("hung"), so a deadlock is
# reported with where it is instead of stalling the run.
HANG_SECONDS = float(os.environ.get("KILL_FUZZ_HANG_SECONDS", "240"))


def build_model():
    import keras

    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    return model


_say_lock = threading.Lock()


def say(line: str) -> None:
    """Reports a line to the parent, whole.

    keras-ft's listener reports its first commit from the writer thread while
    the training thread reports steps: `print()` writes the text and the
    newline in two calls, so two threads' lines could run together
    ("STEP 5COMMITTED"), and the parent would wait for a commit line forever.
    """
    with _say_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def make_callback(name: str, backup_dir: str):
    import keras

    import keras_ft

    if name == "keras-ft":

        class Committed(keras_ft.CheckpointListener):
            reported = False

            def after_commit(self, path, epoch, step):
                if not self.reported:
                    self.reported = True
                    say("COMMITTED")

        return keras_ft.BackupAndRestore(
            backup_dir, save_freq=1, verbose=0, listeners=[Committed()]
        )
    if name == "orbax":
        return keras.callbacks.OrbaxCheckpoint(
            backup_dir, save_freq=1, save_on_background=True
        )
    return keras.callbacks.BackupAndRestore(backup_dir, save_freq=1)


def first_commit_seen(callback: str, backup_dir: str, line: str) -> bool:
    """Whether the child's backup holds a committed save by now."""
    if callback == "keras-ft":
        return line.startswith("COMMITTED")
    if callback == "keras":  # Saved in the batch end before the step's report.
        return line.startswith("STEP")
    # Orbax renames a finished save to a directory named by its step.
    return line.startswith("STEP") and any(
        name.isdigit() for name in os.listdir(backup_dir)
    )


def worker(backup_dir: str, callback: str) -> None:
    """The training process: backs up every batch, reports every step."""
    # SIGUSR1 dumps every thread's stack to stderr (the parent's hang report).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import keras
    import numpy as np

    class Report(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            say("BEGIN")

        def on_train_batch_end(self, batch, logs=None):
            # Runs after the backup callback's own batch end: this step is
            # backed up (by keras-ft, handed to its background writer).
            step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            say(f"STEP {step}")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 64)).astype("float32")
    y = rng.normal(size=(512, 1)).astype("float32")
    build_model().fit(
        x,
        y,
        batch_size=32,
        epochs=10_000,
        verbose=0,
        callbacks=[make_callback(callback, backup_dir), Report()],
    )


def restore_step(callback: str, backup_dir: str) -> int | None:
    """Loads the backup into a new model; the step it holds, None if none."""
    import keras

    import keras_ft

    model = build_model()
    if callback == "keras-ft":
        resume = keras_ft.WorkerTrainingState(model, backup_dir).restore()
        return None if resume is None else resume.step
    if callback == "orbax":
        # OrbaxCheckpoint does not restore at fit() start: load as a user would.
        if not any(name.isdigit() for name in os.listdir(backup_dir)):
            return None
        model.optimizer.build(model.trainable_variables)
        model.load_weights(backup_dir)
        return int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    keras_callback = keras.callbacks.BackupAndRestore(backup_dir)
    keras_callback.set_model(model)
    keras_callback.on_train_begin()
    step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    return step if step or model._initial_epoch else None


class Lines:
    """The child's stdout, read in a thread so that waiting can time out."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.ended = False
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def wait_for(self, seen, timeout: float) -> bool:
        """Whether a line for which `seen` holds came (False: EOF or timeout)."""
        deadline = time.monotonic() + timeout
        checked = 0
        with self.changed:
            while True:
                for line in self.lines[checked:]:
                    if seen(line):
                        return True
                checked = len(self.lines)
                left = deadline - time.monotonic()
                if self.ended or left <= 0:
                    return False
                self.changed.wait(left)


def stacks_of(process: subprocess.Popen, stderr_path: str) -> str:
    """Asks a stuck child for its threads' stacks: each thread's top frames."""
    process.send_signal(signal.SIGUSR1)
    time.sleep(3.0)
    with open(stderr_path, errors="replace") as f:
        dump = [line.strip() for line in f if line.strip()]
    threads, frames = [], 0
    for line in dump:  # faulthandler: a header per thread, innermost first.
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([line])
            frames = 0
        elif threads and line.startswith("File ") and frames < 6:
            threads[-1].append(line)
            frames += 1
    return " | ".join(" / ".join(thread) for thread in threads) or "no stacks"


def trial(
    callback: str, rng: random.Random, root: str, from_start: bool
) -> tuple[str, int, str]:
    backup_dir = tempfile.mkdtemp(dir=root)
    stderr_path = backup_dir + ".stderr"
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, __file__, "--worker", backup_dir, "--callback", callback],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )  # fmt: skip
    lines = Lines(process.stdout)
    if from_start:
        ready = lines.wait_for(lambda line: line.startswith("BEGIN"), HANG_SECONDS)
    else:
        ready = lines.wait_for(
            lambda line: first_commit_seen(callback, backup_dir, line), HANG_SECONDS
        )
    if not ready and not lines.ended:
        stacks = stacks_of(process, stderr_path)
        process.kill()
        process.wait()
        shutil.rmtree(backup_dir, ignore_errors=True)
        return "failed", 0, f"hung for {HANG_SECONDS:.0f} s: {stacks}"
    time.sleep(rng.uniform(0.0, 1.5))
    process.send_signal(signal.SIGKILL)
    process.wait()
    lines.thread.join(timeout=60)
    steps = [int(line.split()[1]) for line in lines.lines if line.startswith("STEP")]
    backed_up = max(steps, default=0)
    if callback in ("keras-ft", "orbax"):
        # Their backups are written in the background: when step n is
        # reported, step n - 1's backup is committed (keras-ft), or in flight.
        backed_up = max(0, backed_up - 1)
    # A restore that hangs is a failure too: dump where, and stop the run.
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    try:
        restored = restore_step(callback, backup_dir)
    except Exception as e:  # Any load failure is what we count.
        detail = traceback.format_exception_only(type(e), e)[-1].strip()
        return "failed", 0, detail
    finally:
        faulthandler.cancel_dump_traceback_later()
        shutil.rmtree(backup_dir, ignore_errors=True)
    if restored is None:
        if backed_up:
            return "failed", backed_up, f"started over after step {backed_up}"
        return "fresh", 0, ""
    return "resumed", max(0, backed_up - restored), ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--backend", default=os.environ.get("KERAS_BACKEND", "jax"))
    parser.add_argument(
        "--callback", choices=["keras-ft", "keras", "orbax", "both", "all"],
        default="both",
    )  # fmt: skip
    parser.add_argument(
        "--from-start", action="store_true",
        help="Kill at a random moment after training began, not after the "
        "first committed backup.",
    )  # fmt: skip
    parser.add_argument("--keras-trials", type=int, help="Defaults to --trials.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.worker:
        worker(args.worker, args.callback)
        return

    import warnings

    warnings.simplefilter("ignore")  # Fallback warnings are expected here.
    callbacks = {"both": ["keras-ft", "keras"], "all": ["keras-ft", "keras", "orbax"]}
    callbacks = callbacks.get(args.callback, [args.callback])
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="kill-fuzz-")
    rows = []
    try:
        for callback in callbacks:
            trials = args.trials
            if callback == "keras" and args.keras_trials:
                trials = args.keras_trials
            counts = {"resumed": 0, "fresh": 0, "failed": 0}
            lost, details = 0, {}
            for i in range(trials):
                outcome, batches_lost, detail = trial(
                    callback, rng, root, args.from_start
                )
                counts[outcome] += 1
                lost += batches_lost if outcome == "resumed" else 0
                if detail:
                    key = detail.split(":")[0][:60]
                    details[key] = details.get(key, 0) + 1
                    if detail.startswith("hung"):
                        print(f"{callback} trial {i + 1}: {detail}", file=sys.stderr)
                print(f"{callback} trial {i + 1}/{trials}: {outcome}", flush=True)
            rows.append((callback, trials, counts, lost, details))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    after = "training began" if args.from_start else "the first committed backup"
    print(f"\nkill-fuzz, backend={args.backend}, SIGKILL at a random moment "
          f"after {after}, backup every batch")  # fmt: skip
    print(f"{'callback':10s} {'trials':>6s} {'resumed':>8s} {'fresh':>6s} "
          f"{'failed':>7s} {'batches lost':>13s}")  # fmt: skip
    for callback, trials, counts, lost, details in rows:
        print(f"{callback:10s} {trials:6d} {counts['resumed']:8d} {counts['fresh']:6d} "
              f"{counts['failed']:7d} {lost:13d}")  # fmt: skip
        for detail, n in sorted(details.items(), key=lambda kv: -kv[1]):
            print(f"{'':10s} failure: {n} x {detail}")


if __name__ == "__main__":
    main()
