"""The suite's jobs, each backend's test files split into parts of about
equal time, longest job first (for `.ci/suites`: a job starts in the first
free lane, so the longest first packs the lanes best).

Usage: python .ci/split.py PARTS JOB...   (a job: a backend, or `compat`)
       python .ci/split.py record BACKEND LOG   (LOG: pytest --durations=0)

Prints one line per job: `<name> <seconds> <backend> <files...>` (`compat`
has no files). The seconds are estimates from `.ci/durations.json`, each test
file's seconds per backend measured on a quiet 2-core VM (`--durations=0`,
summed by file); a file not measured counts as `DEFAULT` seconds. Only the
split depends on them: every file runs whatever they say.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = 5.0
COMPAT = 560.0  # `make test-compat`, as CI measured it.
TABLE = os.path.join(HERE, "durations.json")


def record(backend: str, log: str) -> None:
    """Puts the seconds per file of a `--durations=0` log into the table."""
    seconds: dict[str, float] = collections.defaultdict(float)
    with open(log, encoding="utf-8") as f:
        for line in f:
            found = re.match(r"([0-9.]+)s (?:call|setup|teardown) +(tests/[^:]+)::",
                             line)  # fmt: skip
            if found:
                seconds[found.group(2)] += float(found.group(1))
    table = {}
    if os.path.exists(TABLE):
        with open(TABLE, encoding="utf-8") as f:
            table = json.load(f)
    table[backend] = {name: round(s, 1) for name, s in sorted(seconds.items())}
    with open(TABLE, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")


def main(parts: int, jobs: list[str]) -> None:
    with open(TABLE, encoding="utf-8") as f:
        measured = json.load(f)
    files = sorted(
        os.path.relpath(p, os.path.dirname(HERE))
        for p in glob.glob(os.path.join(HERE, "..", "tests", "test_*.py"))
    )
    plan = []
    for job in jobs:
        if job == "compat":
            plan.append((COMPAT, "compat", "compat", []))
            continue
        seconds = measured.get(job, {})
        # The heaviest file first, each into the lightest part so far.
        bins: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(parts)]
        for name in sorted(files, key=lambda n: -seconds.get(n, DEFAULT)):
            total, chosen = min(bins, key=lambda b: b[0])
            bins.remove((total, chosen))
            bins.append((total + seconds.get(name, DEFAULT), [*chosen, name]))
        for index, (total, chosen) in enumerate(bins, 1):
            name = job if parts == 1 else f"{job}-{index}"
            plan.append((total, name, job, sorted(chosen) if parts > 1 else []))
    for total, name, backend, chosen in sorted(plan, key=lambda p: -p[0]):
        print(name, round(total), backend, *chosen)


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3])
    else:
        main(int(sys.argv[1]), sys.argv[2:])
