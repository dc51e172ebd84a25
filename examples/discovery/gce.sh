#!/usr/bin/env bash
# Discovery recipe: running Compute Engine VMs with a given label (internal IPs), and which of
# them are being preempted or will be stopped for host maintenance.
#
#   LABEL=role=trainer SLOTS=8 elasticrun -np 16 --min-np 8 --discovery-interval 2 \
#       --discovery-timeout 20 --host-discovery-script examples/discovery/gce.sh python train.py
#
# Lists VMs with status RUNNING and label $LABEL (KEY=VALUE, required), in $ZONES (comma
# separated; default: all zones) of $PROJECT (default: gcloud's), one `INTERNAL_IP:$SLOTS`
# per line, from `gcloud compute instances list`.
#
# Notices: Compute Engine tells a VM that it is being preempted (about 30 s ahead) or that a
# host maintenance will stop it (ahead of the event; VMs with GPUs cannot live-migrate) only
# in the VM's own metadata server. So for every VM listed, this script runs gce_notice.sh
# (next to it) over SSH, with the same keys elasticrun uses to start workers there,
# $NOTICE_PARALLEL (default 16) hosts at a time, and prints `INTERNAL_IP:$SLOTS draining  # why`
# for a VM with a notice: its workers leave gracefully at the next step and nothing new starts
# there. MAINTENANCE=ignore reacts to preemption only. A VM whose notices cannot be read (SSH
# refused, no answer within $NOTICE_TIMEOUT, default 5 s) is listed as usable, with a warning
# on stderr. NOTICES=0 skips the SSH calls (then a preempted VM just drops out of the list).
# Settings of the SSH calls: see gce_notice.sh (ELASTICRUN_SSH_*, SSH_ARGS, SSH).
#
# A preemption gives 30 s: keep --discovery-interval short (1 or 2 s) and the training steps
# a few seconds, so that the workers leave in time. gcloud takes a second or more per call:
# set --discovery-timeout above $GCLOUD_TIMEOUT (default 8 s, applied with `timeout` when
# available) plus $NOTICE_TIMEOUT. Contract: docs/discovery.md.
set -euo pipefail
me=gce.sh
gcloud=${GCLOUD:-gcloud}   # or the tool's full path

if ! command -v "$gcloud" >/dev/null 2>&1; then
    echo "$me: gcloud not found (\"$gcloud\" is not on PATH; set GCLOUD to its path or install the Google Cloud CLI)" >&2
    exit 1
fi
if ! [[ "${LABEL:-}" =~ ^[a-z][a-z0-9_-]*=[a-z0-9_-]+$ ]]; then
    echo "$me: set LABEL to KEY=VALUE of the training VMs' label (lowercase), e.g. LABEL=role=trainer" >&2
    exit 1
fi
slots=${SLOTS:-1}
if ! [[ "$slots" =~ ^[1-9][0-9]*$ ]]; then
    echo "$me: SLOTS='$slots' is not a positive whole number" >&2
    exit 1
fi
notices=${NOTICES:-1}
notice=${NOTICE_SCRIPT:-$(dirname -- "${BASH_SOURCE[0]}")/gce_notice.sh}
parallel=${NOTICE_PARALLEL:-16}
if [[ "$notices" != 0 ]]; then
    if ! command -v "${SSH:-ssh}" >/dev/null 2>&1; then
        echo "$me: ssh not found (\"${SSH:-ssh}\" is not on PATH; set SSH to its path, or NOTICES=0 to list VMs without their notices)" >&2
        exit 1
    fi
    if [[ ! -x "$notice" ]]; then
        echo "$me: $notice is not an executable file (keep gce_notice.sh next to $me, set NOTICE_SCRIPT, or NOTICES=0)" >&2
        exit 1
    fi
    if ! [[ "$parallel" =~ ^[1-9][0-9]*$ ]]; then
        echo "$me: NOTICE_PARALLEL='$parallel' is not a positive whole number" >&2
        exit 1
    fi
fi
limit=()
if timeout --foreground 1 true >/dev/null 2>&1; then
    # --foreground keeps gcloud in this script's process group, which a discovery timeout kills.
    limit=(timeout --foreground "${GCLOUD_TIMEOUT:-8}")
elif command -v timeout >/dev/null 2>&1; then
    limit=(timeout "${GCLOUD_TIMEOUT:-8}")
fi
args=(compute instances list --filter="labels.${LABEL%%=*}=${LABEL#*=} AND status=RUNNING"
      --format='value(networkInterfaces[0].networkIP)')
if [[ -n "${ZONES:-}" ]]; then
    args+=(--zones="$ZONES")
fi
if [[ -n "${PROJECT:-}" ]]; then
    args+=(--project="$PROJECT")
fi
if ! out=$("${limit[@]}" "$gcloud" "${args[@]}"); then
    echo "$me: gcloud compute instances list failed or timed out (see above)" >&2
    exit 1
fi
ips=$(awk 'NF { print $1 }' <<<"$out")
if [[ -z "$ips" ]]; then
    exit 0
fi
if [[ "$notices" == 0 ]]; then
    awk -v slots="$slots" '{ print $1 ":" slots }' <<<"$ips"
    exit 0
fi

# Ask every VM in parallel; each answer becomes one line "N IP [draining  # why | unknown]"
# (unquoted $answer: a stray line break cannot start a line of its own), put back in the
# listed order by N.
ask='set -f; if answer=$("$0" "$2"); then echo "$1 $2" $answer; else echo "$1 $2 unknown"; fi'
while read -r _ ip word why; do
    case $word in
        draining) why=${why#"#"}; echo "$ip:$slots draining  # ${why# }" ;;
        unknown) echo "$me: $ip: notices unknown (see above); listed as usable" >&2
                 echo "$ip:$slots" ;;
        *) echo "$ip:$slots" ;;
    esac
done < <(awk '{ print NR, $1 }' <<<"$ips" | xargs -n 2 -P "$parallel" bash -c "$ask" "$notice" | sort -n -k1,1)
