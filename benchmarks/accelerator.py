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
    raw_read,
    raw_write,
    spread,
)

BACKENDS = ("tensorflow", "jax", "torch")


def state_values(model) -> list:
    """The backend tensors of the model's and optimizer's variables."""
    from keras_ft.backend import raw_value

    return [raw_value(v) for v in model.weights + model.optimizer.variables]


def device_copy_seconds(model) -> float:
    """One fused on-device copy of the state, as a save makes it."""
    from keras_ft.backend import device_snapshot

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


def peak_device_bytes() -> int | None:
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use")
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated()
    return None


def measure(args) -> dict:
    import keras

    root = tempfile.mkdtemp(prefix="keras-ft-accel-", dir=args.dir)
    try:
        sizes = [measure_size(args, width, root) for width in args.widths]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"backend": keras.backend.backend(), "sizes": sizes}


def measure_size(args, width: int, root: str) -> dict:
    """Every measurement of one model size (see the module)."""
    import keras

    import keras_ft
    from keras_ft.backend import accelerator

    model = build_model(width)
    x, y = data(args.steps)
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    device = accelerator(model.weights[0]) or "cpu"
    row: dict = {"params": model.count_params(), "device": device}
    modes = ["host", "device"]

    def callbacks(kind: str, every: str | int, where: str) -> list:
        path = os.path.join(root, f"{kind}-{where}")
        shutil.rmtree(path, ignore_errors=True)
        if kind == "none":
            return []
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

    kinds = ["none", "keras", *modes]
    if keras.backend.backend() == "jax" and _has_orbax():
        kinds.append("orbax")

    def fit(kind: str, every: str | int, epochs: int, steps: int, where: str):
        def run() -> float:
            stopwatch = Stopwatch()
            start = time.perf_counter()
            model.fit(
                x[: 32 * steps],
                y[: 32 * steps],
                batch_size=32,
                epochs=epochs,
                verbose=0,
                callbacks=[*callbacks(kind, every, where), stopwatch.callback],
            )
            return stopwatch.ended - start

        return run

    # 1. Saving every epoch, and every batch (fewer steps).
    row["epoch"] = interleaved(
        {k: fit(k, "epoch", args.epochs, args.steps, "epoch") for k in kinds},
        args.rounds,
    )
    row["batch_steps"] = batch_steps = max(4, args.steps // 10)
    row["batch"] = interleaved(
        {k: fit(k, 1, 1, batch_steps, "batch") for k in kinds}, args.rounds
    )

    # 2. Blocked per save, saves far enough apart.
    def blocked(mode: str):
        def run() -> float:
            blocking = Blocking(args.blocking_every)
            path = os.path.join(root, f"blocked-{mode}")
            shutil.rmtree(path, ignore_errors=True)
            save = keras_ft.BackupAndRestore(
                path, save_freq=args.blocking_every, snapshot=mode, verbose=0
            )
            model.fit(x, y, batch_size=32, epochs=1, verbose=0,
                      callbacks=blocking.around([save]))  # fmt: skip
            return med(blocking.times)

        return run

    row["blocked"] = interleaved({m: blocked(m) for m in modes}, args.rounds)

    # 3, 4. Floors and the restore, in this run.
    state = keras_ft.WorkerTrainingState(model, os.path.join(root, "floor"), keep=1)
    state.back_up(0)
    keras_ft.wait_for_backups()
    chief = os.path.join(root, "floor", "chief")
    row["bytes"] = nbytes = dir_bytes(chief)
    block = os.urandom(nbytes)
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
    if device == "cuda":
        floors["pinned host copy"] = lambda: host_copy_seconds(model, pinned=True)
    row["floors"] = interleaved(floors, args.rounds)

    # 5. Memory of one save, each way.
    row["host_rss"], row["device_peak"] = {}, {}
    for mode in modes:
        fresh = keras_ft.WorkerTrainingState(
            model, os.path.join(root, f"rss-{mode}"), async_save=True, snapshot=mode
        )

        def save(fresh=fresh) -> None:
            fresh.back_up(0)
            fresh.wait()

        row["host_rss"][mode] = peak_extra_rss(save) / nbytes
        row["device_peak"][mode] = peak_device_bytes()
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


def rows_of(result: dict) -> list[tuple[str, str]]:
    rows = []
    for row in result["sizes"]:
        name = f"{row['params'] / 1e6:.1f}M params on {row['device']}"
        epoch, batch, blocked, floors = (
            row["epoch"], row["batch"], row["blocked"], row["floors"]
        )  # fmt: skip
        for kind in epoch:
            if kind != "none":
                ratios = zip(epoch[kind], epoch["none"], strict=True)
                rows.append((
                    f"{name}: every epoch, {kind} / none",
                    spread([a / b for a, b in ratios]),
                ))  # fmt: skip
        steps = row["batch_steps"]
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
                      "read", "to device"):  # fmt: skip
            if floor in floors:
                rows.append((f"{name}: {floor}, seconds", spread(floors[floor])))
        restore_floor = [
            a + b for a, b in zip(floors["read"], floors["to device"], strict=True)
        ]
        rows.append((
            f"{name}: restore / (read + to device)",
            spread([a / b for a, b in zip(floors["restore"], restore_floor,
                                          strict=True)]),
        ))  # fmt: skip
        for mode, ratio in row["host_rss"].items():
            label = f"{name}: host memory of a save, {mode} / state"
            rows.append((label, f"{ratio:.2f}"))
        for mode, peak in row["device_peak"].items():
            if peak is not None:
                rows.append((
                    f"{name}: peak device memory after {mode} saves / state",
                    f"{peak / row['bytes']:.2f}",
                ))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, action="append")
    parser.add_argument(
        "--quick", action="store_true", help="CPU-sized: 1.6M and 5.2M parameters"
    )
    parser.add_argument("--widths", type=int, nargs="*")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocking-every", type=int, default=8)
    parser.add_argument("--dir", help="where checkpoints go (default: /tmp)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.widths is None:  # ~10M and ~200M parameters; CPU-sized with --quick.
        args.widths = [1024, 2048] if args.quick else [3000, 14000]
    if args.steps is None:
        args.steps = 40 if args.quick else 600
    if args.worker:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    for backend in args.backend or BACKENDS:
        command = [sys.executable, os.path.abspath(__file__), "--worker",
                   "--widths", *map(str, args.widths), "--steps", str(args.steps),
                   "--epochs", str(args.epochs), "--rounds", str(args.rounds),
                   "--blocking-every", str(args.blocking_every)]  # fmt: skip
        if args.dir:
            command += ["--dir", args.dir]
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        env["PYTHONPATH"] = os.path.dirname(HERE)
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{backend}: failed\n{done.stderr[-3000:]}")
            continue
        result = json.loads(lines[-1][len("RESULT ") :])
        print(f"\n{backend} (median and spread over {args.rounds} rounds)")
        for label, value in rows_of(result):
            print(f"  {label:<72} {value}")


if __name__ == "__main__":
    main()
