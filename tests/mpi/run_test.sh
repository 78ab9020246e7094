#!/usr/bin/env bash
# `loom run` under mpirun with comm/mpi against the threads backend (comm/local):
#   1. -np 2 (dp 2) and -np 4 (dp 2 x tp 2, distributed optimizer): the per-step
#      metrics (loss, lr, grad norm, memory, validation) are identical, timing
#      fields aside; only rank 0 prints the step log; 1a. with the gradient
#      reduction overlapped with the backward too; 1b. MoE blocks at ep 2 too;
#      1c. and folded (etp 1 under tp 2 + SP, ep 2, dp 2) at -np 4;
#      1d. pipelines (pp 2, and interleaved vpp 2) with each stage's next receive
#      posted early on comm/mpi's receiver thread, and with receives at the wait;
#   2. checkpoints written under mpirun (every rank its file, rank 0 commits) resume
#      under mpirun to the same steps as the uninterrupted threads run; 2b. at another
#      layout and process count, each process gathering only what its rank holds;
#   3. a rank that fails (its checkpoint file is damaged) ends the whole job promptly
#      with a message naming it and a non-zero exit, long before comm.timeout_s;
#   3b. SIGUSR1 to mpirun stops every rank after one step with a checkpoint (exit 130);
#   4. comm.backend = "local" under mpirun, and comm/mpi without mpirun, are refused
#      with a message saying what to do; a setup error in one process alone is printed
#      by it.
# usage: run_test.sh LOOM MPIEXEC MANIFEST [MPIEXEC FLAGS...]
set -euo pipefail
loom=$1 mpiexec=$2 manifest=$3
shift 3
flags=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }
# The metrics without the fields that measure time.
strip() { sed -E 's/, ?"(tokens_per_s|ms|flops_per_s|mfu)": ?[^,}]*//g' "$1"; }
same() {  # same FILE_A FILE_B WHAT
  [ -s "$1" ] || fail "$3: $1 is empty"
  if ! diff <(strip "$1") <(strip "$2") >"$work/diff"; then
    head -5 "$work/diff" >&2
    fail "$3: metrics differ"
  fi
  echo "ok: $3 ($(wc -l <"$1") steps identical)"
}
threads() { "$loom" run "$manifest" "$@"; }
mpi() {  # mpi NP ARGS...
  local np=$1
  shift
  timeout 150 "$mpiexec" "${flags[@]}" -np "$np" "$loom" run "$manifest" --set comm.backend=mpi "$@"
}

# 1. Equivalence with the threads backend.
threads --metrics "$work/t2.jsonl" >"$work/t2.out"
mpi 2 --metrics "$work/m2.jsonl" >"$work/m2.out"
same "$work/t2.jsonl" "$work/m2.jsonl" "mpirun -np 2 vs threads (dp 2)"
[ "$(grep -c '^step ' "$work/m2.out")" -eq "$(grep -c '^step ' "$work/t2.out")" ] ||
  fail "the step log under mpirun should come from rank 0 only: $(grep -c '^step ' "$work/m2.out") lines"

four=(--set parallel.tp=2 --set optimizer.strategy=distributed)
threads "${four[@]}" --metrics "$work/t4.jsonl" >/dev/null
mpi 4 "${four[@]}" --metrics "$work/m4.jsonl" >/dev/null
same "$work/t4.jsonl" "$work/m4.jsonl" "mpirun -np 4 vs threads (dp 2 x tp 2, distributed optimizer)"

# 1a. Overlapped gradient reduction and parameter all-gather: comm/mpi runs the
# started reduce-scatters (during the backward) and all-gathers (into the next
# forward) on each member's worker thread; the steps equal the threads backend's
# in-line ones.
ov=(--set parallel.tp=2 --set optimizer.strategy=distributed --set optimizer.bucket_size=2000)
threads "${ov[@]}" --metrics "$work/tov.jsonl" >/dev/null
mpi 4 "${ov[@]}" --set optimizer.overlap_grad_reduce=true --set optimizer.overlap_param_gather=true \
  --metrics "$work/mov.jsonl" >/dev/null
same "$work/tov.jsonl" "$work/mov.jsonl" "mpirun -np 4 overlapped vs threads in line (dp 2 x tp 2, distributed optimizer)"

# 1b. Expert parallelism: MoE blocks with their experts split over ep = 2, the
# tokens dispatched between the processes by comm/mpi's all_to_all(v).
moe=(--set 'model.block=["attention", "moe"]' --set model.layer.moe.num_experts=4 --set parallel.ep=2)
threads "${moe[@]}" --metrics "$work/te.jsonl" >/dev/null
mpi 2 "${moe[@]}" --metrics "$work/me.jsonl" >/dev/null
same "$work/te.jsonl" "$work/me.jsonl" "mpirun -np 2 vs threads (MoE, dp 2 x ep 2)"
grep -q '"aux_loss"' "$work/me.jsonl" || fail "the MoE run under mpirun reports no aux_loss"
# The all-gather dispatcher between processes trains exactly as the all-to-all one
# (what it communicates and allocates differs, so only the training is compared).
mpi 2 "${moe[@]}" --set parallel.expert=expert.allgather --metrics "$work/mg.jsonl" >/dev/null
training() { grep -o '"\(loss\|aux_loss\|grad_norm\|val_loss\)": *[^,}]*' "$1"; }
diff <(training "$work/te.jsonl") <(training "$work/mg.jsonl") >/dev/null ||
  fail "mpirun -np 2 all-gather dispatcher vs threads all-to-all (MoE, ep 2): the training differs"
[ "$(training "$work/mg.jsonl" | grep -c '"loss"')" -eq 6 ] || fail "the all-gather run reported no losses"
echo "ok: mpirun -np 2 all-gather dispatcher vs threads all-to-all (MoE, ep 2): losses and norms identical"
# 1c. MoE parallel folding: etp 1 under tp 2 + SP, ep 2 in tp 2 x dp 2, so each ep
# group joins tp peers (other processes) that hold other sequence shards.
fold=("${moe[@]}" --set parallel.tp=2 --set parallel.sequence_parallel=true --set parallel.etp=1)
threads "${fold[@]}" --metrics "$work/tf.jsonl" >/dev/null
mpi 4 "${fold[@]}" --metrics "$work/mf.jsonl" >/dev/null
same "$work/tf.jsonl" "$work/mf.jsonl" "mpirun -np 4 vs threads (MoE folded: tp 2 + SP, etp 1, ep 2, dp 2)"

# 1d. Pipelines: with pipeline.overlap_p2p_comm (the default) each stage posts its
# next receive before computing, and comm/mpi's receiver thread takes the message
# while the stage computes; the steps equal the threads run's, and the run with
# receives at the wait.
pp=(--set parallel.dp=1 --set parallel.pp=2 --set model.num_layers=4)
threads "${pp[@]}" --metrics "$work/tp.jsonl" >/dev/null
mpi 2 "${pp[@]}" --metrics "$work/mp.jsonl" >/dev/null
same "$work/tp.jsonl" "$work/mp.jsonl" "mpirun -np 2 vs threads (pp 2, receives posted early)"
threads "${pp[@]}" --set pipeline.overlap_p2p_comm=false --metrics "$work/tpl.jsonl" >/dev/null
mpi 2 "${pp[@]}" --set pipeline.overlap_p2p_comm=false --metrics "$work/mpl.jsonl" >/dev/null
same "$work/tpl.jsonl" "$work/mpl.jsonl" "mpirun -np 2 vs threads (pp 2, receives at the wait)"
diff <(training "$work/mp.jsonl") <(training "$work/mpl.jsonl") >/dev/null ||
  fail "mpirun -np 2 (pp 2): receives posted early train differently from receives at the wait"
vpp=("${pp[@]}" --set parallel.vpp=2 --set pipeline.schedule=interleaved)
threads "${vpp[@]}" --metrics "$work/tv.jsonl" >/dev/null
mpi 2 "${vpp[@]}" --metrics "$work/mv.jsonl" >/dev/null
same "$work/tv.jsonl" "$work/mv.jsonl" "mpirun -np 2 vs threads (pp 2 x vpp 2, receives posted early)"

# 2. Checkpoints under mpirun, and resuming from them.
ck=(--set "checkpoint.dir=\"$work/ck\"" --set checkpoint.every=3)
mpi 2 "${ck[@]}" --metrics "$work/c.jsonl" >/dev/null
for s in 3 6; do
  for r in 0 1; do
    f=$(printf '%s/ck/step_%08d/rank_%05d.bin' "$work" "$s" "$r")
    [ -f "$f" ] || fail "checkpoint file $f is missing"
  done
done
same "$work/t2.jsonl" "$work/c.jsonl" "mpirun -np 2 with checkpoints vs threads"
# Written beside training (checkpoint.async_save): the processes agree on each commit;
# the same bytes.
mpi 2 --set "checkpoint.dir=\"$work/ck_async\"" --set checkpoint.every=3 --set checkpoint.async_save=true \
  --metrics "$work/ca.jsonl" >"$work/ca.out" 2>&1 || fail "mpirun -np 2 with async_save: $(tail -3 "$work/ca.out")"
grep -q "checkpoint: step 3 saved in .*, written beside training in" "$work/ca.out" || fail "async_save: $(cat "$work/ca.out")"
for s in 3 6; do
  for f in meta.toml rank_00000.bin rank_00001.bin; do
    step=$(printf 'step_%08d' "$s")
    cmp -s "$work/ck/$step/$f" "$work/ck_async/$step/$f" || fail "async_save under mpirun: $step/$f differs"
  done
done
rm -rf "$(printf '%s/ck/step_%08d' "$work" 6)"
mpi 2 "${ck[@]}" --resume --metrics "$work/r.jsonl" >/dev/null
tail -n 3 "$work/t2.jsonl" >"$work/t2_tail.jsonl"
same "$work/t2_tail.jsonl" "$work/r.jsonl" "mpirun -np 2 resumed at step 3 vs threads steps 4-6"

# 2b. Resuming that dp 2 checkpoint at pp 2 regathers it by name; each process gathers
# only its own stage's parameters and state, and the steps equal the threads run's.
rm -rf "$work/ck_pp"
cp -r "$work/ck" "$work/ck_pp"
rm -rf "$(printf '%s/ck_pp/step_%08d' "$work" 6)"
re=(--set "checkpoint.dir=\"$work/ck_pp\"" --set checkpoint.every=0 --set parallel.dp=1 --set parallel.pp=2 --resume)
threads "${re[@]}" --metrics "$work/rt.jsonl" >/dev/null 2>&1
rm -rf "$work/ck_pp" && cp -r "$work/ck" "$work/ck_pp" && rm -rf "$(printf '%s/ck_pp/step_%08d' "$work" 6)"
mpi 2 "${re[@]}" --metrics "$work/rm.jsonl" >"$work/rm.out" 2>&1
same "$work/rt.jsonl" "$work/rm.jsonl" "mpirun -np 2 resumed at pp 2 from a dp 2 checkpoint vs threads"
grep -q "resume: gathered [0-9]* of the checkpoint's [0-9]* parameters (those of this process's ranks)" "$work/rm.out" ||
  fail "the pp 2 processes should gather only their stage's parameters: $(grep resume "$work/rm.out")"
# And with another number of processes: the checkpoint's manifest describes the run
# that wrote it (2 processes), not this launch (4).
re4=(--set "checkpoint.dir=\"$work/ck_pp\"" --set checkpoint.every=0 --set parallel.dp=2 --set parallel.pp=2 --resume)
rm -rf "$work/ck_pp" && cp -r "$work/ck" "$work/ck_pp" && rm -rf "$(printf '%s/ck_pp/step_%08d' "$work" 6)"
threads "${re4[@]}" --metrics "$work/rt4.jsonl" >/dev/null 2>&1
rm -rf "$work/ck_pp" && cp -r "$work/ck" "$work/ck_pp" && rm -rf "$(printf '%s/ck_pp/step_%08d' "$work" 6)"
mpi 4 "${re4[@]}" --metrics "$work/rm4.jsonl" >"$work/rm4.out" 2>&1 || fail "resuming a 2-process checkpoint with 4: $(tail -3 "$work/rm4.out")"
same "$work/rt4.jsonl" "$work/rm4.jsonl" "mpirun -np 4 resumed at pp 2 x dp 2 from a dp 2 checkpoint written by 2 vs threads"

# 3. A failing rank ends the job promptly (comm.timeout_s is 10 minutes).
bad=$(printf '%s/ck/step_%08d/rank_%05d.bin' "$work" 6 1)
truncate -s 100 "$bad"
start=$(date +%s)
set +e
mpi 2 "${ck[@]}" --resume --set comm.timeout_s=600.0 >"$work/f.out" 2>&1
rc=$?
set -e
elapsed=$(($(date +%s) - start))
[ "$rc" -ne 0 ] || fail "a failing rank should fail the run"
[ "$rc" -ne 124 ] || fail "a failing rank left the job hanging (killed after 150 s)"
[ "$elapsed" -lt 60 ] || fail "the job took ${elapsed} s to end after a rank failed"
# Either process may say it first (rank 0 relays the reason before MPI_Abort ends rank 1).
grep -q "rank 1: .*rank_00001.bin" "$work/f.out" || { cat "$work/f.out" >&2; fail "no message naming rank 1 and its file"; }
echo "ok: a failing rank ended the job in ${elapsed} s (exit $rc)"

# 3b. SIGUSR1 to mpirun (which forwards it to every rank) stops all ranks after the
# same step with a complete checkpoint and exit 130; --resume goes on from there.
long=(--set run.steps=100000 --set optimizer.decay_steps=100000 --set run.eval_every=0
      --set "checkpoint.dir=\"$work/ck_sig\"" --set checkpoint.every=0)
# mpirun itself in the background (a wrapper such as timeout would not forward SIGUSR1).
"$mpiexec" "${flags[@]}" -np 2 "$loom" run "$manifest" --set comm.backend=mpi "${long[@]}" \
  --metrics "$work/sig.jsonl" >"$work/sig.out" 2>&1 &
job=$!
trap 'kill -KILL "$job" 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 600); do
  [ -s "$work/sig.jsonl" ] && [ "$(wc -l <"$work/sig.jsonl")" -ge 3 ] && break
  sleep 0.1
done
kill -USR1 "$job"
for _ in $(seq 600); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
kill -0 "$job" 2>/dev/null && fail "the run did not stop within 60 s of SIGUSR1"
set +e
wait "$job"
rc=$?
set -e
trap 'rm -rf "$work"' EXIT
[ "$rc" -eq 130 ] || { tail -5 "$work/sig.out" >&2; fail "SIGUSR1 under mpirun should stop with exit 130 (got $rc)"; }
stopped=$(sed -nE 's/^interrupted: stopped after step ([0-9]+).*/\1/p' "$work/sig.out")
[ -n "$stopped" ] || { cat "$work/sig.out" >&2; fail "no 'interrupted: stopped after step N' line"; }
for r in 0 1; do
  f=$(printf '%s/ck_sig/step_%08d/rank_%05d.bin' "$work" "$stopped" "$r")
  [ -f "$f" ] || fail "the interrupted run's checkpoint file $f is missing"
done
[ -f "$(printf '%s/ck_sig/step_%08d/meta.toml' "$work" "$stopped")" ] || fail "the interrupted checkpoint has no meta.toml"
timeout 150 "$mpiexec" "${flags[@]}" -np 2 "$loom" run "$manifest" --set comm.backend=mpi "${long[@]}" --resume \
  --set run.steps=$((stopped + 2)) --metrics "$work/sig_r.jsonl" >"$work/sig_r.out" 2>&1 ||
  { tail -5 "$work/sig_r.out" >&2; fail "resuming the interrupted run failed"; }
first=$(head -1 "$work/sig_r.jsonl" | sed -nE 's/.*"step": ?([0-9]+).*/\1/p')
[ "$first" = "$((stopped + 1))" ] || fail "the resumed run should start at step $((stopped + 1)), not $first"
echo "ok: SIGUSR1 to mpirun stopped both ranks after step $stopped with a checkpoint; resumed at step $first"

# 4. Misconfigurations are refused.
set +e
timeout 120 "$mpiexec" "${flags[@]}" -np 2 "$loom" run "$manifest" >"$work/l.out" 2>&1
rc=$?
set -e
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "comm/local under mpirun should be refused (exit $rc)"
grep -q "comm.backend=mpi" "$work/l.out" || { cat "$work/l.out" >&2; fail "no hint to set comm.backend=mpi"; }
echo "ok: comm/local under mpirun refused"

set +e
timeout 60 "$loom" run "$manifest" --set comm.backend=mpi >"$work/n.out" 2>&1
rc=$?
set -e
[ "$rc" -eq 1 ] || fail "comm/mpi without mpirun should exit 1 (got $rc)"
grep -q "mpirun -np 2" "$work/n.out" || { cat "$work/n.out" >&2; fail "no hint to start with mpirun -np 2"; }
echo "ok: comm/mpi without mpirun refused"

# A setup error in one process only (here its command line; on a cluster, a file its
# node lacks) is printed by that process, naming it, and ends the job.
set +e
timeout 120 "$mpiexec" "${flags[@]}" -np 1 "$loom" run "$manifest" --set comm.backend=mpi : \
  -np 1 "$loom" run "$manifest" --set comm.backend=mpi --set run.steps=0 >"$work/one.out" 2>&1
rc=$?
set -e
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "a setup error in process 1 should end the job (exit $rc)"
grep -q "^\[process 1 of 2\] manifest has 1 error" "$work/one.out" && grep -q "run.steps must be" "$work/one.out" || { cat "$work/one.out" >&2; fail "process 1's error was not printed"; }
echo "ok: a setup error in process 1 alone is printed, naming the process"
