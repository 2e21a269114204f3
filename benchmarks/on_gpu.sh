#!/usr/bin/env bash
# What keras-ft checks on a GPU machine, in one run of about 9 minutes: the
# snapshot, exact-resume and NaN-guard tests on the GPU (JAX with XLA's deterministic
# ops, PyTorch with its deterministic algorithms), then benchmarks/accelerator.py
# for a ~10M and a ~200M-parameter model. Logs go to $OUT (default: ./gpu-out).
#
# The machine needs JAX and PyTorch for CUDA; Keras and what it lacks travel as
# wheels in .whl/ (../shared/device/prepare-wheels.sh), installed first.
# QUICK=1 runs the same steps CPU-sized, to try the script anywhere.
# STAGES picks what runs (default "tests jax torch"): a device call is at most
# 10 minutes, so run "tests jax" and "torch" as two calls where needed.
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

stages=" ${STAGES:-tests jax torch} "
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

# The ~10M model saved every batch beside Keras' callbacks, then the ~200M one
# saved every epoch (with the baselines that split what a save adds: batch ends
# synced, keras-ft's hooks without saves).
if [ -n "${QUICK:-}" ]; then
  small=(--widths 256 --steps 40 --epoch-seconds 0); big=(--widths 1024 --epoch-seconds 1)
else
  small=(--widths 3000 --epoch-seconds 0 --steps 400); big=(--widths 14000 --epoch-seconds 4)
fi
common=(--rounds 2 --modes device --blocking-saves 2 --blocking-rounds 1
        --dir "${CHECKPOINTS:-/tmp}")
for backend in jax torch; do
  [[ $stages == *" $backend "* ]] || continue
  python_=(env PYTHONUNBUFFERED=1 $py benchmarks/accelerator.py --backend $backend)
  "${python_[@]}" "${small[@]}" "${common[@]}" --epoch-widths --timeout 90 2>&1 \
    | tee "$out/bench-$backend-small.log" | grep -v '^JSON'
  "${python_[@]}" "${big[@]}" "${common[@]}" --batch-widths --no-peers --timeout 160 \
    2>&1 | tee "$out/bench-$backend-big.log" | grep -v '^JSON'
done
