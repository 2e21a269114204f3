"""Whether one of a training's helper pools pays: keras-ft as it is, against
keras-ft doing that pool's work in the thread that hands it over, saving
every batch (or every `--every` batches), in one process, rounds interleaved
(`ab.py`).

The pools (`threads.Pools`): `copy` (the training thread and a helper each
copy about half of a snapshot), `checksum` (helpers checksum each piece
while the writer writes it), `fsync` (a checkpoint's files fsync'ed together). The
second arm gives the work no thread in this process only (the package is not
changed), as a machine with one core does for `copy`.

Run: `python benchmarks/without_pool.py copy --backend jax` (defaults: a
~6M-parameter MLP with Adam, 72 MB of state, 100 saves a fit, 6 rounds);
`--every 8` for saves far enough apart that only the copy holds training up
(the time it holds training up: `held_versions.py`).
"""

from __future__ import annotations

import sys

from ab import arguments, compare_patched

PREFIXES = {"copy": "keras-ft-copy", "checksum": "keras-ft-checksum",
            "fsync": "keras-ft-fsync"}  # fmt: skip


def main() -> None:
    pool = sys.argv.pop(1) if len(sys.argv) > 1 else ""
    if pool not in PREFIXES:
        sys.exit(f"usage: without_pool.py {{{','.join(PREFIXES)}}} [options]")
    args = arguments(__doc__.split("\n")[0])
    from keras_ft.threads import Pool

    with_it = Pool.__call__

    def without_it(self):
        return None if self.prefix == PREFIXES[pool] else with_it(self)

    arms = (f"with {pool}", f"without {pool}")
    compare_patched(args, arms, Pool, "__call__", without_it)


if __name__ == "__main__":
    main()
