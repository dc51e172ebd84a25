#!/usr/bin/env bash
# Discovery recipe: hosts from a file you edit while the job runs.
#
#   HOSTS_FILE=/shared/hosts.txt elasticrun -np 2 --min-np 1 \
#       --host-discovery-script examples/discovery/static_file.sh python train.py
#
# The file holds one `host` or `host:slots` per line; `#` comments and blank lines are
# ignored. Add a line and the host joins at the next commit; remove it and its workers leave
# gracefully at the next commit. Write `host:slots draining` to move the training off a host
# that is still up (maintenance ahead): nothing new starts there until you remove the word. A missing or unreadable file is a failed run (exit 1, reason
# on stderr): elasticrun keeps the last hosts, or refuses to start on its first run.
# Contract: docs/discovery.md.
set -euo pipefail

hosts_file=${HOSTS_FILE:-./hosts.txt}
if [[ ! -e "$hosts_file" ]]; then
    echo "static_file.sh: host file '$hosts_file' not found (cwd: $PWD); create it or set HOSTS_FILE" >&2
    exit 1
fi
if [[ ! -r "$hosts_file" ]]; then
    echo "static_file.sh: host file '$hosts_file' is not readable" >&2
    exit 1
fi
# Drop comments, trim whitespace, skip blank lines. elasticrun validates each line itself.
sed -e 's/#.*//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$hosts_file"
