"""Where a save's NaN/infinity check pays: in the copy (each piece summed by
the copying thread while it is in the cache) or after it (a thread of its own
reads the whole buffer again, and the training thread goes on as soon as the
copy is made), saving every batch, in one process, rounds interleaved
(`ab.py`).

With background writes, keras-ft checks after the copy, except where the copy
starts behind the last save's write (`weights_copy._behind()`: saves back to
back), which it waits for anyway: then in the copy, so that the check does not
compete with the next write for the cores. The second arm replaces
`weights_copy._behind` in this process only (the package is not changed): every
copy is checked after it is made.

Run: `python benchmarks/check_in_copy.py --backend jax` (defaults: a
~6M-parameter MLP with Adam, 72 MB of state, 100 saves a fit, 6 rounds);
`--every 8` for saves far enough apart that the arms do the same.
"""

from __future__ import annotations

from ab import arguments, compare_patched


def main() -> None:
    args = arguments(__doc__.split("\n")[0])
    from keras_ft.state import weights_copy

    arms = ("in when behind", "always after")
    compare_patched(args, arms, weights_copy, "_behind", lambda previous: False)


if __name__ == "__main__":
    main()
