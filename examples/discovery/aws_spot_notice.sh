#!/usr/bin/env bash
# Spot notice of one EC2 instance, read from its instance metadata service (IMDSv2).
#
#   examples/discovery/aws_spot_notice.sh            # run on the instance itself
#   examples/discovery/aws_spot_notice.sh 10.1.0.7   # ask instance 10.1.0.7, over SSH
#
# Prints `draining  # <why>` when EC2 has scheduled the instance's interruption
# (meta-data/spot/instance-action: terminate, stop or hibernate, about 2 minutes ahead) or,
# unless REBALANCE=ignore, sent it a rebalance recommendation
# (meta-data/events/recommendations/rebalance, often earlier); prints nothing otherwise.
# Exits 1 with the reason on stderr when it cannot tell (no metadata service, SSH failed,
# an unexpected answer). It is not a discovery script by itself: aws_spot.sh runs it for every
# instance it lists (docs/discovery.md, "Hosts about to go away").
#
# The metadata service answers only on the instance itself, so with a HOST the script sends
# itself to `ssh HOST bash -s` (the host needs bash and curl, nothing installed), with
# elasticrun's ELASTICRUN_SSH_USER, _PORT, _IDENTITY_FILE and _KNOWN_HOSTS when set, plus
# $SSH_ARGS (e.g. "-o ControlMaster=auto -o ControlPath=~/.ssh/cm-%C -o ControlPersist=60"
# reuses one connection per host, kept open in the background between runs).
# $NOTICE_TIMEOUT (default 5 s) bounds the whole SSH call; $METADATA_TIMEOUT (default 2 s)
# each request (it and REBALANCE are passed on to the host). IMDS_URL (default
# http://169.254.169.254) is where the instance reaches the metadata service. SSH and CURL
# give the tools' paths when they are not on the PATH.
set -euo pipefail
me=aws_spot_notice.sh

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

rebalance=${REBALANCE:-drain}
if [[ "$rebalance" != drain && "$rebalance" != ignore ]]; then
    fail "REBALANCE must be drain or ignore, not '$rebalance'"
fi
wait_s=${METADATA_TIMEOUT:-2}
if ! [[ "$wait_s" =~ ^[1-9][0-9]*$ ]]; then
    fail "METADATA_TIMEOUT='$wait_s' is not a positive whole number of seconds"
fi
if (($# > 1)); then
    fail "usage: $me [HOST] (no HOST: this instance)"
fi

if (($# == 1)); then
    # On the driver: run this same script on HOST, where the metadata service is.
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
        "NOTICE_HOST=$host REBALANCE=$rebalance METADATA_TIMEOUT=$wait_s bash -s" <"${BASH_SOURCE[0]}" || status=$?
    case $status in
        0) exit 0 ;;
        124) fail "$host: no answer over SSH within ${limit}s (NOTICE_TIMEOUT)" ;;
        255) fail "$host: ssh failed (see above)" ;;
        *) exit 1 ;;  # the script on the host said why
    esac
fi

# On the instance: ask its metadata service.
who=${NOTICE_HOST:-this instance}
curl=${CURL:-curl}
if ! command -v "$curl" >/dev/null 2>&1; then
    fail "curl not found on $who (\"$curl\" is not on PATH; install curl or set CURL to its path)"
fi
url=${IMDS_URL:-http://169.254.169.254}
url=${url%/}

# request METHOD PATH [curl args...]: sets $code (HTTP status) and $body.
request() {
    local method=$1 path=$2 out
    shift 2
    # --noproxy: the metadata service is link-local; an HTTP(S)_PROXY must not see the request.
    if ! out=$("$curl" -sS --noproxy '*' --connect-timeout "$wait_s" --max-time "$wait_s" \
            -X "$method" "$@" -w '\n%{http_code}' "$url$path" </dev/null); then
        fail "$who: no answer from the metadata service at $url$path (see above)"
    fi
    code=${out##*$'\n'}
    body=${out%$'\n'*}
}
# field NAME: the string value of "NAME" in the JSON $body, reduced to safe characters.
field() {
    local value=""
    if [[ "$body" =~ \"$1\"[[:space:]]*:[[:space:]]*\"([^\"]*)\" ]]; then
        value=${BASH_REMATCH[1]//[^A-Za-z0-9:._+-]/}
    fi
    echo "${value:-?}"
}

# IMDSv2: a session token first (required when the instance enforces IMDSv2).
request PUT /latest/api/token -H "X-aws-ec2-metadata-token-ttl-seconds: 60"
if [[ "$code" != 200 || -z "$body" ]]; then
    fail "$who: the metadata service at $url refused a session token (HTTP $code)"
fi
token=$body

request GET /latest/meta-data/spot/instance-action -H "X-aws-ec2-metadata-token: $token"
case $code in
    200) echo "draining  # spot interruption notice: $(field action) at $(field time)"; exit 0 ;;
    404) ;;  # no interruption scheduled
    *) fail "$who: unexpected HTTP $code from $url/latest/meta-data/spot/instance-action" ;;
esac

if [[ "$rebalance" == drain ]]; then
    request GET /latest/meta-data/events/recommendations/rebalance -H "X-aws-ec2-metadata-token: $token"
    case $code in
        200) echo "draining  # rebalance recommendation since $(field noticeTime)" ;;
        404) ;;  # no recommendation
        *) fail "$who: unexpected HTTP $code from $url/latest/meta-data/events/recommendations/rebalance" ;;
    esac
fi
