#!/usr/bin/env bash
# A single-node Apache Kafka 4.x (KRaft, combined broker+controller) for tests, CI and
# `fabricwatch up`. No Docker, no Kafka download: the jars come from Maven Central via
# deploy/kafka/pom.xml, the JVM runs straight from them. Listens on 127.0.0.1 only.
#
# Usage: kafka-local.sh [options] {fetch|start|stop|status|wipe}
#
#   fetch    copy the broker jars into the cache (idempotent; skipped when complete)
#   start    fetch if needed, write config, format storage once, start the broker in the
#            background, wait until it answers metadata, print the bootstrap address
#   stop     stop the broker (SIGTERM, then SIGKILL after a grace period)
#   status   print the state; exit 0 = running and answering, 1 = running but not
#            answering, 3 = not running
#   wipe     stop, then delete the data dir
#
# Options (each also settable through the environment):
#   --port N             broker port            FABRICWATCH_KAFKA_PORT (default 9092)
#   --controller-port N  KRaft controller port  FABRICWATCH_KAFKA_CONTROLLER_PORT (default port+1)
#   --data-dir DIR       data dir               FABRICWATCH_KAFKA_DATA_DIR
#                        (default ${FABRICWATCH_STATE:-./.fabricwatch}/kafka-<port>)
#   --cache-dir DIR      jar cache              FABRICWATCH_KAFKA_LIBS
#                        (default ${FABRICWATCH_CACHE:-$HOME/.cache/fabricwatch}/kafka-4.1.1/libs)
#   --timeout S          start timeout, seconds FABRICWATCH_KAFKA_START_TIMEOUT (default 90)
# JVM: FABRICWATCH_KAFKA_HEAP_OPTS (default -Xms256m -Xmx512m), FABRICWATCH_KAFKA_JVM_OPTS (extra).
set -euo pipefail

readonly KAFKA_VERSION=4.1.1 # keep in step with kafka.version in pom.xml
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
readonly POM="$SCRIPT_DIR/pom.xml"

die() { echo "kafka-local: $*" >&2; exit 1; }
log() { echo "kafka-local: $*" >&2; }

abspath() { # absolute path of $1 (need not exist)
    case "$1" in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s/%s\n' "$PWD" "${1#./}" ;;
    esac
}

is_port() { [[ "$1" =~ ^[0-9]+$ ]] && (( $1 > 0 && $1 < 65536 )); }

# ---------------------------------------------------------------- arguments
CMD=""
PORT="${FABRICWATCH_KAFKA_PORT:-9092}"
CONTROLLER_PORT="${FABRICWATCH_KAFKA_CONTROLLER_PORT:-}"
DATA_DIR="${FABRICWATCH_KAFKA_DATA_DIR:-}"
LIBS_DIR="${FABRICWATCH_KAFKA_LIBS:-${FABRICWATCH_CACHE:-$HOME/.cache/fabricwatch}/kafka-$KAFKA_VERSION/libs}"
START_TIMEOUT="${FABRICWATCH_KAFKA_START_TIMEOUT:-90}"

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

while (( $# )); do
    case "$1" in
        --port) PORT="${2:?--port needs a value}"; shift 2 ;;
        --port=*) PORT="${1#*=}"; shift ;;
        --controller-port) CONTROLLER_PORT="${2:?--controller-port needs a value}"; shift 2 ;;
        --controller-port=*) CONTROLLER_PORT="${1#*=}"; shift ;;
        --data-dir) DATA_DIR="${2:?--data-dir needs a value}"; shift 2 ;;
        --data-dir=*) DATA_DIR="${1#*=}"; shift ;;
        --cache-dir) LIBS_DIR="${2:?--cache-dir needs a value}"; shift 2 ;;
        --cache-dir=*) LIBS_DIR="${1#*=}"; shift ;;
        --timeout) START_TIMEOUT="${2:?--timeout needs a value}"; shift 2 ;;
        --timeout=*) START_TIMEOUT="${1#*=}"; shift ;;
        -h|--help|help) usage; exit 0 ;;
        fetch|start|stop|status|wipe)
            [[ -z "$CMD" ]] || die "only one command at a time (got '$CMD' and '$1')"
            CMD="$1"; shift ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done
[[ -n "$CMD" ]] || { usage >&2; exit 2; }

is_port "$PORT" || die "bad --port: $PORT"
[[ -n "$CONTROLLER_PORT" ]] || CONTROLLER_PORT=$(( PORT + 1 ))
is_port "$CONTROLLER_PORT" || die "bad --controller-port: $CONTROLLER_PORT"
(( CONTROLLER_PORT != PORT )) || die "controller port must differ from the broker port ($PORT)"
[[ "$START_TIMEOUT" =~ ^[0-9]+$ ]] || die "bad --timeout: $START_TIMEOUT"
[[ -n "$DATA_DIR" ]] || DATA_DIR="${FABRICWATCH_STATE:-./.fabricwatch}/kafka-$PORT"
DATA_DIR="$(abspath "$DATA_DIR")"
LIBS_DIR="$(abspath "$LIBS_DIR")"
readonly PORT CONTROLLER_PORT DATA_DIR LIBS_DIR START_TIMEOUT

readonly PID_FILE="$DATA_DIR/kafka.pid"
readonly SERVER_PROPS="$DATA_DIR/server.properties"
readonly LOG4J_PROPS="$DATA_DIR/log4j2.properties"
readonly LOG_DIR="$DATA_DIR/log"        # broker's own logs (server.log, stdout.log)
readonly KAFKA_LOG_DIRS="$DATA_DIR/data" # log.dirs: the topic partitions + KRaft metadata
readonly BOOTSTRAP="127.0.0.1:$PORT"

# ---------------------------------------------------------------- java / maven
JAVA=""
find_java() {
    if [[ -n "${JAVA_HOME:-}" && -x "$JAVA_HOME/bin/java" ]]; then
        JAVA="$JAVA_HOME/bin/java"
    elif command -v java >/dev/null 2>&1; then
        JAVA="$(command -v java)"
    else
        die "java not found: install Java 17 or newer (e.g. apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
    fi
    local ver major
    ver="$("$JAVA" -version 2>&1 | sed -n 's/.*version "\([^"]*\)".*/\1/p' | head -n1)"
    major="${ver%%.*}"
    [[ "$major" == 1 ]] && major="$(cut -d. -f2 <<<"$ver")"
    if [[ "$major" =~ ^[0-9]+$ ]] && (( major < 17 )); then
        die "Kafka $KAFKA_VERSION needs Java 17 or newer, $JAVA is $ver: install Java 17 (e.g. openjdk-17-jre-headless)"
    fi
}

libs_complete() {
    [[ -f "$LIBS_DIR/.complete" ]] || return 1
    [[ "$(cat "$LIBS_DIR/.complete")" == "$(pom_digest)" ]] || return 1
    compgen -G "$LIBS_DIR/kafka_2.13-$KAFKA_VERSION.jar" >/dev/null
}

pom_digest() { sha256sum "$POM" | cut -d' ' -f1; }

do_fetch() {
    libs_complete && return 0
    command -v mvn >/dev/null 2>&1 \
        || die "maven not found: install Maven 3 (e.g. apt-get install maven) to fetch the Kafka $KAFKA_VERSION jars"
    mkdir -p "$(dirname "$LIBS_DIR")"
    # One fetch at a time per cache dir (parallel test runs, CI + a developer shell).
    exec 8>"$LIBS_DIR.lock"
    flock 8
    if libs_complete; then exec 8>&-; return 0; fi
    local tmp="$LIBS_DIR.tmp.$$"
    rm -rf "$tmp"
    log "fetching Kafka $KAFKA_VERSION jars into $LIBS_DIR (Maven Central)"
    local start=$SECONDS
    if ! mvn -B -q -f "$POM" dependency:copy-dependencies -DoutputDirectory="$tmp" \
            >"$tmp.mvn.log" 2>&1; then
        sed 's/\x1b\[[0-9;]*m//g' "$tmp.mvn.log" >&2
        rm -rf "$tmp" "$tmp.mvn.log"
        die "maven could not fetch the Kafka jars (is Maven Central reachable? see the output above)"
    fi
    rm -f "$tmp.mvn.log"
    compgen -G "$tmp/kafka_2.13-$KAFKA_VERSION.jar" >/dev/null || { rm -rf "$tmp"; die "fetch finished but kafka_2.13-$KAFKA_VERSION.jar is missing"; }
    pom_digest >"$tmp/.complete"
    rm -rf "$LIBS_DIR"
    mv "$tmp" "$LIBS_DIR"
    log "fetched $(find "$LIBS_DIR" -name '*.jar' | wc -l) jars in $(( SECONDS - start ))s"
    exec 8>&-
}

# ---------------------------------------------------------------- process state
# pid of our broker, if one runs: from the pid file, verified against /proc so that a
# recycled pid is never taken for ours; else a process whose command line names our
# server.properties (pid file lost).
broker_pid() {
    local pid=""
    if [[ -f "$PID_FILE" ]]; then
        pid="$(tr -dc 0-9 <"$PID_FILE")"
        if [[ -n "$pid" ]] && is_our_broker "$pid"; then echo "$pid"; return 0; fi
    fi
    local d
    for d in /proc/[0-9]*; do
        pid="${d#/proc/}"
        if is_our_broker "$pid"; then echo "$pid"; return 0; fi
    done
    return 1
}

is_our_broker() { # pid: is it `java ... kafka.Kafka <our server.properties>`?
    local -a args=()
    local i
    { mapfile -d '' -t args <"/proc/$1/cmdline"; } 2>/dev/null || return 1
    for (( i = 0; i + 1 < ${#args[@]}; i++ )); do
        [[ "${args[i]}" == kafka.Kafka && "${args[i+1]}" == "$SERVER_PROPS" ]] && return 0
    done
    return 1
}

# Ask the broker for metadata with a raw Kafka request over bash's /dev/tcp: a
# MetadataRequest v4 for no topics. Succeeds when the broker answers and lists at least
# one live broker (i.e. it has registered with the controller and is unfenced).
metadata_ok() {
    local hex
    exec 3<>"/dev/tcp/127.0.0.1/$PORT" || return 1
    # size=17 | api_key=3 api_version=4 correlation_id=7 client_id="fw" | topics=[] allow_auto_create=false
    printf '\x00\x00\x00\x11\x00\x03\x00\x04\x00\x00\x00\x07\x00\x02fw\x00\x00\x00\x00\x00' >&3 || { exec 3>&-; return 1; }
    # response: size(4) correlation_id(4) throttle_time_ms(4) brokers count(4) ...
    hex="$(timeout 5 od -An -v -tx1 -N16 <&3 | tr -d ' \n')" || true
    exec 3>&-
    [[ ${#hex} -eq 32 && "${hex:8:8}" == 00000007 ]] || return 1
    (( 16#${hex:24:8} >= 1 && 16#${hex:24:8} < 16#80000000 ))
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# ---------------------------------------------------------------- config
write_config() {
    mkdir -p "$DATA_DIR" "$LOG_DIR" "$KAFKA_LOG_DIRS"
    cat >"$SERVER_PROPS" <<EOF
# Written by deploy/kafka/kafka-local.sh on every start; edits are overwritten.
# Single-node KRaft: this process is both the broker and the (only) controller.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$CONTROLLER_PORT
controller.listener.names=CONTROLLER
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$KAFKA_LOG_DIRS

# One node: every internal topic has a single replica.
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
default.replication.factor=1
min.insync.replicas=1
num.partitions=1

# The app creates its topics itself (streams/topics.py), with explicit partitions.
auto.create.topics.enable=false
delete.topic.enable=true
group.initial.rebalance.delay.ms=0

# Small machine, local use.
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.check.interval.ms=60000
EOF
    cat >"$LOG4J_PROPS" <<EOF
# Written by deploy/kafka/kafka-local.sh on every start.
status = warn
name = fabricwatch-local-kafka
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = $LOG_DIR/server.log
appender.file.filePattern = $LOG_DIR/server.log.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 50MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.authorizer.name = kafka.authorizer.logger
logger.authorizer.level = WARN
EOF
}

jvm_opts() {
    # shellcheck disable=SC2206  # word splitting of the *_OPTS variables is intended
    JVM_OPTS=(
        ${FABRICWATCH_KAFKA_HEAP_OPTS:--Xms256m -Xmx512m}
        -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError
        -Djava.awt.headless=true
        -Dlog4j2.configurationFile="$LOG4J_PROPS"
        -Dkafka.logs.dir="$LOG_DIR"
        ${FABRICWATCH_KAFKA_JVM_OPTS:-}
    )
}

format_storage() {
    [[ -f "$KAFKA_LOG_DIRS/meta.properties" ]] && return 0
    local cluster_id
    # A Kafka Uuid: 16 random bytes, base64url without padding; not starting with '-'
    # (it would read as an option).
    while :; do
        cluster_id="$(head -c16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"
        [[ "$cluster_id" != -* ]] && break
    done
    log "formatting KRaft storage in $KAFKA_LOG_DIRS (cluster id $cluster_id)"
    jvm_opts
    if ! "$JAVA" "${JVM_OPTS[@]}" -cp "$LIBS_DIR/*" kafka.tools.StorageTool format \
            -t "$cluster_id" -c "$SERVER_PROPS" >"$LOG_DIR/format.log" 2>&1; then
        cat "$LOG_DIR/format.log" >&2
        die "formatting the KRaft storage failed (see above; wipe with: $0 --port $PORT wipe)"
    fi
}

# ---------------------------------------------------------------- commands
do_start() {
    find_java
    mkdir -p "$DATA_DIR"
    exec 9>"$DATA_DIR/.lock" # one start/stop per data dir at a time
    flock 9
    local pid
    if pid="$(broker_pid)"; then
        if wait_ready "$pid"; then echo "$BOOTSTRAP"; return 0; fi
        die "a broker (pid $pid) runs on $DATA_DIR but does not answer; see $LOG_DIR/server.log"
    fi
    port_open "$PORT" && die "port $PORT on 127.0.0.1 is already in use by another process (choose another with --port)"
    port_open "$CONTROLLER_PORT" && die "controller port $CONTROLLER_PORT on 127.0.0.1 is already in use (choose another with --controller-port)"
    do_fetch
    write_config
    format_storage
    jvm_opts
    log "starting Kafka $KAFKA_VERSION on $BOOTSTRAP (controller 127.0.0.1:$CONTROLLER_PORT, data $DATA_DIR)"
    local log_lines_before=0 # on failure, show only what this start wrote to server.log
    [[ -f "$LOG_DIR/server.log" ]] && log_lines_before="$(wc -l <"$LOG_DIR/server.log")"
    local launcher=()
    command -v setsid >/dev/null 2>&1 && launcher=(setsid)
    # The broker must not hold our lock fds (8, 9) open: close them in the child.
    "${launcher[@]}" "$JAVA" "${JVM_OPTS[@]}" -cp "$LIBS_DIR/*" kafka.Kafka "$SERVER_PROPS" \
        </dev/null >"$LOG_DIR/stdout.log" 2>&1 8>&- 9>&- &
    pid=$!
    echo "$pid" >"$PID_FILE"
    if ! wait_ready "$pid"; then
        echo "---- last lines of $LOG_DIR/server.log ----" >&2
        tail -n "+$(( log_lines_before + 1 ))" "$LOG_DIR/server.log" 2>/dev/null | tail -n 40 >&2 || true
        echo "---- $LOG_DIR/stdout.log ----" >&2
        tail -n 20 "$LOG_DIR/stdout.log" >&2 2>/dev/null || true
        if kill -0 "$pid" 2>/dev/null; then
            stop_pid "$pid"
            die "the broker did not answer within ${START_TIMEOUT}s; stopped it"
        fi
        rm -f "$PID_FILE"
        die "the broker exited during start-up (logs above)"
    fi
    log "broker ready in $(( SECONDS - START_SECONDS ))s"
    echo "$BOOTSTRAP"
}

wait_ready() { # pid: wait until the broker answers metadata; fail if it dies or times out
    local pid="$1" deadline=$(( SECONDS + START_TIMEOUT ))
    while (( SECONDS < deadline )); do
        kill -0 "$pid" 2>/dev/null || return 1
        if port_open "$PORT" && metadata_ok 2>/dev/null; then return 0; fi
        sleep 0.5
    done
    return 1
}

stop_pid() {
    local pid="$1" i
    kill -TERM "$pid" 2>/dev/null || return 0
    for (( i = 0; i < 60; i++ )); do # controlled shutdown: a few seconds, 30 s grace
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.5
    done
    log "broker (pid $pid) did not stop within 30s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for (( i = 0; i < 20; i++ )); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.25
    done
}

do_stop() {
    [[ -d "$DATA_DIR" ]] || { log "not running ($DATA_DIR does not exist)"; return 0; }
    exec 9>"$DATA_DIR/.lock"
    flock 9
    local pid
    if pid="$(broker_pid)"; then
        log "stopping broker pid $pid ($BOOTSTRAP)"
        stop_pid "$pid"
    else
        log "not running"
    fi
    rm -f "$PID_FILE"
}

do_status() {
    local pid
    if ! pid="$(broker_pid)"; then
        echo "stopped ($DATA_DIR)"
        return 3
    fi
    if metadata_ok 2>/dev/null; then
        echo "running pid=$pid bootstrap=$BOOTSTRAP data=$DATA_DIR"
        return 0
    fi
    echo "starting-or-unhealthy pid=$pid bootstrap=$BOOTSTRAP data=$DATA_DIR (see $LOG_DIR/server.log)"
    return 1
}

do_wipe() {
    do_stop
    case "$DATA_DIR" in
        /|"$HOME"|"$PWD") die "refusing to delete $DATA_DIR" ;;
    esac
    rm -rf "$DATA_DIR"
    log "deleted $DATA_DIR"
}

START_SECONDS=$SECONDS
case "$CMD" in
    fetch) do_fetch; echo "$LIBS_DIR" ;;
    start) do_start ;;
    stop) do_stop ;;
    status) do_status ;;
    wipe) do_wipe ;;
esac
