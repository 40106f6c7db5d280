#!/usr/bin/env bash
# Build a real node's container runtime from Go modules into a cache keyed by version; reuse
# it when present. Prints the bin folder on its last line. (kubelet itself is built with the
# control plane by scripts/build-k8s.sh, from the same pinned k8s.io/kubernetes.)
#
#   containerd, containerd-shim-runc-v2, ctr    <- github.com/containerd/containerd/v2   $CONTAINERD_VERSION
#   crictl                                      <- sigs.k8s.io/cri-tools                 $CRICTL_VERSION
#   CNI plugins bridge, host-local, loopback, portmap <- github.com/containernetworking/plugins $CNI_VERSION
#   pause (the Pod sandbox's process)           <- tests/k8s/pause.c, gcc -static
#
# runc comes from Debian (`apt-get install runc`, scripts/test-tools.sh): a runc built from
# its module without cgo lacks seccomp, and every Pod then fails ("seccomp not supported").
# Cold build on 2 cores: about 4 minutes (249 s measured). Needs Go >= 1.25, gcc and the Go module proxy.
set -euo pipefail

CONTAINERD_VERSION="${KELASTIC_CONTAINERD_VERSION:-2.4.2}"
CRICTL_VERSION="${KELASTIC_CRICTL_VERSION:-1.37.0}"
CNI_VERSION="${KELASTIC_CNI_VERSION:-1.10.0}"
CACHE="${KELASTIC_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kelastic/k8s}"
REPO="${KELASTIC_REPO:-$(cd "$(dirname "$0")/.." && pwd)}"
PAUSE_SRC="$REPO/tests/k8s/pause.c"
PAUSE_KEY=$(sha256sum "$PAUSE_SRC" | cut -c1-12)
BIN="$CACHE/node-containerd$CONTAINERD_VERSION-crictl$CRICTL_VERSION-cni$CNI_VERSION-pause$PAUSE_KEY/bin"
TOOLS=(containerd containerd-shim-runc-v2 ctr crictl bridge host-local loopback portmap pause)

have_all() {
    local tool
    for tool in "${TOOLS[@]}"; do [ -x "$BIN/$tool" ] || return 1; done
    [ -f "$BIN/.complete" ]
}

if have_all; then
    echo "build-node: reusing $BIN" >&2
    echo "$BIN"
    exit 0
fi

command -v go > /dev/null || { echo "build-node: needs Go (go1.25+) on PATH" >&2; exit 1; }
command -v gcc > /dev/null || { echo "build-node: needs gcc (the pause binary)" >&2; exit 1; }
started=$(date +%s)
mkdir -p "$BIN"
export CGO_ENABLED=0 GOBIN="$BIN"
echo "build-node: building containerd v$CONTAINERD_VERSION, crictl v$CRICTL_VERSION and the" \
     "CNI plugins v$CNI_VERSION into $BIN (cold: ~4 min on 2 cores)" >&2
containerd=github.com/containerd/containerd/v2
go install -trimpath -ldflags="-s -w -X $containerd/version.Version=v$CONTAINERD_VERSION" \
    -tags "no_btrfs no_devmapper no_zfs" \
    "$containerd/cmd/containerd@v$CONTAINERD_VERSION" \
    "$containerd/cmd/containerd-shim-runc-v2@v$CONTAINERD_VERSION" \
    "$containerd/cmd/ctr@v$CONTAINERD_VERSION"
go install -trimpath -ldflags="-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=v$CRICTL_VERSION" \
    "sigs.k8s.io/cri-tools/cmd/crictl@v$CRICTL_VERSION"
plugins=github.com/containernetworking/plugins/plugins
go install -trimpath -ldflags="-s -w" \
    "$plugins/main/bridge@v$CNI_VERSION" "$plugins/ipam/host-local@v$CNI_VERSION" \
    "$plugins/main/loopback@v$CNI_VERSION" "$plugins/meta/portmap@v$CNI_VERSION"
gcc -Os -static -o "$BIN/pause" "$PAUSE_SRC"
touch "$BIN/.complete"
echo "build-node: built in $(( $(date +%s) - started )) s" >&2
echo "$BIN"
