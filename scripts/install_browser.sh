#!/usr/bin/env bash
# Install headless Chromium for the report's browser test (tests/integration/test_report_browser.py).
# Idempotent: does nothing when `chromium` is on PATH. Installs the Debian package `chromium` where it can
# (root and apt-get); elsewhere warns and exits 1 (the test then skips, or fails under CI=true).
set -euo pipefail

command -v chromium >/dev/null 2>&1 && exit 0
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing chromium (headless report test)"
  # A stale package index is the usual reason the install fails: update it only then, and try once more.
  if install 2>/dev/null || { apt-get update -qq >/dev/null && install; }; then
    command -v chromium >/dev/null 2>&1 && exit 0
  fi
fi
echo "warning: could not install chromium (needs root and apt-get): install the Debian package 'chromium'" >&2
exit 1
