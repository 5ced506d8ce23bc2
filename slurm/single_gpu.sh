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
set -euo pipefail
[ $# -gt 0 ] || set -- 50 10
srun python single_gpu.py "$@"
