#!/usr/bin/env bash
# Discovery recipe: running EC2 spot instances with a given tag (private IPs), and which of
# them EC2 is about to take back.
#
#   TAG=Name=trainer SLOTS=8 elasticrun -np 16 --min-np 8 --discovery-interval 10 \
#       --discovery-timeout 20 --host-discovery-script examples/discovery/aws_spot.sh python train.py
#
# Lists instances that are `running`, are spot instances and carry tag $TAG (KEY=VALUE,
# required), in $AWS_REGION / the CLI's default region, one `PRIVATE_IP:$SLOTS` per line.
#
# Notices: EC2 announces a spot interruption (about 2 minutes ahead) and a rebalance
# recommendation (often earlier) only in each instance's own metadata service. So for every
# instance listed, this script runs aws_spot_notice.sh (next to it) over SSH, with the same
# keys elasticrun uses to start workers there, $NOTICE_PARALLEL (default 16) hosts at a time,
# and prints `PRIVATE_IP:$SLOTS draining  # why` for an instance with a notice: its workers
# leave gracefully at the next step and nothing new starts there. REBALANCE=ignore reacts to
# interruption notices only. An instance whose notices cannot be read (SSH refused, no
# answer within $NOTICE_TIMEOUT, default 5 s) is listed as usable, with a warning on stderr.
# NOTICES=0 skips the SSH calls (then a reclaimed instance just drops out of the list).
# Settings of the SSH calls: see aws_spot_notice.sh (ELASTICRUN_SSH_*, SSH_ARGS, SSH).
#
# The AWS API is slow and rate-limited: use --discovery-interval 10 or more and a
# --discovery-timeout above $AWS_TIMEOUT (default 8 s, applied with `timeout` when available)
# plus $NOTICE_TIMEOUT. Contract: docs/discovery.md.
set -euo pipefail
me=aws_spot.sh
aws=${AWS:-aws}   # or the tool's full path

if ! command -v "$aws" >/dev/null 2>&1; then
    echo "$me: aws not found (\"$aws\" is not on PATH; set AWS to its path or install awscli v2)" >&2
    exit 1
fi
if [[ "${TAG:-}" != ?*=* ]]; then
    echo "$me: set TAG to KEY=VALUE of the training instances' tag, e.g. TAG=Name=trainer" >&2
    exit 1
fi
slots=${SLOTS:-1}
if ! [[ "$slots" =~ ^[1-9][0-9]*$ ]]; then
    echo "$me: SLOTS='$slots' is not a positive whole number" >&2
    exit 1
fi
notices=${NOTICES:-1}
notice=${NOTICE_SCRIPT:-$(dirname -- "${BASH_SOURCE[0]}")/aws_spot_notice.sh}
parallel=${NOTICE_PARALLEL:-16}
if [[ "$notices" != 0 ]]; then
    if ! command -v "${SSH:-ssh}" >/dev/null 2>&1; then
        echo "$me: ssh not found (\"${SSH:-ssh}\" is not on PATH; set SSH to its path, or NOTICES=0 to list instances without their spot notices)" >&2
        exit 1
    fi
    if [[ ! -x "$notice" ]]; then
        echo "$me: $notice is not an executable file (keep aws_spot_notice.sh next to $me, set NOTICE_SCRIPT, or NOTICES=0)" >&2
        exit 1
    fi
    if ! [[ "$parallel" =~ ^[1-9][0-9]*$ ]]; then
        echo "$me: NOTICE_PARALLEL='$parallel' is not a positive whole number" >&2
        exit 1
    fi
fi
limit=()
if timeout --foreground 1 true >/dev/null 2>&1; then
    # --foreground keeps aws in this script's process group, which a discovery timeout kills.
    limit=(timeout --foreground "${AWS_TIMEOUT:-8}")
elif command -v timeout >/dev/null 2>&1; then
    limit=(timeout "${AWS_TIMEOUT:-8}")
fi
if ! out=$("${limit[@]}" "$aws" ec2 describe-instances \
        --filters "Name=tag:${TAG%%=*},Values=${TAG#*=}" \
                  "Name=instance-state-name,Values=running" \
                  "Name=instance-lifecycle,Values=spot" \
        --query 'Reservations[].Instances[].PrivateIpAddress' --output text); then
    echo "$me: aws ec2 describe-instances failed or timed out (see above)" >&2
    exit 1
fi
# --output text separates the addresses with tabs; "None" means an instance without one.
ips=$(tr -s '\t ' '\n\n' <<<"$out" | awk 'NF && $1 != "None" { print $1 }')
if [[ -z "$ips" ]]; then
    exit 0
fi
if [[ "$notices" == 0 ]]; then
    awk -v slots="$slots" '{ print $1 ":" slots }' <<<"$ips"
    exit 0
fi

# Ask every instance in parallel; each answer becomes one line "N IP [draining  # why | unknown]"
# (unquoted $answer: a stray line break cannot start a line of its own), put back in the
# listed order by N.
ask='set -f; if answer=$("$0" "$2"); then echo "$1 $2" $answer; else echo "$1 $2 unknown"; fi'
while read -r _ ip word why; do
    case $word in
        draining) why=${why#"#"}; echo "$ip:$slots draining  # ${why# }" ;;
        unknown) echo "$me: $ip: spot notices unknown (see above); listed as usable" >&2
                 echo "$ip:$slots" ;;
        *) echo "$ip:$slots" ;;
    esac
done < <(awk '{ print NR, $1 }' <<<"$ips" | xargs -n 2 -P "$parallel" bash -c "$ask" "$notice" | sort -n -k1,1)
