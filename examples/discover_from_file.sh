#!/usr/bin/env bash
# Host discovery from a file you edit while the job runs.
#
# elasticrun runs this every --discovery-interval seconds; it prints the hosts listed in
# $HOSTS_FILE (default ./hosts.txt, relative to where elasticrun was started), one
# `host:slots` (or `host`) per line. Add a line and the host joins at the next commit;
# delete (or comment out) a line and its workers are stopped gracefully.
#
#   cat > hosts.txt <<'HOSTS'
#   localhost:1
#   127.0.0.1:1      # a second "host" on this machine
#   HOSTS
#   HOSTS_FILE=$PWD/hosts.txt elasticrun -np 2 --min-np 1 --max-np 4 \
#       --host-discovery-script examples/discover_from_file.sh python examples/train_digits.py
#
# Comments (`# ...`, whole-line or trailing) and blank lines are ignored. If the file is
# missing the script fails (exit 1, with the reason on stderr): elasticrun then keeps the
# hosts it knew, or refuses to start if this is the first run.
set -euo pipefail

hosts_file=${HOSTS_FILE:-./hosts.txt}

if [[ ! -f "$hosts_file" ]]; then
    echo "discover_from_file.sh: host file '$hosts_file' not found (cwd: $PWD);" \
         "create it or set HOSTS_FILE to its path" >&2
    exit 1
fi
if [[ ! -r "$hosts_file" ]]; then
    echo "discover_from_file.sh: host file '$hosts_file' is not readable" >&2
    exit 1
fi

# Drop comments, trim whitespace, skip blank lines.
sed -e 's/#.*//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$hosts_file"
