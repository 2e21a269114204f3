"""Kill-fuzz of sharded saves: SIGKILL one of N model-parallel JAX processes.

Each trial runs `examples/model_parallel_cluster.py --kill-after-commit`: N
processes train under `ModelParallel` saving every few batches; once a backup
is committed, a random process is SIGKILLed at a random moment (often during a
save: each process writing its part, or the chief waiting for the others),
the others are stopped, and all are relaunched. A trial is survivable when
the relaunch resumes from a committed step and ends with the weights of an
uninterrupted run (bitwise, compared against a reference run).

Run: `python benchmarks/sharded_kill_fuzz.py [--trials 20] [--processes 2]`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "model_parallel_cluster.py")


def run(backup_dir: str, common: list[str], *extra: str) -> dict | None:
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--backup-dir", backup_dir, "--json", "--quiet",
         *common, *extra],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT ")), "")
    return json.loads(line[len("RESULT ") :]) if line else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    common = ["--processes", str(args.processes), "--devices", str(args.devices),
              "--epochs", "3", "--save-freq", "2", "--seconds-per-batch", "0.05",
              "--units", "512", "--kill-window", "0.6"]  # fmt: skip
    root = tempfile.mkdtemp(prefix="keras-ft-sharded-fuzz-")
    outcomes: collections.Counter = collections.Counter()
    lost = 0
    try:
        reference = run(os.path.join(root, "reference"), common)
        if reference is None:
            raise RuntimeError("the reference run failed")
        final = reference["final_digests"][0]
        for trial in range(args.trials):
            backup_dir = os.path.join(root, f"trial-{trial}")
            found = run(backup_dir, common, "--kill-after-commit", "--seed", str(trial))
            if found is None or set(found["exit_codes"]) != {0}:
                outcome = "failed"
            elif set(found["final_digests"]) != {final}:
                outcome = "other weights"
            else:
                outcome = "resumed, same weights"
                lost += found["killed_after_step"] - found["resumed_steps"][0]
            outcomes[outcome] += 1
            victim = found and found.get("victim")
            print(f"trial {trial}: killed process {victim}: {outcome}", flush=True)
            shutil.rmtree(backup_dir, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.processes} processes x {args.devices} devices, {args.trials} "
          f"SIGKILLs after a commit: {dict(outcomes)}; {lost} steps trained again "
          "in total.")  # fmt: skip
    return 0 if outcomes["resumed, same weights"] == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
