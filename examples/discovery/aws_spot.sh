#!/usr/bin/env bash
# Discovery recipe: running EC2 spot instances with a given tag (private IPs).
#
#   TAG=Name=trainer SLOTS=8 elasticrun -np 16 --min-np 8 --discovery-interval 10 \
#       --discovery-timeout 20 --host-discovery-script examples/discovery/aws_spot.sh python train.py
#
# Lists instances that are `running`, are spot instances and carry tag $TAG (KEY=VALUE,
# required), in $AWS_REGION / the CLI's default region, one `PRIVATE_IP:$SLOTS` per line.
# A reclaimed spot instance drops out of the list (its workers are then gone anyway: the job
# rolls back to the last commit); new ones join at the next commit. The AWS API is slow and
# rate-limited: use --discovery-interval 10 or more and a --discovery-timeout above
# $AWS_TIMEOUT (default 8 s, applied with `timeout` when available).
# Contract: docs/discovery.md.
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
limit=()
if command -v timeout >/dev/null 2>&1; then
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
tr -s '\t ' '\n\n' <<<"$out" | awk -v slots="$slots" 'NF && $1 != "None" { print $1 ":" slots }'
