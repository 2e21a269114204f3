"""Whether two writer threads pay: saving every batch with keras-ft's writer,
which starts a save's write while the save before it commits its small files
(commits keep their order), against one writer thread (each save written and
committed only once the one before is over), in one process, rounds
interleaved.

The second arm wraps `BackgroundWriter.submit` in this process only (the
package is not changed): each write first waits for the one before to end.

Run: `python benchmarks/one_writer.py --backend jax` (defaults: a ~6M-parameter
MLP with Adam, 72 MB of state, 100 saves a fit, 6 rounds). The design keeps a
mechanism only where such a row shows it pays at least 10 % (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from save_cost import build_model, data  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"))
    parser.add_argument("--width", type=int, default=2200)
    parser.add_argument("--saves", type=int, default=100, help="batches a fit")
    parser.add_argument("--every", type=int, default=1, help="batches a save")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dir", help="where checkpoints go (default: /tmp)")
    args = parser.parse_args()
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend

    import keras

    import keras_ft
    from keras_ft import threads
    from keras_ft.threads import BackgroundWriter

    overlapped = BackgroundWriter.submit

    def one_in_flight(self, write, *args):
        def in_turn(*call):  # `(*args, previous)`, as the writer calls it.
            previous = call[-1]
            if previous is not None:
                previous.join()  # As one writer thread would run them.
            return write(*call)

        return overlapped(self, in_turn, *args)

    model = build_model(args.width)
    x, y = data(args.saves)
    model.fit(x[:64], y[:64], batch_size=32, verbose=0)  # Compiled.
    root = tempfile.mkdtemp(dir=args.dir)

    def fit(arm: str) -> float:
        callbacks = []
        if arm != "none":
            chosen = overlapped if arm == "overlapped" else one_in_flight
            BackgroundWriter.submit = chosen
            directory = os.path.join(root, arm)
            callbacks = [
                keras_ft.BackupAndRestore(directory, save_freq=args.every, verbose=0)
            ]
        start = time.perf_counter()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)  # fmt: skip
        seconds = time.perf_counter() - start
        threads.wait_for_discards()  # The finished backup's removal.
        return seconds

    arms = ("none", "overlapped", "one writer")
    try:
        fit("overlapped"), fit("one writer")  # Each path's first use, untimed.
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for round_ in range(args.rounds):
            for arm in arms if round_ % 2 == 0 else arms[::-1]:
                times[arm].append(fit(arm))
    finally:
        BackgroundWriter.submit = overlapped
        shutil.rmtree(root, ignore_errors=True)
    state = 3 * model.count_params() * 4
    saves = args.saves // args.every
    print(
        f"{keras.backend.backend()}: {model.count_params():,} parameters "
        f"({state / 1e6:.0f} MB of state), a save every {args.every} batches, "
        f"{saves} a fit, {args.rounds} rounds, medians"
    )
    base = statistics.median(times["none"])
    for arm in arms:
        median = statistics.median(times[arm])
        added = (median - base) / saves * 1e3
        spread = ", ".join(f"{t:.2f}" for t in times[arm])
        print(f"  {arm:13s} fit {median:6.3f} s, added per save {added:5.1f} ms"
              f"  ({spread})")  # fmt: skip
    ratios = [
        a / b for a, b in zip(times["overlapped"], times["one writer"], strict=True)
    ]
    print(
        f"  fit() overlapped / one writer: {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
