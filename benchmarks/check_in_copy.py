"""Where a save's NaN/infinity check pays: in the copy (each piece summed by
the copying thread while it is in the cache) against after it (the default
with background writes: a thread of its own reads the whole buffer again,
and the training thread goes on as soon as the copy is made), saving every
batch, in one process, rounds interleaved (`ab.py`).

The first arm wraps `CopyBuffer.capture` in this process only (the package
is not changed): every copy is checked as it is made.

Run: `python benchmarks/check_in_copy.py --backend jax` (defaults: a
~6M-parameter MLP with Adam, 72 MB of state, 100 saves a fit, 6 rounds);
`--every 8` for saves far enough apart that only the training thread's share
counts.
"""

from __future__ import annotations

from ab import arguments, compare_patched


def main() -> None:
    args = arguments(__doc__.split("\n")[0])
    from keras_ft.state.weights_copy import CopyBuffer

    after = CopyBuffer.capture

    def in_copy(self, values, fill, check_later=False, move=None):
        return after(self, values, fill, move is not None, move)

    arms = ("after the copy", "in the copy")
    compare_patched(args, arms, CopyBuffer, "capture", in_copy)


if __name__ == "__main__":
    main()
