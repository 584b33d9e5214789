#!/usr/bin/env bash
# Make the local base image every other recipe starts FROM: Debian bookworm, bootstrapped
# with debootstrap from a Debian mirror and imported into the local container engine.
# No registry is involved (none is reachable on the build hosts).
#
#   docker/make-base-image.sh            # image qsa-base:bookworm, engine docker or podman
#   QSA_ENGINE=podman DEBIAN_MIRROR=http://mirror.example/debian docker/make-base-image.sh
#
# Needs root (debootstrap creates device nodes and chroots), debootstrap, and docker or podman.
set -euo pipefail

IMAGE="${QSA_BASE_IMAGE:-qsa-base:bookworm}"
SUITE="${QSA_BASE_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# NOTES: ca-certificates lets pip reach HTTPS indexes inside derived images; everything else
# is installed by the recipes that need it, so the base stays ~80 MB.
INCLUDE="ca-certificates"

die() { echo "make-base-image: $*" >&2; exit 1; }

[[ "$(id -u)" == 0 ]] || die "must run as root (debootstrap creates device nodes and chroots)"
command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"

ENGINE="${QSA_ENGINE:-}"
if [[ -z "$ENGINE" ]]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker
  elif command -v podman >/dev/null; then ENGINE=podman
  else die "no container engine: neither a running docker daemon (docker info failed) nor podman"
  fi
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/qsa-base.XXXXXX")"
cleanup() { rm -rf --one-file-system "$WORK"; }
trap cleanup EXIT
ROOTFS="$WORK/rootfs"

echo "make-base-image: debootstrap $SUITE from $MIRROR (minbase + $INCLUDE) ..."
start=$SECONDS
# Progress: debootstrap prints one line per stage (Retrieving / Validating / Unpacking / Configuring).
debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$ROOTFS" "$MIRROR" \
  | awk '/^I: (Retrieving|Validating|Extracting|Unpacking|Configuring|Base system)/ && !seen[$2]++ { print "  " $0; fflush() }'
echo "make-base-image: rootfs ready in $((SECONDS - start)) s"

# Slim the rootfs: package lists and caches are fetched again by recipes that install packages.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
  "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/log/*.log "$ROOTFS"/tmp/*
# Recipes run apt-get without a terminal.
printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
  > "$ROOTFS/etc/apt/apt.conf.d/90qsa-no-recommends"

echo "make-base-image: importing into $ENGINE as $IMAGE ..."
tar --numeric-owner -C "$ROOTFS" -c . \
  | "$ENGINE" import \
      --change 'ENV LANG=C.UTF-8' \
      --change 'ENV DEBIAN_FRONTEND=noninteractive' \
      --change 'CMD ["/bin/bash"]' \
      - "$IMAGE" >/dev/null
echo "make-base-image: $IMAGE ready ($("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE") bytes) in $((SECONDS - start)) s"
