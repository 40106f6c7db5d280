#!/usr/bin/env bash
# Build Kueue's controller manager (the gang admission the ElasticJobs will queue through)
# from Go modules into a cache keyed by version; reuse it when present. Prints the bin
# folder on its last line.
#
#   kueue (cmd/kueue, the controller manager and its webhook server) <- sigs.k8s.io/kueue $KUEUE_VERSION
#
# Beside bin/, config/ holds what the manager needs from the module's source tree, copied
# unchanged: crd/bases (the CRDs), crd/patches and crd/kustomization.yaml (which CRDs get
# a conversion webhook), webhook/manifests.yaml (the admission webhooks and their paths),
# rbac/role.yaml, metrics_auth_role.yaml and manager_secrets_role.yaml (the manager's
# ClusterRoles and its Role in its namespace: MultiKueue watches Secrets there) and
# manager/controller_manager_config.yaml (its default Configuration, for reference).
# tests/k8s/kueue.py points the webhooks at a URL on loopback.
# sigs.k8s.io/kueue has no replace directives, so `go install module@version` builds it as
# released (its go.mod says go 1.25: Go 1.26 builds it). Cold build on 2 cores: ~5 min
# (283 s measured, module downloads included, with the Go build cache of build-k8s.sh).
# Needs Go >= 1.25 and the Go module proxy; nothing else.
set -euo pipefail

KUEUE_VERSION="${KELASTIC_KUEUE_VERSION:-0.17.0}"
CACHE="${KELASTIC_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kelastic/k8s}"
ROOT_DIR="$CACHE/kueue-v$KUEUE_VERSION"
BIN="$ROOT_DIR/bin"
CONFIG="$ROOT_DIR/config"

if [ -x "$BIN/kueue" ] && [ -f "$BIN/.complete" ]; then
    echo "build-kueue: reusing $BIN" >&2
    echo "$BIN"
    exit 0
fi

command -v go > /dev/null || { echo "build-kueue: needs Go (go1.25+) on PATH" >&2; exit 1; }
started=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$ROOT_DIR"
mkdir -p "$BIN" "$CONFIG"
export GOFLAGS="-mod=mod" CGO_ENABLED=0

echo "build-kueue: building Kueue v$KUEUE_VERSION into $BIN (cold: ~5 min on 2 cores)" >&2
cd "$work"
src=$(go mod download -json "sigs.k8s.io/kueue@v$KUEUE_VERSION" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
if grep -q '^replace' "$src/go.mod"; then
    # `go install module@version` refuses a module with replace directives
    echo "build-kueue: sigs.k8s.io/kueue@v$KUEUE_VERSION has replace directives: extend this script" >&2
    exit 1
fi
# the version the manager reports (its log's first lines, the kueue_build_info metric)
version_pkg=sigs.k8s.io/kueue/pkg/version
ldflags="-s -w -X $version_pkg.GitVersion=v$KUEUE_VERSION -X $version_pkg.GitCommit=module-build"
ldflags+=" -X $version_pkg.BuildDate=1970-01-01T00:00:00Z"
GOBIN="$work/gobin" go install -trimpath -ldflags="$ldflags" \
    "sigs.k8s.io/kueue/cmd/kueue@v$KUEUE_VERSION"
mv "$work/gobin/kueue" "$BIN/kueue"
components="$src/config/components"
mkdir -p "$CONFIG/crd" "$CONFIG/webhook" "$CONFIG/rbac" "$CONFIG/manager"
cp -r "$components/crd/bases" "$components/crd/patches" "$components/crd/kustomization.yaml" \
    "$CONFIG/crd/"
cp "$components/webhook/manifests.yaml" "$CONFIG/webhook/"
cp "$components/rbac/role.yaml" "$components/rbac/metrics_auth_role.yaml" \
    "$components/rbac/manager_secrets_role.yaml" "$CONFIG/rbac/"
cp "$components/manager/controller_manager_config.yaml" "$CONFIG/manager/"
chmod -R u+w "$CONFIG"  # the module cache's files are read-only
touch "$BIN/.complete"
echo "build-kueue: built in $(( $(date +%s) - started )) s" >&2
echo "$BIN"
