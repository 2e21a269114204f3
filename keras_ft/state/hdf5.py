"""Reading HDF5 files from a backup, which is untrusted input.

HDF5 can make a reader open other files (external links, external raw
storage, virtual datasets) or allocate far more memory than the file holds
(a compressed dataset of zeros, a declared size with no data behind it).
Every HDF5 file keras-ft writes stores numbers, each dataset contiguously and
whole, inside the file, reached by plain (hard) links: anything else in a file it
reads is refused, before a single value is read, as a damaged checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import h5py

from keras_ft.errors import CorruptCheckpointError

# Element types keras-ft's HDF5 files hold; anything else is not ours.
NUMERIC_KINDS = "biuf"


def check_plain(f: h5py.Group, path: str) -> None:
    """Raises `CorruptCheckpointError` unless every object below `f` (a file,
    or a group of the file at `path`) is a group or a contiguous dataset
    stored whole inside the file."""
    handle = f.file
    size = os.fstat(handle.id.get_vfd_handle()).st_size if _has_handle(handle) else None
    problems: list[str] = []

    def visit(name: str, link: Any) -> None:
        if problems:
            return
        if not isinstance(link, h5py.HardLink):
            problems.append(f"{name} is a {type(link).__name__}, not a plain object")
            return
        item = f.get(name, getlink=False)
        if not isinstance(item, h5py.Dataset):
            return
        if item.dtype.kind not in NUMERIC_KINDS and not _is_bfloat16(item):
            problems.append(f"{name} holds {item.dtype}, not numbers")
        elif item.external or item.is_virtual:
            problems.append(f"{name} reads its data from another file")
        elif item.chunks is not None or item.compression is not None:
            problems.append(f"{name} is chunked or compressed")
        elif item.nbytes and item.id.get_storage_size() != item.nbytes:
            problems.append(f"{name} declares {item.nbytes} bytes but stores fewer")
        elif size is not None and item.nbytes > size:
            problems.append(f"{name} declares more bytes than the file has")

    try:
        f.visititems_links(visit)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        problems.append(f"cannot be walked ({e})")
    if problems:
        raise CorruptCheckpointError(
            os.path.dirname(path),
            f"{os.path.basename(path)}: {problems[0]}",
        )


def _is_bfloat16(dataset: h5py.Dataset) -> bool:
    """Keras' and keras-ft's bfloat16: 2 bytes, marked by an attribute."""
    return dataset.dtype.itemsize == 2 and dataset.attrs.get("dtype") == "bfloat16"


def _has_handle(f: h5py.File) -> bool:
    try:
        f.id.get_vfd_handle()
    except Exception:  # An in-memory file: no descriptor to ask.
        return False
    return True
