#!/usr/bin/env bash
# netsim.sh: an emulated multi-node cluster on one Linux machine, for measuring what fewer bytes
# on a slow inter-node link buy (ZeRO++ vs ZeRO-3). See docs/netsim.md.
#
# Topology (prefix P, N nodes):
#   node i = network namespace "${P}n$i", one interface eth0 = 10.77.0.(i+1)/24, hostname ${P}node$i
#   switch = namespace "${P}sw" holding a bridge br0 and one veth end v$i per node
#   shaping: tbf on eth0 egress (the node's upload) and on v$i egress (its download), so each node
#   has a full-duplex link of RATE Mbit/s to a non-blocking switch. Ranks of one node share its
#   namespace and reach each other through its loopback, which is never shaped (the "NVLink").
# Nothing is created in the host's namespace: the veth pairs are born inside our namespaces, the
# node namespaces have no default route, so no address or packet ever leaves the emulated cluster.
#
# Usage:
#   netsim.sh [options] run -- CMD [ARGS...]   build, run CMD once per rank, print link bytes, tear down
#   netsim.sh [options] up                     build and leave it up (give -p so 'down' can find it)
#   netsim.sh -p PREFIX down                   tear down everything with that prefix
#   netsim.sh -p PREFIX -b RATE rate           re-shape the links of a live topology (0 = unshaped)
#   netsim.sh -p PREFIX -n N counters          print tx/rx bytes of every node's link
# Options:
#   -n NODES (2)  -r RANKS_PER_NODE (2)  -b RATE_MBIT (100; 0 = unshaped)  -m MTU (1500)
#   -p PREFIX (qsn<pid>-; [a-z0-9-], <= 20 chars)  -P MASTER_PORT (29500)  -t RANK_TIMEOUT_S (600)
#   -l LOGDIR (one log per rank; default: ranks write to this terminal)
# Environment: NETSIM_SYSCTL="key=value ..." sets these sysctls in every node namespace (e.g.
#   net.ipv4.tcp_slow_start_after_idle=0; docs/netsim.md), each with "sysctl -w".
# Per-rank environment: RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE NODE_RANK NNODES MASTER_ADDR
#   MASTER_PORT GLOO_SOCKET_IFNAME=eth0 NETSIM_PREFIX NETSIM_RATE_MBIT NETSIM_MTU NETSIM_SCRIPT
#   NETSIM_IFACE=eth0 OMP_NUM_THREADS (1 unless set) PYTHONUNBUFFERED=1
# Exit status: that of the first rank to fail (the others are then stopped), 0 if all succeed,
#   124 if a rank ran past its timeout, 77 when the machine cannot do this (not root, no netns,
#   veth, bridge or tbf), 2 for a usage error.
set -Eeuo pipefail

readonly EXIT_UNAVAILABLE=77
readonly SUBNET=10.77.0

nodes=2
rpn=2
rate=100
mtu=1500
prefix="qsn$$-"
port=29500
rank_timeout=600
logdir=""
prefix_given=0

die() { echo "netsim: $*" >&2; exit 2; }
unavailable() { echo "netsim: unavailable here: $*" >&2; exit "$EXIT_UNAVAILABLE"; }

usage() { sed -n '2,/^set -Eeuo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2; }
help() { sed -n '2,/^set -Eeuo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0; }

[ "${1:-}" = "--help" ] && help
while getopts "n:r:b:m:p:P:t:l:h" opt; do
    case "$opt" in
        n) nodes=$OPTARG ;;
        r) rpn=$OPTARG ;;
        b) rate=$OPTARG ;;
        m) mtu=$OPTARG ;;
        p) prefix=$OPTARG; prefix_given=1 ;;
        P) port=$OPTARG ;;
        t) rank_timeout=$OPTARG ;;
        l) logdir=$OPTARG ;;
        h) help ;;
        *) usage ;;
    esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || usage
mode=$1; shift

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
is_uint "$nodes" && [ "$nodes" -ge 1 ] && [ "$nodes" -le 200 ] || die "-n NODES must be 1..200; got '$nodes'"
is_uint "$rpn" && [ "$rpn" -ge 1 ] || die "-r RANKS_PER_NODE must be >= 1; got '$rpn'"
is_uint "$rate" || die "-b RATE_MBIT must be a whole number of Mbit/s (0 = unshaped); got '$rate'"
is_uint "$mtu" && [ "$mtu" -ge 576 ] && [ "$mtu" -le 65000 ] || die "-m MTU must be 576..65000; got '$mtu'"
is_uint "$port" && [ "$port" -ge 1024 ] && [ "$port" -le 65535 ] || die "-P PORT must be 1024..65535; got '$port'"
is_uint "$rank_timeout" && [ "$rank_timeout" -ge 1 ] || die "-t RANK_TIMEOUT_S must be >= 1; got '$rank_timeout'"
[[ $prefix =~ ^[a-z][a-z0-9-]{0,19}$ ]] || die "-p PREFIX must match [a-z][a-z0-9-]{0,19} (it names namespaces and hostnames); got '$prefix'"

node_ns() { echo "${prefix}n$1"; }
switch_ns() { echo "${prefix}sw"; }
node_addr() { echo "$SUBNET.$(($1 + 1))"; }
node_host() { echo "${prefix}node$1"; }

# Our namespaces only: exactly <prefix>sw and <prefix>n<digits>.
our_namespaces() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}(sw|n[0-9]+)\$" || true
}

check_capable() {
    [ "$(id -u)" -eq 0 ] || unavailable "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for ip netns, tc and unshare --uts); run as root or skip"
    local tool
    for tool in ip tc unshare timeout hostname; do
        command -v "$tool" >/dev/null || unavailable "'$tool' is not installed (Debian: iproute2, util-linux, coreutils, hostname)"
    done
    [ "${BASH_VERSINFO[0]}" -gt 5 ] || { [ "${BASH_VERSINFO[0]}" -eq 5 ] && [ "${BASH_VERSINFO[1]}" -ge 1 ]; } \
        || unavailable "needs bash >= 5.1 (wait -n -p); this is $BASH_VERSION"
}

# burst >= max(128 KiB, 2 ms at the rate): smaller bursts under-shoot the rate at >= 1 Gbit/s.
shape() {  # shape NS DEV
    local ns=$1 dev=$2 burst
    ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
    [ "$rate" -eq 0 ] && return 0
    burst=$((rate * 1000000 / 8 / 500))
    [ "$burst" -ge 131072 ] || burst=131072
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "${rate}mbit" burst "$burst" latency 100ms
}

up() {
    local sw i ns hosts
    sw=$(switch_ns)
    [ -z "$(our_namespaces)" ] || die "namespaces with prefix '$prefix' exist already; run: $0 -p $prefix down"
    ip netns add "$sw" || unavailable "'ip netns add' failed (no network namespaces or no privilege)"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge || unavailable "the kernel has no bridge support"
    ip -n "$sw" link set br0 mtu "$mtu" up
    hosts="127.0.0.1 localhost"$'\n'"::1 localhost ip6-localhost ip6-loopback"$'\n'
    for ((i = 0; i < nodes; i++)); do
        # c10d's store socket is dual-stack and reverse-resolves peers by their v4-mapped form.
        hosts+="$(node_addr "$i") $(node_host "$i")"$'\n'"::ffff:$(node_addr "$i") $(node_host "$i")"$'\n'
    done
    for ((i = 0; i < nodes; i++)); do
        ns=$(node_ns "$i")
        ip netns add "$ns"
        mkdir -p "/etc/netns/$ns"
        printf '%s' "$hosts" >"/etc/netns/$ns/hosts"
        : >"/etc/netns/$ns/resolv.conf"  # no DNS: the host's resolver is unreachable from here
        ip -n "$ns" link set lo up
        for kv in ${NETSIM_SYSCTL:-}; do
            ip netns exec "$ns" sysctl -qw "$kv" >/dev/null || die "sysctl $kv failed in $ns"
        done
        ip link add name eth0 mtu "$mtu" netns "$ns" type veth peer name "v$i" mtu "$mtu" netns "$sw" \
            || unavailable "the kernel has no veth support"
        ip -n "$sw" link set "v$i" master br0 up
        ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        shape "$ns" eth0 || unavailable "tc tbf failed (no sch_tbf in this kernel?)"
        shape "$sw" "v$i"
    done
    echo "netsim: up: $nodes nodes x $rpn ranks, ${rate} Mbit/s per node link (0 = unshaped), MTU $mtu, prefix $prefix" >&2
}

down() {
    local ns pid
    for ns in $(our_namespaces); do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
    done
    sleep 0.2
    for ns in $(our_namespaces); do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true  # removes its veths, and the bridge with the switch
        [ -n "$ns" ] && rm -rf "/etc/netns/${ns:?}"
    done
}

counters() {
    local i ns
    for ((i = 0; i < nodes; i++)); do
        ns=$(node_ns "$i")
        ip netns exec "$ns" sh -c 'echo "netsim: node '"$i"' link tx_bytes=$(cat /sys/class/net/eth0/statistics/tx_bytes) rx_bytes=$(cat /sys/class/net/eth0/statistics/rx_bytes)"' >&2
    done
}

# One rank: its node's namespace, its node's hostname (unshare --uts, so hostname-based grouping
# works), the torchrun environment, and a hard per-rank timeout.
start_rank() {  # start_rank NS NODE LOCAL RANK WORLD CMD...
    local ns=$1 n=$2 l=$3 r=$4 world=$5
    shift 5
    exec ip netns exec "$ns" unshare --uts -- timeout --kill-after=10 "$rank_timeout" \
        env RANK="$r" WORLD_SIZE="$world" LOCAL_RANK="$l" LOCAL_WORLD_SIZE="$rpn" \
        NODE_RANK="$n" NNODES="$nodes" MASTER_ADDR="$(node_addr 0)" MASTER_PORT="$port" \
        GLOO_SOCKET_IFNAME=eth0 NETSIM_IFACE=eth0 NETSIM_PREFIX="$prefix" \
        NETSIM_RATE_MBIT="$rate" NETSIM_MTU="$mtu" NETSIM_SCRIPT="$(readlink -f "$0")" \
        OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1 \
        sh -c 'hostname "$0" && exec "$@"' "$(node_host "$n")" "$@"
}

rank_pids=()
torn_down=0
teardown() {
    [ "$torn_down" -eq 1 ] && return 0
    torn_down=1
    local pid
    for pid in "${rank_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    down
}

run() {
    [ $# -ge 1 ] || die "run needs a command: $0 run -- CMD [ARGS...]"
    local world=$((nodes * rpn)) n l r ns pid status failed=0 first_status=0
    [ -z "$logdir" ] || mkdir -p "$logdir"
    trap teardown EXIT
    trap 'teardown; exit 130' INT
    trap 'teardown; exit 143' TERM
    trap 'teardown' ERR
    up
    local -A rank_of=()
    for ((n = 0; n < nodes; n++)); do
        ns=$(node_ns "$n")
        for ((l = 0; l < rpn; l++)); do
            r=$((n * rpn + l))  # node-major: gloo's ring crosses each node boundary once per direction
            if [ -n "$logdir" ]; then
                start_rank "$ns" "$n" "$l" "$r" "$world" "$@" >"$logdir/rank$r.log" 2>&1 &
            else
                start_rank "$ns" "$n" "$l" "$r" "$world" "$@" &
            fi
            rank_pids+=("$!")
            rank_of[$!]=$r
        done
    done
    local -A live=()
    for pid in "${rank_pids[@]}"; do live[$pid]=1; done
    while [ "${#live[@]}" -gt 0 ]; do
        pid=""
        status=0
        wait -n -p pid "${!live[@]}" 2>/dev/null || status=$?
        if [ -z "${pid:-}" ]; then  # bash reaped the rest itself (after a kill): nothing left to wait for
            wait 2>/dev/null || true
            break
        fi
        unset "live[$pid]"
        if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
            failed=1
            first_status=$status
            echo "netsim: rank ${rank_of[$pid]} exited with status $status$([ "$status" -eq 124 ] && echo " (timeout ${rank_timeout}s)"); stopping the others" >&2
            for pid in "${rank_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
        fi
    done
    counters
    return "$first_status"
}

case "$mode" in
    up)
        [ "$prefix_given" -eq 1 ] || die "give -p PREFIX with 'up', so that 'down' can find it later"
        check_capable
        trap 'rc=$?; [ "$rc" -eq 0 ] || down' EXIT  # a half-built topology never stays behind
        up
        ;;
    down)
        [ "$prefix_given" -eq 1 ] || die "give the -p PREFIX that 'up' used"
        check_capable
        down
        ;;
    rate)
        [ "$prefix_given" -eq 1 ] || die "give the -p PREFIX of the live topology"
        check_capable
        n=0
        for ns in $(our_namespaces); do
            [ "$ns" = "$(switch_ns)" ] && continue
            i=${ns#"${prefix}n"}
            shape "$ns" eth0
            shape "$(switch_ns)" "v$i"
            n=$((n + 1))
        done
        [ "$n" -gt 0 ] || die "no topology with prefix '$prefix' is up"
        echo "netsim: $n node links now ${rate} Mbit/s (0 = unshaped)" >&2
        ;;
    counters)
        [ "$prefix_given" -eq 1 ] || die "give the -p PREFIX of the live topology"
        check_capable
        counters
        ;;
    run)
        [ "${1:-}" = "--" ] && shift
        check_capable
        run "$@"
        ;;
    *) die "unknown mode '$mode' (up, down, rate, counters, run)" ;;
esac
