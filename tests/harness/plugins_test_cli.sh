#!/usr/bin/env bash
# `loom plugins test` end to end: a correct layer passes (exit 0), a layer with a
# mistake fails the check that looks for it (exit 1, naming it), a misspelt option is
# a usage error (exit 2, with a suggestion), and the built-in layers pass.
set -uo pipefail
loom=$1 faulty=$2 builtin_dir=$3
out=$(mktemp /tmp/loom-plugins-test-XXXXXX)
trap 'rm -f "$out"' EXIT
fail() { echo "FAIL: $*"; cat "$out"; exit 1; }

"$loom" plugins test "$faulty" > "$out" 2>&1 || fail "a correct layer: exit $?"
grep -q "7 of 7 checks pass" "$out" || fail "a correct layer: no summary"

"$loom" plugins test "$faulty" --set fault=reduce > "$out" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "a layer that all-reduces its own gradient: exit $rc (expected 1)"
grep -q "FAIL  tp2 " "$out" || fail "the tp2 check did not fail"
grep -q "gain gradient" "$out" || fail "the failure does not name the parameter"

"$loom" plugins test "$faulty" --set fault=reduce --skip tp2 --skip tp2+sp > "$out" 2>&1 || fail "--skip: exit $?"
grep -q "5 of 5 checks pass" "$out" || fail "--skip did not leave the checks out"
"$loom" plugins test "$faulty" --set state=forward --skip state > "$out" 2>&1 || fail "--skip state: exit $?"
grep -q "7 of 7 checks pass" "$out" || fail "--skip state did not leave the state check out"

"$loom" plugins test "$faulty" --skip gradient > "$out" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "--skip of no such check: exit $rc (expected 2)"
grep -q "no such check" "$out" || fail "--skip of no such check: no message"

"$loom" plugins test "$faulty" --skip gradients --skip accumulation --skip microbatches --skip kv_cache --skip memory --skip tp2 --skip tp2+sp \
  > "$out" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "every check skipped: exit $rc (expected 2)"

"$loom" plugins test "$builtin_dir/loom_layer_moe.so" --set num_experts=2 --set top_k=3 > "$out" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "a layer refusing its options: exit $rc (expected 1)"
[ "$(grep -c "must be at most num_experts" "$out")" -eq 1 ] || fail "the refusal is not said once"

"$loom" plugins test "$faulty" --set faul=reduce > "$out" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "a misspelt option: exit $rc (expected 2)"
grep -q "did you mean 'fault'" "$out" || fail "a misspelt option: no suggestion"

"$loom" plugins test "$builtin_dir/loom_device_cpu.so" > "$out" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "a library without layers: exit $rc (expected 2)"
grep -q "registers no layer plugin" "$out" || fail "a library without layers: no message"

"$loom" plugins test "$builtin_dir" --json > "$out" 2>&1 || fail "the built-in layers: exit $?"
grep -q '"failures":0' "$out" || fail "the built-in layers: failures reported"
# Every advertised --tp splits the harness's model (a head per rank at least).
"$loom" plugins test "$builtin_dir/loom_layer_attention.so" --tp 8 > "$out" 2>&1 || fail "attention at --tp 8: $(tail -3 "$out")"
echo "ok"
