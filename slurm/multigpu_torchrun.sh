#!/bin/bash
# Stage 3 on a Slurm cluster: torchrun on one node starts one process per allocated GPU (CPU_PROCS on a CPU-only node)
# and restarts them all from the last snapshot if one fails (--max-restarts).
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
# Restarted workers must not meet the dead ones' addresses in torchrun's shared store (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# Stopped by a signal, torchrun gives its workers this long to save before it kills them (30 s by default). It
# passes on SIGUSR1 too, as --signals-to-handle below asks: a time-limit warning sent to the job's steps.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}
# Stopped before its end (the time-limit warning asked for above, a preemption, scancel --signal=TERM or USR1), the
# run saves where it stands and torchrun exits with an error; then this job requeues itself and resumes there. One
# log. An error line from the run (bad input, a diverged run, a snapshot that cannot be read or written) would come
# again: the run then ends torchrun at once (exit status 137), and the job ends without a requeue.
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
trap 'ended=1' TERM  # Slurm ends the job (scancel, a preemption): the run stops and saves; so does this
status=0
srun torchrun --standalone --nproc_per_node="$nproc" --max-restarts=3 \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    multigpu_torchrun.py --snapshot_path "$snapshot" "$@" &
wait $! || wait $! || status=$?  # again when a trap interrupted the first wait: the run's own status
if [ -n "${ended:-}" ]; then
    echo "Ended by Slurm (SIGTERM to the job), its progress saved in $snapshot: submit it again to go on"
    exit "$status"
fi
if [ "$status" -eq 137 ]; then  # torchrun ended by the run itself, after an error line
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
