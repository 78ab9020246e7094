#!/usr/bin/env bash
# End-to-end checks of the loom binary: a real SIGTERM mid-run then --resume
# equals an uninterrupted run; a bad manifest is reported with file:line:column
# and exit 1; usage errors exit 2.
set -uo pipefail
loom=$1
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/loom-cli-XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# 1. Uninterrupted reference run.
"$loom" run "$here/tiny.toml" --metrics "$work/ref.jsonl" > "$work/ref.out" 2>&1 || fail "reference run: $(cat "$work/ref.out")"
[ "$(wc -l < "$work/ref.jsonl")" -eq 300 ] || fail "reference run wrote $(wc -l < "$work/ref.jsonl") metric lines, expected 300"

# 2. The same run, stopped by SIGTERM as soon as step 5 is written.
"$loom" run "$here/tiny.toml" --set checkpoint.dir="\"$work/ckpt\"" --metrics "$work/cut.jsonl" > "$work/cut.out" 2>&1 &
pid=$!
for _ in $(seq 1 3000); do
  [ -f "$work/cut.jsonl" ] && [ "$(wc -l < "$work/cut.jsonl")" -ge 5 ] && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.01
done
kill -TERM $pid 2>/dev/null
wait $pid
rc=$?
if [ $rc -eq 0 ]; then
  fail "the run finished before the signal arrived (machine too fast for this test? raise run.steps)"
else
  [ $rc -eq 130 ] || fail "interrupted run exited $rc (expected 130): $(tail -3 "$work/cut.out")"
  grep -q "interrupted: stopped after step" "$work/cut.out" || fail "no interruption message: $(tail -3 "$work/cut.out")"
fi
ls -d "$work"/ckpt/step_* > /dev/null 2>&1 || fail "no checkpoint written on SIGTERM"
ls -a "$work/ckpt" | grep -q '^\.tmp' && fail "a temporary checkpoint directory was left behind"

# 3. Resume to the end; the final loss equals the uninterrupted run's, bit for bit. A
# save that never finished (a step directory without meta.toml, past the real one) is
# skipped, saying which checkpoint the run resumes from.
mkdir -p "$work/ckpt/step_99999999"
"$loom" run "$here/tiny.toml" --set checkpoint.dir="\"$work/ckpt\"" --resume --metrics "$work/cut.jsonl" > "$work/resume.out" 2>&1 \
  || fail "resume: $(tail -3 "$work/resume.out")"
grep -q "resume: skipped .*step_99999999 (no meta.toml: a save that did not finish); resuming from .*step_" \
  "$work/resume.out" || fail "incomplete step directory: $(head -3 "$work/resume.out")"
rmdir "$work/ckpt/step_99999999"
last_ref=$(tail -1 "$work/ref.jsonl" | sed 's/.*"loss": *\([^,]*\),.*/\1/')
last_res=$(tail -1 "$work/cut.jsonl" | sed 's/.*"loss": *\([^,]*\),.*/\1/')
[ "$(tail -1 "$work/cut.jsonl" | sed 's/.*"step": *\([0-9]*\),.*/\1/')" = 300 ] || fail "resumed run did not reach step 300"
[ "$last_ref" = "$last_res" ] || fail "final loss after SIGTERM+resume $last_res != uninterrupted $last_ref"

# 3b. run.exit_interval, one command line for every job (--resume-if-any): each launch
# stops after the next multiple of 120 with exit 0 and says so; the last ends where the
# uninterrupted run does, bit for bit.
for n in 1 2 3; do
  "$loom" run "$here/tiny.toml" --set checkpoint.dir="\"$work/chunks\"" --set run.exit_interval=120 --resume-if-any \
    --metrics "$work/chunks.jsonl" > "$work/chunk$n.out" 2>&1 || fail "exit_interval launch $n: $(tail -3 "$work/chunk$n.out")"
done
grep -q "no checkpoint in .*chunks yet; starting the run" "$work/chunk1.out" || fail "first launch: $(head -3 "$work/chunk1.out")"
grep -q "exit: stopped after step 120 of 300 as run.exit_interval = 120 asks; resume with --resume" "$work/chunk1.out" \
  || fail "no exit message: $(tail -3 "$work/chunk1.out")"
grep -q "exit: stopped after step 240 of 300" "$work/chunk2.out" || fail "second launch: $(tail -3 "$work/chunk2.out")"
grep -q "^exit: " "$work/chunk3.out" && fail "the last launch ends the run: $(tail -3 "$work/chunk3.out")"
[ "$(tail -1 "$work/chunks.jsonl" | sed 's/.*"loss": *\([^,]*\),.*/\1/')" = "$last_ref" ] \
  || fail "exit_interval + resume: final loss differs from the uninterrupted run's"

# 3c. A checkpoint of a run with a batch ramp generates, evaluates and plans (their own
# batches replace the ramp), and its run's log names the ramp's batches.
"$loom" run "$here/tiny.toml" --set checkpoint.dir="\"$work/ramp\"" --set run.steps=20 --set run.log_every=1 \
  --set 'batch.rampup_batch_size=[4, 4, 32]' --set batch.global_batch_size=16 > "$work/ramp.out" 2>&1 \
  || fail "ramped run: $(tail -3 "$work/ramp.out")"
grep -q "^step     1/20 | loss [0-9.]* | batch 4 |" "$work/ramp.out" || fail "ramp log: $(head -3 "$work/ramp.out")"
"$loom" generate "$work/ramp" --prompt-ids 1,2 --max-new-tokens 3 > "$work/ramp_gen.out" 2>&1 \
  || fail "generate from a ramped run's checkpoint: $(tail -3 "$work/ramp_gen.out")"
printf '12+34=|64|' > "$work/ramp_eval.txt"
"$loom" eval "$work/ramp" --data "$work/ramp_eval.txt" > "$work/ramp_eval.out" 2>&1 \
  || fail "eval of a ramped run's checkpoint: $(tail -3 "$work/ramp_eval.out")"
"$loom" plan "$here/tiny.toml" --set 'batch.rampup_batch_size=[12, 4, 32]' --set batch.global_batch_size=16 --perf \
  > "$work/ramp_plan.out" 2>&1 || fail "plan --perf of a ramped manifest: $(tail -3 "$work/ramp_plan.out")"
# The run's manifest (its checkpoint.dir holds the checkpoint) at a micro-batch its ramp
# could not take: the command's own batches, not the ramp's checks.
sed "s|^\[run\]|[run]\ntrain_samples = 200|" "$here/tiny.toml" > "$work/ramp.toml"
cat >> "$work/ramp.toml" <<TOML
[checkpoint]
dir = "$work/ramp"
TOML
sed -i "s|^global_batch_size = .*|global_batch_size = 16\nrampup_batch_size = [4, 4, 32]|" "$work/ramp.toml"
"$loom" eval "$work/ramp.toml" --data "$work/ramp_eval.txt" --set batch.micro_batch_size=3 > "$work/ramp_eval2.out" 2>&1 \
  || fail "eval of a ramped run's manifest: $(tail -3 "$work/ramp_eval2.out")"

# 4. A bad manifest: every problem, each with file:line:column; exit 1.
cat > "$work/bad.toml" <<'TOML'
extends = "TINY"
[parallel]
tpp = 2
[model]
num_heads = 6
TOML
sed -i "s|TINY|$here/tiny.toml|" "$work/bad.toml"
"$loom" validate "$work/bad.toml" > "$work/bad.out" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "validate of a bad manifest exited $rc (expected 1)"
grep -q "bad.toml:3:1: parallel.tpp: unknown key 'parallel.tpp' (did you mean 'parallel.tp'?)" "$work/bad.out" \
  || fail "unknown-key message: $(cat "$work/bad.out")"
grep -q "model.num_heads (6)" "$work/bad.out" || fail "num_heads message: $(cat "$work/bad.out")"
[ "$(grep -c ': ' "$work/bad.out")" -ge 2 ] || fail "both problems must be reported at once"
# comm/local's link model is checked before launch, with where it was set.
"$loom" validate "$here/tiny.toml" --set 'comm.options.links="dp=25GB,10us"' > "$work/links.out" 2>&1
[ $? -eq 1 ] && grep -q "comm.options.links: link 'dp=25GB,10us': bandwidth '25GB' must be" "$work/links.out" \
  || fail "a malformed comm.options.links: $(cat "$work/links.out")"
# A layer named twice in a block would give two layers one set of parameter names.
"$loom" validate "$here/tiny.toml" --set 'model.block=["attention", "mlp", "att2", "mlp"]' \
  --set 'model.layer.att2.plugin="attention"' > "$work/dup.out" 2>&1
[ $? -eq 1 ] && grep -q "model.block: layer 'mlp' is listed twice in model.block" "$work/dup.out" \
  || fail "a layer listed twice in model.block: $(cat "$work/dup.out")"

# 4b. The plan of an expert-parallel MoE manifest names its dispatcher and edp.
"$loom" validate "$here/tiny.toml" --set 'model.block=["attention", "moe"]' --set model.layer.moe.num_experts=4 \
  --set parallel.dp=4 --set parallel.ep=2 --set parallel.expert=expert.allgather > "$work/moe.out" 2>&1 ||
  fail "validate of an ep = 2 manifest: $(tail -3 "$work/moe.out")"
grep -q "expert layout     ep 2 x etp 1 (edp 2, dispatcher parallel/expert.allgather)" "$work/moe.out" ||
  fail "expert layout line: $(grep 'expert layout' "$work/moe.out")"

# 5. Pipeline schedules: Megatron-LM's interleaved 1F1B order (pp 4, 2 virtual chunks, 8
# microbatches; megatron/core/pipeline_parallel/schedules.py), and a refusal that names the rule.
"$loom" schedule --pp 4 --vpp 2 --microbatches 8 --json > "$work/sched.json" || fail "loom schedule"
grep -q '{"rank":0,"warmup":10,"order":\[1,1,1,1,2,2,2,2,1,1,1,-2,1,-2,2,-2,2,-2,2,-1,2,-1,-1,-1,-2,-2,-2,-2,-1,-1,-1,-1\]}' "$work/sched.json" \
  || fail "interleaved order of rank 0: $(head -c 300 "$work/sched.json")"
"$loom" schedule --pp 4 --vpp 2 --microbatches 6 > /dev/null 2> "$work/sched.err"
[ $? -eq 1 ] && grep -q "microbatches mod N must be 0 or at least pp" "$work/sched.err" || fail "refusal: $(cat "$work/sched.err")"
# A pipeline too deep to simulate is refused at once (the simulation's work grows with pp
# times the order's entries).
timeout 20 "$loom" schedule --pp 1000000 --microbatches 1 > /dev/null 2> "$work/deep.err"
[ $? -eq 1 ] && grep -q "entries x stages a schedule is checked with" "$work/deep.err" || fail "pp 1000000: $(cat "$work/deep.err")"
# A trace of millions of events is refused before simulating, and an earlier trace stays.
echo '[]' > "$work/keep.json"
timeout 20 "$loom" schedule --pp 50 --microbatches 100000 --trace "$work/keep.json" > /dev/null 2> "$work/big.err"
[ $? -eq 1 ] && grep -q "at most 2000000 with --trace" "$work/big.err" && [ "$(cat "$work/keep.json")" = "[]" ] ||
  fail "a trace of 10^7 events: $(cat "$work/big.err")"
# An option that takes one value, given twice, is refused rather than the last one used.
"$loom" schedule --pp 2 --pp 3 --microbatches 4 > /dev/null 2> "$work/twice.err"
[ $? -eq 2 ] && grep -q -- "--pp is given 2 times (2, 3); it takes one value" "$work/twice.err" \
  || fail "an option given twice: $(cat "$work/twice.err")"
# A group size 1F1B does not read gives the default's orders: said, not echoed as if used.
"$loom" schedule --pp 2 --microbatches 4 --group-size 3 > /dev/null 2> "$work/group.err"
grep -q "warning: --group-size 3 gives the same orders as 0 (pp) under parallel/pipeline.1f1b" "$work/group.err" \
  || fail "schedule --group-size under 1f1b: $(cat "$work/group.err")"

# 6. Usage errors exit 2; --help exits 0.
"$loom" run > /dev/null 2>&1; [ $? -eq 2 ] || fail "loom run without a manifest should exit 2"
"$loom" frobnicate > /dev/null 2>&1; [ $? -eq 2 ] || fail "an unknown command should exit 2"
# Multi-latent attention's sizes are bounded before any product of them is formed, and
# its latents' sizes are checked by validate.
"$loom" validate "$here/../../configs/deepseek_quickstart.toml" --set model.layer.attention.qk_head_dim=4611686018427387904 \
  > "$work/mla.out" 2>&1 && fail "validate of a qk_head_dim of 2^62 succeeded"
grep -q "qk_head_dim must be between 0 and 1048576" "$work/mla.out" || fail "no bound on qk_head_dim: $(tail -2 "$work/mla.out")"
"$loom" validate "$here/../../configs/deepseek_quickstart.toml" --set model.layer.attention.qk_pos_emb_head_dim=7 \
  > "$work/mla.out" 2>&1 && fail "validate of an odd qk_pos_emb_head_dim succeeded"
grep -q "qk_pos_emb_head_dim (7) must be even" "$work/mla.out" || fail "odd rotary part: $(tail -2 "$work/mla.out")"
for c in run validate plugins groups schedule; do "$loom" $c --help > /dev/null || fail "loom $c --help"; done

# 7. Resharding on resume: 6 steps at dp = 4 (distributed optimizer), resumed at dp = 2 to
# step 12; steps 7..12 match the dp = 2 reference run above (distributed trains like ddp) up to
# the reduction order. Then resumed at tp = 2, dp = 1 (the parameters and optimizer
# state regathered by name) to step 18, matching the reference to the reduction order.
rs=(--set optimizer.strategy=distributed --set checkpoint.dir="\"$work/rs\"")
"$loom" run "$here/tiny.toml" "${rs[@]}" --set parallel.dp=4 --set run.steps=6 > "$work/rs1.out" 2>&1 \
  || fail "dp=4 run: $(tail -3 "$work/rs1.out")"
"$loom" run "$here/tiny.toml" "${rs[@]}" --set parallel.dp=2 --set run.steps=12 --resume --metrics "$work/rs.jsonl" \
  > "$work/rs2.out" 2>&1 || fail "resume at dp=2: $(tail -3 "$work/rs2.out")"
[ "$(wc -l < "$work/rs.jsonl")" -eq 6 ] || fail "resumed run wrote $(wc -l < "$work/rs.jsonl") steps, expected 6"
for s in 7 12; do
  a=$(grep "\"step\": *$s," "$work/rs.jsonl" | sed 's/.*"loss": *\([^,]*\),.*/\1/')
  b=$(grep "\"step\": *$s," "$work/ref.jsonl" | sed 's/.*"loss": *\([^,]*\),.*/\1/')
  awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= 1e-5 * b) }' \
    || fail "step $s after resharding dp 4 -> 2: loss $a, uninterrupted dp = 2: $b"
done
"$loom" run "$here/tiny.toml" "${rs[@]}" --set parallel.dp=1 --set parallel.tp=2 --set run.steps=18 --resume \
  --metrics "$work/rs3.jsonl" > "$work/rs3.out" 2>&1 || fail "resume at tp=2: $(tail -3 "$work/rs3.out")"
grep -q "regathering parameters and optimizer state" "$work/rs3.out" || fail "tp-change resume: $(head -3 "$work/rs3.out")"
for s in 13 18; do
  a=$(grep "\"step\": *$s," "$work/rs3.jsonl" | sed 's/.*"loss": *\([^,]*\),.*/\1/')
  b=$(grep "\"step\": *$s," "$work/ref.jsonl" | sed 's/.*"loss": *\([^,]*\),.*/\1/')
  awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= 1e-5 * b) }' \
    || fail "step $s after resuming at tp 2 x dp 1 from tp 1 x dp 2: loss $a, uninterrupted tp 1 x dp 2: $b"
done

# 8. More rank threads than the process may start (a virtual-memory limit that thread
# stacks exhaust): exit 1 with a message, not std::terminate (134) with live threads.
# (Not under AddressSanitizer, whose shadow memory needs far more address space.)
if [ -z "${ASAN_OPTIONS:-}" ]; then
  ( ulimit -v 8000000 && exec "$loom" run "$here/tiny.toml" --set run.steps=2 --set parallel.dp=1000 \
      --set batch.global_batch_size=1000 --set batch.micro_batch_size=1 ) > "$work/threads.out" 2>&1
  rc=$?
  [ $rc -eq 1 ] || fail "1000 rank threads under ulimit -v 8000000 should exit 1, exited $rc: $(tail -3 "$work/threads.out")"
  grep -qE "cannot start the thread of rank|out of host memory" "$work/threads.out" \
    || fail "thread-limit message: $(tail -3 "$work/threads.out")"
fi

# 9. A plan far past this machine's memory (hidden 65536, 1000 layers) is refused before
# anything is allocated, and validate warns about it.
big=(--set model.hidden_size=65536 --set model.num_heads=64 --set model.num_layers=1000 --set run.steps=1)
"$loom" run "$here/tiny.toml" "${big[@]}" > "$work/big.out" 2>&1
rc=$?
[ $rc -eq 1 ] && grep -q "GiB of memory" "$work/big.out" || fail "huge plan: exit $rc, $(tail -2 "$work/big.out")"
"$loom" validate "$here/tiny.toml" "${big[@]}" 2>&1 | grep -q "warning: the plan needs .* loom run refuses it on this machine" \
  || fail "validate: no memory warning"
"$loom" validate "$here/tiny.toml" "${big[@]}" --json 2>&1 | grep -q '"memory_problem":"the plan needs' \
  || fail "validate --json: no memory_problem"

# 10. Options of a layer table no layer uses (MoE options on a dense model) change nothing:
# validate, plan and run say so, naming where the value was set.
unused=(--set model.layer.moe.num_experts=4 --set run.steps=1)
for c in validate plan run; do
  "$loom" $c "$here/tiny.toml" "${unused[@]}" > "$work/unused.out" 2>&1
  grep -q "warning: --set model.layer.moe.num_experts=4: model.layer.moe is set but no layer" "$work/unused.out" \
    || fail "$c: no warning about the unused model.layer.moe: $(tail -2 "$work/unused.out")"
done

# 10b. Blocks that differ over uneven pipeline chunks: loom plan lists what each chunk
# holds, the pattern's kinds in order, so stages of unlike blocks can be balanced.
"$loom" plan "$here/tiny.toml" --set 'model.blocks.wide=["attention", "mlp_wide"]' \
  --set 'model.layer.mlp_wide.plugin="mlp"' --set 'model.block_pattern=["wide", "block*3"]' --set model.num_layers=4 \
  --set parallel.pp=2 --set parallel.dp=1 --set 'pipeline.chunk_layers=[1, 3]' > "$work/chunks.out" 2>&1 || fail "plan: $(cat "$work/chunks.out")"
grep -q "chunk 0 (stage 0): block 0, wide x 1" "$work/chunks.out" && grep -q "chunk 1 (stage 1): blocks 1-3, block x 3" \
  "$work/chunks.out" || fail "plan lists no chunk's blocks: $(cat "$work/chunks.out")"

# 11. A stop signal before the first step has finished stops at once (nothing new to
# save; starting up may block: here on a metrics FIFO nobody reads). Once a step has
# finished, the first signal is acknowledged as it arrives (a step may take minutes) and
# a second one ends the run at once, without waiting for the step (~8 s here).
mkfifo "$work/nobody.fifo"
"$loom" run "$here/tiny.toml" --metrics "$work/nobody.fifo" > "$work/early.out" 2>&1 &
pid=$!
sleep 2
kill -TERM $pid
start=$(date +%s)
wait $pid
rc=$?
[ $rc -eq 130 ] || fail "a signal while starting up: exit $rc, expected 130: $(tail -2 "$work/early.out")"
[ $(( $(date +%s) - start )) -le 5 ] || fail "a signal while starting up: the run took more than 5 s to stop"
grep -q "signal received before the first step finished: nothing new to save; stopping now" "$work/early.out" \
  || fail "early signal not reported: $(tail -2 "$work/early.out")"
long=(--set model.hidden_size=1024 --set model.num_layers=4 --set model.seq_length=1024 --set parallel.dp=1
      --set batch.micro_batch_size=2 --set batch.global_batch_size=2 --set data.kind=text
      --set "data.path=\"$here/../../README.md\"" --set run.steps=20 --set run.log_every=1)
"$loom" run "$here/tiny.toml" "${long[@]}" --metrics "$work/sig.jsonl" > "$work/sig.out" 2>&1 &
pid=$!
for _ in $(seq 1 1200); do
  [ -s "$work/sig.jsonl" ] && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.1
done
kill -TERM $pid
sleep 1
grep -q "signal received: stopping after the current step" "$work/sig.out" \
  || fail "first signal not acknowledged: $(tail -2 "$work/sig.out")"
kill -TERM $pid 2>/dev/null
start=$(date +%s)
wait $pid
rc=$?
[ $rc -eq 130 ] || fail "second signal: exit $rc, expected 130: $(tail -2 "$work/sig.out")"
[ $(( $(date +%s) - start )) -le 5 ] || fail "second signal: the run took more than 5 s to stop"
grep -q "second signal: stopping now" "$work/sig.out" || fail "second signal not reported: $(tail -2 "$work/sig.out")"

# 12. The manifest reference in docs is what the schema says.
{ head -4 "$here/../../docs/manifest.md"; "$loom" validate --reference; } | diff -q - "$here/../../docs/manifest.md" \
  > /dev/null || fail "docs/manifest.md differs from loom validate --reference; regenerate it"

# 12b. --json reports a plugin's refusal in the same form as the schema's.
for cmd in validate plan; do
  out=$("$loom" $cmd "$here/../../configs/llama_quickstart.toml" --json --set parallel.tp=4 --set parallel.dp=1 \
    --set model.layer.attention.num_query_groups=2 2>/dev/null)
  [ $? -eq 1 ] && [[ "$out" == '{"valid":false,"errors":[{'*"num_query_groups (2) must be divisible"* ]] ||
    fail "$cmd --json of a plugin's refusal: '$out'"
done

# 13. Every shipped config validates (on the CPU device: a build without CUDA has no
# device/cuda, and the GPU configs' device options are device/cuda's), and the
# Llama-shaped quickstart trains (a few steps).
for c in "$here"/../../configs/*.toml; do
  "$loom" validate "$c" --set device.kind=cpu --set 'device.options={}' > "$work/config.out" 2>&1 \
    || fail "validate $(basename "$c"): $(tail -3 "$work/config.out")"
done
"$loom" run "$here/../../configs/llama_quickstart.toml" --set run.steps=20 --set run.eval_every=0 --set run.log_every=10 \
  > "$work/llama.out" 2>&1 || fail "llama_quickstart: $(tail -3 "$work/llama.out")"
grep -q "step    20/20" "$work/llama.out" || fail "llama_quickstart did not reach step 20: $(tail -3 "$work/llama.out")"

# 14. loom generate from a checkpoint: greedy decoding with the key/value cache gives
# the ids of running the whole sequence again, and the same at tp 2 x pp 2; a prompt
# symbol the data has no token for, and a manifest that names no weights, are refused.
"$loom" run "$here/tiny.toml" --set run.steps=20 --set checkpoint.dir="\"$work/gen\"" > "$work/gen_train.out" 2>&1 \
  || fail "generate: training: $(tail -3 "$work/gen_train.out")"
ids() { "$loom" generate "$work/gen" --prompt "12+34=" --temperature 0 --max-new-tokens 6 --json "$@" \
          | sed -n 's/.*"ids":\(\[[0-9,]*\]\).*/\1/p'; }
cached=$(ids)
[ -n "$cached" ] && [ "$(echo "$cached" | tr ',' '\n' | wc -l)" -eq 6 ] || fail "generate --json: ids '$cached'"
[ "$(ids --no-cache)" = "$cached" ] || fail "generate: --no-cache gave $(ids --no-cache), the cache $cached"
[ "$(ids --set parallel.tp=2 --set parallel.pp=2)" = "$cached" ] || fail "generate at tp 2 x pp 2 differs from $cached"
# A checkpoint of interleaved stages with uneven chunks (pp 2 x vpp 2, the embedding and
# the output layer chunks alone) samples at pp 1: its split is not the model's.
"$loom" run "$here/tiny.toml" --set run.steps=20 --set parallel.dp=1 --set parallel.pp=2 --set parallel.vpp=2 \
  --set 'pipeline.chunk_layers=[0, 1, 1, 0]' --set checkpoint.dir="\"$work/gen_vpp\"" > "$work/gen_vpp.out" 2>&1 \
  || fail "generate: training at pp 2 x vpp 2: $(tail -3 "$work/gen_vpp.out")"
for c in generate eval; do
  for _ in $(seq 1 20); do printf '12+34=64|'; done > "$work/sums.txt"
  if [ $c = generate ]; then a=(--prompt "12+34=" --max-new-tokens 2); else a=(--data "$work/sums.txt"); fi
  "$loom" $c "$work/gen_vpp" "${a[@]}" --set parallel.pp=1 > "$work/gen_vpp_$c.out" 2>&1 \
    || fail "$c at pp 1 of a pp 2 x vpp 2 checkpoint: $(tail -3 "$work/gen_vpp_$c.out")"
done
"$loom" generate "$work/gen" --prompt "12+" --max-new-tokens 1 --set parallel.cp=2 > "$work/gen_cp.out" 2>&1 \
  && grep -q "set parallel.cp=2 changes nothing: one sequence decodes at dp = cp = ep = 1" "$work/gen_cp.out" \
  || fail "generate: --set parallel.cp=2 taken silently: $(cat "$work/gen_cp.out")"
"$loom" generate "$work/gen" --prompt "12+ab" > "$work/gen_bad.out" 2>&1
[ $? -eq 1 ] && grep -q "no token for 'a'" "$work/gen_bad.out" || fail "generate: bad prompt: $(cat "$work/gen_bad.out")"
"$loom" generate "$work/gen" --prompt "12+" --set data.kind=text > "$work/gen_data.out" 2>&1
[ $? -eq 2 ] && grep -q "come with the weights" "$work/gen_data.out" ||
  fail "generate: --set data.kind (another vocabulary than the weights'): $(cat "$work/gen_data.out")"
# A manifest naming the checkpoint, with other data settings, would read its ids as
# another vocabulary's: refused naming the key.
printf 'extends = "%s"\n[data]\ndigits = 3\n[checkpoint]\ndir = "%s"\n' "$here/tiny.toml" "$work/gen" > "$work/gen3.toml"
"$loom" generate "$work/gen3.toml" --prompt "12+" > "$work/gen3.out" 2>&1
[ $? -eq 2 ] && grep -q "trained with data.digits = 2, this manifest has 3" "$work/gen3.out" ||
  fail "generate: a manifest with other data settings than its checkpoint's: $(cat "$work/gen3.out")"
# The same through checkpoint.init_weights naming the checkpoint.
printf 'extends = "%s"\n[data]\ndigits = 3\n[checkpoint]\ninit_weights = "%s"\n' "$here/tiny.toml" "$work/gen" > "$work/gen4.toml"
"$loom" generate "$work/gen4.toml" --prompt "12+" > "$work/gen4.out" 2>&1
[ $? -eq 2 ] && grep -q "trained with data.digits = 2, this manifest has 3" "$work/gen4.out" ||
  fail "generate: init_weights naming a checkpoint of other data settings: $(cat "$work/gen4.out")"
"$loom" generate "$here/tiny.toml" --prompt "1" > "$work/gen_none.out" 2>&1
[ $? -eq 2 ] && grep -q "names no weights" "$work/gen_none.out" || fail "generate: no weights: $(cat "$work/gen_none.out")"

# 14b. data.tokenizer, relative to the manifest: the model's vocabulary is the
# tokenizer's (400, not the largest id of these few letters + 1: 391); generate finds it
# from the checkpoint without --tokenizer, from another directory; a manifest naming
# the checkpoint with another tokenizer is refused.
mkdir -p "$work/tok/cfg"
awk 'BEGIN { srand(7); for (l = 0; l < 3000; ++l) { s = ""; for (w = 0; w < 8; ++w) { n = 2 + int(rand() * 6);
       for (c = 0; c < n; ++c) s = s sprintf("%c", 97 + int(rand() * 20)); s = s " " } print s } }' > "$work/tok/corpus.txt"
for t in sp sp2; do
  "$loom" tokenizer-train --input "$work/tok/corpus.txt" --model-prefix "$work/tok/$t" --vocab-size 400 \
    $( [ $t = sp2 ] && echo --model-type unigram ) > "$work/tok/$t.out" 2>&1 || fail "tokenizer-train $t: $(tail -2 "$work/tok/$t.out")"
done
for _ in $(seq 1 20); do echo "ab abc ba cab"; done > "$work/tok/few.txt"  # a few letters: not the last ids
"$loom" preprocess --tokenizer "$work/tok/sp.model" --input "$work/tok/few.txt" --output-prefix "$work/tok/ds" \
  > "$work/tok/pre.out" 2>&1 || fail "preprocess: $(tail -2 "$work/tok/pre.out")"
printf 'extends = "%s"\n[model]\nseq_length = 16\n[data]\nkind = "indexed"\npath = "../ds"\ntokenizer = "../sp.model"\n[checkpoint]\ndir = "%s"\n' \
  "$here/tiny.toml" "$work/tok/ck" > "$work/tok/cfg/m.toml"
"$loom" run "$work/tok/cfg/m.toml" --set run.steps=3 --set run.eval_every=0 > "$work/tok/run.out" 2>&1 ||
  fail "training on token files with data.tokenizer: $(tail -3 "$work/tok/run.out")"
grep -q "vocab 400" "$work/tok/run.out" || fail "data.tokenizer: the vocabulary is not the tokenizer's 400: $(grep vocab "$work/tok/run.out")"
(cd / && "$loom" generate "$work/tok/ck" --prompt "abc de" --max-new-tokens 2 > "$work/tok/gen.out" 2>&1) ||
  fail "generate without --tokenizer from another directory: $(tail -2 "$work/tok/gen.out")"
sed 's/sp.model/sp2.model/' "$work/tok/cfg/m.toml" > "$work/tok/cfg/other.toml"
"$loom" generate "$work/tok/cfg/other.toml" --prompt "abc" > "$work/tok/other.out" 2>&1
[ $? -eq 2 ] && grep -q "another vocabulary" "$work/tok/other.out" ||
  fail "generate: a manifest naming the checkpoint with another tokenizer: $(cat "$work/tok/other.out")"
# --tokenizer of another vocabulary than data.tokenizer's is refused (eval likewise);
# stdout holds the text alone (the figures go to stderr).
"$loom" generate "$work/tok/ck" --prompt "abc" --tokenizer "$work/tok/sp2.model" > "$work/tok/other2.out" 2>&1
[ $? -eq 1 ] && grep -q "is not the one the model was trained with" "$work/tok/other2.out" ||
  fail "generate: --tokenizer of another vocabulary: $(cat "$work/tok/other2.out")"
"$loom" eval "$work/tok/ck" --data "$work/tok/few.txt" --tokenizer "$work/tok/sp2.model" > "$work/tok/other3.out" 2>&1
[ $? -eq 1 ] && grep -q "is not the one the model was trained with" "$work/tok/other3.out" ||
  fail "eval: --tokenizer of another vocabulary: $(cat "$work/tok/other3.out")"
"$loom" generate "$work/tok/ck" --prompt "abc" --tokenizer "$work/tok/sp.model" --max-new-tokens 3 \
  > "$work/tok/text.out" 2> "$work/tok/text.err" || fail "generate: $(cat "$work/tok/text.err")"
grep -q "^generate: " "$work/tok/text.err" && ! grep -q "generate:" "$work/tok/text.out" ||
  fail "generate's figures are not on stderr alone: $(cat "$work/tok/text.out")"

# 15. loom eval: a byte-level model's perplexity over a text predicts every byte after
# the first once (tokens = bytes - 1), the same at tp 2 x pp 2 as at its own layout;
# LAMBADA-style JSONL gives an accuracy; a JSONL line without "text" is refused by line.
for _ in $(seq 1 60); do echo "the quick brown fox jumps over the lazy dog and runs far away"; done > "$work/corpus.txt"
"$loom" run "$here/tiny.toml" --set run.steps=20 --set data.kind='"text"' --set data.path="\"$work/corpus.txt\"" \
  --set model.seq_length=32 --set checkpoint.dir="\"$work/bytes\"" > "$work/bytes_train.out" 2>&1 \
  || fail "eval: training a byte model: $(tail -3 "$work/bytes_train.out")"
head -c 1000 "$work/corpus.txt" > "$work/eval.txt"
field() { sed -n "s/.*\"$1\":\([^,}]*\).*/\1/p"; }
one=$("$loom" eval "$work/bytes" --data "$work/eval.txt" --json)
[ "$(echo "$one" | field tokens)" = 999 ] || fail "eval: tokens in $one (expected 999)"
other=$("$loom" eval "$work/bytes" --data "$work/eval.txt" --set parallel.tp=2 --set parallel.pp=2 --set parallel.dp=1 --json)
awk -v a="$(echo "$one" | field loss)" -v b="$(echo "$other" | field loss)" 'BEGIN { d = a - b; exit !(d < 1e-5 && d > -1e-5) }' \
  || fail "eval: loss at tp 2 x pp 2 ($other) differs from its own layout's ($one)"
# The same bytes as an llm.c token file (--format tokens): the same loss, exactly.
n=$(wc -c < "$work/eval.txt")
{ printf '\x88\xd8\x34\x01\x01\x00\x00\x00'
  printf "\\x$(printf %02x $((n & 255)))\\x$(printf %02x $(((n >> 8) & 255)))\\x00\\x00"
  head -c 1012 /dev/zero
  od -An -v -tx1 "$work/eval.txt" | tr -s ' ' '\n' | grep . | while read -r b; do printf "\\x$b\\x00"; done
} > "$work/eval.bin"
tokens=$("$loom" eval "$work/bytes" --data "$work/eval.bin" --format tokens --json)
[ "$(echo "$tokens" | field loss)" = "$(echo "$one" | field loss)" ] \
  || fail "eval --format tokens: $tokens differs from the text's $one"
printf '{"text": "the quick brown fox jumps"}\n{"text": "over the lazy dog"}\n' > "$work/lambada.jsonl"
"$loom" eval "$work/bytes" --data "$work/lambada.jsonl" --task lambada --json | grep -q '"samples":2,.*"accuracy":' \
  || fail "eval --task lambada: $("$loom" eval "$work/bytes" --data "$work/lambada.jsonl" --task lambada --json 2>&1)"
# Multiple choice (HellaSwag's fields): accuracy by summed loss and per token, the same
# at tp 2 x pp 2 as at the checkpoint's layout.
printf '{"ctx": "the quick brown", "endings": ["fox", "dog jumps", "cat"], "label": 0}\n{"ctx": "over the", "endings": ["lazy dog", "moon"], "label": 1}\n' > "$work/choice.jsonl"
choice=$("$loom" eval "$work/bytes" --data "$work/choice.jsonl" --task choice --json)
echo "$choice" | grep -q '"examples":2,"accuracy":[0-9.]*,"accuracy_norm":[0-9.]*' || fail "eval --task choice: $choice"
choice_tp=$("$loom" eval "$work/bytes" --data "$work/choice.jsonl" --task choice --set parallel.tp=2 --set parallel.pp=2 --set parallel.dp=1 --json)
[ "$(echo "$choice" | field accuracy_norm)" = "$(echo "$choice_tp" | field accuracy_norm)" ] \
  || fail "eval --task choice at tp 2 x pp 2: $choice_tp, at its own layout: $choice"
printf '{"txt": "a b"}\n' > "$work/bad.jsonl"
"$loom" eval "$work/bytes" --data "$work/bad.jsonl" --task lambada > "$work/bad_eval.out" 2>&1
[ $? -eq 1 ] && grep -q 'bad.jsonl:1: expected an object with a string field "text"' "$work/bad_eval.out" \
  || fail "eval: bad JSONL: $(cat "$work/bad_eval.out")"

# 16. loom import: a Hugging Face export read back as a checkpoint at another layout (tp 2),
# which a resume trains on from exactly as checkpoint.init_weights does; a directory that
# holds checkpoints, or a manifest of another model, is refused (exit 1).
"$loom" export "$work/bytes" --format hf "$work/hf" > /dev/null 2>&1 || fail "export for import"
bytes=(--set run.steps=2 --set data.kind='"text"' --set data.path="\"$work/corpus.txt\"" --set model.seq_length=32
       --set parallel.tp=2 --set parallel.dp=1)
"$loom" import "$work/hf" "$here/tiny.toml" "$work/imported" "${bytes[@]}" > "$work/import.out" 2>&1 \
  || fail "import: $(tail -3 "$work/import.out")"
grep -q "import: .* -> .*imported/step_00000000 (world 2: tp 2" "$work/import.out" || fail "import: $(cat "$work/import.out")"
"$loom" run "$here/tiny.toml" "${bytes[@]}" --set checkpoint.dir="\"$work/imported\"" --resume \
  --metrics "$work/imported.jsonl" > "$work/import_run.out" 2>&1 || fail "resume of an import: $(tail -3 "$work/import_run.out")"
"$loom" run "$here/tiny.toml" "${bytes[@]}" --set checkpoint.init_weights="\"$work/hf\"" \
  --metrics "$work/init.jsonl" > "$work/init_run.out" 2>&1 || fail "init_weights run: $(tail -3 "$work/init_run.out")"
[ "$(grep -o '"loss": *[^,]*' "$work/imported.jsonl")" = \
  "$(grep -o '"loss": *[^,]*' "$work/init.jsonl")" ] || fail "import + resume differs from init_weights"
"$loom" import "$work/hf" "$here/tiny.toml" "$work/imported" "${bytes[@]}" > "$work/again.out" 2>&1
[ $? -eq 1 ] && grep -q "holds checkpoints already" "$work/again.out" || fail "import into checkpoints: $(cat "$work/again.out")"
"$loom" import "$work/hf" "$here/tiny.toml" "$work/hf/sub" "${bytes[@]}" > "$work/inside.out" 2>&1
[ $? -eq 1 ] && grep -q "is inside .*hf, the source" "$work/inside.out" && [ ! -e "$work/hf/sub" ] \
  || fail "import into its source: $(cat "$work/inside.out")"
"$loom" import "$work/hf" "$here/tiny.toml" "$work/other" "${bytes[@]}" --set model.num_heads=2 > "$work/other.out" 2>&1
[ $? -eq 1 ] && grep -q "config.json: n_head = 4 but the model's model.num_heads is 2" "$work/other.out" \
  || fail "import of another model: $(cat "$work/other.out")"
[ ! -e "$work/other" ] || fail "a failed import left its OUTDIR: $(ls -A "$work/other" 2>&1)"
mkdir -p "$work/not_a_model"
"$loom" import "$work/not_a_model" "$here/tiny.toml" "$work/other" "${bytes[@]}" > "$work/other.out" 2>&1
[ $? -eq 1 ] && grep -q "SOURCE .*not_a_model is neither a Hugging Face model directory" "$work/other.out" \
  || fail "import of a directory holding no model: $(cat "$work/other.out")"

# 16b. import --write-manifest: the manifest of the export's model (GPT-2's blocks) from
# its config.json, which an import into tp 2 then takes; an existing file is not
# written over; a directory without config.json says what it needs.
"$loom" import "$work/hf" --write-manifest "$work/written.toml" > "$work/written.out" 2>&1 \
  || fail "import --write-manifest: $(cat "$work/written.out")"
grep -q "then: loom import" "$work/written.out" && grep -q '^num_layers = ' "$work/written.toml" \
  || fail "import --write-manifest wrote: $(cat "$work/written.out" "$work/written.toml")"
"$loom" import "$work/hf" "$work/written.toml" "$work/imported2" "${bytes[@]}" > "$work/import2.out" 2>&1 \
  || fail "import with the written manifest: $(tail -3 "$work/import2.out")"
[ "$("$loom" import "$work/hf" --write-manifest -)" = "$(cat "$work/written.toml")" ] || fail "--write-manifest - differs"
"$loom" import "$work/hf" --write-manifest "$work/written.toml" > "$work/again.out" 2>&1
[ $? -eq 1 ] && grep -q "written.toml exists; the manifest is not written over it" "$work/again.out" \
  || fail "--write-manifest over a file: $(cat "$work/again.out")"
# generate and eval read a Hugging Face directory as that manifest: the same tokens as
# the checkpoint it was exported from (its ids: the directory has no tokenizer).
hf_ids=$("$loom" generate "$work/hf" --prompt-ids 104,101,108 --max-new-tokens 6 --temperature 0 --json 2>/dev/null)
ck_ids=$("$loom" generate "$work/bytes" --prompt-ids 104,101,108 --max-new-tokens 6 --temperature 0 --json 2>/dev/null)
[ -n "$hf_ids" ] && [ "$(echo "$hf_ids" | grep -o '"ids":\[[0-9,]*\]')" = "$(echo "$ck_ids" | grep -o '"ids":\[[0-9,]*\]')" ] \
  && echo "$hf_ids" | grep -q '"text":null' || fail "generate from a Hugging Face directory: $hf_ids vs $ck_ids"
# --max-shard-size: the same model in shards (and its index), read as the one file.
"$loom" export "$work/bytes" --format hf "$work/hfs" --max-shard-size 20KB > "$work/hfs.out" 2>&1 \
  && [ -f "$work/hfs/model.safetensors.index.json" ] && [ ! -f "$work/hfs/model.safetensors" ] \
  || fail "export in shards: $(cat "$work/hfs.out"; ls "$work/hfs")"
hfs_ids=$("$loom" generate "$work/hfs" --prompt-ids 104,101,108 --max-new-tokens 6 --temperature 0 --json 2>/dev/null)
[ "$(echo "$hfs_ids" | grep -o '"ids":\[[0-9,]*\]')" = "$(echo "$hf_ids" | grep -o '"ids":\[[0-9,]*\]')" ] \
  || fail "generate from shards: $hfs_ids vs $hf_ids"
"$loom" export "$work/bytes" --format hf "$work/hfx" --max-shard-size 5XB > /dev/null 2>&1
[ $? -eq 2 ] || fail "--max-shard-size 5XB is not a usage error"
"$loom" import "$work/not_a_model" --write-manifest "$work/none.toml" > "$work/none.out" 2>&1
[ $? -eq 1 ] && grep -q "config.json: cannot read the file" "$work/none.out" && [ ! -e "$work/none.toml" ] \
  || fail "--write-manifest of no model: $(cat "$work/none.out")"

# 17. A disk that fills (here a file-size limit) while a checkpoint is written, in line
# or beside training (checkpoint.async_save): the run fails naming the file (exit 1),
# the step is not committed, the checkpoint before it stays, and a resume continues
# from that one, removing what the failed save left.
for mode in false true; do
  save=(--set checkpoint.dir="\"$work/full_$mode\"" --set checkpoint.every=2 --set checkpoint.async_save=$mode)
  "$loom" run "$here/tiny.toml" "${save[@]}" --set run.steps=2 > "$work/full.out" 2>&1 || fail "save: $(cat "$work/full.out")"
  (ulimit -f 200; exec "$loom" run "$here/tiny.toml" "${save[@]}" --set run.steps=6 --resume) \
    > "$work/full.out" 2>&1
  rc=$?
  [ $rc -eq 1 ] && grep -q "rank_0000[01].bin failed: File too large (disk full?)" "$work/full.out" \
    || fail "async_save=$mode, disk full: exit $rc: $(tail -3 "$work/full.out")"
  [ "$mode" = false ] || grep -q "the checkpoint of step 4, written beside training, failed" "$work/full.out" \
    || fail "async_save=$mode, disk full: $(tail -3 "$work/full.out")"
  [ "$(cd "$work/full_$mode" && echo step_*)" = step_00000002 ] || fail "async_save=$mode: $(ls -a "$work/full_$mode")"
  "$loom" run "$here/tiny.toml" "${save[@]}" --set run.steps=6 --resume > "$work/full.out" 2>&1 \
    || fail "async_save=$mode, resume after a full disk: $(tail -3 "$work/full.out")"
  grep -q "resume: from .*step_00000002 (step 2)" "$work/full.out" || fail "resume: $(cat "$work/full.out")"
  [ "$(cd "$work/full_$mode" && echo step_* .tmp*)" = "step_00000002 step_00000004 step_00000006 .tmp*" ] \
    || fail "async_save=$mode, after the resume: $(ls -a "$work/full_$mode")"
done

# TensorBoard: --tensorboard DIR writes an event file (its first record: 8 bytes of
# length, the masked CRC, then an Event whose file_version is brain.Event:2); without
# a directory it is a usage error; a directory that cannot be made fails the run.
"$loom" run "$here/tiny.toml" --set run.steps=3 --tensorboard "$work/tb" > "$work/tb.out" 2>&1 \
  || fail "--tensorboard: $(tail -3 "$work/tb.out")"
tb_file=$(ls "$work"/tb/events.out.tfevents.* 2>/dev/null | head -1)
[ -s "$tb_file" ] && grep -q "tensorboard: writing $tb_file" "$work/tb.out" || fail "--tensorboard: $(cat "$work/tb.out")"
grep -aq "brain.Event:2" "$tb_file" || fail "--tensorboard: no file version in $tb_file"
"$loom" run "$here/tiny.toml" --tensorboard > "$work/tb2.out" 2>&1
[ $? -eq 2 ] || fail "--tensorboard without a directory: $(cat "$work/tb2.out")"
"$loom" run "$here/tiny.toml" --set run.steps=3 --set run.tensorboard_dir="\"$tb_file/sub\"" > "$work/tb3.out" 2>&1
[ $? -eq 1 ] && grep -q "tensorboard directory $tb_file/sub: cannot create it" "$work/tb3.out" \
  || fail "an impossible tensorboard directory: $(cat "$work/tb3.out")"

# loom inspect: a MoE checkpoint with DeepSeek-V3's expert bias shows its step and its
# layers' state (each MoE block's bias and load; the loads sum to the step's tokens x
# top_k); --json has every value; a damaged state file exits 1 naming it.
"$loom" run "$here/tiny.toml" --set run.steps=2 --set 'model.block=["attention", "moe"]' \
  --set 'model.layer.moe.score_function="sigmoid"' --set model.layer.moe.expert_bias=true \
  --set checkpoint.dir="\"$work/bias\"" > "$work/bias.out" 2>&1 || fail "expert-bias run: $(tail -3 "$work/bias.out")"
"$loom" inspect "$work/bias" > "$work/inspect.out" 2>&1 || fail "inspect: $(cat "$work/inspect.out")"
grep -q "step_00000002: step 2, 16 training samples read" "$work/inspect.out" \
  && grep -q "blocks.0.moe.router.expert_bias  \[8\]" "$work/inspect.out" \
  && grep -q "blocks.1.moe.router.expert_load  \[8\]" "$work/inspect.out" || fail "inspect: $(cat "$work/inspect.out")"
"$loom" inspect "$work/bias" --json > "$work/inspect.json" 2>&1 || fail "inspect --json: $(cat "$work/inspect.json")"
python3 - "$work/inspect.json" "$(grep -o 'seq_length = [0-9]*' "$here/tiny.toml" | grep -o '[0-9]*$')" <<'PY' || fail "inspect --json: $(cat "$work/inspect.json")"
import json, sys
j = json.load(open(sys.argv[1]))
state = j["layer_state"]
loads = [v for k, v in state.items() if k.endswith(".expert_load")]
assert j["step"] == 2 and len(state) == 2 * len(loads) and loads, state
assert all(sum(v) == 8 * int(sys.argv[2]) * 2 for v in loads), (loads, sys.argv[2])  # global batch 8, top_k 2
PY
printf 'x' >> "$work/bias/step_00000002/rank_00000.state"
"$loom" inspect "$work/bias" > "$work/inspect2.out" 2>&1
[ $? -eq 1 ] && grep -q "rank_00000.state: the header's size does not match the file's" "$work/inspect2.out" \
  || fail "inspect of a damaged state file: $(cat "$work/inspect2.out")"

echo "cli tests passed"
