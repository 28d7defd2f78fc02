#!/usr/bin/env bash
# Build the linters that tests/test_deploy_files.py runs over deploy/ (each is optional there:
# a missing one is skipped, saying so). Everything comes through the Go module proxy.
#
#   deploy/lint/install-linters.sh          # prints "name path" for each linter built
#
#   helm             helm.sh/helm/v3/cmd/helm@$HELM_VERSION            -> `helm lint`, `helm template`
#   compose-validate deploy/lint/compose-validate (github.com/compose-spec/compose-go/v2
#                    $COMPOSE_GO_VERSION, the loader of Docker Compose v2): what
#                    `docker compose config` checks, without Docker. (Compose itself does not
#                    `go install`: its go.mod has exclude directives, and the machine's docker
#                    CLI has no compose plugin.)
#   k8s-validate     deploy/lint/k8s-validate (k8s.io/api $K8S_API_VERSION): strict decoding of
#                    rendered manifests into the typed Kubernetes API objects: unknown or
#                    misspelt fields, wrong types and unknown kinds fail. It stands in for
#                    kubeconform, whose JSON schemas are downloaded at run time from a host
#                    this machine cannot reach.
#
# Installed once per version under $FABRICWATCH_GO_CACHE (default ~/.cache/fabricwatch/go,
# shared with deploy/gnmi/build-fake-server.sh); later runs only print the paths
# (idempotent). Nothing is written into this repository.
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v3.22.0}"
COMPOSE_GO_VERSION="${COMPOSE_GO_VERSION:-v2.9.1}"   # what docker/compose v2.40.3 builds with
K8S_API_VERSION="${K8S_API_VERSION:-v0.37.0}"     # the k8s.io/api helm $HELM_VERSION builds with

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${FABRICWATCH_GO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fabricwatch/go}"
BIN_DIR="$CACHE/bin/linters"
HELM="$BIN_DIR/helm-$HELM_VERSION"
K8S_VALIDATE="$BIN_DIR/k8s-validate-$K8S_API_VERSION-$(sha256sum "$HERE/k8s-validate/main.go" | cut -c1-12)"
COMPOSE_VALIDATE="$BIN_DIR/compose-validate-$COMPOSE_GO_VERSION-$(sha256sum "$HERE/compose-validate/main.go" | cut -c1-12)"

log() { echo "install-linters: $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
    [[ -x /usr/local/go/bin/go ]] || { log "'go' not found; install Go >= 1.24"; exit 3; }
    export PATH="$PATH:/usr/local/go/bin"
fi
mkdir -p "$BIN_DIR"
export GOPATH="$CACHE/gopath"
export GOMODCACHE="$CACHE/gopath/pkg/mod"
export GOCACHE="${GOCACHE:-$CACHE/build}"
export GOFLAGS="-mod=mod -modcacherw"
export GO111MODULE=on

# go install into a scratch GOBIN, then move the binary to its versioned name.
install_tool() { # $1 package@version, $2 name go gives the binary, $3 destination
    local scratch
    scratch="$(mktemp -d)"
    log "go install $1"
    GOBIN="$scratch" go install -trimpath "$1" >&2
    mv "$scratch/$2" "$3"
    rm -rf "$scratch"
}

[[ -x "$HELM" ]] || install_tool "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" helm "$HELM"
# Build one of our small programs (deploy/lint/<name>/main.go) against pinned modules.
build_local() { # $1 name, $2 destination, $3... "module version" requirements
    local name="$1" dest="$2" src="$CACHE/src/$1"
    shift 2
    rm -rf "$src"
    mkdir -p "$src"
    cp "$HERE/$name/main.go" "$src/"
    {
        printf 'module fabricwatch.local/%s\n\ngo 1.24.0\n\nrequire (\n' "$name"
        printf '\t%s\n' "$@"
        printf ')\n'
    } > "$src/go.mod"
    log "go build $name ($*)"
    (cd "$src" && go mod tidy >&2 && go build -trimpath -o "$dest" . >&2)
}

[[ -x "$K8S_VALIDATE" ]] || build_local k8s-validate "$K8S_VALIDATE" \
    "k8s.io/api $K8S_API_VERSION" "k8s.io/apimachinery $K8S_API_VERSION" "sigs.k8s.io/yaml v1.6.0"
[[ -x "$COMPOSE_VALIDATE" ]] || build_local compose-validate "$COMPOSE_VALIDATE" \
    "github.com/compose-spec/compose-go/v2 $COMPOSE_GO_VERSION"

# Stable names for the tests: the newest build of each tool.
ln -sf "$HELM" "$BIN_DIR/helm"
ln -sf "$COMPOSE_VALIDATE" "$BIN_DIR/compose-validate"
ln -sf "$K8S_VALIDATE" "$BIN_DIR/k8s-validate"
echo "helm $BIN_DIR/helm"
echo "compose-validate $BIN_DIR/compose-validate"
echo "k8s-validate $BIN_DIR/k8s-validate"
