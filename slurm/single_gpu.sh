#!/bin/bash
# Stage 1 on a Slurm cluster: one task, one GPU. Submit from the repository root with your Python environment active:
#   sbatch slurm/single_gpu.sh [total_epochs save_every flags...]    (default: 50 10)
#   sbatch --gpus-per-node=0 slurm/single_gpu.sh                     (a CPU-only cluster)
# Add what your site needs, e.g. #SBATCH --partition=NAME and #SBATCH --account=NAME.
#SBATCH --job-name=single_gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
set -- --total_epochs 50 --save_every 10 "$@"  # the default 50 10: your arguments come after and win
# Stopped before its end (the time-limit warning asked for above, a preemption, scancel --signal=TERM or USR1), the
# run saves where it stands and exits with 128 + the signal; then this job requeues itself and resumes there. One
# log. Exit code 1 or 2 (one error line: bad input, a diverged run, a snapshot that cannot be read or written) would
# come again: the job ends without a requeue. Exit code 75 (a fault that may pass) requeues it if it saved.
snapshot=${SNAPSHOT:-single_gpu.pt}  # the file this script checks: SNAPSHOT, or --snapshot_path among the arguments
args=("$@")
for i in "${!args[@]}"; do
    case ${args[i]} in
        --snapshot_path=*) snapshot=${args[i]#*=} ;;
        --snapshot_path) snapshot=${args[i + 1]:-$snapshot} ;;
    esac
done
# Slurm 22.05 to 23.02 do not pass --cpus-per-task on to srun: without this, each step could run on one core.
[ -z "${SLURM_CPUS_PER_TASK:-}" ] || export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
echo "Job $SLURM_JOB_ID, start $((${SLURM_RESTART_COUNT:-0} + 1)) (requeued ${SLURM_RESTART_COUNT:-0} times)"
saved() { head -c 1 "$snapshot" >/dev/null 2>&1 && stat -c %y "$snapshot"; }  # opened: fresh on NFS too
before=$(saved || true)
trap 'scancel --signal=TERM "$SLURM_JOB_ID" || true' USR1  # every process of the run: stop after a step
trap 'ended=1' TERM  # Slurm ends the job (scancel, a preemption): the run stops and saves; so does this
status=0
srun python single_gpu.py --snapshot_path "$snapshot" "$@" &
wait $! || wait $! || status=$?  # again when a trap interrupted the first wait: the run's own status
if [ -n "${ended:-}" ]; then
    echo "Ended by Slurm (SIGTERM to the job), its progress saved in $snapshot: submit it again to go on"
    exit "$status"
fi
if [ "$status" -eq 1 ] || [ "$status" -eq 2 ]; then  # an error line from the run
    echo "Ended on an error that a new start would meet again (above): not requeued"
    exit "$status"
fi
if [ "$status" -ne 0 ] && [ "$(saved || true)" != "$before" ]; then  # not a finished run, nor an error
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "${MAX_REQUEUES:-20}" ]; then  # stopped early at every start
        echo "Stopped early with its progress saved in $snapshot, again: not requeued after ${MAX_REQUEUES:-20} requeues"
        exit "$status"
    fi
    echo "Stopped early with its progress saved in $snapshot: requeued to go on"
    scontrol requeue "$SLURM_JOB_ID" || { echo "scontrol requeue failed: submit the job again to go on"; exit "$status"; }
    sleep 60  # Slurm ends this start now: exiting first would end the job as failed, not requeued
fi
exit "$status"
