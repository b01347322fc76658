#!/usr/bin/env bash
# ensure-dockerd.sh — make sure a Docker engine answers `docker info`.
#
# Idempotent: exits 0 at once when `docker info` already works.  Otherwise it
#   1. installs Debian's docker.io (non-interactive) when `dockerd` is missing,
#   2. clears stale pidfiles (docker's and its managed containerd's),
#   3. starts dockerd in the background (overlay2 storage when the kernel and
#      the backing filesystem allow it, else vfs; --iptables=false,
#      --ip-forward=false: no NAT and no forwarding, so containers can never
#      route traffic off this machine; the host still reaches them directly on
#      their bridge addresses),
#   4. polls `docker info` until a deadline and fails with the tail of the
#      dockerd log when the engine does not come up.
# Concurrent callers are serialised with flock.
#
# Environment (all optional):
#   KVWIRE_DOCKERD_TIMEOUT         seconds to wait for the engine (default 60)
#   KVWIRE_DOCKERD_LOG             dockerd log file (default /tmp/kvwire-dockerd.log)
#   KVWIRE_DOCKERD_PIDFILE         dockerd pidfile (default /var/run/docker.pid)
#   KVWIRE_DOCKER_STORAGE_DRIVER   auto (default), overlay2 or vfs.  auto tries
#                                  overlay2 and falls back to vfs if dockerd cannot
#                                  use it.  Measured here: creating a container
#                                  from the ~260 MB test image takes ~0.05 s with
#                                  overlay2 but ~5-6 s with vfs (vfs copies the
#                                  whole rootfs twice per container).  Images are
#                                  stored per driver: after a switch, rebuild them.
#   KVWIRE_DOCKERD_EXTRA_ARGS      extra dockerd flags (word-split)
set -euo pipefail

TIMEOUT="${KVWIRE_DOCKERD_TIMEOUT:-60}"
LOG="${KVWIRE_DOCKERD_LOG:-/tmp/kvwire-dockerd.log}"
PIDFILE="${KVWIRE_DOCKERD_PIDFILE:-/var/run/docker.pid}"
DRIVER="${KVWIRE_DOCKER_STORAGE_DRIVER:-auto}"
LOCK="/tmp/kvwire-ensure-dockerd.lock"
CONTAINERD_PIDFILE="/var/run/docker/containerd/containerd.pid"

log() { printf '[ensure-dockerd] %s\n' "$*" >&2; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

engine_ok() {
    command -v docker >/dev/null 2>&1 || return 1
    timeout 15 docker info >/dev/null 2>&1
}

fail() {
    log "ERROR: $*"
    if [[ -s "$LOG" ]]; then
        log "---- last 40 lines of $LOG ----"
        tail -n 40 "$LOG" >&2 || true
        log "---- end of dockerd log ----"
    fi
    exit 1
}

# Fast path, before taking the lock.
if engine_ok; then
    exit 0
fi

if [[ "$(id -u)" != 0 ]]; then
    fail "docker engine not reachable and not running as root: cannot start dockerd"
fi

exec 9>"$LOCK"
flock -w "$((TIMEOUT + 120))" 9 || fail "could not take lock $LOCK"

# Someone else may have started it while we waited for the lock.
if engine_ok; then
    exit 0
fi

# ---------------------------------------------------------------- install
if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
    t0=$(now)
    log "dockerd not found: installing docker.io from Debian (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    # Keep the package's postinst from trying to start a service (no init here).
    made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        made_policy=1
    fi
    install_ok=0
    for attempt in 1 2; do
        if apt-get update -qq >>"$LOG.apt" 2>&1 &&
           apt-get install -y -q --no-install-recommends docker.io >>"$LOG.apt" 2>&1; then
            install_ok=1
            break
        fi
        log "apt-get attempt $attempt failed (see $LOG.apt)"
        sleep 2
    done
    [[ $made_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d
    if [[ $install_ok != 1 ]]; then
        tail -n 20 "$LOG.apt" >&2 || true
        fail "apt-get install docker.io failed"
    fi
    hash -r
    log "docker.io installed in $(elapsed "$t0") s"
fi

# ---------------------------------------------------------------- start
proc_comm() { cat "/proc/$1/comm" 2>/dev/null || true; }
# kill -0 succeeds on zombies; a SIGKILLed dockerd stays a zombie until PID 1
# reaps it, so look at the process state too.
is_alive() {
    local st
    st="$(sed -e 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" || return 1
    [[ -n "$st" && "$st" != Z && "$st" != X ]]
}

find_running_dockerd() {
    running_pid=""
    if [[ -s "$PIDFILE" ]]; then
        local pid
        pid="$(tr -dc '0-9' < "$PIDFILE" || true)"
        if [[ -n "$pid" ]] && is_alive "$pid" && [[ "$(proc_comm "$pid")" == dockerd ]]; then
            running_pid="$pid"
            return
        fi
        log "removing stale pidfile $PIDFILE (pid '${pid:-?}' is not a running dockerd)"
        rm -f "$PIDFILE"
    fi
    local other
    for other in $(pgrep -x dockerd || true); do
        if is_alive "$other"; then running_pid="$other"; return; fi
    done
}

# Wait for `docker info`; returns 0 ready, 1 daemon died, 2 deadline passed.
wait_ready() {
    local deadline=$(( $(date +%s) + TIMEOUT ))
    while :; do
        engine_ok && return 0
        is_alive "$running_pid" || { engine_ok && return 0; return 1; }
        (( $(date +%s) >= deadline )) && return 2
        sleep 0.5
    done
}

# shellcheck disable=SC2206
extra=( ${KVWIRE_DOCKERD_EXTRA_ARGS:-} )
start_dockerd() {  # $1 = storage driver
    local args=(
        --storage-driver="$1"
        --iptables=false      # no NAT / masquerading / isolation rules at all
        --ip-forward=false    # do not turn on net.ipv4.ip_forward (it is 0 here)
        --ip-masq=false
        --pidfile="$PIDFILE"
        "${extra[@]}"
    )
    # A containerd pidfile left by a killed dockerd may point at a reused pid.
    if [[ -s "$CONTAINERD_PIDFILE" ]]; then
        local cpid
        cpid="$(tr -dc '0-9' < "$CONTAINERD_PIDFILE" || true)"
        if [[ -z "$cpid" ]] || ! is_alive "$cpid" || [[ "$(proc_comm "$cpid")" != containerd ]]; then
            rm -f "$CONTAINERD_PIDFILE"
        fi
    fi
    mkdir -p "$(dirname "$LOG")"
    printf '\n==== %s starting: dockerd %s\n' "$(date -Is)" "${args[*]}" >>"$LOG"
    # setsid + nohup: the daemon must outlive this script and its caller.
    setsid nohup dockerd "${args[@]}" >>"$LOG" 2>&1 </dev/null &
    running_pid=$!
    log "started dockerd --storage-driver=$1 (pid $running_pid, log $LOG)"
}

t0=$(now)
find_running_dockerd
if [[ -n "$running_pid" ]]; then
    log "dockerd already running (pid $running_pid) but not answering yet; waiting"
    rc=0; wait_ready || rc=$?
    case $rc in
        0) log "docker engine ready after $(elapsed "$t0") s"; exit 0 ;;
        2) fail "docker engine not ready after ${TIMEOUT}s (dockerd pid $running_pid still running)" ;;
        *) log "dockerd pid $running_pid went away; starting a new one"
           rm -f "$PIDFILE"; sleep 0.5 ;;
    esac
fi

t0=$(now)
driver="$DRIVER"
if [[ "$driver" == auto ]]; then
    driver=vfs
    grep -qw overlay /proc/filesystems 2>/dev/null && driver=overlay2
fi
start_dockerd "$driver"
rc=0; wait_ready || rc=$?
if [[ $rc == 1 && "$DRIVER" == auto && "$driver" == overlay2 ]]; then
    log "dockerd could not start with overlay2 (see $LOG); falling back to vfs"
    rm -f "$PIDFILE"
    start_dockerd vfs
    rc=0; wait_ready || rc=$?
fi
case $rc in
    0) log "docker engine ready after $(elapsed "$t0") s" ;;
    1) fail "dockerd (pid $running_pid) exited before the engine became ready" ;;
    *) fail "docker engine not ready after ${TIMEOUT}s (dockerd pid $running_pid still running)" ;;
esac
