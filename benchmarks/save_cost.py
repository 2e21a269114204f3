"""Cost of a backup: keras-ft vs `keras.callbacks.BackupAndRestore` vs nothing.

Measures, side by side in one run on the current backend (`KERAS_BACKEND`):
1. `fit()` time of a ~5M-parameter MLP with Adam saving every batch: no
   callback, Keras' own, keras-ft synchronous, keras-ft asynchronous (the
   default); and keras-ft with `save_freq="auto"` over a longer run;
2. `fit()` time of a ~50M-parameter MLP saving every epoch: no callback,
   Keras' own, keras-ft;
3. save and restore throughput against raw write+fsync and raw read of the
   same number of bytes on the same disk (reads start from a cold page
   cache: the files' cached pages are dropped first);
4. peak extra resident memory during an asynchronous save.

Prints medians over repeats with the spread (min-max). Run: `make bench`, or
`KERAS_BACKEND=jax python benchmarks/save_cost.py --repeats 5`; `--no-big`
leaves out the 50M model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import tempfile
import threading
import time

import keras
import numpy as np

import keras_ft

med = statistics.median


def build_model(width: int) -> keras.Model:
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


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def fmt(times: list[float]) -> str:
    return f"{med(times):8.3f} s  ({min(times):.3f}-{max(times):.3f})"


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


def raw_read(path: str) -> None:
    drop_cached_pages([path])
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 24):
            pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_extra_rss(fn) -> int:
    """Peak resident memory above the level before `fn`, sampled every 1 ms."""
    before, peak, done = rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], rss_bytes()) - before


def fit_times(width, x, y, callbacks, repeats, epochs=1) -> list[float]:
    """`fit()` seconds of a fresh, warmed-up model with `callbacks()`."""
    model = build_model(width)
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    return timed(
        lambda: model.fit(
            x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=callbacks()
        ),
        repeats,
    )


def data(steps: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(32 * steps, 512)).astype("float32")
    return x, np.zeros((len(x), 10), "float32")


def ft(path: str, **kwargs):
    return lambda: [keras_ft.BackupAndRestore(path, verbose=0, **kwargs)]


def keras_own(path: str, **kwargs):
    return lambda: [keras.callbacks.BackupAndRestore(path, **kwargs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--fit-steps", type=int, default=20)
    parser.add_argument("--auto-steps", type=int, default=300)
    parser.add_argument("--big-width", type=int, default=6900)
    parser.add_argument("--big-steps", type=int, default=40)
    parser.add_argument("--big-epochs", type=int, default=3)
    parser.add_argument("--big-repeats", type=int, default=3)
    parser.add_argument("--no-big", action="store_true")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="keras-ft-bench-")
    table: list[tuple[str, str, str]] = []
    notes: list[str] = []
    try:
        # 4. Memory first, in a fresh process, before anything is cached.
        model = build_model(args.width)
        x, y = data(args.fit_steps)
        model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
        params = model.count_params()
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
        keras_rss = peak_extra_rss(keras_cb._save_model)

        # 3. Throughput against the raw disk.
        state = keras_ft.WorkerTrainingState(model, os.path.join(root, "ft"), keep=1)
        ft_save = timed(lambda: state.back_up(0), args.repeats)
        chief = os.path.join(root, "ft", "chief")
        ft_bytes = dir_bytes(chief)

        def cold_restore():
            drop_cached_pages(files_below(chief))
            state.restore()

        ft_restore = timed(cold_restore, args.repeats)
        keras_save = timed(keras_cb._save_model, args.repeats)
        keras_files = files_below(os.path.join(root, "keras"))

        def keras_cold_restore():
            drop_cached_pages(keras_files)
            keras_cb._load_model()

        keras_restore = timed(keras_cold_restore, args.repeats)
        raw_path = os.path.join(root, "raw.bin")
        block = np.random.default_rng(0).bytes(ft_bytes)
        raw_w = timed(lambda: raw_write(raw_path, block), args.repeats)
        raw_r = timed(lambda: raw_read(raw_path), args.repeats)

        # 1. Every batch, ~5M parameters.
        fit_args = (args.width, x, y)
        every = {
            "no callback": fit_times(*fit_args, list, args.repeats),
            "Keras BackupAndRestore": fit_times(
                *fit_args, keras_own(f"{root}/f-keras", save_freq=1), args.repeats
            ),
            "keras-ft sync": fit_times(
                *fit_args,
                ft(f"{root}/f-sync", save_freq=1, async_save=False),
                args.repeats,
            ),
            "keras-ft async": fit_times(
                *fit_args, ft(f"{root}/f-async", save_freq=1), args.repeats
            ),
        }
        base = med(every["no callback"])
        keras_added = med(every["Keras BackupAndRestore"]) - base
        for name, times in every.items():
            added = med(times) - base
            vs_keras = ""
            if name != "no callback" and keras_added > 0:
                vs_keras = f", added {added / keras_added:.2f}x Keras'"
            table.append(
                (
                    f"fit {args.fit_steps} steps every batch, {name}",
                    fmt(times),
                    f"{med(times) / base:.2f}x{vs_keras}",
                )
            )
        xa, ya = data(args.auto_steps)
        auto_none = fit_times(args.width, xa, ya, list, args.repeats)
        auto_log = io.StringIO()  # The interval it chose, printed when verbose.
        with contextlib.redirect_stdout(auto_log):
            auto_ft = fit_times(
                args.width,
                xa,
                ya,
                lambda: [keras_ft.BackupAndRestore(f"{root}/f-auto", save_freq="auto")],
                args.repeats,
            )
        table.append((f"fit {args.auto_steps} steps, no callback", fmt(auto_none), ""))
        table.append(
            (
                f"fit {args.auto_steps} steps, keras-ft save_freq='auto'",
                fmt(auto_ft),
                f"{med(auto_ft) / med(auto_none):.3f}x",
            )
        )
        notes.extend(sorted(set(auto_log.getvalue().splitlines())))

        # 2. Every epoch, ~50M parameters.
        if not args.no_big:
            xb, yb = data(args.big_steps)
            big = build_model(args.big_width)
            big_params = big.count_params()
            del big
            big_args = (args.big_width, xb, yb)
            epoch_runs = {
                "no callback": fit_times(
                    *big_args, list, args.big_repeats, epochs=args.big_epochs
                ),
                "Keras BackupAndRestore": fit_times(
                    *big_args,
                    keras_own(f"{root}/b-keras"),
                    args.big_repeats,
                    epochs=args.big_epochs,
                ),
                "keras-ft": fit_times(
                    *big_args,
                    ft(f"{root}/b-ft"),
                    args.big_repeats,
                    epochs=args.big_epochs,
                ),
            }
            bbase = med(epoch_runs["no callback"])
            for name, times in epoch_runs.items():
                table.append(
                    (
                        f"fit {big_params / 1e6:.0f}M params, {args.big_epochs} "
                        f"epochs x {args.big_steps} steps, every epoch, {name}",
                        fmt(times),
                        f"{med(times) / bbase:.3f}x",
                    )
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    mb = ft_bytes / 1e6
    table[:0] = [
        ("save, keras-ft sync (fsync)", fmt(ft_save), f"{mb / med(ft_save):.0f} MB/s"),
        ("raw write+fsync, same bytes", fmt(raw_w), f"{mb / med(raw_w):.0f} MB/s"),
        ("save, Keras BackupAndRestore (no fsync)", fmt(keras_save), ""),
        ("restore, keras-ft, cold cache", fmt(ft_restore),
         f"{mb / med(ft_restore):.0f} MB/s"),
        ("raw read, cold cache, same bytes", fmt(raw_r), f"{mb / med(raw_r):.0f} MB/s"),
        ("restore, Keras BackupAndRestore, cold cache", fmt(keras_restore), ""),
    ]  # fmt: skip
    print(
        f"\nbackend={keras.backend.backend()}  parameters={params:,}  "
        f"checkpoint={mb:.1f} MB  repeats={args.repeats}  (median, min-max)\n"
    )
    for name, value, extra in table:
        print(f"{name:64s} {value:28s} {extra}")
    print(
        f"\nsave throughput / raw write+fsync: {med(raw_w) / med(ft_save):.2f}\n"
        f"restore throughput / raw read: {med(raw_r) / med(ft_restore):.2f}\n"
        f"peak extra RSS, keras-ft async save: {rss_extra / ckpt_bytes:.2f}x "
        f"the checkpoint ({rss_extra / 1e6:.0f} MB); Keras' own save: "
        f"{keras_rss / 1e6:.0f} MB"
    )
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
