"""Training held up per save, for two versions of keras-ft: `save_cost.py`'s
row "keras-ft save held up / one copy of the state" (a save every 8 batches),
measured in processes alternating between two source trees (say a `git
worktree` of the commit before a change, and the change), each process
timing one copy and keras-ft's saves in turn.

A change to what the training thread does at a save (the copy, its helper)
shows here; the fit-time A/Bs (`ab.py`) cannot see a millisecond a save.
`--every-batch`: instead, the time a save every batch adds to `fit()` (the
every-batch row), a fit without a callback and one with keras-ft in turn.

Run: `python benchmarks/held_versions.py /tmp/old . --backend tensorflow`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(fits: int, every_batch: bool) -> None:
    """In a process of one version: held up / one copy, for each of `fits`
    (or milliseconds added per save every batch)."""
    sys.path.insert(0, HERE)
    from save_cost import BLOCKING_EVERY, CopyOnly, blocking_runner, data, fit_runner

    import keras_ft

    root = tempfile.mkdtemp()
    if every_batch:
        steps = 60
        xs, ys = data(steps)
        directory = os.path.join(root, "every")
        none = fit_runner(2048, xs, ys, list)
        saved = fit_runner(
            2048, xs, ys, lambda: [keras_ft.BackupAndRestore(directory, save_freq=1)]
        )
        added = []
        for _ in range(fits):
            added.append((saved() - none()) / steps * 1000)
            keras_ft.wait_for_backups()
        print("RATIOS", " ".join(f"{a:.1f}" for a in added))
        return
    xs, ys = data(BLOCKING_EVERY * 8)

    def backup() -> list:
        directory = os.path.join(root, "backup")
        return [keras_ft.BackupAndRestore(directory, save_freq=BLOCKING_EVERY)]

    copy = blocking_runner(2048, xs, ys, lambda: [CopyOnly(BLOCKING_EVERY).callback])
    held = blocking_runner(2048, xs, ys, backup)
    ratios = []
    for _ in range(fits):
        ratios.append(held() / copy())
        keras_ft.wait_for_backups()
    print("RATIOS", " ".join(f"{r:.3f}" for r in ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs=2, help="two source trees of keras-ft")
    parser.add_argument("--backend", default="tensorflow")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fits", type=int, default=5)
    parser.add_argument("--every-batch", action="store_true")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.fits, args.every_batch)
        return
    for round_ in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "KERAS_BACKEND": args.backend,
                   "PYTHONPATH": os.path.abspath(tree)}  # fmt: skip
            out = subprocess.run(
                [sys.executable, __file__, *args.trees, "--measure",
                 "--fits", str(args.fits)]
                + (["--every-batch"] if args.every_batch else []),
                capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(),
                check=True,
            ).stdout  # fmt: skip
            ratios = [float(r) for r in out.split("RATIOS")[-1].split()]
            row = "ms added a save" if args.every_batch else "held up / one copy"
            print(
                f"round {round_ + 1}, {tree}: {row} "
                f"{statistics.median(ratios):.3f} "
                f"({', '.join(f'{r:.2f}' for r in ratios)})",
                flush=True,
            )


if __name__ == "__main__":
    main()
