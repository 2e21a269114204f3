"""The checkpoint format (`keras_ft/checkpoint/format.py`): names, places,
manifests and the checks of `backup_dir` and `local_dir`. Damaged and forged
backups read whole: `test_hostile_backups.py`, `test_store.py`."""

from __future__ import annotations

import copy
import os

import pytest
from conftest import run_once_on

from keras_ft.checkpoint import format as fmt
from keras_ft.checkpoint.files import DIGEST
from keras_ft.errors import CorruptCheckpointError

ONCE = run_once_on("torch", "the format alone; the backend does not matter")


@ONCE
@pytest.mark.parametrize("sequence", [1, 42, 99_999_999, 100_000_000, 10**17])
def test_a_checkpoint_name_gives_back_its_number(sequence):
    name = fmt.checkpoint_name(sequence)
    assert name.startswith("ckpt-") and fmt.checkpoint_sequence(name) == sequence


@ONCE
@pytest.mark.parametrize(
    "name",
    ["ckpt-1", "ckpt-000000001", "ckpt-00000001\n", "ckpt-0000000١", "ckpt-",
     "ckpt-00000001.tmp", "CKPT-00000001", "ckpt-" + "9" * 19, "x-ckpt-00000001"],
)  # fmt: skip
def test_only_names_the_format_gives_are_checkpoints(name):
    assert fmt.checkpoint_sequence(name) is None


@ONCE
@pytest.mark.parametrize(
    "path, url",
    [("s3://bucket/run", True), ("gs://b", True), ("memory://x", True),
     ("file:///tmp/run", False), ("/tmp/run", False), ("run", False),
     ("C://weird", False), ("s3:/bucket/run", False), ("", False)],
)  # fmt: skip
def test_what_is_a_url(path, url):
    assert bool(fmt.is_url(path)) is url


@ONCE
def test_the_chief_directory_of_a_backup():
    assert fmt.chief_directory("s3://bucket/run/") == "s3://bucket/run/chief"
    assert fmt.chief_directory("file:///tmp/run") == "/tmp/run/chief"
    assert fmt.chief_directory("/tmp/run") == os.path.join("/tmp/run", fmt.CHIEF_DIR)
    assert fmt.join_location("s3://b/run/", "chief", "x") == "s3://b/run/chief/x"


@ONCE
@pytest.mark.parametrize(
    "name, ok",
    [("restarts.json", True), ("uploaded.json", True), ("a" * 64 + ".json", True),
     ("a" * 65 + ".json", False), ("Restarts.json", False), ("../x.json", False),
     ("x.json\n", False), ("x.txt", False), (".json", False)],
)  # fmt: skip
def test_notice_names(name, ok):
    assert fmt.is_notice_name(name) is ok
    if not ok:
        with pytest.raises(ValueError, match="Not a notice name"):
            fmt.check_notice_name(name)


FILES = {"weights.bin": {"size": 10, DIGEST: "ab" * 16},
         "metadata.json": {"size": 2, DIGEST: "cd" * 16}}  # fmt: skip


@ONCE
@pytest.mark.parametrize("key", [None, b"secret"])
def test_a_manifest_reads_back_its_files(key):
    body = fmt.manifest_body(copy.deepcopy(FILES), 1.0, key)
    assert fmt.manifest_files(body, "ckpt", key) == FILES


@ONCE
@pytest.mark.parametrize(
    "change, named",
    [
        (lambda m: m.update(format="other"), "no format tag"),
        (lambda m: m.update(version=2), "version 2"),
        (lambda m: m["files"]["weights.bin"].update(size=11), "digest mismatch"),
        (lambda m: m.pop("digest"), "digest mismatch"),
    ],
)
def test_a_manifest_altered_after_it_was_sealed_is_damaged(change, named):
    body = fmt.manifest_body(copy.deepcopy(FILES), 1.0)
    change(body)
    with pytest.raises(CorruptCheckpointError, match=named):
        fmt.manifest_files(body, "ckpt")


@ONCE
@pytest.mark.parametrize(
    "change, named",
    [
        (lambda f: f.clear(), "lists no files"),
        (lambda f: f.pop("metadata.json"), "lists no files"),
        (lambda f: f.update({"../x": f["weights.bin"]}), "outside"),
        (lambda f: f.update({"manifest.json": f["weights.bin"]}), "outside"),
        (lambda f: f.update({"a\\b": f["weights.bin"]}), "outside"),
        (lambda f: f["weights.bin"].update(size=-1), "malformed"),
        (lambda f: f["weights.bin"].update(size=True), "malformed"),
        (lambda f: f["weights.bin"].pop(DIGEST), "malformed"),
        (lambda f: f["weights.bin"].update({DIGEST: 7}), "malformed"),
        (lambda f: f["metadata.json"].update(size=2**40), "more than"),
    ],
)
def test_a_sealed_manifest_of_files_no_save_writes_is_damaged(change, named):
    """What a forger writes: sealed with the right digest, and refused for
    what it lists."""
    files = copy.deepcopy(FILES)
    change(files)
    with pytest.raises(CorruptCheckpointError, match=named):
        fmt.manifest_files(fmt.manifest_body(files, 1.0), "ckpt")


@ONCE
def test_a_signed_manifest_is_refused_without_its_key():
    signed = fmt.manifest_body(copy.deepcopy(FILES), 1.0, b"secret")
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        fmt.manifest_files(signed, "ckpt", b"another")
    unsigned = fmt.manifest_body(copy.deepcopy(FILES), 1.0)
    with pytest.raises(CorruptCheckpointError, match="not signed"):
        fmt.manifest_files(unsigned, "ckpt", b"secret")


@ONCE
def test_the_signing_key_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv(fmt.MANIFEST_KEY_ENV, raising=False)
    assert fmt.signing_key(None) is None
    assert fmt.signing_key("k") == b"k"
    monkeypatch.setenv(fmt.MANIFEST_KEY_ENV, "from-env")
    assert fmt.signing_key(None) == b"from-env"
    assert fmt.signing_key(b"given") == b"given"
    for bad in ("", b"", 3):
        with pytest.raises(ValueError, match="manifest_key"):
            fmt.signing_key(bad)


@ONCE
def test_json_that_is_not_is_damage():
    assert fmt.parse_json(fmt.json_bytes({"b": 1, "a": [2]}), "c", "m") == {
        "a": [2],
        "b": 1,
    }
    for data in (b"{", b"\xff", b"[" * 100_000):
        with pytest.raises(CorruptCheckpointError, match="m is not valid JSON"):
            fmt.parse_json(data, "c", "m")


@ONCE
def test_backup_dir_is_checked(tmp_path):
    assert fmt.validate_backup_dir(tmp_path / "new") == str(tmp_path / "new")
    assert fmt.validate_backup_dir("s3://bucket/run/") == "s3://bucket/run"
    assert fmt.validate_backup_dir(f"file://{tmp_path}") == str(tmp_path)
    (tmp_path / "file").write_text("")
    for bad, named in [
        ("", "Empty `backup_dir`"),
        (None, "Empty `backup_dir`"),
        (3, "Received: backup_dir=3"),
        ("s3:/bucket/run", "lost a slash.*s3://bucket/run"),
        (str(tmp_path / "file"), "existing file"),
    ]:
        with pytest.raises(ValueError, match=named):
            fmt.validate_backup_dir(bad)


@ONCE
def test_local_dir_is_checked(tmp_path):
    bucket = "s3://bucket/run"
    assert fmt.validate_local_dir(None, bucket) is None
    assert fmt.validate_local_dir(tmp_path / "tier", bucket) == str(tmp_path / "tier")
    (tmp_path / "file").write_text("")
    for bad, backup_dir, named in [
        ("", bucket, "Expected a path"),
        (3, bucket, "Expected a path"),
        ("s3://other", bucket, "it is a URL"),
        (str(tmp_path / "tier"), str(tmp_path / "backup"), "a directory already"),
        (str(tmp_path / "file"), bucket, "existing file"),
    ]:
        with pytest.raises(ValueError, match=named):
            fmt.validate_local_dir(bad, backup_dir)
