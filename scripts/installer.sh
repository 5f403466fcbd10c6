# Sourced by setup.sh and install_vllm.sh: `install_into VENV PIP_ARGS...` installs packages into VENV.
#
# With uv (pinned below, installed into VENV by its pip) where it can be had: it installs the same locked
# set several times faster than pip (parallel unpacking and bytecode compiling). Bytecode is compiled up
# front, as pip does: where PYTHONDONTWRITEBYTECODE is set, Python would otherwise recompile every module
# it imports in every process (twice the CPU time of the whole test suite). uv does not read pip's
# configuration, so the indexes and find-links pip is configured with (pip config list) are passed on,
# and every index is searched for the best match, as pip does. Where uv cannot be installed, pip does it all.
# INSTALL_BYTECODE=lazy leaves compiling to Python at first import: for an environment few processes use
# (.venv-classic), where compiling all of it (torch's ~20k modules included) costs 47 of its install's 58 CPU s.
UV_VERSION=0.13.9

_pip_sources_for_uv() {
  local key val v
  while IFS='=' read -r key val; do
    val=${val#\'}
    val=${val%\'}
    case "$key" in
      *.find-links) for v in $val; do printf -- '--find-links\n%s\n' "$v"; done ;;
      *.extra-index-url) for v in $val; do printf -- '--extra-index-url\n%s\n' "$v"; done ;;
      *.index-url) printf -- '--index-url\n%s\n' "$val" ;;
    esac
  done < <("$1/bin/python" -m pip config list 2>/dev/null)
}

install_into() {
  local venv=$1
  shift
  if [ "${ASYNCRL_NO_UV:-0}" != 1 ] && { [ -x "$venv/bin/uv" ] ||
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION" >/dev/null 2>&1; }; then
    local sources
    mapfile -t sources < <(_pip_sources_for_uv "$venv")
    local compile=(--compile-bytecode)
    [ "${INSTALL_BYTECODE:-}" = lazy ] && compile=()
    "$venv/bin/uv" pip install -q "${compile[@]}" --python "$venv/bin/python" --index-strategy unsafe-best-match "${sources[@]}" "$@"
  else
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
  fi
}
