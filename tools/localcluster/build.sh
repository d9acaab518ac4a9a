#!/usr/bin/env bash
# Build the local control plane's binaries from their Go modules into a cache outside the
# repository, reusing whatever is already there. Safe to run repeatedly: a binary whose
# version stamp matches is not rebuilt.
#
#   TRN_CLUSTER_CACHE  where binaries go (default ~/.cache/trainium-operator/cluster)
#
# Versions are pinned here and in gomod/*/go.mod; change both together.
set -euo pipefail

K8S_VERSION=v1.34.4
ETCD_VERSION=v3.5.35
KWOK_VERSION=v0.7.0
HELM_VERSION=v3.19.0
# The Prometheus operator's CRDs (ServiceMonitor, PodMonitor, PrometheusRule), so the chart's
# monitoring objects are validated by the API server; taken from the Go module's example/ folder.
PROMETHEUS_OPERATOR_VERSION=v0.85.0
# Kueue's controller (the queueing tests run it against the local API server) and its CRDs
KUEUE_VERSION=v0.17.0

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${TRN_CLUSTER_CACHE:-$HOME/.cache/trainium-operator/cluster}
bin=$cache/bin
mkdir -p "$bin"
export GOFLAGS="${GOFLAGS:-} -trimpath"
export CGO_ENABLED=0

log() { printf '[cluster build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# fresh NAME VERSION: true when bin/NAME exists and was built from VERSION.
fresh() { [ -x "$bin/$1" ] && [ "$(cat "$bin/.$1.version" 2>/dev/null)" = "$2" ]; }
stamp() { echo "$2" > "$bin/.$1.version"; }

build_kubernetes() {
  local major minor pkg=k8s.io/component-base/version
  major=$(echo "$K8S_VERSION" | cut -d. -f1 | tr -d v)
  minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  # The same ldflags as Kubernetes' own hack/lib/version.sh, so /version reports the release.
  local ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  ldflags+=" -X $pkg.gitCommit=$K8S_VERSION"
  for cmd in kube-apiserver kube-controller-manager kube-scheduler; do
    if fresh "$cmd" "$K8S_VERSION"; then log "$cmd $K8S_VERSION: cached"; continue; fi
    log "$cmd $K8S_VERSION: building (cold: several minutes)"
    (cd "$here/gomod/kubernetes" && go build -ldflags "$ldflags" -o "$bin/$cmd" "k8s.io/kubernetes/cmd/$cmd")
    stamp "$cmd" "$K8S_VERSION"
  done
}

build_etcd() {
  if fresh etcd "$ETCD_VERSION"; then log "etcd $ETCD_VERSION: cached"; return; fi
  log "etcd $ETCD_VERSION: building"
  (cd "$here/gomod/etcd" && go build -ldflags "-s -w" -o "$bin/etcd" .)
  stamp etcd "$ETCD_VERSION"
}

build_go_install() {  # NAME MODULE_PATH VERSION [LDFLAGS]
  if fresh "$1" "$3"; then log "$1 $3: cached"; return; fi
  log "$1 $3: building"
  GOBIN="$bin" go install -ldflags "-s -w ${4:-}" "$2@$3"
  stamp "$1" "$3"
}

fetch_monitoring_crds() {
  local out=$cache/monitoring-crds dir
  if [ "$(cat "$out/.version" 2>/dev/null)" = "$PROMETHEUS_OPERATOR_VERSION" ]; then
    log "prometheus-operator CRDs $PROMETHEUS_OPERATOR_VERSION: cached"; return
  fi
  log "prometheus-operator CRDs $PROMETHEUS_OPERATOR_VERSION: downloading the module"
  dir=$(go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  mkdir -p "$out"
  for kind in servicemonitors podmonitors prometheusrules; do
    cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml" "$out/"
  done
  echo "$PROMETHEUS_OPERATOR_VERSION" > "$out/.version"
}

# The pods' network shim (podnet.c, an LD_PRELOAD library): rebuilt when its source changes.
build_podnet() {
  local sum
  sum=$(sha256sum "$here/podnet.c" | cut -c1-16)
  if [ -f "$bin/libpodnet.so" ] && [ "$(cat "$bin/.libpodnet.so.version" 2>/dev/null)" = "$sum" ]; then
    log "libpodnet.so: cached"; return
  fi
  if ! command -v cc >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing Debian's gcc (podnet.c is compiled)"
    # (one apt-get at a time: tools/test installs other packages beside this build, on a fresh machine)
    ( flock 8; apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
    ) 8>/var/lock/trainium-operator-apt.lock
  fi
  command -v cc >/dev/null || { echo "tools/localcluster/build.sh: a C compiler (cc) is needed for podnet.c; install gcc" >&2; exit 1; }
  log "libpodnet.so: compiling"
  cc -shared -fPIC -O2 -Wall -o "$bin/libpodnet.so" "$here/podnet.c" -ldl
  stamp libpodnet.so "$sum"
}

# Kueue: built from its Go module (the module cache's copy, as `go mod download` leaves it), with
# its CRDs copied beside; a version stamp on both. Slow cold (a large module): it runs beside the
# other builds.
build_kueue() {
  local out=$cache/kueue-crds dir
  if fresh kueue "$KUEUE_VERSION" && [ "$(cat "$out/.version" 2>/dev/null)" = "$KUEUE_VERSION" ]; then
    log "kueue $KUEUE_VERSION: cached"; return
  fi
  log "kueue $KUEUE_VERSION: building (cold: several minutes)"
  dir=$(cd "$(mktemp -d)" && GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  (cd "$dir" && GOFLAGS="-mod=mod -trimpath" go build -ldflags "-s -w" -o "$bin/kueue" ./cmd/kueue)
  rm -rf "$out" && mkdir -p "$out"
  cp "$dir"/config/components/crd/bases/*.yaml "$out/"
  echo "$KUEUE_VERSION" > "$out/.version"
  stamp kueue "$KUEUE_VERSION"
  log "kueue $KUEUE_VERSION: built"
}

start=$(date +%s)
build_kueue &
kueue_build=$!
build_podnet
build_etcd
build_kubernetes
build_go_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" \
  "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
build_go_install kwokctl sigs.k8s.io/kwok/cmd/kwokctl "$KWOK_VERSION" \
  "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
build_go_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" \
  "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
fetch_monitoring_crds
wait "$kueue_build" || { echo "tools/localcluster/build.sh: building Kueue failed (output above)" >&2; exit 1; }
log "all binaries ready in $bin ($(( $(date +%s) - start ))s)"
