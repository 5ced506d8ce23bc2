#!/bin/bash
# Stage 2 on a Slurm cluster: one task that spawns one process per allocated GPU (2 on a CPU-only node).
# Submit from the repository root with your Python environment active:
#   sbatch slurm/multigpu.sh [total_epochs save_every flags...]       (default: 50 10)
#   sbatch --gpus-per-node=0 slurm/multigpu.sh                        (a CPU-only cluster)
# Add what your site needs, e.g. #SBATCH --partition=NAME and #SBATCH --account=NAME.
#SBATCH --job-name=multigpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
[ $# -gt 0 ] || set -- 50 10
# NCCL_DEBUG=INFO shows how NCCL connects the GPUs; useful when a job hangs at start.
srun python multigpu.py "$@"
