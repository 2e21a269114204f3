"""A restore's local copy of a bucket's checkpoint: its files downloaded
(the large ones in concurrent ranges, checksummed as they arrive) into a
local directory, or left in the bucket for a reader to fetch by ranges."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from keras_ft import events, threads
from keras_ft.checkpoint import scratch, transfers
from keras_ft.checkpoint.format import Checkpoint, checkpoint_name
from keras_ft.checkpoint.local import LocalReader

if TYPE_CHECKING:
    from keras_ft.checkpoint.remote import ObjectStorage


class LocalCopies:
    """The local copies of `storage`'s checkpoints being restored, and the
    downloads still arriving into them."""

    def __init__(self, storage: ObjectStorage):
        self._storage = storage
        self._arriving: dict[str, dict[str, transfers.RangedDownload]] = {}

    def make(
        self,
        checkpoint: Checkpoint,
        sizes: dict[str, int],
        stream: frozenset[str] = frozenset(),
        ranged: frozenset[str] = frozenset(),
    ) -> Checkpoint:
        """Downloads the files of `checkpoint` (`sizes`: names and sizes in
        its manifest) into a local directory, removed by `release()`.

        The files named in `stream` at least `transfers.STREAM_MIN` bytes long arrive
        in ranges fetched concurrently, written in place, and this returns
        once they have begun: `reader()` checksums (and the loader then
        reads) each one as its bytes arrive, rather than after the whole
        download. The files named in `ranged` are not downloaded: a reader
        fetches the byte ranges it needs of them (the copy's `ranges`). The
        others are whole when this returns.
        """
        root = scratch.make("download")
        downloading = threads.Pool(threads.TRANSFERS, "keras-ft-transfer")
        local = Checkpoint(
            checkpoint.sequence,
            os.path.join(root, checkpoint_name(checkpoint.sequence)),
        )
        try:
            os.mkdir(local.path)
            streamed = {
                name for name, size in sizes.items()
                if name in stream and size >= transfers.STREAM_MIN
            }  # fmt: skip
            moved = [name for name in sizes if name not in ranged]
            # One line for the checkpoint, ended when its last byte is here.
            shown = self._storage._progress_of(
                "restore", f"downloading {checkpoint.name}",
                sum(sizes[name] for name in moved),
            )  # fmt: skip
            # The small files first: the transfer threads take work in order.
            downloads = [
                threads.submit(
                    downloading, self._download, checkpoint, name,
                    local.file(name), shown,
                )
                for name in moved
                if name not in streamed
            ]  # fmt: skip
            if ranged:
                ranges = functools.partial(self._read_range, checkpoint, ranged)
                local = dataclasses.replace(local, ranges=ranges)
            self._arriving[local.path] = {
                name: transfers.RangedDownload(
                    self._storage,
                    checkpoint,
                    name,
                    local.file(name),
                    sizes[name],
                    shown,
                )
                for name in sorted(streamed)
            }
            for download in downloads:
                download.result()
        except BaseException:
            downloading.close()  # None goes on writing into what is removed.
            self.release(local)
            raise
        downloading.close()  # Every download is in: its threads end.
        return local

    def reader(self, local: Checkpoint) -> LocalReader:
        """Reads `make()`'s files, each checksum following its file's
        download."""
        streams = self._arriving.get(local.path, {})

        def arrived(name: str) -> Callable[[int], None] | None:
            download = streams.get(name)
            return None if download is None else download.wait_for

        return LocalReader(arrived)

    def _read_range(
        self, checkpoint: Checkpoint, names: frozenset[str], name: str,
        offset: int, size: int,
    ) -> bytes:  # fmt: skip
        """`size` bytes at `offset` of the object `name` (one ranged GET)."""
        if name not in names:
            raise FileNotFoundError(errno.ENOENT, f"{name} is not read by ranges")
        key = self._storage._key(checkpoint, name)
        return transfers.as_os_error(
            lambda: self._storage.fs.cat_file(key, start=offset, end=offset + size),
            f"download of {key} (bytes {offset} to {offset + size})",
        )

    def _download(
        self,
        checkpoint: Checkpoint,
        name: str,
        path: str,
        shown: events.Progress | None = None,
    ) -> None:
        key = self._storage._key(checkpoint, name)
        with contextlib.suppress(FileNotFoundError):  # Verification says so.
            transfers.retried(
                lambda: self._storage.fs.get_file(
                    key, path, callback=transfers.moves(shown)
                )
            )

    def release(self, local: Checkpoint) -> None:
        """Removes a download of `make()` once it is loaded (calling
        off what is still arriving). Arrays a loader mapped from it stay
        valid: an unlinked file lives on while mapped."""
        for download in self._arriving.pop(local.path, {}).values():
            download.stop()
        root = os.path.dirname(local.path)
        if os.path.basename(root).startswith("keras-ft-download-"):
            scratch.remove(root)
