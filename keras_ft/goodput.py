"""Goodput of a run from its attempts (`training/goodput.py` records them):
how much of the wall time trained the model for good, and where the rest
went; and a timeline picture (optimizer step against wall time).

For each attempt (a process's `fit()`):
- startup: from the process's start to its restore, and from the restore to
  its first batch end (imports, compilation, replayed input);
- restore: reading and loading the backup;
- checkpointing: the time saves held training up;
- lost work: training past the step the next attempt resumed at (trained
  again after the failure);
- productive: the rest of its training time.
Between attempts, "down" is time with no process running (a failure not yet
noticed, the scheduler's restart). They add up to the wall time, from the
first process's start to the last batch recorded.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from typing import Any

from keras_ft import events
from keras_ft.training.goodput import MAX_KEPT_BYTES, PREFIX, kept, thinned

CATEGORIES = ("productive", "startup", "restore", "checkpointing", "lost", "down")


@dataclasses.dataclass
class Report:
    """Seconds per category, over the whole run.

    Attributes:
        wall: From the first process's start to the last batch recorded.
        seconds: `{category: seconds}` for `CATEGORIES`; they add up to `wall`.
        attempts: How many attempts (processes' `fit()`s) there were.
    """

    wall: float
    seconds: dict[str, float]
    attempts: int

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall if self.wall > 0 else 0.0


def load_attempts(store: Any) -> list[dict[str, Any]]:
    """The attempts recorded in a backup's store, oldest first (malformed
    records are left out)."""
    attempts = []
    for name in store.notices(PREFIX):
        try:
            record = json.loads(store.read_notice(name) or b"null")
        except (ValueError, RecursionError):
            continue
        if _valid(record):
            attempts.append(record)
    return sorted(attempts, key=lambda a: a["process_start"])


def report_finished(store: Any, path: str | os.PathLike | None) -> None:
    """A finished run's goodput, before its backup is deleted: said to the
    `keras_ft.goodput` logger (at `INFO`, the attempts in the record's
    `goodput` attribute), and written to `path` where one is named, for
    `keras-ft goodput PATH`. Best effort: a record that cannot be read or
    written is not worth failing the end of a training for."""
    try:
        attempts = load_attempts(store)
    except Exception:  # Any storage's error (a bucket out of reach).
        return
    if not attempts:
        return
    events.logger("goodput").info(
        "keras-ft: the run is over; " + describe(summarize(attempts)),
        extra={"goodput": attempts},
    )
    data = thinned(attempts)
    if path is None or data is None:
        return
    target = os.fspath(path)
    try:
        with open(target + ".tmp", "wb") as f:
            f.write(data)
        os.replace(target + ".tmp", target)
    except OSError as e:
        events.warn(
            "save", f"keras-ft: the goodput record was not written to {target}: {e}"
        )


def load_file(path: str) -> list[dict[str, Any]]:
    """The attempts `report_finished()` wrote to `path`, oldest first."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read(MAX_KEPT_BYTES + 1) or b"null")
    except (OSError, ValueError, RecursionError):
        return []
    found = value.get("attempts") if isinstance(value, dict) else None
    attempts = [a for a in found if _valid(a)] if isinstance(found, list) else []
    return sorted(attempts, key=lambda a: a["process_start"])


def load_kept(root: Any) -> list[dict[str, Any]]:
    """The attempts of a finished run, kept in its `backup_dir` (`root`, a
    storage) when its checkpoints were deleted, oldest first."""
    attempts = [a for a in kept(root) if _valid(a)]
    return sorted(attempts, key=lambda a: a["process_start"])


def _valid(record: Any) -> bool:
    numbers = ("process_start", "train_begin", "save_seconds")
    return (
        isinstance(record, dict)
        and all(isinstance(record.get(k), (int, float)) for k in numbers)
        and isinstance(record.get("samples"), list)
        and len(record["samples"]) > 0
        and all(
            isinstance(s, list)
            and len(s) == 2
            and all(isinstance(v, (int, float)) for v in s)
            for s in record["samples"]
        )
    )


def summarize(attempts: list[dict[str, Any]]) -> Report:
    """Goodput and badput of the run the `attempts` make."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    if not attempts:
        return Report(0.0, seconds, 0)
    previous_end = attempts[0]["process_start"]
    for i, attempt in enumerate(attempts):
        # A process that started before the last one's last sample (clocks
        # of two hosts, a launcher that starts the next before the last is
        # reaped): the overlap is not counted twice.
        start = max(attempt["process_start"], previous_end)
        restore_begin = attempt.get("restore_begin") or attempt["train_begin"]
        restore_end = attempt.get("restore_end") or restore_begin
        first_t = attempt["samples"][0][0]
        last_t, last_step = attempt["samples"][-1]
        seconds["startup"] += (restore_begin - start) + (first_t - restore_end)
        seconds["restore"] += restore_end - restore_begin
        span = last_t - first_t
        saving = min(attempt["save_seconds"], span)
        lost = 0.0
        if i + 1 < len(attempts):
            resumed = attempts[i + 1].get("resumed_step", 0)
            if resumed < last_step:
                lost = last_t - _time_at(attempt["samples"], resumed)
            seconds["down"] += max(0.0, attempts[i + 1]["process_start"] - last_t)
        lost = min(max(lost, 0.0), span - saving)
        seconds["checkpointing"] += saving
        seconds["lost"] += lost
        seconds["productive"] += span - saving - lost
        previous_end = last_t
    wall = attempts[-1]["samples"][-1][0] - attempts[0]["process_start"]
    return Report(wall, seconds, len(attempts))


def _time_at(samples: list[list[float]], step: float) -> float:
    """When the attempt reached `step`, interpolated between its samples."""
    steps = [s[1] for s in samples]
    i = bisect.bisect_left(steps, step)
    if i == 0:
        return samples[0][0]
    if i == len(samples):
        return samples[-1][0]
    (t0, s0), (t1, s1) = samples[i - 1], samples[i]
    return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1e-9)


def describe(report: Report) -> str:
    """The report as lines of text."""
    lines = [
        f"{report.attempts} attempts, {report.wall:.1f} s of wall time, "
        f"goodput {report.goodput:.1%}",
    ]
    for category in CATEGORIES:
        value = report.seconds[category]
        share = value / report.wall if report.wall > 0 else 0.0
        lines.append(f"  {category:<14}{value:10.1f} s  {share:6.1%}")
    return "\n".join(lines)


def timeline_png(attempts: list[dict[str, Any]], path: str, size=(800, 400)) -> None:
    """Draws optimizer step against wall time, each attempt a line, each
    failure (an attempt's end without a finish) a red mark and each resume a
    green one, into the PNG file `path`.

    Raises:
        ImportError: without Pillow (`pip install 'keras-ft[goodput]'`).
    """
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        raise ImportError(
            "keras-ft goodput needs Pillow to draw the timeline: "
            "pip install 'keras-ft[goodput]'"
        ) from None
    width, height = size
    margin = 50
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    if not attempts:
        draw.text((margin, height // 2), "no attempts recorded", fill="black")
        image.save(path, "PNG")
        return
    t0 = attempts[0]["process_start"]
    t1 = max(a["samples"][-1][0] for a in attempts)
    top = max(max(s[1] for s in a["samples"]) for a in attempts) or 1

    def at(t: float, step: float) -> tuple[float, float]:
        x = margin + (width - 2 * margin) * (t - t0) / max(t1 - t0, 1e-9)
        y = height - margin - (height - 2 * margin) * step / top
        return x, y

    draw.line([at(t0, 0), at(t1, 0)], fill="black")  # Axes.
    draw.line([at(t0, 0), at(t0, top)], fill="black")
    draw.text((margin, height - margin + 8), "0 s", fill="black")
    draw.text(
        (width - margin - 40, height - margin + 8), f"{t1 - t0:.0f} s", fill="black"
    )
    draw.text((4, margin - 6), f"step {top}", fill="black")
    for i, attempt in enumerate(attempts):
        start = attempt.get("restore_end") or attempt["train_begin"]
        points = [at(start, attempt.get("resumed_step", 0))]
        points += [at(t, s) for t, s in attempt["samples"]]
        draw.line(points, fill="blue", width=2)
        if i > 0:
            x, y = points[0]
            draw.ellipse([x - 4, y - 4, x + 4, y + 4], outline="green", width=2)
        if attempt.get("status") is None:  # Died without reaching its end.
            x, y = points[-1]
            draw.line([x - 5, y - 5, x + 5, y + 5], fill="red", width=2)
            draw.line([x - 5, y + 5, x + 5, y - 5], fill="red", width=2)
    draw.text((margin + 10, 10), "optimizer step vs wall time; x: failure, o: resume",
              fill="black")  # fmt: skip
    image.save(path, "PNG")
