#!/bin/bash
# A multi-worker training that SLURM runs again after a task dies: each
# attempt resumes from the chief's last backup. Submit it from the directory
# holding examples/ (the job runs there), with a backup_dir every node sees:
#
#   sbatch --ntasks=2 examples/slurm_requeue.sh --backup-dir /shared/backup
#
# keras_ft.initialize_cluster() in the script reads SLURM's variables (JAX
# and TensorFlow's SlurmClusterResolver find the job's hosts themselves):
# nothing to export. SLURM holds a requeued job for about two minutes
# before it may start again.
#SBATCH --requeue
#SBATCH --open-mode=append

# One task dead ends the step: the others need not wait for its heartbeat.
srun --kill-on-bad-exit=1 "${PYTHON:-python3}" examples/multiworker_torchrun.py "$@"
status=$?
# 75 is keras-ft's retryable exit (a stall, a lost peer), over 128 a signal
# (a kill, a preemption): worth another attempt. 1 is a Python exception, a
# bug to fix first.
if { [ "$status" -eq 75 ] || [ "$status" -gt 128 ]; } &&
  [ "${SLURM_RESTART_COUNT:-0}" -lt "${MAX_RESTARTS:-3}" ]; then
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
