#!/usr/bin/env bash
# The tmux layout of PRIME-RL's docs, one window "RL" with three panes:
#   Trainer       a shell: type `rl ...` here
#   Orchestrator  follows {OUTPUT_DIR}/logs/orchestrator.log (rl writes it)
#   Inference     a shell: type `inference @ ...` here to keep a server across runs
#                 (when rl starts the server itself: tail -F {OUTPUT_DIR}/logs/inference.log)
# Usage:
#   bash scripts/tmux.sh [SESSION] [OUTPUT_DIR]   # start or attach (default session "asyncrl", dir "outputs";
#                                                 # SESSION exp-1: dir outputs/exp-1, as `rl ... --exp-id exp-1`)
#   bash scripts/tmux.sh kill [SESSION]           # kill the session
# Not on a terminal (a script, a test), it builds the session detached and prints how to attach.
set -euo pipefail
if [ "${1:-}" = "kill" ]; then
  tmux kill-session -t "${2:-asyncrl}"
  exit 0
fi
session=${1:-asyncrl}
out=${2:-outputs}
if [ "$session" != "asyncrl" ] && [ -z "${2:-}" ]; then
  out="outputs/$session"   # matches `rl ... --exp-id $session`
fi
command -v tmux >/dev/null || { echo "error: tmux is not installed (apt-get install tmux)" >&2; exit 2; }

attach() {
  if [ -n "${TMUX:-}" ]; then
    exec tmux switch-client -t "$session"
  elif [ -t 0 ] && [ -t 1 ]; then
    exec tmux attach -t "$session"
  fi
  echo "tmux session '$session' is ready: tmux attach -t $session"
}

if tmux has-session -t "=$session" 2>/dev/null; then
  attach
  exit 0
fi
mkdir -p "$out/logs"
follow() { echo "while [ ! -f $out/logs/$1.log ]; do sleep 1; done; exec tail -F $out/logs/$1.log"; }
shell_with() { echo "printf '%s\n' $(printf '%q' "$1"); exec \"\${SHELL:-bash}\""; }
tmux new-session -d -s "$session" -n RL -c "$PWD"
tmux select-pane -t "$session:RL.0" -T Trainer
tmux split-window -h -t "$session:RL.0" -c "$PWD" "$(follow orchestrator)"
tmux select-pane -t "$session:RL.1" -T Orchestrator
tmux split-window -v -t "$session:RL.1" -c "$PWD" \
  "$(shell_with "# Inference: start a server here (inference @ CONFIG); rl's own: tail -F $out/logs/inference.log")"
tmux select-pane -t "$session:RL.2" -T Inference
tmux set-option -t "$session" pane-border-status top
tmux set-option -t "$session" pane-border-format " #{pane_title} "
tmux select-pane -t "$session:RL.0"
attach
