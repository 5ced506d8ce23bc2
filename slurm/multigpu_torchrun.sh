#!/bin/bash
# Stage 3 on a Slurm cluster: torchrun on one node starts one process per allocated GPU
# (CPU_PROCS on a CPU-only node); if one fails, the job is requeued from the last snapshot as below.
# Submit from the repository root with your Python environment active:
#   sbatch slurm/multigpu_torchrun.sh [total_epochs save_every flags...]   (default: 50 10)
#   sbatch --gpus-per-node=0 slurm/multigpu_torchrun.sh                    (a CPU-only cluster)
# Add what your site needs, e.g. #SBATCH --partition=NAME and #SBATCH --account=NAME.
# Process LOCAL_RANK uses GPU LOCAL_RANK: torchrun's processes see all of the node's GPUs.
#SBATCH --job-name=multigpu_torchrun
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
set -- --total_epochs 50 --save_every 10 "$@"  # the default 50 10: your arguments come after and win
nproc=${SLURM_GPUS_ON_NODE:-0}
[ "$nproc" -gt 0 ] || nproc=${CPU_PROCS:-2}
# Stopped by a signal, torchrun gives its workers this long to save before it kills them (torch 2.12+; else 30 s).
# It passes on SIGUSR1 too (scancel --signal=USR1), as --signals-to-handle below asks.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}
# The run's exit status says what happened, and this script decides whether the job starts again. A run stopped
# early (the time-limit warning asked for above, scancel --signal=TERM or USR1, a lost or hung rank) that saved
# progress in this start is requeued and resumes there; one log. A run that saved nothing in this start is not
# requeued: an error that would come again (bad input, a diverged run, a snapshot that cannot be read or written)
# so costs at most one more start. A job that Slurm ends (scancel, a preemption) is not requeued by this script.
snapshot=${SNAPSHOT:-multigpu_torchrun.pt}  # the file this script checks: SNAPSHOT, or --snapshot_path among the arguments
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
trap 'ended=1' TERM  # Slurm ends the job (scancel, a preemption): the run stops and saves, and this ends
status=0
srun torchrun --standalone --nproc_per_node="$nproc" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    multigpu_torchrun.py --snapshot_path "$snapshot" "$@" &
wait $! || wait $! || status=$?  # again when a trap interrupted the first wait: the run's own status
if [ -n "${ended:-}" ]; then
    kept="its progress saved in $snapshot"
    [ "$(saved || true)" != "$before" ] || kept="nothing saved in $snapshot since this start"
    echo "Ended by Slurm (SIGTERM to the job), $kept: submit it again to go on"
    exit "$status"
fi
if [ "$status" -ne 0 ] && [ "$(saved || true)" == "$before" ]; then  # nothing saved: it would fail again
    echo "Ended early with nothing saved in $snapshot since this start (above): not requeued"
elif [ "$status" -ne 0 ]; then  # stopped early with its progress saved
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "${MAX_REQUEUES:-20}" ]; then  # stopped early at every start
        echo "Stopped early with its progress saved in $snapshot, again: not requeued after ${MAX_REQUEUES:-20} requeues"
        exit "$status"
    fi
    echo "Stopped early with its progress saved in $snapshot: requeued to go on"
    scontrol requeue "$SLURM_JOB_ID" || { echo "scontrol requeue failed: submit the job again to go on"; exit "$status"; }
    sleep 60  # Slurm ends this start now: exiting first would end the job as failed, not requeued
fi
exit "$status"
