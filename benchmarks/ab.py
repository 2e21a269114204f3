"""The harness of the 10 % rule's A/B benchmarks (`recycling.py`,
`without_pool.py`, `check_in_copy.py`): `fit()` saving every
batch (or every `--every` batches) with no callback and with keras-ft in each
arm, in one process, rounds interleaved (every other round in reverse order),
medians. A fit is timed up to its last callback's train end (keras-ft's waits
for its commits there): TensorFlow sometimes spends seconds more in tf.data's
iterator destructor, in any arm (`save_cost.Stopwatch`).

An arm is set up in this process only (the package is not changed) by the
benchmark's `use(arm)`, called before each fit of a keras-ft arm; the
benchmark puts the package back itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from save_cost import Stopwatch, build_model, data  # noqa: E402


def arguments(description: str) -> argparse.Namespace:
    """The command line every A/B takes; sets `KERAS_BACKEND` from it."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"))
    parser.add_argument("--width", type=int, default=2200)
    parser.add_argument("--saves", type=int, default=100, help="batches a fit")
    parser.add_argument("--every", type=int, default=1, help="batches a save")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dir", help="where checkpoints go (default: /tmp)")
    args = parser.parse_args()
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend
    return args


def compare(
    args: argparse.Namespace, arms: tuple[str, str], use: Callable[[str], None]
) -> None:
    """Runs no callback and both `arms`, prints each one's `fit()` time and
    added time per save, and the first arm's `fit()` over the second's."""
    import keras

    import keras_ft
    from keras_ft import threads

    model = build_model(args.width)
    x, y = data(args.saves)
    model.fit(x[:64], y[:64], batch_size=32, verbose=0)  # Compiled.
    root = tempfile.mkdtemp(dir=args.dir)

    def fit(arm: str) -> float:
        stopwatch = Stopwatch()  # Last: up to every callback's train end.
        callbacks = [stopwatch.callback]
        if arm != "none":
            use(arm)
            directory = os.path.join(root, arm.replace(" ", "_"))
            backup = keras_ft.BackupAndRestore(
                directory, save_freq=args.every, verbose=0
            )
            callbacks.insert(0, backup)
        start = time.perf_counter()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)  # fmt: skip
        threads.wait_for_discards()  # The finished backup's removal.
        return stopwatch.ended - start

    every = ("none", *arms)
    try:
        fit(arms[0]), fit(arms[1])  # Each path's first use, untimed.
        times: dict[str, list[float]] = {arm: [] for arm in every}
        for round_ in range(args.rounds):
            for arm in every if round_ % 2 == 0 else every[::-1]:
                times[arm].append(fit(arm))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    saves = args.saves // args.every
    state = 3 * model.count_params() * 4
    print(
        f"{keras.backend.backend()}: {model.count_params():,} parameters "
        f"({state / 1e6:.0f} MB of state), a save every {args.every} batches, "
        f"{saves} a fit, {args.rounds} rounds, medians"
    )
    base = statistics.median(times["none"])
    for arm in every:
        median = statistics.median(times[arm])
        added = (median - base) / saves * 1e3
        spread = ", ".join(f"{t:.2f}" for t in times[arm])
        print(f"  {arm:13s} fit {median:6.3f} s, added per save {added:5.1f} ms"
              f"  ({spread})")  # fmt: skip
    ratios = [a / b for a, b in zip(times[arms[0]], times[arms[1]], strict=True)]
    print(
        f"  fit() {arms[0]} / {arms[1]}: {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f})"
    )


def compare_patched(
    args: argparse.Namespace,
    arms: tuple[str, str],
    owner: Any,
    name: str,
    replacement: Callable,
) -> None:
    """`compare()` with `owner.name` as it is in the first arm and
    `replacement` in the second, put back afterwards (in this process only)."""
    original = getattr(owner, name)

    def use(arm: str) -> None:
        setattr(owner, name, original if arm == arms[0] else replacement)

    try:
        compare(args, arms, use)
    finally:
        setattr(owner, name, original)
