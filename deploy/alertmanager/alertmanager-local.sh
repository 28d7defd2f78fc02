#!/usr/bin/env bash
# A local Prometheus Alertmanager (Debian's `prometheus-alertmanager`) for tests, CI and
# trying the Alertmanager sink. Listens on 127.0.0.1 only; HA gossip is off
# (--cluster.listen-address= empty, else it would bind 0.0.0.0:9094).
#
# Usage: alertmanager-local.sh {start|stop|status} <state_dir> [port]
#
#   start    write <state_dir>/alertmanager.yml (once; edit it freely), start Alertmanager in
#            the background, wait until GET /-/ready answers, print the base URL
#   stop     stop it (SIGTERM, then SIGKILL after a grace period)
#   status   exit 0 = running and ready, 1 = running but not ready, 3 = not running
#
# port defaults to 9093. The config routes everything to one receiver, grouped by
# [cluster, alertname, job, switch]: a null receiver, or a webhook when
# FABRICWATCH_AM_WEBHOOK_URL is set. Environment:
#   FABRICWATCH_ALERTMANAGER_BIN   the binary (default: prometheus-alertmanager on PATH,
#                                  then /usr/bin/prometheus-alertmanager, then alertmanager)
#   FABRICWATCH_AM_START_TIMEOUT   seconds to wait for /-/ready (default 30)
# Logs: <state_dir>/alertmanager.log; pid: <state_dir>/alertmanager.pid; data: <state_dir>/data.
set -euo pipefail

die() { echo "alertmanager-local: $*" >&2; exit 1; }
log() { echo "alertmanager-local: $*" >&2; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

(( $# >= 2 && $# <= 3 )) || { usage >&2; exit 2; }
CMD="$1"
STATE_DIR="$2"
PORT="${3:-9093}"
START_TIMEOUT="${FABRICWATCH_AM_START_TIMEOUT:-30}"
case "$CMD" in start|stop|status) ;; *) usage >&2; die "unknown command: $CMD" ;; esac
[[ "$PORT" =~ ^[0-9]+$ ]] && (( PORT > 0 && PORT < 65536 )) || die "bad port: $PORT"
[[ "$START_TIMEOUT" =~ ^[0-9]+$ ]] || die "bad FABRICWATCH_AM_START_TIMEOUT: $START_TIMEOUT"
case "$STATE_DIR" in /*) ;; *) STATE_DIR="$PWD/${STATE_DIR#./}" ;; esac

readonly PID_FILE="$STATE_DIR/alertmanager.pid"
readonly CONFIG="$STATE_DIR/alertmanager.yml"
readonly LOG_FILE="$STATE_DIR/alertmanager.log"
readonly BASE_URL="http://127.0.0.1:$PORT"

find_bin() {
    if [[ -n "${FABRICWATCH_ALERTMANAGER_BIN:-}" ]]; then echo "$FABRICWATCH_ALERTMANAGER_BIN"; return; fi
    command -v prometheus-alertmanager 2>/dev/null && return
    [[ -x /usr/bin/prometheus-alertmanager ]] && { echo /usr/bin/prometheus-alertmanager; return; }
    command -v alertmanager 2>/dev/null && return
    die "Alertmanager not found: apt-get install prometheus-alertmanager (or set FABRICWATCH_ALERTMANAGER_BIN)"
}

running_pid() { # print the pid when the recorded process is alive
    [[ -f "$PID_FILE" ]] || return 1
    local pid; pid="$(cat "$PID_FILE")"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

is_ready() { # GET /-/ready without curl: plain HTTP over bash's /dev/tcp
    local reply
    { exec 3<>"/dev/tcp/127.0.0.1/$PORT"; } 2>/dev/null || return 1
    printf 'GET /-/ready HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    reply="$(timeout 2 cat <&3 || true)"
    exec 3<&- 3>&-
    [[ "$reply" == "HTTP/1."?" 200"* ]]
}

write_config() {
    [[ -f "$CONFIG" ]] && return
    local receiver='  - name: "default"'
    if [[ -n "${FABRICWATCH_AM_WEBHOOK_URL:-}" ]]; then
        receiver+=$'\n    webhook_configs:\n      - url: "'"$FABRICWATCH_AM_WEBHOOK_URL"'"\n        send_resolved: true'
    fi
    # group_wait / group_interval short so a local run shows notifications quickly.
    cat >"$CONFIG" <<YAML
route:
  receiver: "default"
  group_by: [cluster, alertname, job, switch]
  group_wait: 1s
  group_interval: 10s
  repeat_interval: 4h
receivers:
$receiver
YAML
}

do_start() {
    local pid
    if pid="$(running_pid)"; then
        is_ready || die "already running (pid $pid) but not ready; see $LOG_FILE"
        log "already running (pid $pid)"; echo "$BASE_URL"; return
    fi
    local bin; bin="$(find_bin)"
    mkdir -p "$STATE_DIR/data"
    write_config
    local t0=$SECONDS
    # setsid: the daemon outlives this script and the caller's process group signals.
    setsid "$bin" --config.file="$CONFIG" --storage.path="$STATE_DIR/data" \
        --web.listen-address="127.0.0.1:$PORT" --cluster.listen-address= \
        >>"$LOG_FILE" 2>&1 </dev/null &
    echo $! >"$PID_FILE"
    pid=$!
    while ! is_ready; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 20 "$LOG_FILE" >&2 || true
            rm -f "$PID_FILE"; die "Alertmanager exited during start; see $LOG_FILE"
        fi
        if (( SECONDS - t0 >= START_TIMEOUT )); then
            do_stop; die "not ready after ${START_TIMEOUT}s; see $LOG_FILE"
        fi
        sleep 0.1
    done
    log "ready at $BASE_URL (pid $pid)"
    echo "$BASE_URL"
}

do_stop() {
    local pid
    if ! pid="$(running_pid)"; then rm -f "$PID_FILE"; log "not running"; return; fi
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "no exit after SIGTERM; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
    rm -f "$PID_FILE"
    log "stopped (pid $pid)"
}

do_status() {
    local pid
    if ! pid="$(running_pid)"; then echo "not running"; exit 3; fi
    if is_ready; then echo "running (pid $pid) at $BASE_URL"; exit 0; fi
    echo "running (pid $pid) but not ready"; exit 1
}

case "$CMD" in
    start) do_start ;;
    stop) do_stop ;;
    status) do_status ;;
esac
