# shellcheck shell=bash
# =====================================================================================================
# The launch shared by the sbatch templates (sourced by slurm/train_*.sbatch; not run on its own).
#
# It starts one `python -m recipes.train` per task with srun; Lightning's SLURMEnvironment reads the
# rank and world size from SLURM, derives MASTER_ADDR/MASTER_PORT from the job, and — with the
# templates' `--signal=SIGUSR1@90 --requeue` — saves hpc_ckpt_N.ckpt and requeues the job 90 s before
# its time limit.  The requeued job runs this again and recipes.train resumes from the run directory's
# newest checkpoint.  Devices per node = tasks per node (one process per GPU), nodes = SLURM_NNODES.
#
# Knobs (environment, ${VAR:-default}; sbatch passes the submitting shell's environment on):
#   CONFIG           recipes/configs/*.yaml to train                (the template's default)
#   SEED             train.seed                                       (42)
#   ACCELERATOR      gpu | cpu                                        (gpu)
#   PYTHON           the interpreter with gaugeopt's dependencies     (python)
#   RUN_NAME         train.run_name                                   (<config>_s<seed>)
#   OUT_DIR          train.out_dir                                    (the config's, runs/)
#   EXTRA_ARGS       more section.key=value overrides, space separated, e.g. "train.max_steps=100"
#   DRY_RUN=1        print the srun command and run `recipes.train --dry-run` (no srun, no GPU needed)
#   REPO             the repository to run in                         ($SLURM_SUBMIT_DIR, else the current one)
#   NODES            nodes, outside a job (DRY_RUN)                   (under Slurm: $SLURM_NNODES; else 1)
#   GPUS_PER_NODE    tasks per node, outside a job                    (under Slurm: --ntasks-per-node; else 8)
#   OMP_NUM_THREADS  threads per task                                 ($SLURM_CPUS_PER_TASK, else 1)
# `bash slurm/launch.sh --help` (or a template's --help) prints this.
# =====================================================================================================
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the header above, without the comment marks
    awk '/^# =+$/ {n++; next} n == 1 {sub(/^# ?/, ""); print} n > 1 {exit}' "${BASH_SOURCE[0]}"
    exit 0
fi
set -euo pipefail

# ---- where and what ----------------------------------------------------------------------------------
REPO="${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
cd "$REPO"
PYTHON="${PYTHON:-python}"
SEED="${SEED:-42}"
ACCELERATOR="${ACCELERATOR:-gpu}"
NODES="${SLURM_NNODES:-${NODES:-1}}"
TASKS_PER_NODE="${SLURM_NTASKS_PER_NODE:-${GPUS_PER_NODE:-8}}"
TASKS_PER_NODE="${TASKS_PER_NODE%%(*}"          # "8(x2)" -> "8"

# ---- environment -------------------------------------------------------------------------------------
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"  # srun >= 22.05 no longer inherits --cpus-per-task
fi
export PYTHONUNBUFFERED=1

# ---- the command -------------------------------------------------------------------------------------
OVERRIDES=("train.seed=$SEED" "train.accelerator=$ACCELERATOR" "train.devices=$TASKS_PER_NODE" "train.num_nodes=$NODES")
[[ -n "${RUN_NAME:-}" ]] && OVERRIDES+=("train.run_name=$RUN_NAME")
[[ -n "${OUT_DIR:-}" ]] && OVERRIDES+=("train.out_dir=$OUT_DIR")
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
ARGS=(-m recipes.train --config "$CONFIG" --set "${OVERRIDES[@]}" ${EXTRA[@]+"${EXTRA[@]}"})
SRUN=(srun --kill-on-bad-exit=1 --ntasks-per-node="$TASKS_PER_NODE" "$PYTHON" "${ARGS[@]}")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    echo "nodes=$NODES tasks_per_node=$TASKS_PER_NODE gpus_per_node=${GPUS_PER_NODE:-} accelerator=$ACCELERATOR"
    echo "would run: ${SRUN[*]}"
    exec "$PYTHON" "${ARGS[@]}" --dry-run
fi

echo "==== job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-$(hostname)}: $(date -Is)"
echo "==== repo $REPO @ $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
command -v nvidia-smi >/dev/null && [[ "$ACCELERATOR" == gpu ]] && nvidia-smi -L || true
echo "==== ${SRUN[*]}"
"${SRUN[@]}"
echo "==== job ${SLURM_JOB_ID:-?} finished: $(date -Is)"
