#!/usr/bin/env bash
# A real single-node Slurm (slurmctld + slurmd + its own munged) for tests, CI and local
# runs of the Slurm executor. No systemd and nothing under /etc/slurm: everything lives in
# the state dir, and every Slurm command finds it through SLURM_CONF=<state_dir>/slurm.conf.
# Daemons listen on 127.0.0.1 only (the host name must resolve to a loopback address).
#
# Usage: slurm-local.sh [--timeout S] {start|stop|status} <state_dir>
#
#   start    write slurm.conf (free loopback ports), start munged, slurmctld and slurmd,
#            wait until the node answers (sinfo shows it idle, or drained from an earlier
#            run), print `SLURM_CONF=<state_dir>/slurm.conf` on stdout. Idempotent: when
#            this state dir's daemons already run, only waits and prints.
#   stop     stop slurmd, slurmctld and munged of this state dir (SIGTERM, then SIGKILL)
#   status   exit 0 = running and the node answers, 1 = running but not answering,
#            3 = not running
#
# Options (also settable through the environment):
#   --timeout S   start timeout in seconds   FABRICWATCH_SLURM_START_TIMEOUT (default 60)
#
# Needs root (slurmd launches jobs as their users) and Debian's slurm-wlm + munge
# packages (slurmctld, slurmd, munged). The daemons run as `slurm` / `munge` when those
# users can reach the state dir, else as root (pytest's tmp dirs are 0700 root).
# Jobs' state survives a stop/start in <state_dir>/ctld, so a node drained in one run is
# still drained in the next.
set -euo pipefail

die() { echo "slurm-local: $*" >&2; exit 1; }
log() { echo "slurm-local: $*" >&2; }

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

# ---------------------------------------------------------------- arguments
CMD=""
STATE_DIR=""
START_TIMEOUT="${FABRICWATCH_SLURM_START_TIMEOUT:-60}"
while (( $# )); do
    case "$1" in
        --timeout) START_TIMEOUT="${2:?--timeout needs a value}"; shift 2 ;;
        --timeout=*) START_TIMEOUT="${1#*=}"; shift ;;
        -h|--help|help) usage; exit 0 ;;
        start|stop|status)
            [[ -z "$CMD" ]] || die "only one command at a time (got '$CMD' and '$1')"
            CMD="$1"; shift ;;
        -*) usage >&2; die "unknown option: $1" ;;
        *)
            [[ -z "$STATE_DIR" ]] || die "only one state dir (got '$STATE_DIR' and '$1')"
            STATE_DIR="$1"; shift ;;
    esac
done
[[ -n "$CMD" && -n "$STATE_DIR" ]] || { usage >&2; exit 2; }
[[ "$START_TIMEOUT" =~ ^[0-9]+$ ]] || die "bad --timeout: $START_TIMEOUT"
case "$STATE_DIR" in /*) ;; *) STATE_DIR="$PWD/${STATE_DIR#./}" ;; esac

readonly CONF="$STATE_DIR/slurm.conf"
readonly CTLD_DIR="$STATE_DIR/ctld"      # StateSaveLocation (jobs, node states)
readonly SPOOL_DIR="$STATE_DIR/spool"    # SlurmdSpoolDir (batch scripts)
readonly RUN_DIR="$STATE_DIR/run"        # pid files
readonly LOG_DIR="$STATE_DIR/log"
readonly MUNGE_DIR="$STATE_DIR/munge"    # key, socket, pid, seed, log of our own munged
readonly MUNGE_SOCKET="$MUNGE_DIR/munge.socket"
NODE="$(hostname -s)"
readonly NODE
export SLURM_CONF="$CONF"

# ---------------------------------------------------------------- helpers
need_bin() { command -v "$1" >/dev/null 2>&1 || die "$1 not found: install Debian's slurm-wlm and munge (apt-get install slurm-wlm munge)"; }

# The pid of our daemon $2 (basename): the one in pid file $1 if that process runs $2 with
# our state dir on its command line (a recycled pid is never taken for ours), else a scan of
# /proc for such a process (pid file lost, e.g. a tmp cleaner emptied the state dir).
our_pid() {
    local pid_file="$1" bin="$2" pid d
    if [[ -f "$pid_file" ]]; then
        pid="$(tr -dc 0-9 <"$pid_file")"
        if [[ -n "$pid" ]] && is_ours "$pid" "$bin"; then echo "$pid"; return 0; fi
    fi
    for d in /proc/[0-9]*; do
        pid="${d#/proc/}"
        if is_ours "$pid" "$bin"; then echo "$pid"; return 0; fi
    done
    return 1
}

is_ours() { # pid bin
    local cmdline
    cmdline="$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null)" || return 1
    [[ "$(basename "${cmdline%% *}")" == "$2" && "$cmdline" == *"$STATE_DIR/"* ]]
}

free_port() { # a free TCP port on 127.0.0.1, chosen by the kernel
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The user a daemon runs as: $1 when it can reach the state dir, else root.
daemon_user() {
    if id -u "$1" >/dev/null 2>&1 && runuser -u "$1" -- test -x "$STATE_DIR" 2>/dev/null; then
        echo "$1"
    else
        echo root
    fi
}

node_state() { sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1; }

# The node answers: idle/mixed/allocated, or drained/draining/... from an earlier run;
# not unknown, down, or a state with the '*' of a non-responding node.
node_answers() {
    local state
    state="$(node_state)" || return 1
    case "$state" in
        ""|unknown*|down*|*'*'|not_responding*|future*) return 1 ;;
        *) return 0 ;;
    esac
}

stop_pids() { # name=pid ...: SIGTERM to all at once (saves seconds), SIGKILL after 10 s
    local entry i alive
    for entry in "$@"; do kill -TERM "${entry#*=}" 2>/dev/null || true; done
    for (( i = 0; i < 40; i++ )); do
        alive=0
        for entry in "$@"; do kill -0 "${entry#*=}" 2>/dev/null && alive=1; done
        (( alive )) || return 0
        sleep 0.25
    done
    for entry in "$@"; do
        if kill -0 "${entry#*=}" 2>/dev/null; then
            log "${entry%%=*} (pid ${entry#*=}) did not stop within 10s: SIGKILL"
            kill -KILL "${entry#*=}" 2>/dev/null || true
        fi
    done
}

show_logs() { # the daemons' logs, then the stderr of their start (fatal config errors)
    local entry f
    for entry in 25:"$LOG_DIR/slurmctld.log" 25:"$LOG_DIR/slurmd.log" 8:"$MUNGE_DIR/munged.log" \
                 8:"$LOG_DIR/slurmctld.stderr" 8:"$LOG_DIR/slurmd.stderr"; do
        f="${entry#*:}"
        [[ -s "$f" ]] || continue
        echo "---- last lines of $f ----" >&2
        tail -n "${entry%%:*}" "$f" >&2
    done
}

# ---------------------------------------------------------------- munge
start_munged() {
    our_pid "$MUNGE_DIR/munged.pid" munged >/dev/null && return 0
    local user
    user="$(daemon_user munge)"
    mkdir -p "$MUNGE_DIR"
    chmod 0711 "$MUNGE_DIR" # munged: the socket dir must be searchable by all
    if [[ ! -s "$MUNGE_DIR/munge.key" ]]; then # a key of our own: nothing shared with a system munged
        (umask 077; head -c 1024 /dev/urandom >"$MUNGE_DIR/munge.key")
    fi
    chmod 0600 "$MUNGE_DIR/munge.key"
    chown -R "$user:" "$MUNGE_DIR"
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    local -a args=(--socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key"
                   --pid-file="$MUNGE_DIR/munged.pid" --seed-file="$MUNGE_DIR/munged.seed"
                   --log-file="$MUNGE_DIR/munged.log" --num-threads=2)
    if [[ "$user" == root ]]; then
        munged --force "${args[@]}" </dev/null 8>&- 9>&- || { show_logs; die "munged failed to start"; }
    else
        runuser -u "$user" -- munged "${args[@]}" </dev/null 8>&- 9>&- || { show_logs; die "munged failed to start"; }
    fi
    local i
    for (( i = 0; i < 40; i++ )); do
        if munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; then return 0; fi
        sleep 0.25
    done
    show_logs
    die "munged on $MUNGE_SOCKET does not answer"
}

# ---------------------------------------------------------------- config
write_config() {
    local slurm_user="$1" ctld_port slurmd_port cpus mem_mb host_addr
    host_addr="$(getent ahostsv4 "$NODE" | awk 'NR == 1 { print $1 }')"
    [[ "$host_addr" == 127.* ]] || die "host name $NODE resolves to '${host_addr:-nothing}', not a loopback address: the daemons would listen beyond 127.0.0.1 (add '127.0.0.1 $NODE' to /etc/hosts)"
    ctld_port="$(free_port)"
    slurmd_port="$(free_port)"
    while [[ "$slurmd_port" == "$ctld_port" ]]; do slurmd_port="$(free_port)"; done
    cpus="$(nproc --all)"
    # A little under MemTotal: slurmd marks the node invalid when it finds less than configured.
    mem_mb="$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.95 }' /proc/meminfo)"
    cat >"$CONF" <<EOF
# Written by deploy/slurm/slurm-local.sh on every start; edits are overwritten.
ClusterName=fabricwatch
SlurmctldHost=$NODE($host_addr)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
# slurmctld and slurmd bind to the address the host name resolves to (loopback, checked
# above), not 0.0.0.0.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=$slurm_user
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$CTLD_DIR
SlurmdSpoolDir=$SPOOL_DIR
# The daemons' own pid files; ours ($RUN_DIR/<daemon>.pid) are written at launch.
SlurmctldPidFile=$RUN_DIR/slurmctld.daemon.pid
SlurmdPidFile=$RUN_DIR/slurmd.daemon.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
PlugStackConfig=$STATE_DIR/plugstack.conf
# No cgroups, no accounting: the smallest set that runs on a plain (or sandboxed) host.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Batch jobs may be requeued (the executor's REQUEUE_JOBS / EXCLUDE_AND_RESTART).
JobRequeue=1
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
MailProg=/bin/true
MinJobAge=300
NodeName=$NODE NodeAddr=$host_addr CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    : >"$STATE_DIR/plugstack.conf" # empty: no SPANK plugins (Debian's /etc/slurm one is not ours)
    chmod 0644 "$CONF" "$STATE_DIR/plugstack.conf"
}

# ---------------------------------------------------------------- commands
daemons_up() {
    our_pid "$RUN_DIR/slurmctld.pid" slurmctld >/dev/null && our_pid "$RUN_DIR/slurmd.pid" slurmd >/dev/null
}

wait_ready() {
    local deadline=$(( SECONDS + START_TIMEOUT ))
    while (( SECONDS < deadline )); do
        if node_answers; then return 0; fi
        our_pid "$RUN_DIR/slurmctld.pid" slurmctld >/dev/null || { log "slurmctld exited"; return 1; }
        our_pid "$RUN_DIR/slurmd.pid" slurmd >/dev/null || { log "slurmd exited"; return 1; }
        sleep 0.5
    done
    log "node $NODE not up within ${START_TIMEOUT}s (sinfo state: '$(node_state)')"
    return 1
}

do_start() {
    [[ "$(id -u)" == 0 ]] || die "must run as root (slurmd starts jobs as their users); try sudo $0 start $STATE_DIR"
    local b
    for b in slurmctld slurmd munged munge unmunge sinfo scontrol; do need_bin "$b"; done
    mkdir -p "$STATE_DIR"
    exec 9>"$STATE_DIR/.lock" # one start/stop per state dir at a time
    flock 9
    if [[ -f "$CONF" ]] && daemons_up; then
        wait_ready || { show_logs; die "Slurm runs on $STATE_DIR but node $NODE does not answer"; }
        log "already running (node $NODE: $(node_state))"
        echo "SLURM_CONF=$CONF"
        return 0
    fi
    do_stop_locked # half-started leftovers (one daemon died): start from a clean slate
    local slurm_user
    slurm_user="$(daemon_user slurm)"
    mkdir -p "$CTLD_DIR" "$SPOOL_DIR" "$RUN_DIR" "$LOG_DIR"
    chown "$slurm_user:" "$CTLD_DIR" "$RUN_DIR" "$LOG_DIR"
    start_munged
    write_config "$slurm_user"
    log "starting slurmctld + slurmd for node $NODE (state $STATE_DIR, user $slurm_user)"
    # Foreground mode under setsid: we know the pids, and the daemons must not hold our lock fd.
    setsid slurmctld -D -f "$CONF" </dev/null >"$LOG_DIR/slurmctld.stderr" 2>&1 9>&- &
    echo $! >"$RUN_DIR/slurmctld.pid"
    setsid slurmd -D -f "$CONF" </dev/null >"$LOG_DIR/slurmd.stderr" 2>&1 9>&- &
    echo $! >"$RUN_DIR/slurmd.pid"
    if ! wait_ready; then
        show_logs
        do_stop_locked
        die "Slurm did not come up within ${START_TIMEOUT}s; stopped it (logs above)"
    fi
    log "node $NODE is $(node_state) after $(( SECONDS - START_SECONDS ))s"
    echo "SLURM_CONF=$CONF"
}

do_stop_locked() {
    local pid name
    local -a running=()
    for name in slurmd slurmctld; do
        if pid="$(our_pid "$RUN_DIR/$name.pid" "$name")"; then running+=("$name=$pid"); fi
    done
    (( ${#running[@]} )) && stop_pids "${running[@]}"
    rm -f "$RUN_DIR/slurmd.pid" "$RUN_DIR/slurmctld.pid"
    # munged last: the Slurm daemons authenticate through it until they are gone.
    if pid="$(our_pid "$MUNGE_DIR/munged.pid" munged)"; then stop_pids "munged=$pid"; fi
    rm -f "$MUNGE_DIR/munged.pid"
}

do_stop() {
    [[ -d "$STATE_DIR" ]] || { log "not running ($STATE_DIR does not exist)"; return 0; }
    exec 9>"$STATE_DIR/.lock"
    flock 9
    do_stop_locked
    log "stopped ($STATE_DIR)"
}

do_status() {
    if ! daemons_up; then echo "stopped ($STATE_DIR)"; return 3; fi
    if node_answers; then echo "running node=$NODE state=$(node_state) SLURM_CONF=$CONF"; return 0; fi
    echo "starting-or-unhealthy node=$NODE state=$(node_state) (see $LOG_DIR)"
    return 1
}

START_SECONDS=$SECONDS
case "$CMD" in
    start) do_start ;;
    stop) do_stop ;;
    status) do_status ;;
esac
