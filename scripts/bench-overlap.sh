#!/usr/bin/env bash
# Step time with and without overlapping communication with computation: the
# data-parallel gradient reduction with the backward (optimizer.overlap_grad_reduce;
# with the distributed optimizer also its parameter all-gather with the next forward,
# optimizer.overlap_param_gather) and pipeline transfers with the step before
# (pipeline.overlap_p2p_comm: receives posted early), on one machine: ranks are threads
# (comm/local) and comm.options.links makes every collective and transfer take the
# time a given network would (alpha-beta ring model), so the table shows what the
# overlap hides on a cluster. One row per layout: ddp and the distributed optimizer at
# dp 2 and 4, and pipelines (pp 2 x dp 2; pp 2 and pp 4 alone: transfers only).
# Medians of the steps after the first; losses must be identical with and without.
#
# usage: scripts/bench-overlap.sh [LOOM] [--set k=v]...
#   LOOM defaults to build/bin/loom; LINKS (env) overrides the modelled network;
#   STEPS (env) the steps per run (default 8).
set -euo pipefail
cd "$(dirname "$0")/.."
loom=build/bin/loom
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then loom=$1; shift; fi
[ -x "$loom" ] || { echo "bench-overlap: $loom not found (build first: cmake --build build)" >&2; exit 2; }
links=${LINKS:-"dp=0.5GB/s,20us; pp=0.05GB/s,20us; *=100GB/s,2us"}
steps=${STEPS:-8}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# A GPT-2-shaped model small enough for a CPU (hidden 256, 4 layers, 128 tokens)
# on the bytes of the shared corpus, or the quickstart's synthetic task without it.
corpus=../shared/data/tinyshakespeare.txt
data=(--set data.kind=\"synthetic\")
if [ -f "$corpus" ]; then data=(--set data.kind=\"text\" --set "data.path=\"$(realpath "$corpus")\""); fi
common=(--set run.steps="$steps" --set run.eval_every=0 --set run.log_every=1000 --set model.hidden_size=256
        --set model.num_heads=8 --set model.num_layers=4 --set model.seq_length=128 --set batch.micro_batch_size=4
        --set optimizer.bucket_size=200000 --set "comm.options.links=\"$links\"" "${data[@]}" "$@")

median_ms() {  # median of the "ms" field over steps 2..N of a metrics file
  python3 - "$1" <<'PY'
import json, sys
ms = [json.loads(l)["ms"] for l in open(sys.argv[1]) if l.strip()][1:]
ms.sort()
print(f"{ms[len(ms) // 2]:.1f}" if ms else "nan")
PY
}
losses() { python3 -c 'import json,sys; print([json.loads(l)["loss"] for l in open(sys.argv[1]) if l.strip()])' "$1"; }

echo "links: $links; $steps steps per run; $(nproc) cores"
printf '| %-40s | %13s | %13s | %7s | %s |\n' "layout" "in line ms" "overlapped ms" "saved" "losses"
printf '|%s|%s|%s|%s|%s|\n' "------------------------------------------" "---------------" "---------------" "---------" "--------"
row() {  # row NAME ARGS...
  local name=$1
  shift
  "$loom" run configs/quickstart.toml "${common[@]}" "$@" --set pipeline.overlap_p2p_comm=false \
    --metrics "$work/a.jsonl" >/dev/null
  local overlap=(--set optimizer.overlap_grad_reduce=true --set pipeline.overlap_p2p_comm=true)
  case "$*" in *distributed*) overlap+=(--set optimizer.overlap_param_gather=true) ;; esac
  "$loom" run configs/quickstart.toml "${common[@]}" "$@" "${overlap[@]}" --metrics "$work/b.jsonl" >/dev/null
  local a b same
  a=$(median_ms "$work/a.jsonl")
  b=$(median_ms "$work/b.jsonl")
  same=$([ "$(losses "$work/a.jsonl")" = "$(losses "$work/b.jsonl")" ] && echo identical || echo DIFFER)
  printf '| %-40s | %13s | %13s | %6.1f%% | %s |\n' "$name" "$a" "$b" "$(python3 -c "print(100 * (1 - $b / $a))")" "$same"
}
row "dp 2, ddp" --set parallel.dp=2 --set batch.global_batch_size=8
row "dp 2, distributed optimizer" --set parallel.dp=2 --set batch.global_batch_size=8 --set optimizer.strategy=\"distributed\"
row "dp 4, ddp" --set parallel.dp=4 --set batch.global_batch_size=16
row "dp 4, distributed optimizer" --set parallel.dp=4 --set batch.global_batch_size=16 --set optimizer.strategy=\"distributed\"
row "pp 2 x dp 2, ddp (1F1B, 4 microbatches)" --set parallel.pp=2 --set parallel.dp=2 --set batch.global_batch_size=32
row "pp 2, ddp (transfers only)" --set parallel.pp=2 --set parallel.dp=1 --set batch.global_batch_size=16
row "pp 4, ddp (transfers only)" --set parallel.pp=4 --set parallel.dp=1 --set batch.global_batch_size=16
