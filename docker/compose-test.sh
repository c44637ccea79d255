#!/usr/bin/env bash
# make compose-test: the docker-compose fleet (3 nodes in one mesh, 2 mock engines, HAProxy) under traffic,
# with one node stopped in the middle; exit 0 only if nothing was lost and the LB and the mesh noticed.
#
#   docker/compose-test.sh
#
# 1. installs what is missing: Docker (Debian's docker.io), a compose (`docker compose` v2 if present, else
#    Debian's docker-compose-plugin if it has one, else Debian's docker-compose v1);
# 2. starts dockerd in the background if none answers (and stops it at the end, also on failure);
# 3. builds shepherd:local with docker/build.sh when it is missing or the sources changed (the image's
#    org.shepherd.source-hash label vs docker/source-hash.sh); no registry needed: the local debootstrap
#    base shepherd-base:bookworm is used (and built once) when python:3.11-slim-bookworm cannot be pulled;
# 4. brings docker-compose.yml up (project shepherd-ct, LB and stats on free loopback ports), then
#    docker/compose_check.py: waits for the LB and a whole mesh, sends the traffic through the LB, stops
#    one node, checks every request succeeded (one retry each) and the LB and the mesh noticed, and first
#    that streamed TTFT through the LB is within a few ms of a direct node (HAProxy's http-no-delay);
# 5. tears it all down (compose down -v), prints the figures and the wall time.
#
# Environment (all optional):
#   CT_REQUESTS=300 CT_DURATION=20 CT_STOP_AT=8   traffic: requests, seconds, when the node is stopped
#   CT_VICTIM=node-2  CT_STOP=stop|kill            which node, and docker stop (graceful) or docker kill
#   CT_REBUILD=1        rebuild the image even if the sources did not change
#   CT_NO_MESH=1        run the nodes without the mesh flags (and skip the mesh checks)
#   CT_KEEP=1           leave the fleet (and a dockerd this script started) running, for debugging
#   CT_HOST_CA=0        do not trust the host's CA bundle in the image (default: trust it, as build.sh --host-ca)
#   CT_PROJECT=shepherd-ct   compose project name
set -euo pipefail
cd "$(dirname "$0")/.."

T0=$(date +%s.%N)
PROJECT="${CT_PROJECT:-shepherd-ct}"
VICTIM="${CT_VICTIM:-node-2}"
STOP_MODE="${CT_STOP:-stop}"
IMAGE=shepherd:local
case "$VICTIM" in node-1|node-2|node-3) ;; *) echo "compose-test: CT_VICTIM must be node-1, node-2 or node-3" >&2; exit 2 ;; esac
case "$STOP_MODE" in stop|kill) ;; *) echo "compose-test: CT_STOP must be stop or kill" >&2; exit 2 ;; esac
WORK="$(mktemp -d /tmp/shepherd-compose-test.XXXXXX)"
PY="$(command -v python3)"

say() { printf 'compose-test: %s\n' "$*"; }
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.0f", b - a }'; }
die() { say "FAILED: $*" >&2; exit 1; }

DOCKERD_PID=""
FORWARD_POLICY=""
ADDED_CA=0
UP=0
COMPOSE=()

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    if [ "$UP" = 1 ]; then
        if [ "$rc" != 0 ]; then
            say "logs of the fleet (last lines of each service):"
            timeout 60 "${COMPOSE[@]}" -p "$PROJECT" logs --no-color --tail 25 2>&1 | sed 's/^/    /'
        fi
        if [ "${CT_KEEP:-0}" = 1 ]; then
            say "CT_KEEP=1: the fleet stays up (${COMPOSE[*]} -p $PROJECT down -v to remove it)"
        else
            say "tearing down"
            timeout 120 "${COMPOSE[@]}" -p "$PROJECT" down -v --remove-orphans -t 10 >"$WORK/down.log" 2>&1 \
                || { say "compose down failed:"; tail -5 "$WORK/down.log"; }
        fi
    fi
    if [ "$ADDED_CA" = 1 ]; then rm -f docker/certs/host-ca.crt; fi
    if [ -n "$DOCKERD_PID" ] && [ "${CT_KEEP:-0}" != 1 ]; then
        say "stopping the dockerd this script started (pid $DOCKERD_PID)"
        kill -TERM "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$DOCKERD_PID" 2>/dev/null; then
            say "dockerd still running after 30 s: SIGKILL"
            kill -KILL "$DOCKERD_PID" 2>/dev/null
        fi
        # what dockerd leaves behind (no other dockerd runs: this one was started because none answered):
        # its default bridge, the netns mount and the FORWARD policy it set to DROP (its iptables chains,
        # empty without containers, stay)
        umount /run/docker/netns/default 2>/dev/null
        ip link delete docker0 2>/dev/null
        if [ "$FORWARD_POLICY" = ACCEPT ]; then iptables -P FORWARD ACCEPT 2>/dev/null; fi
    fi
    rm -rf "$WORK"
    say "wall time $(elapsed) s; exit $rc"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

apt_install() {  # apt_install PKG...: bounded; refreshes the lists once if the first try fails
    say "installing $*"
    export DEBIAN_FRONTEND=noninteractive
    if ! timeout 600 apt-get install -y -qq --no-install-recommends "$@" >"$WORK/apt.log" 2>&1; then
        timeout 300 apt-get update -qq >>"$WORK/apt.log" 2>&1 || true
        timeout 600 apt-get install -y -qq --no-install-recommends "$@" >>"$WORK/apt.log" 2>&1 \
            || { tail -20 "$WORK/apt.log"; die "apt-get install $* failed"; }
    fi
}

apt_candidate() {  # the version apt would install, or nothing
    apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ { if ($2 != "(none)") print $2 }'
}

# ---- 1. tools ---------------------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || docker info >/dev/null 2>&1 || die "run as root (installs packages, starts dockerd)"
if ! command -v docker >/dev/null || ! command -v dockerd >/dev/null; then
    apt_install docker.io
fi
if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then
    COMPOSE=(docker-compose)
elif [ -n "$(apt_candidate docker-compose-plugin)" ]; then
    apt_install docker-compose-plugin
    COMPOSE=(docker compose)
else
    apt_install docker-compose
    COMPOSE=(docker-compose)
fi
say "compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short 2>/dev/null || "${COMPOSE[@]}" version | head -1))"

# ---- 2. the Docker engine ---------------------------------------------------------------------------
if ! timeout 10 docker info >/dev/null 2>&1; then
    if pgrep -x dockerd >/dev/null; then
        die "a dockerd is running but does not answer (docker info); not starting a second one"
    fi
    FORWARD_POLICY="$(iptables -S FORWARD 2>/dev/null | awk '$1 == "-P" { print $3; exit }')"
    say "starting dockerd (log: /tmp/shepherd-dockerd.log)"
    # its own session: a Ctrl-C of make reaches this script (which tears the fleet down first), not dockerd
    setsid dockerd >/tmp/shepherd-dockerd.log 2>&1 </dev/null &
    DOCKERD_PID=$!
    for _ in $(seq 1 60); do
        timeout 5 docker info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -20 /tmp/shepherd-dockerd.log; die "dockerd exited"; }
        sleep 0.5
    done
    timeout 5 docker info >/dev/null 2>&1 || { tail -20 /tmp/shepherd-dockerd.log; die "dockerd not up in 30 s"; }
    pidfile_pid="$(cat /var/run/docker.pid 2>/dev/null || true)"
    if [ -n "$pidfile_pid" ] && [ "$pidfile_pid" != "$DOCKERD_PID" ]; then
        die "dockerd's pid file says $pidfile_pid, not $DOCKERD_PID: not the dockerd this script started"
    fi
fi
say "docker engine $(docker version --format '{{.Server.Version}}') ($(docker info --format '{{.Driver}}, cgroup v{{.CgroupVersion}}' 2>/dev/null))"

# ---- 3. the image -----------------------------------------------------------------------------------
if [ "${CT_HOST_CA:-1}" = 1 ] && [ ! -f docker/certs/host-ca.crt ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt docker/certs/host-ca.crt   # what build.sh --host-ca does
    ADDED_CA=1
fi
HASH="$(docker/source-hash.sh)"
HAVE="$(docker image inspect -f '{{ index .Config.Labels "org.shepherd.source-hash" }}' "$IMAGE" 2>/dev/null || true)"
if [ "$HAVE" = "$HASH" ] && [ "${CT_REBUILD:-0}" != 1 ]; then
    say "image $IMAGE is up to date (sources $HASH)"
    BUILD_S=0
else
    say "building $IMAGE (sources $HASH; the image had ${HAVE:-none}); log: $WORK/build.log"
    build_args=()
    if ! docker image inspect python:3.11-slim-bookworm >/dev/null 2>&1 \
        && docker image inspect shepherd-base:bookworm >/dev/null 2>&1; then
        build_args=(--local-base)   # no registry here before: reuse the local base, do not try pulling
    fi
    b0=$(date +%s)
    if ! SHEPHERD_SOURCE_HASH="$HASH" timeout 1800 docker/build.sh "${build_args[@]}" >"$WORK/build.log" 2>&1; then
        tail -30 "$WORK/build.log"
        die "docker/build.sh failed"
    fi
    BUILD_S=$(( $(date +%s) - b0 ))
    grep -E '^build.sh:|Using cache' "$WORK/build.log" | sort | uniq -c | sed 's/^/    /'
    say "built $IMAGE in ${BUILD_S} s"
    docker image prune -f --filter label=org.shepherd.source-hash >/dev/null 2>&1 || true  # older builds
fi
if [ "$ADDED_CA" = 1 ]; then rm -f docker/certs/host-ca.crt; ADDED_CA=0; fi

# ---- 4. up, traffic, stop one node, checks ----------------------------------------------------------
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export SHEPHERD_LB_PORT SHEPHERD_STATS_PORT SHEPHERD_IMAGE="$IMAGE"
SHEPHERD_LB_PORT="$(free_port)"
SHEPHERD_STATS_PORT="$(free_port)"
compose_file=docker-compose.yml
if [ "${CT_NO_MESH:-0}" = 1 ]; then   # the same fleet without the mesh flags
    compose_file="$WORK/docker-compose.no-mesh.yml"
    sed -e '/--mesh-/d' docker-compose.yml >"$compose_file"
    ln -s "$PWD/docker" "$WORK/docker"
fi
COMPOSE+=(-f "$compose_file")

# the nodes' admin key (their control plane has auth; docker-compose.yml has no default): one per run
if [ -z "${SHEPHERD_ADMIN_KEY:-}" ]; then
    SHEPHERD_ADMIN_KEY="sk-smg-compose-$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')"
fi
export SHEPHERD_ADMIN_KEY
"${COMPOSE[@]}" -p "$PROJECT" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true   # a stale run's
say "up: project $PROJECT, LB on 127.0.0.1:$SHEPHERD_LB_PORT (stats :$SHEPHERD_STATS_PORT)"
UP=1
u0=$(date +%s)
if ! timeout 300 "${COMPOSE[@]}" -p "$PROJECT" up -d --no-build >"$WORK/up.log" 2>&1; then
    tail -20 "$WORK/up.log"
    die "compose up failed"
fi
say "compose up returned after $(( $(date +%s) - u0 )) s (engines and nodes healthy)"

node_args=()
for n in node-1 node-2 node-3; do   # their admin listeners (/mesh/members), with the admin key
    addr="$("${COMPOSE[@]}" -p "$PROJECT" port "$n" 30001 | tail -1)"
    [ -n "$addr" ] || die "no published port for $n"
    node_args+=(--node "$n=http://$addr")
done
# a node's own client port (not the victim's): the LB's TTFT is compared with it
direct_node=node-1; [ "$VICTIM" = node-1 ] && direct_node=node-3
direct_addr="$("${COMPOSE[@]}" -p "$PROJECT" port "$direct_node" 30000 | tail -1)"
[ -n "$direct_addr" ] || die "no published client port for $direct_node"
victim_id="$("${COMPOSE[@]}" -p "$PROJECT" ps -q "$VICTIM")"
[ -n "$victim_id" ] || die "no container for $VICTIM"
case "$STOP_MODE" in
    stop) stop_cmd="docker stop -t 35 $victim_id" ;;
    kill) stop_cmd="docker kill $victim_id" ;;
    *) die "CT_STOP must be stop or kill" ;;
esac
check_args=()
if [ "${CT_NO_MESH:-0}" = 1 ]; then check_args+=(--no-mesh); fi

say "traffic: ${CT_REQUESTS:-300} requests over ${CT_DURATION:-20} s through the LB; docker $STOP_MODE $VICTIM at ${CT_STOP_AT:-8} s"
"$PY" docker/compose_check.py \
    --lb "http://127.0.0.1:$SHEPHERD_LB_PORT" \
    --stats "http://127.0.0.1:$SHEPHERD_STATS_PORT/stats;csv" \
    "${node_args[@]}" --victim "$VICTIM" --stop-cmd "$stop_cmd" --direct "http://$direct_addr" \
    --requests "${CT_REQUESTS:-300}" --duration "${CT_DURATION:-20}" --stop-at "${CT_STOP_AT:-8}" \
    --ready-timeout 120 --notice-timeout 40 "${check_args[@]}" | tee "$WORK/check.log"
check_rc=${PIPESTATUS[0]}
if [ "$STOP_MODE" = stop ]; then
    say "$VICTIM exited with $(docker inspect -f '{{.State.ExitCode}}' "$victim_id" 2>/dev/null || echo '?')" \
        "(0: drained and left the mesh on SIGTERM)"
fi
[ "$check_rc" = 0 ] || die "compose_check: some checks failed"
say "PASSED (image build ${BUILD_S} s)"
