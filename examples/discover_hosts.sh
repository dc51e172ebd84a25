#!/usr/bin/env bash
# Host discovery script for elasticrun (and horovodrun --host-discovery-script).
#
# THE CONTRACT
#   * elasticrun runs this script every --discovery-interval seconds (default 1) and kills it
#     (and anything it started) if it takes longer than --discovery-timeout (default 10).
#   * On success it exits 0 and prints the hosts that are usable *right now* on stdout,
#     one per line, as `host:slots` (or just `host`, which means --slots-per-host slots).
#     Blank lines and `#` comments are ignored.
#   * A non-zero exit means "discovery failed": elasticrun keeps the last known host list
#     (if the very first run fails, the job does not start). Write diagnostics to stderr.
#   * A host that appears is added to the job at the next commit (if --max-np allows);
#     a host that disappears has its workers stopped gracefully at the next commit.
#
# In real life this script asks your cluster: e.g. `kubectl get pods -l app=train -o name`,
# `aws ec2 describe-instances ...`, or a file a scheduler writes. Keep it fast and let it
# print only hosts that are ready to start a worker.
#
# THIS DEMO VERSION needs no cluster: names that resolve to this machine (localhost,
# 127.0.0.1, 127.0.0.2, ...) are distinct hosts to elasticrun, all launched locally.
# The host list changes with the time since the first run of this script:
#
#   from 0 s                  localhost:1  127.0.0.1:1
#   from DEMO_ADD_AFTER s     localhost:1  127.0.0.1:1  127.0.0.2:1     (a host is added)
#   from DEMO_REMOVE_AFTER s  localhost:1               127.0.0.2:1     (a host is removed)
#
# Settings (environment variables, inherited from whoever starts elasticrun):
#   DEMO_STATE_DIR     where the start stamp lives (default $XDG_RUNTIME_DIR/elasticrun-demo-$USER,
#                      or under /tmp without it); a private directory of yours (0700), made if
#                      missing; delete its `started` file to start the schedule over
#   DEMO_ADD_AFTER     seconds until 127.0.0.2 is added   (default 12)
#   DEMO_REMOVE_AFTER  seconds until 127.0.0.1 is removed (default 24)
set -euo pipefail

state_dir=${DEMO_STATE_DIR:-${XDG_RUNTIME_DIR:-/tmp}/elasticrun-demo-${USER:-$(id -un)}}
add_after=${DEMO_ADD_AFTER:-12}
remove_after=${DEMO_REMOVE_AFTER:-24}

# Only a private directory of yours: one that someone else made at that (guessable) name in
# /tmp could hold their links, and writing the stamp would then overwrite a file of yours.
[[ -e "$state_dir" || -L "$state_dir" ]] || mkdir -m 700 "$state_dir" 2>/dev/null || true
if [[ -L "$state_dir" || ! -d "$state_dir" || ! -O "$state_dir" ]] ||
        [[ -n "$(find "$state_dir" -maxdepth 0 -perm /022 2>/dev/null)" ]]; then
    echo "discover_hosts.sh: $state_dir is not a private directory of yours (someone else's, a link, or" \
         "writable by others); set DEMO_STATE_DIR to one" >&2
    exit 1
fi

# The first run records when the demo started; later runs measure the time since then.
stamp="$state_dir/started"
if [[ ! -s "$stamp" ]]; then
    # Write then rename, so a concurrent run never reads a half-written stamp.
    fresh=$(mktemp "$state_dir/started.XXXXXX")
    date +%s.%N > "$fresh"
    mv -f "$fresh" "$stamp"
fi
elapsed=$(awk -v start="$(cat "$stamp")" -v now="$(date +%s.%N)" 'BEGIN { printf "%.1f", now - start }')

# Is `elapsed` at least $1 seconds? (awk, because bash only compares whole numbers)
after() { awk -v e="$elapsed" -v t="$1" 'BEGIN { exit !(e >= t) }'; }

echo "# $elapsed s since $stamp was written"
echo "localhost:1"
if ! after "$remove_after"; then
    echo "127.0.0.1:1"
fi
if after "$add_after"; then
    echo "127.0.0.2:1"
fi
