#!/usr/bin/env bash
# How close `loom plan --perf` comes: for each layout, the estimated step time beside
# the measured one (`loom plan --perf --check`, which runs the manifest for a few
# steps and writes nothing), with comm/local's link model making communication cost
# what a cluster's network would. Two models: the quickstart and a GPT-2-shaped model
# small enough for a CPU (hidden 256, 4 layers, 128 tokens) on the shared corpus.
#
# usage: scripts/bench-perf.sh [LOOM] [--set k=v]...
#   LOOM defaults to build/bin/loom; LINKS (env) overrides the modelled network;
#   STEPS (env) the measured steps per layout (default 12, the first 2 warm up).
set -euo pipefail
cd "$(dirname "$0")/.."
loom=build/bin/loom
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then loom=$1; shift; fi
[ -x "$loom" ] || { echo "bench-perf: $loom not found (build first: cmake --build build)" >&2; exit 2; }
links=${LINKS:-"dp=0.2GB/s,50us; dp-cp=0.2GB/s,50us; pp=1GB/s,20us; tp=5GB/s,10us; cp=5GB/s,10us; *=10GB/s,5us"}
steps=${STEPS:-12}

corpus=../shared/data/tinyshakespeare.txt
data=(--set data.kind=\"synthetic\")
if [ -f "$corpus" ]; then data=(--set data.kind=\"text\" --set "data.path=\"$(realpath "$corpus")\""); fi
gpt=(--set model.hidden_size=256 --set model.num_heads=8 --set model.num_layers=4 --set model.seq_length=128
     --set batch.micro_batch_size=4 --set batch.global_batch_size=16 --set optimizer.bucket_size=200000 "${data[@]}")

echo "links: $links; $steps steps measured per layout (2 warm up); $(nproc) cores"
printf '| %-10s | %-36s | %11s | %11s | %6s |\n' "model" "layout" "estimate ms" "measured ms" "ratio"
printf '|%s|%s|%s|%s|%s|\n' "------------" "--------------------------------------" "-------------" "-------------" "--------"
row() {  # row MODEL NAME ARGS...
  local model=$1 name=$2
  shift 2
  local extra=()
  [ "$model" = "gpt-small" ] && extra=("${gpt[@]}")
  "$loom" plan configs/quickstart.toml "${extra[@]}" --set "comm.options.links=\"$links\"" "$@" \
    --perf --check "$steps" --json | python3 -c '
import json, sys
t = json.loads(sys.stdin.read())
e, m = t["step_ms"], t["measured_step_ms"]
print(f"| {sys.argv[1]:<10} | {sys.argv[2]:<36} | {e:11.2f} | {m:11.2f} | {e / m:6.2f} |")
with open(sys.argv[3], "a") as f:
    f.write(f"{e / m}\n")' "$model" "$name" "$ratios"
}
ratios=$(mktemp)
trap 'rm -f "$ratios"' EXIT
for model in quickstart gpt-small; do
  row "$model" "dp 1" --set parallel.dp=1
  row "$model" "dp 2, ddp" --set parallel.dp=2
  row "$model" "dp 2, ddp, overlap_grad_reduce" --set parallel.dp=2 --set optimizer.overlap_grad_reduce=true
  row "$model" "dp 2, distributed, both overlaps" --set parallel.dp=2 --set optimizer.strategy=\"distributed\" \
    --set optimizer.overlap_grad_reduce=true --set optimizer.overlap_param_gather=true
  row "$model" "dp 4, ddp" --set parallel.dp=4
  row "$model" "tp 2" --set parallel.dp=1 --set parallel.tp=2
  row "$model" "tp 2 + SP" --set parallel.dp=1 --set parallel.tp=2 --set parallel.sequence_parallel=true
  row "$model" "cp 2" --set parallel.dp=1 --set parallel.cp=2
  row "$model" "pp 2" --set parallel.dp=1 --set parallel.pp=2
  row "$model" "pp 4" --set parallel.dp=1 --set parallel.pp=4
  row "$model" "pp 2 x dp 2" --set parallel.dp=2 --set parallel.pp=2
  row "$model" "tp 2 x pp 2" --set parallel.dp=1 --set parallel.tp=2 --set parallel.pp=2
done
python3 - "$ratios" <<'PY'
import sys
r = [float(l) for l in open(sys.argv[1]) if l.strip()]
within = sum(1 for x in r if abs(x - 1) <= 0.2)
print(f"estimate / measured: {min(r):.2f} to {max(r):.2f}; {within} of {len(r)} layouts within 20%")
PY
