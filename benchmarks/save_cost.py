"""Cost of a backup: keras-ft vs `keras.callbacks.BackupAndRestore` vs nothing.

Measures, side by side in one run, on TensorFlow, JAX and PyTorch (one
process each):
1. `fit()` time of a ~5M-parameter MLP with Adam saving every batch: no
   callback, Keras' own, keras-ft synchronous, keras-ft asynchronous (the
   default); how long one save holds training up (saves far enough apart
   for each write to end first) against one copy of the state; and keras-ft
   with `save_freq="auto"` over a longer run;
2. `fit()` time of a ~50M-parameter MLP saving every epoch: no callback,
   Keras' own, keras-ft;
3. save and restore throughput against raw write+fsync of the same number
   of bytes on the same disk and raw read of the checkpoint's own files
   (reads start from a cold page cache: the files' cached pages are
   dropped first);
4. peak extra resident memory during a first asynchronous save.

The variants of a measurement run interleaved (one fit of each, then the
next round, every other round in reverse order), so a machine that slows
down or speeds up affects them alike;
ratios are taken within a round and their median is reported with the
spread (min-max) over rounds. Run: `make bench`; one backend:
`python benchmarks/save_cost.py --backend jax`; `--quick` for a short run
without the 50M model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

med = statistics.median
BACKENDS = ("tensorflow", "jax", "torch")


def build_model(width: int):
    import keras

    model = keras.Sequential(
        [
            keras.Input((512,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-4), loss="mse")
    return model


def data(steps: int):
    import numpy as np

    x = np.random.default_rng(0).normal(size=(32 * steps, 512)).astype("float32")
    return x, np.zeros((len(x), 10), "float32")


def files_below(path: str) -> list[str]:
    return [os.path.join(root, f) for root, _, files in os.walk(path) for f in files]


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_below(path))


def drop_cached_pages(paths: list[str]) -> None:
    """Evicts the files' pages from the page cache, so the next read hits disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: str, block: bytes) -> None:
    with open(path, "wb") as f:
        f.write(block)
        f.flush()
        os.fsync(f.fileno())


def raw_direct_write(path: str, block, in_place: bool = False) -> None:
    """Writes `block` (page-aligned) with O_DIRECT, then fsync: the disk's best.

    `in_place` writes over the existing file's blocks (no truncation) and
    syncs its data only, as keras-ft does over a spare checkpoint's file.
    """
    view = memoryview(block)
    aligned = len(view) - len(view) % 4096
    flags = os.O_WRONLY | os.O_CREAT | os.O_DIRECT
    fd = os.open(path, flags if in_place else flags | os.O_TRUNC)
    try:
        offset = 0
        while offset < aligned:
            offset += os.pwrite(
                fd, view[offset : min(offset + (8 << 20), aligned)], offset
            )
    finally:
        os.close(fd)
    with open(path, "r+b") as f:
        f.seek(aligned)
        f.write(view[aligned:])
        f.flush()
        (os.fdatasync if in_place else os.fsync)(f.fileno())


def aligned_copy(data: bytes):
    """`data` in a page-aligned buffer, as direct I/O needs."""
    block = mmap.mmap(-1, len(data), flags=mmap.MAP_PRIVATE)
    block[:] = data
    return block


_READ_BUFFER = bytearray(1 << 24)  # Reused: fresh memory costs page faults.


def raw_read(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.readinto(_READ_BUFFER):
            pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_while(fn, read) -> int:
    """The highest of `read()` while `fn()` runs, sampled every 1 ms."""
    peak, done = [read()], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], read())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], read())


def peak_extra_rss(fn) -> int:
    """Peak resident memory above the level before `fn`, sampled every 1 ms."""
    before = rss_bytes()
    return peak_while(fn, rss_bytes) - before


def interleaved(variants: dict, rounds: int, settle=None) -> dict[str, list[float]]:
    """Seconds of each variant's run, one of each per round.

    A run that returns a number reports its own time; others are timed.
    `settle`, if given, runs untimed before each run.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(rounds):
        # Every other round in reverse order, so that a steady drift of the
        # machine's speed favours no variant.
        order = list(variants.items())
        for name, run in order if round_ % 2 == 0 else order[::-1]:
            if settle is not None:
                settle()
            start = time.perf_counter()
            reported = run()
            elapsed = time.perf_counter() - start
            times[name].append(reported if isinstance(reported, float) else elapsed)
    return times


class Stopwatch:
    """Last in the callback list: notes when every callback's train end is over.

    TensorFlow sometimes spends another 0.2-1.3 s after that in tf.data's
    iterator destructor, waiting out its autotuning thread's sleep (with or
    without callbacks; docs/benchmarks.md); a fit is timed up to this point.
    """

    def __init__(self):
        import keras

        class Callback(keras.callbacks.Callback):
            def on_train_end(inner, logs=None):
                self.ended = time.perf_counter()

        self.callback = Callback()
        self.ended = 0.0


class CopyOnly:
    """What any backup must do before training may go on: one copy of the
    model's and optimizer's variables into host memory, here by NumPy on one
    thread into a buffer allocated and touched beforehand (the floor a save's
    blocking time is measured against). Each variable is read without a copy,
    as keras-ft reads it (`keras.ops.convert_to_numpy()` would copy twice)."""

    def __init__(self, every: int):
        import keras
        import numpy as np

        from keras_ft.backend.host_memory import view

        self.every = every
        self.buffer = None

        class Callback(keras.callbacks.Callback):
            def on_train_batch_end(inner, batch, logs=None):
                if (batch + 1) % every:
                    return
                model = inner.model  # Syncs, on JAX, as a save must.
                values = [view(v) for v in model.weights + model.optimizer.variables]
                if self.buffer is None:
                    self.buffer = np.ones(sum(v.nbytes for v in values), np.uint8)
                offset = 0
                for value in values:
                    flat = value.reshape(-1).view(np.uint8)
                    np.copyto(self.buffer[offset : offset + flat.size], flat)
                    offset += flat.size

        self.callback = Callback()


class DiskBeside:
    """The disk's share of a save per batch, with training running: a
    thread writes the checkpoint's bytes over a file in place (direct I/O,
    then fdatasync, as keras-ft writes over a spare) again and again while
    `fit()` runs with no callback, and notes how long each write takes.
    Saving every batch, a step cannot come round faster than that."""

    def __init__(self, path: str, block):
        import keras

        self.writes: list[float] = []  # Median write of each fit, seconds.
        stop, times, threads_ = threading.Event(), [], []

        def loop():
            while not stop.is_set():
                start = time.perf_counter()
                raw_direct_write(path, block, in_place=True)
                times.append(time.perf_counter() - start)

        class Callback(keras.callbacks.Callback):
            def on_train_begin(inner, logs=None):
                stop.clear()
                times.clear()
                threads_[:] = [threading.Thread(target=loop)]
                threads_[0].start()

            def on_train_end(inner, logs=None):
                stop.set()
                threads_[0].join()
                self.writes.append(med(times))

        self.callback = Callback()


class Blocking:
    """Around the callbacks measured: how long their batch hooks held
    training up, at the batches they save at (every `every` batches, the
    first left out: it may allocate).

    A save is made at a batch end on the training thread, or, where Keras
    calls the batch ends on a thread of its own (every callback async-safe,
    as these two are), at the next batch's begin: what is timed is the
    callbacks' part of both, on the training thread. Keras then dispatches
    steps ahead of the device (JAX, PyTorch on a GPU), so before a save's
    batch begin the steps queued are waited for, untimed: the device is busy
    with them meanwhile, and a save would wait for them at any batch.
    """

    def __init__(self, every: int, settle=None):
        """`settle`, if given, runs untimed after each save (waits for its
        write, say, so that the next save is measured alone)."""
        import keras

        self.times: list[float] = []
        self._start = self._held = 0.0
        training = threading.get_ident()

        class First(keras.callbacks.Callback):
            async_safe = True

            def on_train_batch_begin(inner, batch, logs=None):
                if batch and not batch % every:
                    # On JAX, `inner.model` also syncs the trainer's state
                    # into the variables, as the save would.
                    iterations = inner.model.optimizer.iterations
                    keras.ops.convert_to_numpy(iterations)
                self._start = time.perf_counter()

            def on_train_batch_end(inner, batch, logs=None):
                if threading.get_ident() == training:
                    self._start = time.perf_counter()

        class Last(keras.callbacks.Callback):
            async_safe = True

            def on_train_batch_end(inner, batch, logs=None):
                if threading.get_ident() == training:
                    self._held = time.perf_counter() - self._start

            def on_train_batch_begin(inner, batch, logs=None):
                held, self._held = self._held, 0.0
                if not batch or batch % every:  # `batch` batches done.
                    return
                if batch > every:
                    self.times.append(held + time.perf_counter() - self._start)
                if settle is not None:
                    settle()

        self.first, self.last = First(), Last()

    def around(self, callbacks: list) -> list:
        return [self.first, *callbacks, self.last]


def blocking_runner(width, x, y, make_callbacks):
    """Like `fit_runner()`; each call returns the median time the callbacks
    held training up at a save."""
    model = build_model(width)
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)

    def run() -> float:
        blocking = Blocking(BLOCKING_EVERY)
        model.fit(
            x,
            y,
            batch_size=32,
            epochs=1,
            verbose=0,
            callbacks=blocking.around(make_callbacks()),
        )
        return med(blocking.times)

    return run


# Saves far enough apart for each write to end before the next save: what
# a save itself costs the training thread, not the disk's pace.
BLOCKING_EVERY = 8


def fit_runner(width, x, y, make_callbacks, epochs=1):
    """A warmed-up model; each call runs `fit()` with fresh callbacks and
    returns the seconds from the call to the end of the last train end."""
    model = build_model(width)
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)

    def run() -> float:
        stopwatch = Stopwatch()
        start = time.perf_counter()
        model.fit(
            x,
            y,
            batch_size=32,
            epochs=epochs,
            verbose=0,
            callbacks=[*make_callbacks(), stopwatch.callback],
        )
        return stopwatch.ended - start

    return run


def measure(args) -> dict:
    """Every measurement on the current backend; returns plain numbers."""
    import keras

    import keras_ft

    root = tempfile.mkdtemp(prefix="keras-ft-bench-", dir=args.dir)
    result: dict = {"backend": keras.backend.backend()}
    notes: list[str] = []
    try:
        # 4. Memory first, in a fresh process, before anything is cached.
        model = build_model(args.width)
        x, y = data(args.fit_steps)
        model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
        result["params"] = model.count_params()
        async_state = keras_ft.WorkerTrainingState(
            model, os.path.join(root, "rss"), keep=1, async_save=True
        )

        def async_save():
            async_state.back_up(0)
            async_state.wait()

        rss_extra = peak_extra_rss(async_save)
        ckpt_bytes = dir_bytes(os.path.join(root, "rss", "chief"))
        keras_cb = keras.callbacks.BackupAndRestore(os.path.join(root, "keras"))
        keras_cb.set_model(model)
        result["rss"] = {
            "keras-ft": rss_extra / ckpt_bytes,
            "keras": peak_extra_rss(keras_cb._save_model) / ckpt_bytes,
        }

        # 3. Throughput against the raw disk, interleaved.
        state = keras_ft.WorkerTrainingState(model, os.path.join(root, "ft"), keep=1)
        state.back_up(0)
        chief = os.path.join(root, "ft", "chief")
        ft_bytes = dir_bytes(chief)
        keras_cb._save_model()
        keras_files = files_below(os.path.join(root, "keras"))
        raw_path = os.path.join(root, "raw.bin")
        block = os.urandom(ft_bytes)
        raw_write(raw_path, block)
        direct_block = aligned_copy(block)
        direct_path = os.path.join(root, "raw-direct.bin")
        raw_direct_write(direct_path + ".in-place", direct_block)  # To write over.

        def cold(paths, fn):
            def run():
                drop_cached_pages(paths() if callable(paths) else paths)
                fn()

            return run

        def save():
            start = time.perf_counter()
            state.back_up(0)
            elapsed = time.perf_counter() - start
            # The checkpoint it superseded goes in the background: not while
            # the next measurement runs.
            keras_ft.wait_for_backups()
            return elapsed

        io_times = interleaved(
            {
                "save": save,
                "raw write": lambda: raw_write(raw_path, block),
                "raw direct write": lambda: raw_direct_write(direct_path, direct_block),
                "raw direct overwrite": lambda: raw_direct_write(
                    direct_path + ".in-place", direct_block, in_place=True
                ),
                "keras save": keras_cb._save_model,
                "restore": cold(lambda: files_below(chief), state.restore),
                # The checkpoint's own files: the same bytes in the same
                # places on disk as the restore reads.
                "raw read": cold(
                    lambda: files_below(chief),
                    lambda: [raw_read(path) for path in files_below(chief)],
                ),
                "keras restore": cold(keras_files, keras_cb._load_model),
            },
            args.repeats,
            # The previous variant's dirty pages (Keras' save has no fsync)
            # would otherwise be written back during the next one.
            settle=os.sync,
        )
        result["bytes"] = ft_bytes
        result["io"] = io_times

        # 1. Every batch, ~5M parameters.
        def ft(path, **kwargs):
            return lambda: [keras_ft.BackupAndRestore(path, verbose=0, **kwargs)]

        def keras_own(path, **kwargs):
            return lambda: [keras.callbacks.BackupAndRestore(path, **kwargs)]

        fit_args = (args.width, x, y)
        beside = DiskBeside(direct_path + ".in-place", direct_block)
        result["every_batch"] = interleaved(
            {
                "none": fit_runner(*fit_args, list),
                "disk beside": fit_runner(*fit_args, lambda: [beside.callback]),
                "keras": fit_runner(*fit_args, keras_own(f"{root}/f-k", save_freq=1)),
                "sync": fit_runner(
                    *fit_args, ft(f"{root}/f-s", save_freq=1, async_save=False)
                ),
                "async": fit_runner(*fit_args, ft(f"{root}/f-a", save_freq=1)),
            },
            args.repeats,
        )
        result["steps"] = args.fit_steps
        result["disk_beside"] = beside.writes

        # 1a. Blocking time of one save, against one copy of the state.
        xs, ys = data(BLOCKING_EVERY * 8)
        result["blocking"] = interleaved(
            {
                "copy": blocking_runner(
                    args.width, xs, ys, lambda: [CopyOnly(BLOCKING_EVERY).callback]
                ),
                "keras-ft": blocking_runner(
                    args.width,
                    xs,
                    ys,
                    ft(f"{root}/f-b", save_freq=BLOCKING_EVERY),
                ),
                "keras": blocking_runner(
                    args.width,
                    xs,
                    ys,
                    keras_own(f"{root}/f-kb", save_freq=BLOCKING_EVERY),
                ),
            },
            args.repeats,
        )

        # 1b. save_freq="auto" over a longer run.
        xa, ya = data(args.auto_steps)
        auto_log = io.StringIO()  # The interval it chose, printed when verbose.

        def auto_callbacks():
            return [keras_ft.BackupAndRestore(f"{root}/f-auto", save_freq="auto")]

        auto_ft = fit_runner(args.width, xa, ya, auto_callbacks)

        def auto_run():
            with contextlib.redirect_stdout(auto_log):
                return auto_ft()

        result["auto"] = interleaved(
            {"none": fit_runner(args.width, xa, ya, list), "auto": auto_run},
            args.repeats,
        )
        result["auto_steps"] = args.auto_steps
        notes.extend(sorted(set(auto_log.getvalue().splitlines())))

        # 2. Every epoch, ~50M parameters.
        if not args.quick:
            xb, yb = data(args.big_steps)
            big = build_model(args.big_width)
            result["big_params"] = big.count_params()
            del big
            big_args = (args.big_width, xb, yb)
            epochs = args.big_epochs
            result["every_epoch"] = interleaved(
                {
                    "none": fit_runner(*big_args, list, epochs),
                    "keras": fit_runner(*big_args, keras_own(f"{root}/b-k"), epochs),
                    "keras-ft": fit_runner(*big_args, ft(f"{root}/b-ft"), epochs),
                },
                args.big_repeats,
            )
            result["big_steps"], result["big_epochs"] = args.big_steps, epochs
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["notes"] = notes
    return result


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return (
        f"{fmt.format(med(values))} ({fmt.format(min(values))}-"
        f"{fmt.format(max(values))})"
    )


def paired(a: list[float], b: list[float], fn) -> list[float]:
    return [fn(x, y) for x, y in zip(a, b, strict=True)]


def rows_of(r: dict) -> list[tuple[str, str, str, str]]:
    """(measurement, value, target, met) rows for one backend's results."""
    rows = []
    mb = r["bytes"] / 1e6
    io_ = r["io"]
    for name, raw, label in (
        ("save", "raw write", "save throughput / raw write+fsync"),
        ("restore", "raw read", "restore throughput / raw cold read"),
    ):
        ratios = paired(io_[raw], io_[name], lambda raw_t, t: raw_t / t)
        rows.append(
            (
                f"{label} ({mb:.0f} MB: {mb / med(io_[name]):.0f} vs "
                f"{mb / med(io_[raw]):.0f} MB/s)",
                spread(ratios, "{:.2f}"),
                ">= 0.80",
                "yes" if med(ratios) >= 0.8 else "no",
            )
        )
    ratios = paired(io_["raw direct write"], io_["save"], lambda raw_t, t: raw_t / t)
    rows.append(
        (
            f"  save throughput / raw direct-I/O write+fsync "
            f"({mb / med(io_['raw direct write']):.0f} MB/s)",
            spread(ratios, "{:.2f}"),
            "",
            "",
        )
    )
    ratios = paired(
        io_["raw direct overwrite"], io_["save"], lambda raw_t, t: raw_t / t
    )
    rows.append(
        (
            f"  save throughput / raw direct-I/O overwrite in place+fdatasync "
            f"({mb / med(io_['raw direct overwrite']):.0f} MB/s)",
            spread(ratios, "{:.2f}"),
            "",
            "",
        )
    )
    for name in ("keras save", "keras restore"):
        rows.append((f"{name} (Keras' own, no fsync), s", spread(io_[name]), "", ""))

    eb = r["every_batch"]
    steps = r["steps"]
    for name in ("none", "disk beside", "keras", "sync", "async"):
        rows.append(
            (
                f"fit {steps} steps saving every batch: {name}, s",
                spread(eb[name]),
                "",
                "",
            )
        )
    for name in ("sync", "async"):
        ratios = [
            (v - n) / (k - n)
            for v, n, k in zip(eb[name], eb["none"], eb["keras"], strict=True)
        ]
        rows.append(
            (
                f"  keras-ft {name} added time / Keras' added time",
                spread(ratios, "{:.2f}"),
                "<= 0.20" if name == "async" else "",
                ("yes" if med(ratios) <= 0.2 else "no") if name == "async" else "",
            )
        )
    per_save = [
        (v - n) / steps * 1000
        for v, n in zip(eb["async"], eb["none"], strict=True)
    ]  # fmt: skip
    rows.append(
        ("  keras-ft async added per save, ms", spread(per_save, "{:.0f}"), "", "")
    )
    # A save cannot come round faster than the disk takes the checkpoint's
    # bytes: with one per step, each step lasts at least that long.
    disk = min(
        med(io_["raw write"]),
        med(io_["raw direct write"]),
        med(io_["raw direct overwrite"]),
    )

    def floor_of(writes: list[float]) -> list[float]:
        """Per round: the time added by one write of `writes` per step
        (beyond the step's own), over Keras' added time."""
        return [
            max(0.0, w - n / steps) * steps / (k - n)
            for w, n, k in zip(writes, eb["none"], eb["keras"], strict=True)
        ]

    floor = floor_of([disk] * len(eb["none"]))
    rows.append(
        (
            f"  disk floor: added time at one {disk * 1000:.0f} ms write+fsync "
            "per step / Keras' added time",
            spread(floor, "{:.2f}"),
            "",
            "",
        )
    )
    # The same floor with the disk's speed while training runs beside it
    # (the disk, its interrupts and the memory bus are shared with the step).
    beside = r["disk_beside"]
    loaded = floor_of(beside)
    rows.append(
        (
            f"  disk floor beside training: one {med(beside) * 1000:.0f} ms write "
            "per step / Keras' added time",
            spread(loaded, "{:.2f}"),
            "",
            "",
        )
    )

    blocking = r["blocking"]
    for name, label in (
        ("copy", "one copy of the state (NumPy, one thread)"),
        ("keras", "Keras' own save"),
        ("keras-ft", "keras-ft async save"),
    ):
        rows.append(
            (
                f"training held up per save, every {BLOCKING_EVERY} batches: "
                f"{label}, ms",
                spread([t * 1000 for t in blocking[name]], "{:.1f}"),
                "",
                "",
            )
        )
    ratios = paired(blocking["keras-ft"], blocking["copy"], lambda a, c: a / c)
    rows.append(
        (
            "  keras-ft save held up / one copy of the state",
            spread(ratios, "{:.2f}"),
            "<= 1.50",
            "yes" if med(ratios) <= 1.5 else "no",
        )
    )

    # Saving every batch, what a save must add at least: the copy training
    # waits for, and the part of the write that the step does not hide
    # (write beside training, per round, minus the step without a save).
    floor_ms = [
        (c + max(0.0, w - n / steps)) * 1000
        for c, w, n in zip(blocking["copy"], beside, eb["none"], strict=True)
    ]
    rows.append(
        (
            "every batch: copy + max(0, write beside training - step), ms",
            spread(floor_ms, "{:.0f}"),
            "",
            "",
        )
    )
    ratios = paired(per_save, floor_ms, lambda a, f: a / f)
    rows.append(
        (
            "  keras-ft async added per save / that",
            spread(ratios, "{:.2f}"),
            "<= 1.50",
            "yes" if med(ratios) <= 1.5 else "no",
        )
    )
    # What that floor leaves out on a machine whose disk costs the step CPU
    # time: a bare writer thread beside the same fit slows every step, even
    # where its write is over before the step is.
    beside_ms = [
        (d - n) / steps * 1000
        for d, n in zip(eb["disk beside"], eb["none"], strict=True)
    ]
    rows.append(
        (
            "  every batch: a bare writer beside training adds per step, ms",
            spread(beside_ms, "{:.0f}"),
            "",
            "",
        )
    )
    copies = blocking["copy"]
    with_writer = [c * 1000 + b for c, b in zip(copies, beside_ms, strict=True)]
    ratios = paired(per_save, with_writer, lambda a, f: a / f)
    rows.append(
        (
            "  keras-ft async added per save / (copy + that)",
            spread(ratios, "{:.2f}"),
            "",
            "",
        )
    )

    auto = r["auto"]
    ratios = paired(auto["auto"], auto["none"], lambda a, n: a / n)
    rows.append(
        (
            f"fit {r['auto_steps']} steps, save_freq='auto' / no callback",
            spread(ratios, "{:.3f}"),
            "<= 1.035",
            "yes" if med(ratios) <= 1.035 else "no",
        )
    )
    if "every_epoch" in r:
        ee = r["every_epoch"]
        label = (
            f"fit {r['big_params'] / 1e6:.0f}M params, {r['big_epochs']} epochs x "
            f"{r['big_steps']} steps, every epoch"
        )
        for name in ("none", "keras", "keras-ft"):
            rows.append((f"{label}: {name}, s", spread(ee[name]), "", ""))
        for name, target in (("keras", ""), ("keras-ft", "<= 1.02")):
            ratios = paired(ee[name], ee["none"], lambda a, n: a / n)
            rows.append(
                (
                    f"  {name} / no callback",
                    spread(ratios),
                    target,
                    ("yes" if med(ratios) <= 1.02 else "no") if target else "",
                )
            )
    rss = r["rss"]
    rows.append(
        (
            "peak extra RSS during a first async save / checkpoint bytes",
            f"{rss['keras-ft']:.2f} (Keras' own save: {rss['keras']:.2f})",
            "<= 1.10",
            "yes" if rss["keras-ft"] <= 1.1 else "no",
        )
    )
    return rows


def print_table(results: list[dict], repeats: int) -> None:
    print(
        "\nkeras-ft save cost: median (min-max) over interleaved rounds; ratios "
        f"paired within a round. repeats={repeats}\n"
    )
    header = ("backend", "measurement", "value", "target", "met")
    lines = [header]
    for r in results:
        for name, value, target, met in rows_of(r):
            lines.append((r["backend"], name, value, target, met))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print(" | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
    for r in results:
        params = f"{r['params']:,} parameters, checkpoint {r['bytes'] / 1e6:.1f} MB"
        print(f"\n{r['backend']}: {params}")
        for note in r["notes"]:
            print(f"  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="all", choices=("all", *BACKENDS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--fit-steps", type=int, default=20)
    parser.add_argument("--auto-steps", type=int, default=600)
    parser.add_argument("--big-width", type=int, default=6900)
    parser.add_argument("--big-steps", type=int, default=40)
    parser.add_argument("--big-epochs", type=int, default=3)
    parser.add_argument("--big-repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="leave out 50M")
    parser.add_argument("--dir", default=None, help="where to write checkpoints")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.json:
        print("RESULT " + json.dumps(measure(args)))
        return
    backends = BACKENDS if args.backend == "all" else (args.backend,)
    results = []
    for backend in backends:
        print(f"measuring on {backend}...", flush=True)
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        argv = []
        for key, value in vars(args).items():
            flag = "--" + key.replace("_", "-")
            if key in ("backend", "json") or value is None or value is False:
                continue
            argv += [flag] if value is True else [flag, str(value)]
        out = subprocess.run(
            [sys.executable, __file__, "--json", *argv],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        ).stdout
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    print_table(results, args.repeats)


if __name__ == "__main__":
    main()
