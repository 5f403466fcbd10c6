# Sourced by the sbatch templates beside it (submit them from the repository root: sbatch copies the
# script itself, so this file is found through $SLURM_SUBMIT_DIR). Sets VENV, NODES (the job's hosts, in
# order), GPUS_PER_NODE; defines `on HOST CMD...` (one task on that host, in the background, pid in PIDS)
# and `finish` (wait for the given pids, then stop every step still running; the worst exit code wins).
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:?run this under SLURM: sbatch scripts/slurm/<template>.sbatch}"
die() { echo "error: $*" >&2; exit 2; }
: "${OUTPUT_DIR:?set OUTPUT_DIR (for multi-node runs: a directory on a file system every node sees)}"
VENV=${ASYNCRL_VENV:-$SLURM_SUBMIT_DIR/.venv}
[ -x "$VENV/bin/python" ] || die "no asyncrl environment at $VENV (run scripts/setup.sh there or set ASYNCRL_VENV)"
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export OUTPUT_DIR
PIDS=()
on() { local host=$1; shift; srun --nodes=1 --ntasks=1 --nodelist="$host" --overlap "$@" & PIDS+=($!); }
finish() {
  local rc=0 pid
  for pid in "$@"; do wait "$pid" || rc=$?; done
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  return "$rc"
}
need() { local f; for f in "$@"; do [ -f "$f" ] || die "$f not found"; done; }
