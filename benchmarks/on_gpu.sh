#!/usr/bin/env bash
# What keras-ft measures on a GPU machine, in one call of at most 9 minutes for
# JAX and PyTorch together (STAGES="split batch", the default), then the GPU
# tests in a second call only if time is left (STAGES=tests):
#
# - split: benchmarks/fit_split.py, the ~203M-parameter MLP saved every epoch,
#   3 epochs of at least 10 s, rounds interleaved (no callback / keras-ft
#   snapshot="auto" / "host"), the added time split into train begin, each
#   epoch end, train end and slowed steps, each save's timeline (snapshot, move,
#   check, write, commit) with its CPU seconds, the copy buffer's allocation and
#   page-lock times, device and host memory peaks;
# - batch: benchmarks/accelerator.py, the ~10M model saved every batch against
#   write + fsync, and the restore against read + host-to-device;
# - tests: the snapshot, exact-resume and NaN-guard tests on the GPU (JAX with
#   XLA's deterministic ops, PyTorch with its deterministic algorithms).
#
# Each stage has a time limit of its own and prints every measurement as it is
# taken (fit_split.py's JSON lines; its table is printed again from the log),
# so a stage cut short keeps what it had. Logs go to $OUT (default: ./gpu-out).
# The machine needs JAX and PyTorch for CUDA; Keras and what it lacks travel as
# wheels in .whl/ (../shared/device/prepare-wheels.sh), installed first.
# TensorFlow is not on that machine: its snapshot path is tested on the CPU.
# QUICK=1 runs the same steps CPU-sized, to try the script anywhere.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
    2>&1 | tail -3
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null
$py -c 'import keras, jax, torch; print("keras", keras.__version__, "jax",
  jax.__version__, jax.devices(), "torch", torch.__version__,
  torch.cuda.is_available())' 2>&1 | tail -1

stages=" ${STAGES:-split batch} "
tests="tests/test_snapshots.py tests/test_exact_resume.py tests/test_rng.py
  tests/test_nan_guard.py"
select="snapshot or mid_epoch_resumes or rng or device_check or rollback or guard or batch_later"
if [[ $stages == *" tests "* ]]; then
# Both backends at once (small models); JAX takes memory as it goes.
XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_deterministic_ops=true \
  KERAS_BACKEND=jax timeout 140 $py -m pytest -q -p no:cacheprovider $tests \
  -k "$select" > "$out/tests-jax.log" 2>&1 &
CUBLAS_WORKSPACE_CONFIG=:4096:8 KERAS_BACKEND=torch timeout 140 \
  $py -m pytest -q -p no:cacheprovider $tests -k "$select" \
  > "$out/tests-torch.log" 2>&1 &
wait
tail -n 4 "$out/tests-jax.log" "$out/tests-torch.log"
fi

# Seconds each stage may take, per backend (QUICK: CPU-sized, shorter).
if [ -n "${QUICK:-}" ]; then
  split=(--quick --rounds 1); split_limit=120
  small=(--widths 256 --steps 40 --epoch-seconds 0); batch_limit=90
else
  split=(--rounds 2); split_limit=200
  small=(--widths 3000 --epoch-seconds 0 --steps 400); batch_limit=60
fi
checkpoints=${CHECKPOINTS:-/tmp}
if [[ $stages == *" split "* ]]; then
  for backend in jax torch; do
    log="$out/split-$backend.log"
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$split_limit" \
      $py benchmarks/fit_split.py --backend $backend "${split[@]}" \
      --dir "$checkpoints" > "$log" 2>&1
    echo "== split, $backend (exit $?)"
    $py benchmarks/fit_split.py --from-log "$log"
  done
fi
# The ~10M model saved every batch beside no callback, and its restore.
if [[ $stages == *" batch "* ]]; then
  for backend in jax torch; do
    timeout $((batch_limit + 10)) env PYTHONUNBUFFERED=1 $py benchmarks/accelerator.py \
      --backend $backend "${small[@]}" --rounds 2 --modes device \
      --blocking-saves 2 --blocking-rounds 1 --no-peers --epoch-widths \
      --dir "$checkpoints" \
      --timeout "$batch_limit" 2>&1 | tee "$out/batch-$backend.log" | grep -v '^JSON'
  done
fi
