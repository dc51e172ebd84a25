#!/usr/bin/env bash
# Everything a lent GPU machine (one GPU, 16 cores) can measure that this project's 2-core
# machines cannot, in one run of 5 to 10 minutes (the parts' limits add up to 590 s), every
# log under OUTDIR (7 files):
#
#   bash benchmarks/gpu_machine.sh OUTDIR
#
# 1. benchmarks/gpu_check.py: every path on CUDA tensors, NCCL, commits, launch (gpu.log, gpu.json,
#    gpu-logs.tgz: every job's whole console);
# 2. on the 16 cores with CUDA hidden: throughput against DDP at 2 and 4 ranks (throughput.log),
#    the recovery sweep to 32 ranks with the kernel's TCP counters around it (sweep.log, tcp.txt),
#    and the driver at 1,024, 2,048 and 4,096 simulated workers (scale.log).
# Each part has its own time limit; one that fails or runs over does not stop the others.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_machine.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

part() {  # part SECONDS LOG COMMAND...: run with a limit, keep its whole output, show its end
  local limit=$1 log=$2
  shift 2
  echo "== $* (limit ${limit} s)"
  timeout "$limit" "$@" >"$out/$log" 2>&1
  echo "   exit $? -> $log"
  tail -n 30 "$out/$log"
}
tcp() { grep -A1 -e '^Tcp:' -e '^TcpExt:' /proc/net/snmp /proc/net/netstat 2>/dev/null; }

work=$(mktemp -d)  # the check's job folders (its temporary files go where TMPDIR says)
TMPDIR=$work part 240 gpu.log "$py" benchmarks/gpu_check.py --json "$out/gpu.json"
tar czf "$out/gpu-logs.tgz" --exclude=ckpt -C "$work" . 2>/dev/null
rm -rf "$work"

export CUDA_VISIBLE_DEVICES=
part 110 throughput.log bash -c "$py benchmarks/throughput.py --np 2 --blocks 20 &&
                                 $py benchmarks/throughput.py --np 4 --blocks 20"
{ echo "before"; tcp; } >"$out/tcp.txt"
part 150 sweep.log "$py" benchmarks/recovery.py --sweep 1,4,8,16 --trials 10 --graceful 0
{ echo "after"; tcp; } >>"$out/tcp.txt"
ulimit -n "$(ulimit -Hn)" 2>/dev/null
# The simulated workers in 4 processes: on 16 cores the simulator is then not one core, and
# 4,096 of them fit any open-file limit of 7,000 or more per process.
part 90 scale.log "$py" benchmarks/driver_scale.py --workers 1024 2048 4096 --modes driver --sim-procs 4 \
  --budget 85 --timeout 40
