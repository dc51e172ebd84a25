#!/usr/bin/env bash
# Discovery script for tests: the host list depends on training progress.
# HOSTS_SCHEDULE="0:localhost:1,127.0.0.1:1;2:localhost:1,127.0.0.1:1,127.0.0.2:1;4:localhost:1"
# means: from epoch 0 list the first set, from epoch 2 the second, from epoch 4 the third.
epoch=$(cat "$PROGRESS_FILE" 2>/dev/null || echo 0)
current=""
IFS=';' read -ra stages <<< "$HOSTS_SCHEDULE"
for stage in "${stages[@]}"; do
  from=${stage%%:*}
  hosts=${stage#*:}
  if [ "$epoch" -ge "$from" ]; then current=$hosts; fi
done
tr ',' '\n' <<< "$current"
