#!/bin/bash
# Stage 3 on a Slurm cluster: torchrun on one node starts one process per allocated GPU (CPU_PROCS on a CPU-only node)
# and restarts them all from the last snapshot if one fails (--max-restarts).
# Submit from the repository root with your Python environment active:
#   sbatch slurm/multigpu_torchrun.sh [total_epochs save_every flags...]   (default: 50 10)
#   sbatch --gpus-per-node=0 slurm/multigpu_torchrun.sh                    (a CPU-only cluster)
# Add what your site needs, e.g. #SBATCH --partition=NAME and #SBATCH --account=NAME.
# Each process uses GPU LOCAL_RANK % (GPUs it sees): all of the node (here) or one each.
#SBATCH --job-name=multigpu_torchrun
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
[ $# -gt 0 ] || set -- 50 10
nproc=${SLURM_GPUS_ON_NODE:-0}
[ "$nproc" -gt 0 ] || nproc=${CPU_PROCS:-2}
# Restarted workers must not meet the dead ones' addresses in torchrun's shared store (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
srun torchrun --standalone --nproc_per_node="$nproc" --max-restarts=3 multigpu_torchrun.py "$@"
