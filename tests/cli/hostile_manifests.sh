#!/usr/bin/env bash
# The manifest cases of a hostile-input campaign, kept as a corpus: `loom validate` on each
# must end with exit 0 (valid) or 1 (refused with a message on stderr) within a few
# seconds, never a signal (SIGFPE, SIGSEGV, SIGBUS, abort), a hang, or a bare library
# message. Cases marked "refuse" must be refused. Usage: hostile_manifests.sh LOOM
set -uo pipefail
loom=$1
here=$(cd "$(dirname "$0")" && pwd)
base=$here/tiny.toml
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# check EXPECT MANIFEST ARGS...: EXPECT is "refuse" (exit 1) or "any" (0 or 1).
check() {
  local expect=$1 manifest=$2; shift 2
  timeout 20 "$loom" validate "$manifest" "$@" > "$work/out" 2>&1
  local rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 1 ]; then
    fail "validate $manifest $*: exit $rc ($(tail -2 "$work/out" | tr '\n' ' '))"
  elif [ "$expect" = refuse ] && [ $rc -ne 1 ]; then
    fail "validate $manifest $*: accepted, expected a refusal"
  elif [ $rc -eq 1 ] && grep -qE "std::|basic_filebuf|bad_alloc|Bad file descriptor" "$work/out"; then
    fail "validate $manifest $*: a library's message instead of loom's: $(tail -1 "$work/out")"
  elif [ $rc -eq 1 ] && grep -q " is valid" "$work/out"; then
    fail "validate $manifest $*: refused after saying the manifest is valid"
  fi
}

# Sizes whose products used to wrap around int64 (SIGFPE), and their neighbours.
for kv in run.seed=18446744073709551615 parallel.dp=2305843009213693952 parallel.pp=4611686018427387904 parallel.cp=9223372036854775807 \
          parallel.tp=-1 parallel.vpp=9223372036854775807 batch.micro_batch_size=4611686018427387904 \
          batch.global_batch_size=0 model.hidden_size=4611686018427387904 model.num_layers=4611686018427387904 \
          model.seq_length=0 model.seq_length=4611686018427387904 model.vocab_size=2147483648 \
          model.num_heads=0 run.steps=-1 model.vocab_divisor=4611686018427387904; do
  check refuse "$base" --set "$kv"
done
check refuse "$base" --set parallel.pp=4611686018427387904 --set parallel.vpp=4
check refuse "$base" --set model.vocab_divisor=2305843009213693952 --set parallel.tp=4 --set parallel.dp=1
# Integer keys the engine holds in 32 bits: a value past 2^32 must not wrap to a small one.
for kv in pipeline.first_chunk_layers=4294967296 pipeline.last_chunk_layers=4294967298 \
          pipeline.microbatch_group_size=4294967298 device.threads=4294967296; do
  check refuse "$base" --set parallel.pp=2 --set "$kv"
done
check refuse "$base" --set parallel.dp=1024 --set parallel.tp=1024 --set parallel.pp=2
# Non-finite numbers and nonsense settings.
# Floats the math takes as 32-bit floats, in range as doubles and out of it as floats
# (NaN at step 2), and learning-rate schedules that are none (Megatron asserts them).
for kv in optimizer.beta2=0.99999999999 optimizer.beta1=0.99999999999 optimizer.eps=1e-300 optimizer.lr=1e308 \
          optimizer.min_lr=0.01 'optimizer.decay_steps=3 --set optimizer.warmup_steps=3' optimizer.decay_style=wsd \
          'optimizer.decay_style=wsd --set optimizer.wsd_decay_steps=1000'; do
  # shellcheck disable=SC2086
  check refuse "$base" --set $kv
done
for kv in optimizer.eps=inf optimizer.lr=nan optimizer.lr=-inf model.layer.attention.dropout=inf \
          model.seq_length=1 'data.task="mul"' model.recompute_num_layers=99; do
  check refuse "$base" --set "$kv"
done
# What validate used to pass and run refuse: an empty first or last layer list, a group
# size the interleaved schedule refuses.
check refuse "$base" --set 'model.pre=[]'
check refuse "$base" --set 'model.post=[]'
# Layers out of their place (ABI 1.9 LOOM_LAYER_READS_TOKENS / WRITES_LOSS): used to train
# nonsense with exit 0, or to fail inside the first step.
for kv in 'model.block=["embedding"]' 'model.block=["lm_head"]' 'model.pre=["lm_head"]' 'model.post=["embedding"]' \
          'model.pre=["attention"]' 'model.post=["mlp"]'; do
  check refuse "$base" --set "$kv"
done
check refuse "$base" --set parallel.pp=2 --set parallel.vpp=2 --set 'pipeline.schedule="interleaved"' \
  --set pipeline.microbatch_group_size=3 --set model.num_layers=4 --set batch.global_batch_size=8 \
  --set batch.micro_batch_size=1 --set parallel.dp=2
# Plugin options outside the range or choices their plugin declares, and the checks a
# plugin makes when created (top_k above num_experts), on CPU and CUDA manifests alike.
moe=(--set 'model.block=["attention", "moe"]' --set model.layer.moe.num_experts=4)
for kv in model.layer.moe.top_k=0 model.layer.moe.top_k=-9223372036854775808 model.layer.moe.top_k=5 \
          model.layer.moe.num_experts=0 model.layer.moe.aux_loss_coeff=nan 'model.layer.moe.drop_policy=""' \
          model.layer.moe.z_loss_coeff=-1 model.layer.moe.capacity_factor=-0.5 model.layer.moe.dropout=1 \
          'device.options.simd="avx3"' device.options.threads=-1; do
  check refuse "$base" "${moe[@]}" --set "$kv"
done
check refuse "$base" --set model.layer.mlp.activation_dropout=1.5
check refuse "$base" --set 'device.kind="cuda"' --set model.layer.attention.dropout=2
check refuse "$base" --set 'device.kind="cuda"' --set device.options.workspace_mb=-1
check refuse "$base" --set 'exec.mode="partial_graph"' --set exec.options.warmup_steps=0
check any "$base" "${moe[@]}" --set model.layer.moe.top_k=4 --set model.layer.moe.dropout=0.5
# What run used to refuse after launch: a vocabulary below the data's, ep on a dense model,
# data too short for a sequence or without a validation split when evaluation needs one.
printf 'abcdefghij' > "$work/short.txt"
check refuse "$base" --set model.vocab_size=5
check refuse "$base" --set parallel.ep=2
check refuse "$base" --set data.kind=text --set "data.path=\"$work/short.txt\""
check refuse "$base" --set data.kind=text --set "data.path=\"$here/tiny.toml\"" --set data.val_fraction=0 \
  --set run.eval_every=10
# Blocks without layers leave a pipeline stage with nothing to run (it crashed in run).
check any "$base" --set 'model.block=[]'
for vpp in 1 2; do
  timeout 20 "$loom" validate "$base" --set 'model.block=[]' --set model.num_layers=4 --set parallel.pp=2 \
    --set parallel.dp=1 --set parallel.vpp=$vpp > "$work/out" 2>&1
  [ $? -eq 1 ] && grep -q "holds no layer" "$work/out" || fail "an empty pipeline chunk at vpp $vpp: $(cat "$work/out")"
done
# Microbatches past what a schedule is built with are refused at once (they took
# gigabytes and minutes, or the OOM killer).
check refuse "$base" --set parallel.dp=1 --set batch.micro_batch_size=1 --set batch.global_batch_size=268435456
# A microbatch of 2^27 tokens is planned from its shapes: validate and plan stay small
# and say what it needs (planning built the embedding's position ids, 8 bytes a token:
# 17 GB here). Under 3 GB of address space, but not under AddressSanitizer, whose
# shadow memory alone reserves terabytes of it.
limit=3000000
[ -n "${ASAN_OPTIONS:-}" ] && limit=unlimited
for cmd in validate plan; do
  ( ulimit -v $limit && exec timeout 20 "$loom" $cmd "$base" --set parallel.dp=1 --set batch.micro_batch_size=134217728 \
      --set batch.global_batch_size=134217728 ) > "$work/out" 2>&1
  rc=$?
  [ $rc -eq 0 ] && grep -q "the plan needs" "$work/out" || fail "$cmd of a 2^27-token microbatch: exit $rc: $(tail -2 "$work/out")"
done
# An indexed dataset whose files are FIFOs is refused, not waited on forever.
mkfifo "$work/ff.idx" "$work/ff.bin"
check refuse "$base" --set 'data.kind="indexed"' --set "data.path=\"$work/ff\""
grep -q "(a FIFO)" "$work/out" || fail "an indexed dataset of FIFOs: $(tail -1 "$work/out")"
# Overrides that are not key paths or values.
for kv in '=3' 'parallel..tp=2' 'extends="x.toml"' 'parallel=5' 'run.steps=[1, 2' 'a.b.c.d.e=1'; do
  check refuse "$base" --set "$kv"
done
check any "$base" --set 'parallel={tp=1}'
check any "$base" --set 'device.options={}'
# Dotted keys of tens of thousands of parts (the TOML parser recursed a frame a part: SIGSEGV).
deep=$(printf 'a.%.0s' $(seq 1 50000))
printf '[%sa]\n' "$deep" > "$work/deep.toml"
check refuse "$work/deep.toml"
check refuse "$base" --set "model.layer.x.${deep}a=1"
check any "$base" --set "run.name=wait${deep}"   # a bare word with dots is a string, not a key
printf 'x = {%sa = 1}\n' "$deep" > "$work/deep_inline.toml"
check refuse "$work/deep_inline.toml"
# Paths that are not manifests.
check refuse "$work"
check refuse /dev/zero
check refuse /nonexistent/manifest.toml
echo 'extends = "/dev/zero"' > "$work/ext.toml"
check refuse "$work/ext.toml"
echo 'extends = "ext2.toml"' > "$work/ext2.toml"
check refuse "$work/ext2.toml"
printf '[run\nsteps = 3\n' > "$work/broken.toml"
check refuse "$work/broken.toml"
head -c 3000 /dev/urandom > "$work/random.toml"
check refuse "$work/random.toml"

[ $failures -eq 0 ] && echo "hostile manifests: every case ended with a message" || exit 1
