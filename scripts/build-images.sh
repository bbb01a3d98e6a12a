#!/usr/bin/env bash
# `make images`: the engine and operator images, built into this machine's podman storage with no registry and no
# Docker daemon.
#   1. buildah, podman, runc, debootstrap, uidmap and catatonit from apt, if missing.
#   2. A base image from Debian's own packages, once: `debootstrap --variant=minbase bookworm` from the mirror apt
#      is configured with, then `podman import`.
#   3. docker/Dockerfile and docker/operator.Dockerfile built FROM that base with `buildah bud`. pip inside the build
#      sees this machine's pip configuration and the local folders it names (bind-mounted read-only), and installs
#      the versions the tests ran with (docker/constraints.txt).
# Both Dockerfiles stay buildable with plain `docker build` (their default base is python:3.11-slim-bookworm).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(awk -F'"' '/^appVersion:/{print $2}' charts/overlap/Chart.yaml)
BASE_IMAGE=${OVERLAP_BASE_IMAGE:-localhost/overlap-base:bookworm}
ENGINE_IMAGE=${OVERLAP_ENGINE_IMAGE:-ghcr.io/overlap-dev/overlap:$VERSION}
OPERATOR_IMAGE=${OVERLAP_OPERATOR_IMAGE:-ghcr.io/overlap-dev/overlap-operator:$VERSION}
log() { echo "== images: $*" >&2; }

ensure_tools() {
  local missing=()
  # catatonit: the init of the pause image behind every podman pod (a Recommends of podman, so not pulled in here)
  for pair in buildah:buildah podman:podman runc:runc debootstrap:debootstrap newuidmap:uidmap catatonit:catatonit; do
    command -v "${pair%%:*}" >/dev/null || missing+=("${pair##*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return
  if [ "$(id -u)" != 0 ]; then
    echo "make images needs ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root" >&2
    exit 1
  fi
  log "installing ${missing[*]} from apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
}

build_base() {
  if podman image exists "$BASE_IMAGE"; then
    log "base $BASE_IMAGE is cached (podman rmi it to rebuild)"
    return
  fi
  local mirror root
  mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' | awk '$2 == "bookworm" {print $1; exit}')
  if [ -z "$mirror" ]; then
    echo "apt has no bookworm source configured, so there is no mirror to debootstrap the base image from" >&2
    exit 1
  fi
  root=$(mktemp -d /var/tmp/overlap-base.XXXXXX)
  trap 'rm -rf "$root"' RETURN
  log "debootstrap bookworm from $mirror (about a minute)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >/dev/null
  # Package caches and docs are rebuilt by `apt-get update` when a Dockerfile installs more.
  rm -rf "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/usr/share/{doc,man,locale}
  tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  log "base $BASE_IMAGE: $(podman image inspect --format '{{.Size}}' "$BASE_IMAGE" | numfmt --to=iec)"
}

# pip's configuration files, and the local files and folders its settings name, mounted where pip looks in the
# build (it runs as root there).
pip_mounts() {
  local file value path
  while read -r file; do
    case "$file" in "$HOME"/*) echo "-v=$file:/root/${file#"$HOME"/}:ro" ;; *) echo "-v=$file:$file:ro" ;; esac
  done < <(${PIP:-pip3} config debug 2>/dev/null | sed -n 's/^ *\(\/[^,]*\), exists: True$/\1/p')
  ${PIP:-pip3} config list 2>/dev/null | sed -n "s/^[^=]*='\(.*\)'$/\1/p" | tr ' ' '\n' | while read -r value; do
    path=${value#file://}
    path=${path%/}
    [[ "$path" == */simple ]] && path=${path%/simple}  # a local index links its files relative to its parent
    [[ "$path" == /* && -e "$path" ]] && echo "-v=$path:$path:ro"
  done | sort -u
}

build() {
  local image=$1 dockerfile=$2 started
  started=$(date +%s)
  log "building $image from $dockerfile"
  mapfile -t mounts < <(pip_mounts)
  buildah bud --quiet --network host --layers --runtime runc \
    --build-arg "PYTHON_IMAGE=$BASE_IMAGE" \
    "${mounts[@]}" -f "$dockerfile" -t "$image" . >/dev/null
  log "$image: $(podman image inspect --format '{{.Size}}' "$image" | numfmt --to=iec), $(($(date +%s) - started)) s"
}

ensure_tools
build_base
build "$OPERATOR_IMAGE" docker/operator.Dockerfile
build "$ENGINE_IMAGE" docker/Dockerfile
