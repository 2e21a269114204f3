"""Whether two writer threads pay: saving every batch with keras-ft's writer,
which starts a save's write while the save before it commits its small files
(commits keep their order), against one writer thread (each save written and
committed only once the one before is over), in one process, rounds
interleaved (`ab.py`).

The second arm wraps `BackgroundWriter.submit` in this process only (the
package is not changed): each write first waits for the one before to end.

Run: `python benchmarks/one_writer.py --backend jax` (defaults: a ~6M-parameter
MLP with Adam, 72 MB of state, 100 saves a fit, 6 rounds). The design keeps a
mechanism only where such a row shows it pays at least 10 % (docs/benchmarks.md).
"""

from __future__ import annotations

from ab import arguments, compare


def main() -> None:
    args = arguments(__doc__.split("\n")[0])
    from keras_ft.threads import BackgroundWriter

    two_writers = BackgroundWriter.submit

    def one_writer(self, write, *args):
        def in_turn(*call):  # `(*args, previous)`, as the writer calls it.
            previous = call[-1]
            if previous is not None:
                previous.join()  # As one writer thread would run them.
            return write(*call)

        return two_writers(self, in_turn, *args)

    def use(arm: str) -> None:
        BackgroundWriter.submit = two_writers if arm == "two writers" else one_writer

    try:
        compare(args, ("two writers", "one writer"), use)
    finally:
        BackgroundWriter.submit = two_writers


if __name__ == "__main__":
    main()
