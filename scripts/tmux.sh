#!/usr/bin/env bash
# A tmux layout for watching an RL run: a Trainer pane (run `rl ...` here) and panes following the
# orchestrator's and inference server's logs. Usage:
#   bash scripts/tmux.sh [SESSION] [OUTPUT_DIR]   # start (default session "asyncrl", dir "outputs")
#   bash scripts/tmux.sh kill [SESSION]           # kill the session
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
command -v tmux >/dev/null || { echo "error: tmux is not installed (apt-get install tmux)"; exit 2; }
if tmux has-session -t "$session" 2>/dev/null; then
  exec tmux attach -t "$session"
fi
mkdir -p "$out/logs"
follow() { echo "while [ ! -f $out/logs/$1.log ]; do sleep 1; done; tail -F $out/logs/$1.log"; }
tmux new-session -d -s "$session" -n rl -c "$PWD"
tmux select-pane -t "$session:rl.0" -T Trainer
tmux split-window -h -t "$session:rl.0" -c "$PWD" "$(follow orchestrator)"
tmux select-pane -t "$session:rl.1" -T Orchestrator
tmux split-window -v -t "$session:rl.1" -c "$PWD" "$(follow inference)"
tmux select-pane -t "$session:rl.2" -T Inference
tmux set-option -t "$session" pane-border-status top
tmux select-pane -t "$session:rl.0"
exec tmux attach -t "$session"
