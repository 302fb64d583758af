#!/usr/bin/env bash
# Sets up podman for the compose tests (marker "compose") on a machine that reaches package registries but no
# container registry:
#   1. podman, runc, netavark, aardvark-dns, iptables and debootstrap from Debian's packages;
#   2. a containers.conf for this host (runc, cgroupfs, no systemd, ulimits within the hard limits) and a
#      registries.conf that resolves short names to docker.io, both in $KVROUTE_PODMAN_HOME;
#   3. a minimal Debian root filesystem (debootstrap --variant=minbase), cached there as a tarball, imported
#      as localhost/kvroute-test/debian:bookworm;
#   4. local stand-ins for the base images the compose files name (Python, Redis, Prometheus), built on it
#      and tagged with those names, unless a real image of that name is already there.
# The compose files are not changed: they are run as users run them. Prints the environment the tests give
# podman, one VAR=value per line, last.
set -euo pipefail
cd "$(dirname "$0")/../.."
HOME_DIR=${KVROUTE_PODMAN_HOME:-$HOME/.cache/kvroute/podman}
BASE=localhost/kvroute-test/debian:bookworm
IMAGES=tests/compose/images
mkdir -p "$HOME_DIR"

missing=()
for tool in podman runc iptables debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
[ -x /usr/lib/podman/netavark ] || missing+=(netavark)
[ -x /usr/lib/podman/aardvark-dns ] || missing+=(aardvark-dns)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing: ${missing[*]}: install them (apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi

conf=$HOME_DIR/containers.conf
registries=$HOME_DIR/registries.conf
export CONTAINERS_CONF=$conf CONTAINERS_REGISTRIES_CONF=$registries
cat > "$registries" <<'EOF'
unqualified-search-registries = ["docker.io"]
short-name-mode = "permissive"
EOF
write_conf() {  # $1: nproc limit
  cat > "$conf" <<EOF
# podman for the compose tests, written by tests/compose/setup.sh
[containers]
# podman's defaults ask for more than this host's hard limits allow
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=$1:$1"]
[engine]
# crun refuses this host's hybrid cgroups; no systemd runs here
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[engine.runtimes]
# the Gaudi recipe asks for runtime "habana": its stand-in replica runs on runc
habana = ["/usr/bin/runc"]
[network]
network_backend = "netavark"
EOF
}
write_conf 4096

if ! podman image exists "$BASE"; then
  tarball=$HOME_DIR/debian-bookworm-minbase.tar
  if [ ! -s "$tarball" ]; then
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    echo "bootstrapping a Debian root filesystem (under a minute)" >&2
    debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >&2
    tar -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
    trap - EXIT
  fi
  podman import "$tarball" "$BASE" >/dev/null
fi

# The largest process limit this host lets a container set (it may be below the shell's hard limit).
for nproc in "$(ulimit -Hu)" 65536 32768 16384 4096; do
  write_conf "$nproc"
  if podman run --rm --network none "$BASE" true 2>/dev/null; then break; fi
done

# Stand-ins, keyed by their build files so that a change rebuilds them.
stand_in() {  # $1: image name as the compose file spells it, $2: folder under $IMAGES
  local name=$1 dir=$IMAGES/$2 key have context
  key=$(cat "$dir"/* | sha256sum | cut -c1-16)
  if podman image exists "$name"; then
    have=$(podman image inspect --format '{{ index .Labels "io.kvroute.stand-in-key" }}' "$name" 2>/dev/null || true)
    if [ -z "$have" ] || [ "$have" = "<no value>" ]; then
      echo "$name: a real image, kept" >&2
      return
    fi
    [ "$have" = "$key" ] && return
  fi
  echo "building a stand-in for $name" >&2
  context=$(mktemp -d)
  cp -r "$dir"/. "$context"/
  mkdir -p "$context/ca"
  cp /usr/local/share/ca-certificates/*.crt "$context/ca/" 2>/dev/null || true
  podman build -q --format docker --build-arg "BASE=$BASE" --label "io.kvroute.stand-in-key=$key" \
    -t "$name" "$context" >&2
  rm -rf "$context"
}
images=$(grep -hoE '^(FROM|  +image:) +[^ ]+' deploy/Dockerfile deploy/docker-compose.yml | awk '{print $2}' | sort -u)
for name in $images; do
  case "$name" in
    python:*) stand_in "docker.io/library/$name" python ;;
    redis:*) stand_in "docker.io/library/$name" redis ;;
    prom/prometheus:*) stand_in "docker.io/$name" prometheus ;;
  esac
done

echo "CONTAINERS_CONF=$conf"
echo "CONTAINERS_REGISTRIES_CONF=$registries"
