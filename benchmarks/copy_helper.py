"""Whether copying a snapshot on two threads pays: the training thread and a
helper each copy about half of every batch of pieces, against the training
thread copying it all, in one process, rounds interleaved (`ab.py`).

The second arm gives the copy no helper in this process only (the package is
not changed), as on a machine with one core.

Run: `python benchmarks/copy_helper.py --backend jax` (defaults: a
~6M-parameter MLP with Adam, 72 MB of state, 100 saves a fit, 6 rounds);
`--every 8` for saves far enough apart that only the copy holds training up.
"""

from __future__ import annotations

from ab import arguments, compare


def main() -> None:
    args = arguments(__doc__.split("\n")[0])
    from keras_ft.threads import Pool

    two_threads = Pool.__call__

    def one_thread(self):
        return None if self.prefix == "keras-ft-copy" else two_threads(self)

    def use(arm: str) -> None:
        Pool.__call__ = two_threads if arm == "two threads" else one_thread

    try:
        compare(args, ("two threads", "one thread"), use)
    finally:
        Pool.__call__ = two_threads


if __name__ == "__main__":
    main()
