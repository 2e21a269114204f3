"""The `keras-ft` command: look at, check, export and prune backups.

    keras-ft ls BACKUP_DIR          one row per checkpoint, and which a resume uses
    keras-ft verify BACKUP_DIR      every checksum; exit 0 if a resume would work
    keras-ft export BACKUP_DIR --model MODEL.keras --out OUT.keras|OUT.weights.h5
    keras-ft prune BACKUP_DIR --keep N
    keras-ft goodput BACKUP_DIR [--png FILE]   where the run's time went
    keras-ft demo                   kill a training and watch it resume

`BACKUP_DIR` is a local directory or an fsspec URL (`s3://bucket/run`). Only
`export` imports Keras; the others read the checkpoint files alone. Exit
status: 0 all is well, 1 a problem found (named on stderr), 2 a bad command
line or a path that is not a backup.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

import keras_ft
from keras_ft.checkpoint.format import CHIEF_DIR
from keras_ft.checkpoint.store import CheckpointStore, locate, open_storage
from keras_ft.errors import CheckpointError, CorruptCheckpointError, DirectoryInUseError


class UsageError(Exception):
    """A command line keras-ft cannot act on (exit status 2)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # Its own options.
        from keras_ft import demo

        return demo.main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (`keras-ft ls ... | head`): as other tools,
        # quietly; standard output is pointed at /dev/null so that Python's
        # own flush at exit does not complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it.
    except UsageError as e:
        print(f"keras-ft {args.command}: {_shown(str(e))}", file=sys.stderr)
        return 2
    except DirectoryInUseError as e:
        print(f"keras-ft {args.command}: refusing: {_shown(str(e))}", file=sys.stderr)
        return 1
    except (CheckpointError, ValueError, OSError) as e:
        # A damaged or hostile backup is an answer, not a crash.
        print(f"keras-ft {args.command}: {_shown(str(e))}", file=sys.stderr)
        return 1


def _shown(text: str) -> str:
    """`text` with what is not printable escaped: names and messages from a
    backup (which anyone may have written) never drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-ft", description="Look at, check, export and prune backups."
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {keras_ft.__version__}"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    ls = commands.add_parser("ls", help="list the checkpoints of a backup")
    ls.add_argument("backup_dir")
    ls.set_defaults(run=_ls)
    verify = commands.add_parser(
        "verify", help="check every checksum; exit 0 if a resume would work"
    )
    verify.add_argument("backup_dir")
    verify.set_defaults(run=_verify)
    export = commands.add_parser(
        "export", help="write the backup's weights as a normal Keras file"
    )
    export.add_argument("backup_dir")
    export.add_argument(
        "--model", help="a .keras file of the model (its architecture is used)"
    )
    export.add_argument("--out", required=True, help="OUT.keras or OUT.weights.h5")
    export.set_defaults(run=_export)
    prune = commands.add_parser(
        "prune", help="keep the newest N checkpoints, remove partial leftovers"
    )
    prune.add_argument("backup_dir")
    prune.add_argument("--keep", type=int, required=True)
    prune.set_defaults(run=_prune)
    goodput = commands.add_parser(
        "goodput", help="goodput and badput of the run, and a timeline picture"
    )
    goodput.add_argument("backup_dir")
    goodput.add_argument("--png", default=None, help="write the timeline here")
    goodput.set_defaults(run=_goodput)
    commands.add_parser("demo", help="kill a training with SIGKILL; watch it resume")
    return parser


# What a backup holds.


def _store(backup_dir: str) -> CheckpointStore:
    """The chief's checkpoints of `backup_dir`, or a `UsageError` saying why
    not. Its `verify()` checks contents too, as a restore does."""
    from keras_ft.state.contents import inspect

    try:
        store, checkpoint = locate(backup_dir, inspect=inspect)
    except (CheckpointError, ImportError, ValueError) as e:
        raise UsageError(str(e)) from None
    # A directory with neither `chief/` nor checkpoints of its own.
    empty = os.path.basename(store.directory) != CHIEF_DIR and not store.checkpoints()
    if checkpoint is not None or empty:
        raise UsageError(
            f"{backup_dir!r} is not a keras-ft backup directory: it has no chief/ "
            "directory of checkpoints. Pass the `backup_dir` given to "
            "keras_ft.BackupAndRestore."
        )
    return store


def _examine(store: Any) -> list[dict[str, Any]]:
    """Every checkpoint, verified, newest last: its numbers and its state."""
    rows = []
    for checkpoint in store.checkpoints():
        row: dict[str, Any] = {"checkpoint": checkpoint, "problem": None}
        try:
            metadata = store.verify(checkpoint)
        except CorruptCheckpointError as e:
            row["problem"] = e.reason
            metadata = store.unverified_metadata(checkpoint)
        row.update(metadata=metadata, size=store.usage(checkpoint.path))
        rows.append(row)
    return rows


def _resume_row(rows: list[dict]) -> dict | None:
    good = [row for row in rows if row["problem"] is None]
    return good[-1] if good else None


def _when(saved: Any) -> str:
    """A checkpoint's `saved_at` as a local time, or `?` (a damaged one's
    may be anything)."""
    try:
        return datetime.datetime.fromtimestamp(saved).strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"


# An entry named like a leftover that is not one: listed, never followed.
_FOREIGN = "foreign entry, not followed (a link or file no save made)"


# Commands.


def _ls(args: argparse.Namespace) -> int:
    store = _store(args.backup_dir)
    rows = _examine(store)
    resume = _resume_row(rows)
    table = [("seq", "epoch", "batch", "step", "saved", "size", "state")]
    for row in rows:
        metadata = row["metadata"]
        when = _when(metadata.get("saved_at"))
        problem = row["problem"]
        state = "good" if problem is None else f"damaged: {_shown(problem)}"
        if row is resume:
            state += "  <- a resume uses this one"
        table.append((
            str(row["checkpoint"].sequence),
            _shown(str(metadata.get("epochs_completed", "?"))),
            _shown(str(metadata.get("batches_completed", "?"))),
            _shown(str(metadata.get("step", "?"))),
            when,
            _human(row["size"]),
            state,
        ))  # fmt: skip
    for leftover in store.leftovers():
        name = _shown(leftover.rstrip("/").rsplit("/", 1)[-1])
        table.append(("-", "-", "-", "-", "-", _human(store.usage(leftover)),
                      f"partial leftover ({name})"))  # fmt: skip
    for entry in store.foreign():
        name = _shown(entry.rstrip("/").rsplit("/", 1)[-1])
        table.append(("-", "-", "-", "-", "-", "-", f"{_FOREIGN} ({name})"))
    print(f"{store.directory}:")
    if len(table) == 1:
        print("  no checkpoints")
        return 0
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for r in table:
        cells = [c.rjust(w) if i < 4 else c.ljust(w) for i, (c, w) in
                 enumerate(zip(r, widths, strict=False))]  # fmt: skip
        print("  " + "  ".join(cells) + "  " + r[-1])
    return 0


def _verify(args: argparse.Namespace) -> int:
    store = _store(args.backup_dir)
    rows = _examine(store)
    for row in rows:
        checkpoint = row["checkpoint"]
        if row["problem"] is None:
            print(f"{store.url(checkpoint)}: good")
        else:
            print(
                f"{store.url(checkpoint)}: DAMAGED: {_shown(row['problem'])}",
                file=sys.stderr,
            )
    for leftover in store.leftovers():
        print(f"{_shown(leftover)}: partial leftover (removed at the next start)")
    for entry in store.foreign():
        print(f"{_shown(entry)}: {_FOREIGN} (removed at the next start)")
    resume = _resume_row(rows)
    if resume is None:
        what = "no checkpoint verifies" if rows else "there is no checkpoint"
        print(f"keras-ft verify: {what}: a resume would start from scratch.",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"a resume would use {store.url(resume['checkpoint'])}: good")
    return 0


def _export(args: argparse.Namespace) -> int:
    out = args.out
    if not (out.endswith(".keras") or out.endswith(".weights.h5")):
        raise UsageError(f"--out must end in .keras or .weights.h5; got {out!r}.")
    if args.model is None and out.endswith(".keras"):
        raise UsageError("exporting a .keras file needs --model MODEL.keras.")
    if args.model is not None and not os.path.isfile(args.model):
        raise UsageError(f"--model {args.model!r} does not exist.")
    store = _store(args.backup_dir)
    if args.model is None:
        # The backup's weights file is a Keras weights file: copy it, verified.
        found = store.latest_good_read(lambda checkpoint, progress: None)
        if found is None:
            print("keras-ft export: the backup holds no checkpoint.", file=sys.stderr)
            return 1
        local = found[0]
        from keras_ft.state.weights_layout import WEIGHTS_FILE, copy_for_inference

        try:
            copy_for_inference(local.file(WEIGHTS_FILE), out)
        finally:
            store.release(local)
        print(f"wrote {out} from {store.url(local)}")
        return 0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    from keras_ft.watching import load_checkpoint

    model = keras.saving.load_model(args.model)
    loaded = load_checkpoint(store.directory.rsplit(f"/{CHIEF_DIR}", 1)[0], model)
    if out.endswith(".keras"):
        model.save(out)
    else:
        model.save_weights(out)
    print(f"wrote {out} from {loaded.path} (epoch {loaded.epoch}, step {loaded.step})")
    return 0


def _goodput(args: argparse.Namespace) -> int:
    from keras_ft import goodput

    # A running (or interrupted) run's record lies beside its checkpoints;
    # a finished one's in the file its `goodput_file` named (or, written by
    # an older keras-ft, in `backup_dir` itself).
    where = args.backup_dir
    if os.path.isfile(where):
        attempts = goodput.load_file(where)
    else:
        attempts = []
        try:
            store = _store(where)
            attempts, where = goodput.load_attempts(store), store.directory
        except UsageError:
            if not os.path.isdir(where):  # Nor a bucket: not a backup.
                raise
        if not attempts:
            try:
                attempts = goodput.load_kept(open_storage(args.backup_dir))
            except (ImportError, ValueError) as e:
                raise UsageError(str(e)) from None
    if not attempts:
        print(
            f"keras-ft goodput: {where} holds no record of a run.",
            file=sys.stderr,
        )
        return 1
    print(goodput.describe(goodput.summarize(attempts)))
    if args.png:
        try:
            goodput.timeline_png(attempts, args.png)
        except ImportError as e:
            raise UsageError(str(e)) from None
        print(f"wrote {args.png}")
    return 0


def _prune(args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise UsageError(f"--keep must be at least 1; got {args.keep}.")
    store = _store(args.backup_dir)
    lock: Any = store.writer_lock()
    lock.acquire()  # DirectoryInUseError while a training holds the backup.
    try:
        leftovers = store.leftovers() + store.foreign()
        store.remove_leftovers()
        committed = store.checkpoints()
        # The newest N that verify; a damaged one counts for nothing. Only
        # checkpoints older than the oldest kept one are deleted: nothing if
        # no good one is found, and no damaged one newer than those kept.
        kept, damaged = [], []
        for checkpoint in reversed(committed):
            if len(kept) == args.keep:
                break
            try:
                store.verify(checkpoint)
                kept.append(checkpoint)
            except CorruptCheckpointError:
                damaged.append(checkpoint)
        oldest = kept[-1].sequence if len(kept) == args.keep else 0
        doomed = [c for c in committed if c.sequence < oldest]
        for checkpoint in doomed:
            store.delete(checkpoint)
    finally:
        lock.release()
    from keras_ft.threads import wait_for_removals

    wait_for_removals()
    names = ", ".join(_shown(c.name) for c in reversed(kept)) or "none"
    print(
        f"removed {len(doomed)} checkpoints and {len(leftovers)} partial leftovers; "
        f"kept the newest good ones: {names}"
        + (f"; {len(damaged)} damaged ones left alone" if damaged else "")
    )
    return 0
