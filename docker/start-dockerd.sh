#!/usr/bin/env bash
# Make sure a docker daemon answers; start one if none does, and print the DOCKER_HOST to use.
#
#   export DOCKER_HOST="$(docker/start-dockerd.sh)"
#
# The daemon it starts keeps its images, containers and socket under QSA_DOCKER_DIR
# (default: $TMPDIR/qsa-docker) and runs until stopped: kill "$(cat "$QSA_DOCKER_DIR/dockerd.pid")".
set -euo pipefail

die() { echo "start-dockerd: $*" >&2; exit 1; }

if docker info >/dev/null 2>&1; then
  echo "${DOCKER_HOST:-unix:///var/run/docker.sock}"
  exit 0
fi
[[ "$(id -u)" == 0 ]] || die "no docker daemon answers and starting one needs root"
command -v dockerd >/dev/null || die "no docker daemon answers and dockerd is not installed (apt-get install docker.io)"

DIR="${QSA_DOCKER_DIR:-${TMPDIR:-/tmp}/qsa-docker}"
SOCK="unix://$DIR/docker.sock"
mkdir -p "$DIR"
nohup dockerd --data-root "$DIR/data" --exec-root "$DIR/exec" -H "$SOCK" \
  --pidfile "$DIR/dockerd.pid" >"$DIR/dockerd.log" 2>&1 &
for _ in $(seq 60); do
  if DOCKER_HOST="$SOCK" docker info >/dev/null 2>&1; then
    echo "$SOCK"
    exit 0
  fi
  sleep 1
done
die "dockerd did not answer within 60 s; see $DIR/dockerd.log"
