"""Whether recycling retired checkpoints pays: saving every batch with a
retired checkpoint's files written over in place (keras-ft's default) against
deleting it and writing new files, in one process, rounds interleaved
(`ab.py`).

A retired checkpoint (past `keep`) is renamed to a spare, and the next save
writes its big file over the spare's blocks (`checkpoint/local.py`), which
saves the filesystem allocating and zeroing new blocks, and freeing the old
ones, at each save. The other arm replaces `LocalStorage.retire` with its
`delete` in this process only (the package is not changed).

Run: `python benchmarks/recycling.py --backend jax` (defaults: a ~6M-parameter
MLP with Adam, 72 MB of state, 100 saves a fit, 6 rounds). The design keeps a
mechanism only where such a row shows it pays at least 10 % (docs/benchmarks.md).
"""

from __future__ import annotations

from ab import arguments, compare_patched


def main() -> None:
    args = arguments(__doc__.split("\n")[0])
    from keras_ft.checkpoint.local import LocalStorage

    def deleted(self, checkpoint) -> None:
        self.delete(checkpoint)

    compare_patched(args, ("recycled", "deleted"), LocalStorage, "retire", deleted)


if __name__ == "__main__":
    main()
