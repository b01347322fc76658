#!/usr/bin/env bash
# build-image.sh WHEELDIR [IMAGE_NAME]
#
# Builds the docker image used by the containerized end-to-end tests, fully
# offline as far as the containers are concerned (nothing is ever pulled):
#
#   1. base root filesystem: `debootstrap --variant=minbase bookworm` (host side,
#      from the Debian mirror), built ONCE into a temp dir, cleaned and cached as
#      $KVWIRE_DOCKER_CACHE/base-<key>.tar (renamed into place only when
#      complete, so a killed run leaves nothing half-built behind);
#   2. final image: the base tarball is unpacked into a temp dir, a venv is made
#      at /opt/kvwire-venv by chrooting into it (the rootfs's own python3.11) and
#      EVERY wheel in WHEELDIR is installed with
#      `pip install --no-index --find-links` (no network; all dependencies must
#      be in WHEELDIR), then `tar | docker import` makes a single-layer image.
#
# Caching: the image is labelled kvwire.wheels-hash=<sha256 of the wheel files,
# the base key and this recipe>, and also tagged <repo>:w-<hash12>.  When the
# requested image already carries the hash, or a w-<hash12> tag exists, nothing
# is rebuilt (at most a re-tag).  Concurrent runs are serialised with flock.
#
# Environment (all optional):
#   KVWIRE_DOCKER_CACHE    cache dir (default /var/cache/kvwire-docker)
#   KVWIRE_DEBIAN_MIRROR   mirror for debootstrap (default http://deb.debian.org/debian)
#   KVWIRE_DOCKER_KEEP     how many old <repo>:w-* images to keep (default 3)
#   KVWIRE_DOCKER_FORCE=1  rebuild the final image even when cached
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() { echo "usage: $0 WHEELDIR [IMAGE_NAME]   (default image kvwire-engine:latest)" >&2; exit 2; }
[[ $# -ge 1 && $# -le 2 ]] || usage
WHEELDIR="$(cd "$1" 2>/dev/null && pwd)" || { echo "build-image: no such directory: $1" >&2; exit 2; }
IMAGE="${2:-kvwire-engine:latest}"
[[ "$IMAGE" == *:* ]] || IMAGE="$IMAGE:latest"
REPO="${IMAGE%:*}"

CACHE="${KVWIRE_DOCKER_CACHE:-/var/cache/kvwire-docker}"
MIRROR="${KVWIRE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
KEEP="${KVWIRE_DOCKER_KEEP:-3}"
SUITE=bookworm
INCLUDE="python3,python3-venv,python3-pip,iproute2,procps,ca-certificates"
BASE_RECIPE=1      # bump to force a new base rootfs
IMAGE_RECIPE=1     # bump to force new final images
VENV=/opt/kvwire-venv
LABEL_KEY=kvwire.wheels-hash

log() { printf '[build-image] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }
T_ALL=$(now)

[[ "$(id -u)" == 0 ]] || die "must run as root (debootstrap, chroot)"
shopt -s nullglob
wheels=("$WHEELDIR"/*.whl)
shopt -u nullglob
(( ${#wheels[@]} > 0 )) || die "no *.whl files in $WHEELDIR"

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock -w 1800 9 || die "could not lock $CACHE/.lock"

# Remove a work dir safely even if a killed debootstrap left proc/sys mounted in it.
safe_rmdir() {
    local d="$1" m
    [[ -n "$d" && -d "$d" ]] || return 0
    while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done < <(findmnt -rn -o TARGET | awk -v p="$d/" 'index($0, p) == 1' | sort -r)
    rm -rf --one-file-system "$d"
}
WORKDIRS=()
cleanup() { local d; for d in "${WORKDIRS[@]}"; do safe_rmdir "$d"; done; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# Leftovers of interrupted runs (we hold the lock, so nobody else is using them).
for d in "$CACHE"/work.*; do [[ -e "$d" ]] && { log "removing leftover $d"; safe_rmdir "$d"; }; done
rm -f "$CACHE"/*.tar.part

"$HERE/ensure-dockerd.sh" || die "docker engine is not available"

# ------------------------------------------------------------ hashes
BASE_KEY="$(printf '%s|%s|%s|%s' "$SUITE" minbase "$INCLUDE" "$BASE_RECIPE" | sha256sum | cut -c1-16)"
BASE_TAR="$CACHE/base-$SUITE-$BASE_KEY.tar"
WHEEL_HASH="$(
    {
        printf 'base=%s image_recipe=%s venv=%s\n' "$BASE_KEY" "$IMAGE_RECIPE" "$VENV"
        (cd "$WHEELDIR" && sha256sum -- *.whl | LC_ALL=C sort -k2)
    } | sha256sum | cut -c1-64
)"
HASH_TAG="$REPO:w-${WHEEL_HASH:0:12}"
log "wheels: ${#wheels[@]} in $WHEELDIR, content hash ${WHEEL_HASH:0:12}"

image_hash() { docker image inspect --format "{{ index .Config.Labels \"$LABEL_KEY\" }}" "$1" 2>/dev/null || true; }

if [[ "${KVWIRE_DOCKER_FORCE:-0}" != 1 ]]; then
    if [[ "$(image_hash "$IMAGE")" == "$WHEEL_HASH" ]]; then
        log "image $IMAGE is up to date (hash ${WHEEL_HASH:0:12}); nothing to do ($(elapsed "$T_ALL") s)"
        exit 0
    fi
    if [[ "$(image_hash "$HASH_TAG")" == "$WHEEL_HASH" ]]; then
        docker tag "$HASH_TAG" "$IMAGE"
        log "re-tagged cached $HASH_TAG as $IMAGE ($(elapsed "$T_ALL") s)"
        exit 0
    fi
fi

# ------------------------------------------------------------ base rootfs
if [[ ! -s "$BASE_TAR" ]]; then
    command -v debootstrap >/dev/null 2>&1 || {
        log "installing debootstrap (apt-get)"
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -q --no-install-recommends debootstrap; } >/dev/null \
            || die "could not install debootstrap"
    }
    W="$(mktemp -d "$CACHE/work.base.XXXXXX")"; WORKDIRS+=("$W")
    t=$(now)
    log "debootstrap $SUITE (minbase + $INCLUDE) into $W/rootfs ..."
    if ! debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$W/rootfs" "$MIRROR" \
            >"$W/debootstrap.log" 2>&1; then
        tail -n 30 "$W/debootstrap.log" >&2
        [[ -f "$W/rootfs/debootstrap/debootstrap.log" ]] && tail -n 30 "$W/rootfs/debootstrap/debootstrap.log" >&2
        die "debootstrap failed"
    fi
    log "debootstrap done in $(elapsed "$t") s"
    R="$W/rootfs"
    # Slim down: package caches and lists, docs, man pages, locales.
    rm -rf "$R"/var/cache/apt/archives/*.deb "$R"/var/lib/apt/lists/* \
           "$R"/usr/share/doc/* "$R"/usr/share/man/* "$R"/usr/share/info/* \
           "$R"/var/log/*.log "$R"/var/cache/debconf/*-old
    find "$R/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
    # docker bind-mounts these at run time
    : > "$R/etc/resolv.conf"; echo kvwire > "$R/etc/hostname"
    t=$(now)
    tar -C "$R" --numeric-owner --xattrs -cf "$BASE_TAR.part" .
    mv -f "$BASE_TAR.part" "$BASE_TAR"
    log "base rootfs cached: $BASE_TAR ($(du -sh "$BASE_TAR" | cut -f1), tar took $(elapsed "$t") s)"
    safe_rmdir "$W"
else
    log "using cached base rootfs $BASE_TAR"
fi

# ------------------------------------------------------------ final rootfs
W="$(mktemp -d "$CACHE/work.img.XXXXXX")"; WORKDIRS+=("$W")
R="$W/rootfs"; mkdir -p "$R"
t=$(now)
tar -C "$R" --numeric-owner --xattrs -xpf "$BASE_TAR"
log "unpacked base in $(elapsed "$t") s"

t=$(now)
mkdir -p "$R/tmp/kvwire-wheels"
cp -- "${wheels[@]}" "$R/tmp/kvwire-wheels/"
# env -i: the host's PIP_* variables / config must not leak into the chroot.
CHROOT_ENV=(env -i HOME=/root LANG=C.UTF-8 PATH=/usr/sbin:/usr/bin:/sbin:/bin
            PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1)
if ! "${CHROOT_ENV[@]}" chroot "$R" /bin/sh -ec "
        python3 -m venv $VENV
        cd /tmp/kvwire-wheels
        $VENV/bin/pip install --isolated --no-index --no-cache-dir --find-links /tmp/kvwire-wheels *.whl
        $VENV/bin/pip list --format=freeze > $VENV/kvwire-wheels.txt
    " >"$W/pip.log" 2>&1; then
    tail -n 40 "$W/pip.log" >&2
    die "installing the wheels into the venv failed (all dependencies must be in $WHEELDIR)"
fi
rm -rf "$R/tmp/kvwire-wheels" "$R/root/.cache"
log "venv + ${#wheels[@]} wheels installed in $(elapsed "$t") s: $(tr '\n' ' ' < "$R$VENV/kvwire-wheels.txt")"

t=$(now)
NEW_ID="$(
    tar -C "$R" --numeric-owner --xattrs -cf - . | docker import \
        --change "ENV PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        --change "ENV VIRTUAL_ENV=$VENV" \
        --change "ENV LANG=C.UTF-8" \
        --change "ENV PYTHONUNBUFFERED=1" \
        --change "LABEL $LABEL_KEY=$WHEEL_HASH" \
        --change "LABEL kvwire.e2e.image=1" \
        --change 'WORKDIR /' \
        --change 'CMD ["/bin/bash"]' \
        --message "kvwire e2e image, wheels ${WHEEL_HASH:0:12}" \
        - "$HASH_TAG"
)" || die "docker import failed"
docker tag "$HASH_TAG" "$IMAGE"
log "docker import took $(elapsed "$t") s -> $IMAGE = $HASH_TAG (${NEW_ID:7:12}), rootfs $(du -sh "$R" | cut -f1)"
safe_rmdir "$W"

# ------------------------------------------------------------ prune old hash tags
old=$(docker images --format '{{.CreatedAt}}\t{{.Repository}}:{{.Tag}}' "$REPO" \
        | awk -F'\t' '$2 ~ /:w-[0-9a-f]+$/' | sort -r | cut -f2 | tail -n +"$((KEEP + 1))")
for ref in $old; do
    [[ "$ref" == "$HASH_TAG" ]] && continue
    if docker rmi "$ref" >/dev/null 2>&1; then log "pruned old image $ref"; fi
done

log "done in $(elapsed "$T_ALL") s"
