#!/usr/bin/env bash
# What keras-ft checks on a GPU machine, in one run of about 8 minutes: the
# snapshot and exact-resume tests on the GPU (JAX with XLA's deterministic
# ops, PyTorch with its deterministic algorithms), then benchmarks/accelerator.py
# for a ~10M and a ~200M-parameter model. Logs go to $OUT (default: ./gpu-out).
#
# The machine needs JAX and PyTorch for CUDA; Keras and what it lacks travel as
# wheels in .whl/ (../shared/device/prepare-wheels.sh), installed first.
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

tests="tests/test_snapshots.py tests/test_exact_resume.py"
select="snapshot or mid_epoch_resumes"
# Both backends at once (small models); JAX takes memory as it goes.
XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_deterministic_ops=true \
  KERAS_BACKEND=jax timeout 120 $py -m pytest -q -p no:cacheprovider $tests \
  -k "$select" > "$out/tests-jax.log" 2>&1 &
CUBLAS_WORKSPACE_CONFIG=:4096:8 KERAS_BACKEND=torch timeout 120 \
  $py -m pytest -q -p no:cacheprovider $tests -k "$select" \
  > "$out/tests-torch.log" 2>&1 &
wait
tail -n 4 "$out/tests-jax.log" "$out/tests-torch.log"

if [ -n "${QUICK:-}" ]; then
  sizes=(--widths 256 1024 --epoch-widths 1024 --batch-widths 256 --steps 40
         --epoch-seconds 1)
else
  sizes=(--widths 3000 14000 --epoch-widths 14000 --batch-widths 3000
         --epoch-seconds 4)
fi
for backend in jax torch; do
  limit=200
  [ $backend = jax ] && limit=230  # Its first compiles take longer.
  $py benchmarks/accelerator.py --backend $backend "${sizes[@]}" --rounds 2 \
    --modes device --blocking-saves 2 --blocking-rounds 1 --timeout $limit \
    --dir "${CHECKPOINTS:-/tmp}" 2>&1 | tee "$out/bench-$backend.log" | grep -v '^JSON'
done
