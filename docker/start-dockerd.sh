#!/usr/bin/env bash
# Make sure a docker daemon answers; start one if none does, and print the DOCKER_HOST to use.
#
#   export DOCKER_HOST="$(docker/start-dockerd.sh)"
#
# The daemon it starts keeps its images, containers and socket under QSA_DOCKER_DIR
# (default: $TMPDIR/qsa-docker) and runs until stopped:
#
#   docker/start-dockerd.sh --stop    # stop the daemon started here, remove QSA_DOCKER_DIR
set -euo pipefail

die() { echo "start-dockerd: $*" >&2; exit 1; }
DIR="${QSA_DOCKER_DIR:-${TMPDIR:-/tmp}/qsa-docker}"

if [[ "${1:-}" == "--stop" ]]; then
  [[ -f "$DIR/dockerd.pid" ]] || exit 0  # none started here
  pid="$(cat "$DIR/dockerd.pid")"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 30); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  kill -0 "$pid" 2>/dev/null && die "dockerd $pid did not stop within 30 s"
  # mounts a container may have left under the directory, deepest first
  grep " $DIR/" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount || true
  rm -rf "$DIR"
  exit 0
fi

if docker info >/dev/null 2>&1; then
  echo "${DOCKER_HOST:-unix:///var/run/docker.sock}"
  exit 0
fi
[[ "$(id -u)" == 0 ]] || die "no docker daemon answers and starting one needs root"
command -v dockerd >/dev/null || die "no docker daemon answers and dockerd is not installed (apt-get install docker.io)"

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
