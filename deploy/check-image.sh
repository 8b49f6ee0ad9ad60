#!/usr/bin/env bash
# Build the Docker image and use it as a user would, through ./run build and ./run docker: the
# default job for a few steps, simdist.py, makeshards.py, and two ranks under torchrun. Checks
# that jpegcrop was compiled into the image, that TensorBoard events and checkpoints land in
# this checkout's outputs/ (and shards in data/), owned by you; prints the image's size and the
# build time. Too heavy for ./run test (the image holds torch with CUDA: several GB); run it
# whenever the Dockerfile, run or requirements.txt change.
#
#   deploy/check-image.sh [DOCKER BUILD FLAGS]      (or ./run check-image; e.g. --no-cache)
#
# The engine: $DOCKER_HOST or the default socket if one answers; otherwise one of its own on
# $WDSDIST_CHECK_DIR/docker.sock (root only; Debian's docker.io is installed with apt if
# missing), started with no iptables and no bridge, so its builds and containers use
# --network host. It is left running; later runs find it there.
# The base: $BASE_IMAGE (default python:3.11-slim-bookworm) if present or pullable; otherwise a
# stand-in (debootstrap bookworm + Debian's Python 3.11), imported as wdsdist-standin:bookworm-py3.11.
# Files: $WDSDIST_CHECK_DIR (default /var/tmp/wdsdist-check): the engine's socket, data-root and
# logs. What the runs write: outputs/check-image-STAMP/ and data/check-image-STAMP/ here.
# Any failure ends with one line "check-image: FAIL: ..." and exit code 1 (2: wrong usage).
set -euo pipefail
# All of it in braces: bash reads the whole script before running it, so editing or pulling a
# new version during the long build cannot change what this run does halfway.
{
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
STATE=${WDSDIST_CHECK_DIR:-/var/tmp/wdsdist-check}
OWN_SOCK="$STATE/docker.sock"
BASE=${BASE_IMAGE:-python:3.11-slim-bookworm}
STANDIN=wdsdist-standin:bookworm-py3.11
IMAGE=${WDSDIST_IMAGE:-wds-distributed}
STAMP=$(date +%Y%m%d-%H%M%S)
LOGS="$STATE/logs/$STAMP"
export WDSDIST_IMAGE=$IMAGE

fail() { echo "check-image: FAIL: $*" >&2; exit 1; }
say() { echo "check-image: $*"; }
# step NAME CMD...: its output goes to a log; on failure the log's end, then the one line.
step() {
  local name=$1 rc=0; shift
  "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
  if [[ $rc != 0 ]]; then
    tail -n 25 "$LOGS/$name.log" >&2
    fail "$name failed (exit $rc): $* (log: $LOGS/$name.log)"
  fi
}
engine_answers() { timeout 20 docker info >/dev/null 2>&1; }
need_root() { [[ $(id -u) == 0 ]] || fail "$1 needs root (run this script with sudo, or start a Docker engine and set DOCKER_HOST)"; }

apt_install() {  # apt_install COMMAND PACKAGE: Debian's package for a missing command
  command -v "$1" >/dev/null 2>&1 && return 0
  need_root "installing $2"
  command -v apt-get >/dev/null 2>&1 || fail "no $1, and no apt-get to install $2 with"
  say "installing Debian's $2 (for $1)"
  step "apt-$2" bash -c "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $2"
}

mkdir -p "$LOGS" || fail "cannot make $LOGS (set WDSDIST_CHECK_DIR to a folder you can write)"

# ---------------------------------------------------------------- the engine
OURS=0
if [[ -n ${DOCKER_HOST:-} && $DOCKER_HOST != "unix://$OWN_SOCK" ]]; then
  command -v docker >/dev/null 2>&1 || fail "no docker command for DOCKER_HOST=$DOCKER_HOST"
  engine_answers || fail "no Docker engine answers at DOCKER_HOST=$DOCKER_HOST"
elif [[ -z ${DOCKER_HOST:-} ]] && command -v docker >/dev/null 2>&1 && engine_answers; then
  :  # the default engine
else
  export DOCKER_HOST="unix://$OWN_SOCK"
  OURS=1
  if ! command -v docker >/dev/null 2>&1 || ! engine_answers; then
    need_root "starting a Docker engine"
    apt_install dockerd docker.io
    apt_install docker docker.io
    say "starting dockerd on $OWN_SOCK (data-root $STATE/docker-root; log $STATE/dockerd.log)"
    # No iptables and no bridge: nothing of the host's network is changed; containers and
    # builds use the host's network (--network host, set below). setsid: it outlives this script.
    setsid dockerd --host "$DOCKER_HOST" --data-root "$STATE/docker-root" --exec-root "$STATE/exec" \
      --pidfile "$STATE/dockerd.pid" --iptables=false --ip6tables=false --bridge=none \
      --storage-driver=overlay2 >> "$STATE/dockerd.log" 2>&1 < /dev/null &
    for _ in $(seq 60); do
      engine_answers && break
      kill -0 $! 2>/dev/null || { tail -n 5 "$STATE/dockerd.log" >&2; fail "dockerd exited (log: $STATE/dockerd.log)"; }
      sleep 1
    done
    engine_answers || fail "dockerd did not answer on $OWN_SOCK within 60 s (log: $STATE/dockerd.log)"
  fi
fi
if [[ $OURS == 1 ]] || ! docker network inspect bridge >/dev/null 2>&1; then
  # An engine without a bridge network (ours has none): builds and containers use the host's.
  export DOCKER_BUILD_FLAGS=${DOCKER_BUILD_FLAGS:---network host}
  export DOCKER_RUN_FLAGS=${DOCKER_RUN_FLAGS:---network host}
fi
say "engine: DOCKER_HOST=${DOCKER_HOST:-(default)}, server $(docker version -f '{{.Server.Version}}' 2>/dev/null)"

# ---------------------------------------------------------------- the base image
make_standin() {
  # Debian's python3 is 3.11 on bookworm, as in python:3.11-slim-bookworm. That image's Python
  # lives in /usr/local and pip installs into it; Debian's refuses (PEP 668), so the stand-in's
  # python3 is a venv first on PATH. The host's CA bundle goes into the stand-in (pip inside the
  # build may sit behind a proxy that needs it), never into the project's image.
  need_root "building the stand-in base (debootstrap)"
  apt_install debootstrap debootstrap
  local chroot="$STATE/standin"
  rm -rf -- "$chroot"
  say "building the stand-in base $STANDIN with debootstrap (a few minutes)"
  step debootstrap debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$chroot" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    install -D -m 644 /etc/ssl/certs/ca-certificates.crt "$chroot/usr/local/share/ca-certificates/host-ca-bundle.crt"
    step standin-ca chroot "$chroot" update-ca-certificates
  fi
  step standin-venv chroot "$chroot" python3 -m venv /opt/python
  # As Debian's own Docker images do: apt keeps no package caches in image layers.
  printf '%s\n' 'Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";' \
    'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb || true"; };' > "$chroot/etc/apt/apt.conf.d/docker-clean"
  rm -rf -- "$chroot"/var/cache/apt/archives/*.deb "$chroot"/var/lib/apt/lists/*
  step standin-import bash -c "tar -C '$chroot' -c . | docker import \
    --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD [\"python3\"]' - '$STANDIN'"
  rm -rf -- "$chroot"
}

if docker image inspect "$BASE" >/dev/null 2>&1; then
  say "base: $BASE (present)"
elif timeout 120 docker pull "$BASE" > "$LOGS/pull.log" 2>&1; then
  say "base: $BASE (pulled)"
else
  say "base: $BASE cannot be pulled ($(tail -n 1 "$LOGS/pull.log")); using the stand-in $STANDIN"
  docker image inspect "$STANDIN" >/dev/null 2>&1 || make_standin
  BASE=$STANDIN
fi

# ---------------------------------------------------------------- build
say "building $IMAGE on $BASE: ./run build --build-arg BASE_IMAGE=$BASE${*:+ $*} (DOCKER_BUILD_FLAGS='${DOCKER_BUILD_FLAGS:-}'; log $LOGS/build.log)"
start=$(date +%s)
step build ./run build --build-arg "BASE_IMAGE=$BASE" "$@"
build_s=$(($(date +%s) - start))
cached=$(grep -c "Using cache\|CACHED" "$LOGS/build.log" || true)
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
say "built in ${build_s} s ($cached steps from the cache)"

# ---------------------------------------------------------------- run
out="outputs/check-image-$STAMP"
data="data/check-image-$STAMP"
uid=$(id -u) gid=$(id -g)

# jpegcrop: the prebuilt library loads, as your uid, from the image's read-only .build/.
# (the same module command the image's build runs, and tests/data/decode/test_jpegcrop.py runs on the package)
step jpegcrop docker run --rm --network none --user "$uid:$gid" --entrypoint python3 "$IMAGE" -m wdsdist.tools.jpegcheck

timed() {  # timed NAME CMD...: step, then one line with the command and its time
  local t=$SECONDS
  step "$@"
  shift
  say "$* ($((SECONDS - t)) s)"
}
timed train ./run docker train.py trainer.steps=20 "run_dir=$out/train"
# Not the bare defaults: they show unequal ranks and exit 1 on purpose (docs/simdist.md: "The defaults fail").
timed simdist ./run docker simdist.py --nbatches auto
timed makeshards ./run docker makeshards.py --synthetic 300 --shards "$data" --prefix check
timed torchrun ./run docker torchrun --nproc-per-node 2 train.py trainer.steps=10 "run_dir=$out/ddp"

# ---------------------------------------------------------------- checks
for log in train torchrun; do
  if note=$(grep -m 1 -E "no C compiler|decoding whole JPEGs" "$LOGS/$log.log"); then
    fail "jpegcrop is not usable in the image ($log: $note)"
  fi
done
grep -q "^SUCCESS" "$LOGS/simdist.log" || fail "simdist.py did not report SUCCESS (log: $LOGS/simdist.log)"
grep -q "jpegcrop loaded" "$LOGS/jpegcrop.log" || fail "jpegcrop did not load: $(tail -n 1 "$LOGS/jpegcrop.log")"
for run in train ddp; do
  ls "$out/$run"/events.out.tfevents.* >/dev/null 2>&1 || fail "no TensorBoard events in $out/$run"
  [[ -f "$out/$run/latest.pt" ]] || fail "no checkpoint (latest.pt) in $out/$run"
done
[[ -f "$data/check.index.json" ]] || fail "makeshards.py wrote no $data/check.index.json"
grep -qE '"nsamples": *300[,}]' "$data/check.index.json" || fail "$data/check.index.json does not count 300 samples"
foreign=$(find "$out" "$data" \( ! -uid "$uid" -o ! -gid "$gid" \) -print -quit)
[[ -z $foreign ]] || fail "$foreign is owned by $(stat -c %u:%g "$foreign"), not by you ($uid:$gid)"

nfiles=$(find "$out" "$data" -type f | wc -l)
say "ok: jpegcrop compiled in; TensorBoard events and checkpoints in $out/{train,ddp}, shards in $data/;"
say "    all $nfiles files owned by $uid:$gid"
say "image $IMAGE: $(awk -v b="$size" 'BEGIN { printf "%.2f GB (%.0f bytes)", b / 1e9, b }'), built in ${build_s} s on $BASE"
say "logs: $LOGS"
exit 0
}
