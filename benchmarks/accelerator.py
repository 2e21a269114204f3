"""What a save costs training on the device the backend finds (GPU, TPU or CPU).

On an accelerator the training state lives in device memory. What a save must
hold training up for is a copy of it there (`snapshot="device"`); moving it
to host memory crosses the bus. This script measures, side by side in one
process per backend, for a ~10M and a ~200M-parameter MLP with Adam:

1. `fit()` time saving every epoch and saving every batch: no callback,
   Keras' `BackupAndRestore`, Keras' `OrbaxCheckpoint` (JAX, where Orbax is
   installed), keras-ft with `snapshot="host"` and with `snapshot="device"`
   (on the CPU too, where it is a second copy: `"auto"` is the host copy
   there), interleaved rounds, medians;
2. how long each save held training up (batch end to the next batch's
   begin, inside the callback list), saves far enough apart for each write
   to end first;
3. the floors, in the same run: a device-to-device copy of the state (one
   fused copy), a device-to-host copy into pageable memory (and into pinned
   memory on a CUDA device under PyTorch), write + fsync of the state's
   bytes, and a cold read of a checkpoint's files;
4. a restore against its floor (the files' cold read + one host-to-device
   copy of the state);
5. peak device memory (where the backend reports it) and host memory above
   training's, for a save.

Run: `python benchmarks/accelerator.py --backend jax` (a GPU machine: the
defaults; a CPU: `--quick`). Targets (a GPU, docs/benchmarks.md): blocked per
save <= 1.5x the device copy + 2 ms; every epoch of the 200M model <= 1.02x
no callback; every batch: added time per save <= 1.1x write + fsync;
restore <= 1.2x its floor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from save_cost import (  # noqa: E402
    Blocking,
    Stopwatch,
    build_model,
    data,
    dir_bytes,
    drop_cached_pages,
    files_below,
    interleaved,
    med,
    peak_extra_rss,
    peak_while,
    raw_read,
    raw_write,
    spread,
)

BACKENDS = ("tensorflow", "jax", "torch")


def state_values(model) -> list:
    """The backend tensors of the model's and optimizer's variables."""
    from keras_ft.backend.device_memory import raw_value

    return [raw_value(v) for v in model.weights + model.optimizer.variables]


def SyncedBatchEnds():  # noqa: N802  A class made when Keras is imported.
    import keras

    class Synced(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    return Synced()


class HeldUp:
    """Around the callbacks measured: the seconds their epoch ends and
    their train end took, where the rest of a fit's added time is steps
    slowed by work beside them."""

    def __init__(self):
        import keras

        self.epoch_ends = self.train_end = 0.0
        self._start = 0.0

        class First(keras.callbacks.Callback):
            def on_epoch_end(inner, epoch, logs=None):
                self._start = time.perf_counter()

            def on_train_end(inner, logs=None):
                self._start = time.perf_counter()

        class Last(keras.callbacks.Callback):
            def on_epoch_end(inner, epoch, logs=None):
                self.epoch_ends += time.perf_counter() - self._start

            def on_train_end(inner, logs=None):
                self.train_end = time.perf_counter() - self._start

        self.first, self.last = First(), Last()

    def around(self, callbacks: list) -> list:
        return [self.first, *callbacks, self.last]


def device_copy_seconds(model) -> float:
    """One fused on-device copy of the state, as a save makes it."""
    from keras_ft.backend.device_memory import device_snapshot

    values = state_values(model)
    start = time.perf_counter()
    _, made = device_snapshot(values)
    made()
    return time.perf_counter() - start


def host_copy_seconds(model, pinned: bool = False) -> float:
    """The state moved to host memory: pageable (NumPy), or with PyTorch on
    CUDA into pinned buffers allocated beforehand."""
    import keras

    values = state_values(model)
    if pinned:
        import torch

        buffers = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for v in values]
        start = time.perf_counter()
        for buffer, value in zip(buffers, values, strict=True):
            buffer.copy_(value, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start
    start = time.perf_counter()
    for value in values:
        keras.ops.convert_to_numpy(value)
    return time.perf_counter() - start


def to_device_seconds(model, arrays: list) -> float:
    """`arrays` (host memory) assigned to the state's variables."""
    start = time.perf_counter()
    for variable, array in zip(
        model.weights + model.optimizer.variables, arrays, strict=True
    ):
        variable.assign(array)
    _sync(model)
    return time.perf_counter() - start


def _sync(model) -> None:
    """Waits for what the device was asked to do with the state."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        jax.block_until_ready(state_values(model))
    elif backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def device_bytes_in_use() -> int | None:
    """What the backend's allocator holds on the first device (`None`: not
    known, or the CPU)."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("bytes_in_use")
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.memory_allocated()
    return None


def peak_extra_device(fn) -> int | None:
    """Peak device memory above the level before `fn` (PyTorch's own peak
    counter; else sampled every 1 ms), `None` where the backend says none."""
    import keras

    before = device_bytes_in_use()
    if before is None:
        return None
    if keras.backend.backend() == "torch":
        import torch

        torch.cuda.reset_peak_memory_stats()
        fn()
        return torch.cuda.max_memory_allocated() - before
    return peak_while(fn, lambda: device_bytes_in_use() or 0) - before


def pinned_to_device_seconds(model) -> float:
    """The state moved from page-locked host buffers (allocated beforehand)
    to new device buffers: PyTorch on CUDA."""
    import torch

    values = state_values(model)
    buffers = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for v in values]
    start = time.perf_counter()
    for buffer, value in zip(buffers, values, strict=True):
        buffer.to(value.device, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def step_seconds(model, x, y, steps: int = 20) -> float:
    """One training step's time, without callbacks (compiled beforehand)."""
    start = time.perf_counter()
    model.fit(x[: 32 * steps], y[: 32 * steps], batch_size=32, epochs=1, verbose=0)
    return (time.perf_counter() - start) / steps


def measure(args) -> None:
    """Prints each size's measurements as soon as they are made (a `SIZE`
    line of JSON): a run cut short still reports the sizes it finished."""
    root = tempfile.mkdtemp(prefix="keras-ft-accel-", dir=args.dir)
    try:
        for width in args.widths:
            print("SIZE " + json.dumps(measure_size(args, width, root)), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure_size(args, width: int, root: str) -> dict:
    """Every measurement of one model size (see the module)."""
    import keras

    import keras_ft
    from keras_ft.backend.device_memory import accelerator

    model = build_model(width)
    x, y = data(20)
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    device = accelerator(model.weights[0]) or "cpu"
    row: dict = {"params": model.count_params(), "device": device}
    row["step"] = step = step_seconds(model, x, y)
    steps = args.steps
    if args.epoch_seconds:  # Epochs of about that long, whatever the device.
        steps = max(20, min(args.max_steps, round(args.epoch_seconds / step)))
    row["epoch_steps"] = steps
    blocked_steps = args.blocking_every * (args.blocking_saves + 1)
    x, y = data(max(steps, blocked_steps))
    modes = list(args.modes)

    def callbacks(kind: str, every: str | int, where: str) -> list:
        path = os.path.join(root, f"{kind}-{where}")
        shutil.rmtree(path, ignore_errors=True)
        if kind == "none":
            return []
        if kind == "synced":
            return [SyncedBatchEnds()]
        if kind == "no saves":  # keras-ft's hooks alone: what saving adds to them.
            return [keras_ft.BackupAndRestore(path, save_freq=False, verbose=0)]
        if kind == "nan guard":  # Its check of the weights at every batch.
            return [
                keras_ft.BackupAndRestore(path, save_freq=False, verbose=0),
                keras_ft.NanGuard(verbose=0),
            ]
        if kind == "keras":
            return [keras.callbacks.BackupAndRestore(path, save_freq=every)]
        if kind == "orbax":
            return [
                keras.callbacks.OrbaxCheckpoint(
                    path, monitor="loss", save_freq=every, max_to_keep=2
                )
            ]
        save = keras_ft.BackupAndRestore
        return [save(path, save_freq=every, snapshot=kind, verbose=0)]

    # "synced": no save, but a callback with a batch end of its own, as
    # keras-ft's (and Keras' progress bar) has: Keras then hands each batch
    # end its logs as numbers, which waits for the step on the device.
    kinds = ["none", "synced", "no saves", *modes]
    if not args.no_peers:
        kinds.insert(2, "keras")
    measured = ("host", "device")  # Blocked time and memory: both, always.
    if keras.backend.backend() == "jax" and _has_orbax() and not args.no_peers:
        kinds.append("orbax")
    # NanGuard, beside the epoch saves' rows only: it saves nothing.
    after = kinds.index("no saves") + 1
    epoch_kinds = [*kinds[:after], "nan guard", *kinds[after:]]

    spent: dict[str, list[tuple[float, float]]] = {}  # Per kind, per fit.

    def fit(kind: str, every: str | int, epochs: int, steps: int, where: str):
        def run() -> float:
            stopwatch, held = Stopwatch(), HeldUp()
            start = time.perf_counter()
            model.fit(
                x[: 32 * steps],
                y[: 32 * steps],
                batch_size=32,
                epochs=epochs,
                verbose=0,
                callbacks=[
                    *held.around(callbacks(kind, every, where)),
                    stopwatch.callback,
                ],
            )
            if every == "epoch":
                spent.setdefault(kind, []).append((held.epoch_ends, held.train_end))
            return stopwatch.ended - start

        return run

    # 1. Saving every epoch, and every batch (fewer steps).
    if args.epoch_widths is None or width in args.epoch_widths:
        row["epoch"] = interleaved(
            {k: fit(k, "epoch", args.epochs, steps, "epoch") for k in epoch_kinds},
            args.rounds,
        )
        row["epoch_spent"] = spent
    if args.batch_widths is None or width in args.batch_widths:
        row["batch_steps"] = batch_steps = max(4, min(steps // 10, 40))
        row["batch"] = interleaved(
            {k: fit(k, 1, 1, batch_steps, "batch") for k in kinds}, args.rounds
        )

    # 2. Blocked per save, each save's write waited for (untimed) before the
    # next: what one save holds training up for, alone.
    def blocked(mode: str):
        def run() -> float:
            blocking = Blocking(args.blocking_every, keras_ft.wait_for_backups)
            path = os.path.join(root, f"blocked-{mode}")
            shutil.rmtree(path, ignore_errors=True)
            save = keras_ft.BackupAndRestore(
                path, save_freq=args.blocking_every, snapshot=mode, verbose=0
            )
            model.fit(x[: 32 * blocked_steps], y[: 32 * blocked_steps],
                      batch_size=32, epochs=1, verbose=0,
                      callbacks=blocking.around([save]))  # fmt: skip
            return med(blocking.times)

        return run

    row["blocked"] = interleaved(
        {m: blocked(m) for m in measured}, args.blocking_rounds or args.rounds
    )

    # 3, 4. Floors and the restore, in this run.
    state = keras_ft.WorkerTrainingState(model, os.path.join(root, "floor"), keep=1)
    state.back_up(0)
    keras_ft.wait_for_backups()
    chief = os.path.join(root, "floor", "chief")
    row["bytes"] = nbytes = dir_bytes(chief)
    # Random bytes (a 64 MiB block repeated: generating gigabytes takes long).
    block = (os.urandom(64 << 20) * (nbytes // (64 << 20) + 1))[:nbytes]
    raw_path = os.path.join(root, "raw.bin")
    arrays = [keras.ops.convert_to_numpy(v) for v in state_values(model)]
    floors = {
        "device copy": lambda: device_copy_seconds(model),
        "host copy": lambda: host_copy_seconds(model),
        "write+fsync": lambda: raw_write(raw_path, block),
        "read": lambda: _cold_read(chief),
        "to device": lambda: to_device_seconds(model, arrays),
        "restore": lambda: _cold_restore(model, root, chief),
    }
    if device == "gpu" and keras.backend.backend() == "torch":
        floors["pinned host copy"] = lambda: host_copy_seconds(model, pinned=True)
        floors["pinned to device"] = lambda: pinned_to_device_seconds(model)
    row["floors"] = interleaved(floors, args.rounds)

    # 5. Memory of saves, each way, beyond training's: two saves, so that
    # what a save keeps for the next (its host buffers) is counted once.
    row["host_rss"], row["device_extra"] = {}, {}
    for mode in measured:
        fresh = keras_ft.WorkerTrainingState(
            model, os.path.join(root, f"rss-{mode}"), async_save=True, snapshot=mode
        )

        def save(fresh=fresh) -> None:
            fresh.back_up(0)
            fresh.wait()

        def twice(save=save) -> None:
            save()
            save()

        row["host_rss"][mode] = peak_extra_rss(twice) / nbytes
        row["device_extra"][mode] = peak_extra_device(twice)
        fresh.close()
    return row


def _cold_read(chief: str) -> None:
    paths = files_below(chief)
    drop_cached_pages(paths)
    for path in paths:
        raw_read(path)


def _cold_restore(model, root: str, chief: str) -> float:
    import keras_ft

    drop_cached_pages(files_below(chief))
    start = time.perf_counter()
    keras_ft.WorkerTrainingState(model, os.path.join(root, "floor")).restore()
    _sync(model)
    return time.perf_counter() - start


def _has_orbax() -> bool:
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:
        return False
    return True


def rows_of(result: dict, modes: tuple = ("host", "device")) -> list[tuple[str, str]]:
    rows = []
    for row in result["sizes"]:
        name = f"{row['params'] / 1e6:.1f}M params on {row['device']}"
        epoch, batch, blocked, floors = (
            row.get("epoch", {}), row.get("batch", {}), row["blocked"], row["floors"]
        )  # fmt: skip
        rows.append((
            f"{name}: a step, ms; steps per epoch",
            f"{row['step'] * 1e3:.2f}; {row['epoch_steps']}",
        ))  # fmt: skip
        for kind in epoch:
            if kind != "none":
                ratios = zip(epoch[kind], epoch["none"], strict=True)
                rows.append((
                    f"{name}: every epoch, {kind} / none",
                    spread([a / b for a, b in ratios]),
                ))  # fmt: skip
                if kind in modes and "synced" in epoch:
                    ratios = zip(epoch[kind], epoch["synced"], strict=True)
                    rows.append((
                        f"{name}: every epoch, {kind} / synced batch ends",
                        spread([a / b for a, b in ratios]),
                    ))  # fmt: skip
                added = [a - b for a, b in zip(epoch[kind], epoch["none"],
                                               strict=True)]  # fmt: skip
                ends, train_end = zip(*row["epoch_spent"][kind], strict=True)
                rows.append((
                    f"{name}: every epoch, {kind}: added s = epoch ends + "
                    "train end + steps slowed",
                    f"{med(added):.2f} = {med(ends):.2f} + {med(train_end):.2f} "
                    f"+ {med(added) - med(ends) - med(train_end):.2f}",
                ))  # fmt: skip
        steps = row.get("batch_steps", 1)
        write = med(floors["write+fsync"])
        for kind in batch:
            if kind != "none":
                added = [
                    (a - b) / steps
                    for a, b in zip(batch[kind], batch["none"], strict=True)
                ]
                rows.append((
                    f"{name}: every batch, {kind}: added per save / write+fsync",
                    spread([a / write for a in added]),
                ))  # fmt: skip
        copy = med(floors["device copy"])
        for mode in blocked:
            rows.append((
                f"{name}: blocked per save, {mode} / (device copy + 2 ms)",
                spread([b / (copy + 0.002) for b in blocked[mode]]),
            ))  # fmt: skip
        for floor in ("device copy", "host copy", "pinned host copy", "write+fsync",
                      "read", "to device", "pinned to device",
                      "restore"):  # fmt: skip
            if floor in floors:
                rows.append((f"{name}: {floor}, seconds", spread(floors[floor])))
        # One move to the device: from page-locked buffers where measured.
        move = floors.get("pinned to device", floors["to device"])
        restore_floor = [a + b for a, b in zip(floors["read"], move, strict=True)]
        rows.append((
            f"{name}: restore / (read + to device)",
            spread([a / b for a, b in zip(floors["restore"], restore_floor,
                                          strict=True)]),
        ))  # fmt: skip
        for mode, ratio in row["host_rss"].items():
            label = f"{name}: host memory of a save, {mode} / state"
            rows.append((label, f"{ratio:.2f}"))
        for mode, extra in row["device_extra"].items():
            if extra is not None:
                rows.append((
                    f"{name}: device memory of a save, {mode} / state",
                    f"{extra / row['bytes']:.2f}",
                ))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, action="append")
    parser.add_argument(
        "--quick", action="store_true", help="CPU-sized: 1.6M and 5.2M parameters"
    )
    parser.add_argument("--widths", type=int, nargs="*")
    parser.add_argument("--steps", type=int, help="steps per epoch")
    parser.add_argument(
        "--epoch-seconds", type=float,
        help="steps per epoch chosen for epochs about this long (default: 10 "
        "without --quick)",
    )  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--modes", nargs="*", default=["host", "device"],
        help="keras-ft's snapshot modes timed in fit() (blocked time and "
        "memory are measured for both)",
    )  # fmt: skip
    parser.add_argument(
        "--batch-widths", type=int, nargs="*",
        help="the widths saved every batch (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--epoch-widths", type=int, nargs="*",
        help="the widths saved every epoch (default: all)",
    )  # fmt: skip
    parser.add_argument("--blocking-every", type=int, default=8)
    parser.add_argument("--blocking-saves", type=int, default=4)
    parser.add_argument("--blocking-rounds", type=int, help="default: --rounds")
    parser.add_argument(
        "--no-peers", action="store_true",
        help="no Keras callbacks timed beside keras-ft (a shorter run)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, help="seconds per backend")
    parser.add_argument("--dir", help="where checkpoints go (default: /tmp)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.widths is None:  # ~10M and ~200M parameters; CPU-sized with --quick.
        args.widths = [1024, 2048] if args.quick else [3000, 14000]
    if args.steps is None:
        args.steps = 40
    if args.epoch_seconds is None and not args.quick:
        args.epoch_seconds = 10.0
    if args.worker:
        measure(args)
        return
    for backend in args.backend or BACKENDS:
        command = [sys.executable, os.path.abspath(__file__), "--worker",
                   "--widths", *map(str, args.widths), "--steps", str(args.steps),
                   "--max-steps", str(args.max_steps),
                   "--epochs", str(args.epochs), "--rounds", str(args.rounds),
                   "--modes", *args.modes,
                   "--blocking-every", str(args.blocking_every),
                   "--blocking-saves", str(args.blocking_saves),
                   "--blocking-rounds", str(args.blocking_rounds or args.rounds),
                   "--epoch-seconds", str(args.epoch_seconds or 0)]  # fmt: skip
        if args.no_peers:
            command.append("--no-peers")
        for option in ("batch_widths", "epoch_widths"):
            if getattr(args, option) is not None:
                flag = "--" + option.replace("_", "-")
                command += [flag, *map(str, getattr(args, option))]
        if args.dir:
            command += ["--dir", args.dir]
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(HERE), *filter(None, [env.get("PYTHONPATH")])]
        )
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env,
                                  timeout=args.timeout)  # fmt: skip
            stdout, stderr, failed = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as late:
            stdout, stderr, failed = late.stdout or "", late.stderr or "", "timeout"
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
            stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
        sizes = [json.loads(x[len("SIZE ") :]) for x in stdout.splitlines()
                 if x.startswith("SIZE ")]  # fmt: skip
        if failed:
            print(f"{backend}: failed ({failed})\n{stderr[-3000:]}")
        if not sizes:
            continue
        print(f"\n{backend} (median and spread over {args.rounds} rounds)")
        for label, value in rows_of({"sizes": sizes}):
            print(f"  {label:<72} {value}", flush=True)
        print("JSON " + json.dumps({"backend": backend, "sizes": sizes}), flush=True)


if __name__ == "__main__":
    main()
