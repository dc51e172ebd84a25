#!/usr/bin/env bash
# Preemption and maintenance notice of one Compute Engine VM, read from its metadata server.
#
#   examples/discovery/gce_notice.sh            # run on the VM itself
#   examples/discovery/gce_notice.sh 10.2.0.7   # ask VM 10.2.0.7, over SSH
#
# Prints `draining  # <why>` when the VM is being preempted (instance/preempted is TRUE: a
# spot or preemptible VM has about 30 s left) or, unless MAINTENANCE=ignore, when a host
# maintenance will stop it (instance/maintenance-event starts with TERMINATE_ON_HOST_MAINTENANCE,
# e.g. a VM with GPUs, which cannot live-migrate; a live migration, MIGRATE_ON_HOST_MAINTENANCE,
# keeps the VM and is ignored); prints nothing otherwise. Exits 1 with the reason on stderr
# when it cannot tell (no metadata server, SSH failed, an unexpected answer). It is not a
# discovery script by itself: gce.sh runs it for every VM it lists (docs/discovery.md,
# "Hosts about to go away").
#
# The metadata server answers only on the VM itself, so with a HOST the script sends itself
# to `ssh HOST bash -s` (the host needs bash and curl, nothing installed), with elasticrun's
# ELASTICRUN_SSH_USER, _PORT, _IDENTITY_FILE and _KNOWN_HOSTS when set, plus $SSH_ARGS.
# $NOTICE_TIMEOUT (default 5 s) bounds the whole SSH call; $METADATA_TIMEOUT (default 2 s)
# each request (it and MAINTENANCE are passed on to the host). METADATA_URL (default
# http://metadata.google.internal) is where the VM reaches its metadata server. SSH and CURL
# give the tools' paths when they are not on the PATH.
set -euo pipefail
me=gce_notice.sh

fail() { echo "$me: $*" >&2; exit 1; }

# `timeout --foreground` leaves the command in this script's process group, so a discovery
# timeout (which kills the group) kills it too; plain `timeout` moves it to a group of its own.
bounded() {
    local seconds=$1; shift
    if timeout --foreground 1 true >/dev/null 2>&1; then
        timeout --foreground "$seconds" "$@"
    elif command -v timeout >/dev/null 2>&1; then
        timeout "$seconds" "$@"
    else
        "$@"
    fi
}

maintenance=${MAINTENANCE:-drain}
if [[ "$maintenance" != drain && "$maintenance" != ignore ]]; then
    fail "MAINTENANCE must be drain or ignore, not '$maintenance'"
fi
wait_s=${METADATA_TIMEOUT:-2}
if ! [[ "$wait_s" =~ ^[1-9][0-9]*$ ]]; then
    fail "METADATA_TIMEOUT='$wait_s' is not a positive whole number of seconds"
fi
if (($# > 1)); then
    fail "usage: $me [HOST] (no HOST: this VM)"
fi

if (($# == 1)); then
    # On the driver: run this same script on HOST, where its metadata server is.
    host=$1
    ssh=${SSH:-ssh}
    if ! command -v "$ssh" >/dev/null 2>&1; then
        fail "ssh not found (\"$ssh\" is not on PATH; install openssh-client or set SSH to its path)"
    fi
    if ! [[ "$host" =~ ^[A-Za-z0-9_][A-Za-z0-9_.@-]*$ ]]; then
        fail "'$host' is not a host name"
    fi
    limit=${NOTICE_TIMEOUT:-5}
    if ! [[ "$limit" =~ ^[1-9][0-9]*$ ]]; then
        fail "NOTICE_TIMEOUT='$limit' is not a positive whole number of seconds"
    fi
    opts=(-o BatchMode=yes -o ConnectTimeout="$limit" -o LogLevel=ERROR)
    [[ -n "${ELASTICRUN_SSH_PORT:-}" ]] && opts+=(-p "$ELASTICRUN_SSH_PORT")
    [[ -n "${ELASTICRUN_SSH_USER:-}" ]] && opts+=(-l "$ELASTICRUN_SSH_USER")
    [[ -n "${ELASTICRUN_SSH_IDENTITY_FILE:-}" ]] && opts+=(-i "$ELASTICRUN_SSH_IDENTITY_FILE")
    [[ -n "${ELASTICRUN_SSH_KNOWN_HOSTS:-}" ]] && opts+=(-o "UserKnownHostsFile=$ELASTICRUN_SSH_KNOWN_HOSTS")
    read -r -a extra <<<"${SSH_ARGS:-}"
    opts+=("${extra[@]}")
    status=0
    bounded "$limit" "$ssh" "${opts[@]}" -- "$host" \
        "NOTICE_HOST=$host MAINTENANCE=$maintenance METADATA_TIMEOUT=$wait_s bash -s" <"${BASH_SOURCE[0]}" || status=$?
    case $status in
        0) exit 0 ;;
        124) fail "$host: no answer over SSH within ${limit}s (NOTICE_TIMEOUT)" ;;
        255) fail "$host: ssh failed (see above)" ;;
        *) exit 1 ;;  # the script on the host said why
    esac
fi

# On the VM: ask its metadata server.
who=${NOTICE_HOST:-this VM}
curl=${CURL:-curl}
if ! command -v "$curl" >/dev/null 2>&1; then
    fail "curl not found on $who (\"$curl\" is not on PATH; install curl or set CURL to its path)"
fi
url=${METADATA_URL:-http://metadata.google.internal}
url=${url%/}

# request METHOD PATH [curl args...]: sets $code (HTTP status) and $body.
request() {
    local method=$1 path=$2 out
    shift 2
    # --noproxy: the metadata server is local to the VM; an HTTP(S)_PROXY must not see the request.
    if ! out=$("$curl" -sS --noproxy '*' --connect-timeout "$wait_s" --max-time "$wait_s" \
            -X "$method" "$@" -w '\n%{http_code}' "$url$path" </dev/null); then
        fail "$who: no answer from the metadata server at $url$path (see above)"
    fi
    code=${out##*$'\n'}
    body=${out%$'\n'*}
    shown=${body:0:60}
    shown=${shown//[$'\r\n\t']/ }
}
# The metadata server answers only requests with this header (403 without it).
flavor=(-H "Metadata-Flavor: Google")

request GET /computeMetadata/v1/instance/preempted "${flavor[@]}"
case "$code $body" in
    "200 TRUE") echo "draining  # preempted: the VM stops within about 30 s"; exit 0 ;;
    "200 FALSE") ;;
    *) fail "$who: unexpected answer from $url/computeMetadata/v1/instance/preempted: HTTP $code $shown" ;;
esac

if [[ "$maintenance" == drain ]]; then
    request GET /computeMetadata/v1/instance/maintenance-event "${flavor[@]}"
    case "$code $body" in
        "200 TERMINATE_ON_HOST_MAINTENANCE"*)
            echo "draining  # maintenance-event ${body//[^A-Z_]/}: the VM will be stopped for host maintenance" ;;
        "200 NONE" | "200 MIGRATE_ON_HOST_MAINTENANCE"*) ;;  # nothing, or a live migration
        *) fail "$who: unexpected answer from $url/computeMetadata/v1/instance/maintenance-event: HTTP $code $shown" ;;
    esac
fi
