#!/usr/bin/env bash
# =====================================================================================================
# Submit paper 002's experiments: Table 1 (conditions A, B, C × seeds 42, 123, 456) and Table 2
# (GaugeFix every 10, 100, 1000 steps, seed 42).  Table 2's "every 1 step" row is condition B at seed
# 42 (the same configuration), so it is not submitted twice unless FREQS says so.  12 runs of ~2.5 h
# on 8× A100 each.
#
#   slurm/sweep.sh --dry-run                                    # print the sbatch commands only
#   slurm/sweep.sh                                              # submit them
#   TEMPLATE=slurm/train_8xH100.sbatch SBATCH_ARGS="--partition=h100" slurm/sweep.sh
#   CONDITIONS="A B" SEEDS="42" FREQS="" slurm/sweep.sh         # a subset
#   slurm/sweep.sh --help                                       # this text
#
# Knobs (environment):
#   TEMPLATE     the sbatch template each run is submitted with   (slurm/train_8xA100.sbatch)
#   CONDITIONS   Table 1's conditions                              (A B C)
#   SEEDS        Table 1's seeds                                   (42 123 456)
#   FREQS        Table 2's GaugeFix intervals                      (10 100 1000; "" submits none)
#   FREQ_SEED    Table 2's seed                                    (42)
#   SBATCH_ARGS  more sbatch options for every run, e.g. "--partition=h100 --account=me"
#   CONFIGS_DIR  the folder of the configs                         (recipes/configs)
# and the template's own (CONFIG and SEED are set per run): `bash slurm/train_8xA100.sbatch --help`.
# =====================================================================================================
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the header above, without the comment marks
    awk '/^# =+$/ {n++; next} n == 1 {sub(/^# ?/, ""); print} n > 1 {exit}' "${BASH_SOURCE[0]}"
    exit 0
fi
set -euo pipefail

# ---- knobs --------------------------------------------------------------------------------------------
TEMPLATE="${TEMPLATE:-slurm/train_8xA100.sbatch}"
CONDITIONS="${CONDITIONS-A B C}"
SEEDS="${SEEDS-42 123 456}"
FREQS="${FREQS-10 100 1000}"
FREQ_SEED="${FREQ_SEED:-42}"
SBATCH_ARGS="${SBATCH_ARGS:-}"
CONFIGS="${CONFIGS_DIR:-recipes/configs}"

DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "usage: $0 [--dry-run | --help]" >&2; exit 2 ;;
esac

submit() {  # submit <config> <seed> <job name>
    local cmd=(env "CONFIG=$1" "SEED=$2" sbatch --job-name="$3")
    read -r -a extra <<< "$SBATCH_ARGS"
    cmd+=(${extra[@]+"${extra[@]}"} "$TEMPLATE")
    if ((DRY)); then
        echo "${cmd[*]:1}"
    else
        [[ -f "$1" ]] || { echo "sweep: missing config $1" >&2; exit 1; }
        echo "$3: $("${cmd[@]}")"
    fi
}

# ---- Table 1: conditions × seeds ------------------------------------------------------------------------
for c in $CONDITIONS; do
    for s in $SEEDS; do
        submit "$CONFIGS/gpt2_owt_$c.yaml" "$s" "gauge-$c-s$s"
    done
done
# ---- Table 2: GaugeFix frequency --------------------------------------------------------------------------
for n in $FREQS; do
    submit "$CONFIGS/gpt2_owt_fix_every_$n.yaml" "$FREQ_SEED" "gauge-every$n-s$FREQ_SEED"
done
