"""How a reader trusts a checkpoint: the files its manifest lists and no
other, each of the size listed, each matching its checksum; and a read of
a checkpoint that overlaps its verification (`fetch()`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING, Any, TypeVar

from keras_ft import events, threads
from keras_ft.checkpoint import files as file_io
from keras_ft.checkpoint.files import ReadProgress
from keras_ft.checkpoint.format import (
    MANIFEST_FILE,
    MAX_JSON_BYTES,
    METADATA_FILE,
    PIECEWISE,
    Checkpoint,
    digest_algorithm,
    parse_json,
)
from keras_ft.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from keras_ft.checkpoint.store import CheckpointReader

_T = TypeVar("_T")


def fetch(
    reader: CheckpointReader,
    checkpoint: Checkpoint,
    files: dict[str, dict[str, Any]],
    read: Callable[[Checkpoint, ReadProgress], _T],
    progress_stream: Any,
    inspected: Callable[[CheckpointReader, Checkpoint, dict, str], None],
) -> tuple[Checkpoint, dict[str, Any], _T]:
    """`CheckpointStore.fetch()` of `checkpoint`, whose manifest lists
    `files`: a local copy verified while `read` reads it. `inspected` checks
    what a verified checkpoint holds."""
    local, on_disk, downloaded = _local_copy(reader, checkpoint, files)
    # On a disk, the checksums' pass is the restore's read; a bucket's
    # download shows its own progress.
    shown = None
    if progress_stream is not None and not reader.ranged_reads:
        shown = events.Progress(
            "restore", f"keras-ft: reading {checkpoint.name}",
            sum(entry_size(entry) for entry in downloaded.values()),
            stream=progress_stream,
        )  # fmt: skip
    progress = ReadProgress(shown)

    def verify() -> dict[str, Any]:
        try:
            # A reader checks what it reads of a piecewise file itself.
            # Sizes were checked before the read began.
            metadata = check_digests(on_disk, local, files, progress, False)
            inspected(on_disk, local, metadata, checkpoint.path)
            return metadata
        finally:
            progress.finish()

    verifying = threads.in_thread(verify, name="keras-ft-verify")
    try:
        try:
            result, error = read(local, progress), None
        except Exception as e:  # Raised below if the checkpoint is good.
            result, error = None, e
        metadata = verifying.result()
        if error is not None:
            raise error
    except BaseException:
        verifying.exception()  # Not left reading a file being removed.
        reader.release(local)
        raise
    return local, metadata, result


def _local_copy(
    reader: CheckpointReader, checkpoint: Checkpoint, files: dict[str, dict[str, Any]]
) -> tuple[Checkpoint, CheckpointReader, dict[str, dict[str, Any]]]:
    """The local copy of `checkpoint` to read and verify (in a bucket, its
    download under way; on a disk, the checkpoint itself), the reader of
    it, and the files to verify in it (those not left in a bucket)."""
    # In a bucket, the checkpoint's objects are listed while its manifest
    # is read: two round trips at once.
    listing = (
        threads.in_thread(reader.names, checkpoint, name="keras-ft-transfer")
        if reader.ranged_reads
        else None
    )
    check_names(reader, checkpoint, files, listing)
    piecewise = frozenset(n for n, e in files.items() if e.get(PIECEWISE))
    # A piecewise file's reader checks each piece it reads: in a bucket,
    # it fetches only the pieces it needs.
    ranged = piecewise if reader.ranged_reads else frozenset()
    try:
        if ranged:
            check_sizes(reader, checkpoint, {n: files[n] for n in ranged})
        local = reader.local_copy(
            checkpoint,
            {name: entry_size(entry) for name, entry in files.items()},
            # A piecewise file downloaded has no checksum pass to
            # follow its download: it is whole first.
            stream=frozenset(files) - piecewise,
            ranged=ranged,
        )
    except OSError as e:
        raise CorruptCheckpointError(
            checkpoint.path, f"could not be read ({e})"
        ) from None
    # What is loaded is the local copy: it is what gets verified, as its
    # bytes arrive (a bucket's download streams into the checksums).
    on_disk = reader.copy_reader(local)
    try:
        downloaded = {n: e for n, e in files.items() if n not in ranged}
        check_sizes(on_disk, local, downloaded)
    except BaseException:
        reader.release(local)
        raise
    return local, on_disk, downloaded


def read_small(reader: CheckpointReader, checkpoint: Checkpoint, name: str) -> bytes:
    try:
        return reader.read_bytes(checkpoint, name, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise CorruptCheckpointError(checkpoint.path, f"{name} is missing") from None
    except ValueError as e:  # Too large, or not a regular file.
        raise CorruptCheckpointError(checkpoint.path, str(e)) from None
    except OSError as e:
        raise CorruptCheckpointError(
            checkpoint.path, f"{name} could not be read ({e})"
        ) from None


def check_names(
    reader: CheckpointReader,
    checkpoint: Checkpoint,
    files: dict[str, dict[str, Any]],
    listing: futures.Future | None = None,
) -> None:
    """A checkpoint holds the files its manifest lists and nothing else: a
    loader looks for some files by name, and an unlisted one must never be
    taken for part of the checkpoint. `listing`: of `reader.names()`, if
    already under way."""
    try:
        present = reader.names(checkpoint) if listing is None else listing.result()
    except OSError as e:
        raise CorruptCheckpointError(
            checkpoint.path, f"cannot be listed ({e})"
        ) from None
    unlisted = sorted(present - set(files) - {MANIFEST_FILE})
    if unlisted:
        names = ", ".join(map(repr, unlisted))
        raise CorruptCheckpointError(
            checkpoint.path, f"it holds files its manifest does not list: {names}"
        )


def check_sizes(
    reader: CheckpointReader, checkpoint: Checkpoint, files: dict[str, dict[str, Any]]
) -> None:
    """Before a loader opens anything: each listed file is a regular file
    (no link to follow, no FIFO to block on) of the size listed."""
    for name, expected in files.items():
        try:
            size = reader.size(checkpoint, name)
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptCheckpointError(
                checkpoint.path, f"{name} is missing or not a regular file"
            ) from None
        if size != expected["size"]:
            raise CorruptCheckpointError(
                checkpoint.path,
                f"{name} has {size} bytes, the manifest says {expected['size']} "
                "(truncated or overwritten)",
            )


def check_files(
    reader: CheckpointReader,
    checkpoint: Checkpoint,
    files: dict[str, dict[str, Any]],
    progress: ReadProgress | None,
    whole: bool,
) -> dict[str, Any]:
    """Checks each of `files` with `reader`; returns the metadata."""
    check_sizes(reader, checkpoint, files)
    return check_digests(reader, checkpoint, files, progress, whole)


def check_digests(
    reader: CheckpointReader,
    checkpoint: Checkpoint,
    files: dict[str, dict[str, Any]],
    progress: ReadProgress | None,
    whole: bool,
) -> dict[str, Any]:
    """Checks the checksum of each of `files` (their sizes checked before);
    returns the metadata."""
    # Smallest first: a reader following `progress` parses the metadata
    # and small arrays while the big files are still being checked.
    for name, expected in sorted(files.items(), key=lambda item: entry_size(item[1])):
        if not whole and expected.get(PIECEWISE):
            continue
        algorithm = digest_algorithm(expected)
        read = None if progress is None else _telling(progress, name)
        try:
            digest = reader.digest(checkpoint, name, algorithm, read)
        except (OSError, ValueError) as e:
            raise CorruptCheckpointError(
                checkpoint.path, f"{name} could not be read ({e})"
            ) from None
        if digest != expected[algorithm]:
            raise CorruptCheckpointError(
                checkpoint.path,
                f"{name} does not match its {file_io.DIGEST_NAMES[algorithm]} checksum",
            )
    metadata = parse_json(
        read_small(reader, checkpoint, METADATA_FILE), checkpoint.path, METADATA_FILE
    )
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(checkpoint.path, "metadata is not an object")
    return metadata


def entry_size(entry: dict[str, Any]) -> int:
    size = entry.get("size")
    return size if isinstance(size, int) and size >= 0 else 0


def _telling(progress: ReadProgress, name: str) -> Callable[[int], None]:
    return lambda level: progress.advance(name, level)
