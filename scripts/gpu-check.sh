#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (CUDA toolkit in /usr/local/cuda):
#   1. builds loom with CUDA (build-gpu/, CMAKE_CUDA_ARCHITECTURES from $LOOM_CUDA_ARCH, default 90),
#      or takes a pack built elsewhere (LOOM_GPU_PREBUILT, below); then checks that every
#      binary finds its libraries and every plugin loads
#   2. tests: the GPU tests (device/cuda against device/cpu on every op; comm/nccl with >= 2 GPUs)
#   3. equivalence: configs/quickstart.toml for 10 steps on device/cuda (fp32) and on
#      device/cpu; every step's loss must agree within 1e-4 (relative); with >= 2 GPUs also
#      dp = 2 over comm/nccl (ranks as threads, and one process per rank under mpirun)
#      and cp = 2 (context parallelism) over comm/nccl
#      against dp = 2 on the CPU; the same for configs/quickstart_moe.toml (MoE blocks,
#      also with expert capacity; with >= 2 GPUs ep = 2 over NCCL with both dispatchers)
#      configs/deepseek_quickstart.toml (multi-latent attention before DeepSeek-V3's MoE)
#      and configs/qwen3_quickstart.toml (RMSNorm, SwiGLU, RoPE, grouped queries, qk_norm),
#      also on lines of text with packed documents and a sliding window
#   4. bf16: a run with device.param_dtype = bf16 whose loss must track the fp32 one;
#      graphs: partial graphs (exec.mode = partial_graph; MoE router sub-steps too) whose
#      losses must equal eager's, and the ms/step of both on the quickstart model (small
#      kernels: launch-bound, where graphs help);
#      recompute: activation recomputation whose losses must equal keeping the activations
#   5. bench: configs/gpt2_124m.toml (GPT-2 124M shape, sequence 1024) with the
#      largest micro-batch that fits; prints ms/step, tokens/s and MFU
# Dependencies the GPU machine lacks: .deb files in $LOOM_GPU_DEPS (default .gpu-deps/,
# made by scripts/gpu-deps.sh on a Debian 12 machine) are unpacked into $build/sysroot and
# used from there (CMAKE_PREFIX_PATH, LD_LIBRARY_PATH); NCCL is looked for in the CUDA
# toolkit, then in the Python wheel nvidia-nccl (PyTorch's), or at $LOOM_NCCL_ROOT.
#
# Build here, run there: LOOM_GPU_PREBUILT=DIR runs every phase on the binaries of a pack
# made by scripts/gpu-pack.sh on another machine (DIR/run-gpu-check.sh sets it), and builds
# nothing: the pack's debs/ are unpacked into DIR/sysroot (never into /), LD_LIBRARY_PATH
# gets their library folders, /usr/local/cuda/lib64 and the NCCL wheel's lib, and the
# pack's configs are used.
#
# Environment:
#   LOOM_GPU_PHASES     the phases to run, of "tests equivalence layouts bf16 graphs recompute samples generate bench perf"
#                       (default all); bf16, graphs and recompute make the eager runs they
#                       compare against when equivalence is not among them
#   LOOM_GPU_TIMEOUT    seconds each phase may take (default 1800, timeout(1)); a phase out
#                       of time is a failure, and the next phase runs
#   LOOM_GPU_CHECK_DIR  logs and metrics (default build-gpu/gpu-check/, DIR/gpu-check/ with a pack)
#   LOOM_GPU_PREBUILT   a pack (above); LOOM_JOBS, LOOM_CUDA_ARCH, LOOM_GPU_BUILD, LOOM_GPU_DEPS,
#                       LOOM_NCCL_ROOT: the build
# Exit status: 0 when every check passed, 1 otherwise. Checks that need 2 GPUs (or mpirun,
# or comm/nccl built with MPI) say SKIPPED with the reason; any other check that cannot run
# is a failure, never skipped.
set -uo pipefail
# Paths the caller gives are relative to where it stands: resolve them before moving.
prebuilt=${LOOM_GPU_PREBUILT:-}
if [ -n "$prebuilt" ]; then
  prebuilt=$(cd "$prebuilt" 2>/dev/null && pwd) ||
    { echo "gpu-check: LOOM_GPU_PREBUILT=$LOOM_GPU_PREBUILT is not a folder"; exit 1; }
fi
out=${LOOM_GPU_CHECK_DIR:-}
case "$out" in /* | "") ;; *) out=$PWD/$out ;; esac
deps=${LOOM_GPU_DEPS:-}  # else the repository's .gpu-deps/
case "$deps" in /* | "") ;; *) deps=$PWD/$deps ;; esac
cd "$(dirname "$0")/.." || exit 1
if [ -n "$prebuilt" ]; then cd "$prebuilt" || exit 1; fi  # the pack's configs and layout
root=$PWD
jobs=${LOOM_JOBS:-$(nproc)}
arch=${LOOM_CUDA_ARCH:-90}
build=${LOOM_GPU_BUILD:-build-gpu}
deps=${deps:-$root/.gpu-deps}
if [ -z "$out" ]; then
  if [ -n "$prebuilt" ]; then out=$root/gpu-check; else out=$root/$build/gpu-check; fi
fi
mkdir -p "$out" || { echo "gpu-check: cannot create $out"; exit 1; }
out=$(cd "$out" && pwd)
failures=0
say() { printf '%s\n' "$*"; }
fail() { say "FAIL: $*"; failures=$((failures + 1)); }
pass() { say "ok:   $*"; }

all_phases="tests equivalence layouts bf16 graphs recompute samples generate bench perf"
phases=${LOOM_GPU_PHASES:-$all_phases}
for p in $phases; do
  case " $all_phases " in
    *" $p "*) ;;
    *) say "gpu-check: unknown phase '$p' in LOOM_GPU_PHASES (phases: $all_phases)"; exit 2 ;;
  esac
done
want() { case " $phases " in *" $1 "*) return 0 ;; esac; return 1; }
phase_limit=${LOOM_GPU_TIMEOUT:-1800}
[[ $phase_limit =~ ^[1-9][0-9]*$ ]] || { say "gpu-check: LOOM_GPU_TIMEOUT=$phase_limit is not a number of seconds"; exit 2; }
# Each phase gets phase_limit seconds in all: every command of it runs under timeout(1)
# with what is left, so a hung run fails its phase instead of hanging the script.
phase_name=""
phase_end=0
phase() {  # phase NAME TITLE: starts a phase
  phase_name=$1
  phase_end=$(( $(date +%s) + phase_limit ))
  say "== $2"
}
limited() {  # limited CMD...: CMD under the time its phase has left; 124 when out of time
  local left=$(( phase_end - $(date +%s) )) rc
  if [ "$left" -le 0 ]; then
    say "gpu-check: phase $phase_name is out of time (LOOM_GPU_TIMEOUT=$phase_limit s); not started: $*"
    return 124
  fi
  timeout -k 30 "$left" "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "gpu-check: timed out: phase $phase_name has $phase_limit s (LOOM_GPU_TIMEOUT); stopped: $*"
    rc=124
  fi
  return "$rc"
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
say "gpu-check: $gpus GPU(s) visible"
say "host: $( (. /etc/os-release && echo "$PRETTY_NAME") 2>/dev/null), $(ldd --version 2>/dev/null | head -1), $(c++ --version 2>/dev/null | head -1), $(cmake --version 2>/dev/null | head -1)"
say "phases: $phases (at most $phase_limit s each); logs in $out"
if [ "$gpus" -eq 0 ]; then
  say "gpu-check: no GPU visible (nvidia-smi); nothing to check here"
  exit 1
fi

unpack() {  # unpack DIR PREFIX: every .deb of DIR into PREFIX (never into /)
  local f tmp
  mkdir -p "$2" || return 1
  for f in "$1"/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$f" "$2" || return 1
    else  # a .deb is an ar archive holding data.tar.*
      tmp=$(mktemp -d) && (cd "$tmp" && ar x "$f") && tar -xf "$tmp"/data.tar.* -C "$2" && rm -rf "$tmp" ||
        return 1
    fi
  done
}
# The nvidia-nccl wheel's folder (PyTorch's NCCL; include/nccl.h, lib/libnccl.so.2), or nothing.
nccl_wheel() {
  python3 -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl"); print(list(s.submodule_search_locations)[0] if s else "")' 2>/dev/null || true
}
nccl_version() {  # nccl_version NCCL_H: "2.28.9"
  sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' "$1" 2>/dev/null | paste -sd.
}
mpi=OFF  # comm/nccl built with MPI (one process per rank under mpirun)

if [ -n "$prebuilt" ]; then
  # ---- 1. a prebuilt pack ---------------------------------------------------------------
  say "== prebuilt pack $root (nothing is built)"
  if [ ! -x bin/loom ] || [ ! -x bin/loom_gpu_tests ] || ! ls lib/loom/plugins/*.so >/dev/null 2>&1; then
    say "gpu-check: $root is not a pack of scripts/gpu-pack.sh (bin/loom, bin/loom_gpu_tests, lib/loom/plugins/*.so)"
    exit 1
  fi
  [ -f PACK-INFO ] && grep -v "^#" PACK-INFO | sed 's/^/  /'
  mpi=$(sed -n 's/^mpi=//p' PACK-INFO 2>/dev/null)
  sysroot=$root/sysroot
  if ls debs/*.deb >/dev/null 2>&1; then
    unpack "$root/debs" "$sysroot" || { say "gpu-check: cannot unpack $root/debs into $sysroot"; exit 1; }
    say "dependencies: $(ls debs/*.deb | wc -l) packages from debs/ unpacked into $sysroot"
  fi
  libdir=$sysroot/usr/lib/x86_64-linux-gnu
  nccl_root=${LOOM_NCCL_ROOT:-}
  [ -z "$nccl_root" ] && [ ! -e /usr/local/cuda/lib64/libnccl.so.2 ] && nccl_root=$(nccl_wheel)
  # CUDA libraries a CUDA image lacks may come with PyTorch's wheels (nvidia/*/lib): looked
  # in last, after the toolkit's.
  wheel_libs=$(python3 -c 'import glob, importlib.util as u; s = u.find_spec("nvidia")
print(":".join(d for p in (s.submodule_search_locations if s else []) for d in sorted(glob.glob(p + "/*/lib"))))' 2>/dev/null || true)
  export LD_LIBRARY_PATH=${nccl_root:+$nccl_root/lib:}$libdir:$libdir/openblas-pthread:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}${wheel_libs:+:$wheel_libs}
  if [ -n "$nccl_root" ]; then
    packed=$(sed -n 's/^nccl=//p' PACK-INFO 2>/dev/null)
    found=$(nccl_version "$nccl_root/include/nccl.h")
    say "NCCL from $nccl_root (${found:-version unknown}; the pack was built against ${packed:-?})"
  fi
  loom=$root/bin/loom
  gpu_tests=$root/bin/loom_gpu_tests
  snake_dir=$root/samples  # the pack's samples/snake plugin
else
  # ---- 1. build -------------------------------------------------------------------------
  say "== build ($build, CUDA arch $arch)"
  t0=$(date +%s)
  cmake_extra=()
  if ls "$deps"/*.deb >/dev/null 2>&1; then
    sysroot=$root/$build/sysroot
    unpack "$deps" "$sysroot" || { say "gpu-check: cannot unpack $deps into $sysroot"; exit 1; }
    libdir=$sysroot/usr/lib/x86_64-linux-gnu
    export LD_LIBRARY_PATH=$libdir:$libdir/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # CMAKE_PREFIX_PATH also puts the prefix's share/glog/cmake (Debian glog's FindUnwind)
    # on the module path: see CMakeLists.txt.
    cmake_extra+=(-DCMAKE_PREFIX_PATH="$sysroot/usr" -DBLAS_LIBRARIES="$libdir/openblas-pthread/libopenblas.so.0")
    say "dependencies: $(ls "$deps"/*.deb | wc -l) packages from $deps unpacked into $sysroot"
  fi
  nccl_root=${LOOM_NCCL_ROOT:-}
  [ -z "$nccl_root" ] && [ ! -e /usr/local/cuda/include/nccl.h ] && nccl_root=$(nccl_wheel)
  if [ -n "$nccl_root" ]; then
    # Header and library both from there (CMake looks nowhere else when it is set).
    cmake_extra+=(-DLOOM_NCCL_ROOT="$nccl_root")
    export LD_LIBRARY_PATH=$nccl_root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    say "NCCL from $nccl_root ($(nccl_version "$nccl_root/include/nccl.h"))"
  fi
  mkdir -p "$build"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    "${cmake_extra[@]}" >"$out/configure.log" 2>&1 || { cat "$out/configure.log"; fail "configure"; exit 1; }
  grep -E "^-- loom:" "$out/configure.log"
  grep -q "loom: CUDA ON" "$out/configure.log" || { fail "CUDA toolkit not found by CMake"; exit 1; }
  grep -q "loom: MPI  ON" "$out/configure.log" && mpi=ON
  say "building with $jobs jobs (log: $out/build.log)"
  cmake --build "$build" -j "$jobs" >"$out/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$out/build.log" | head -20; fail "build (see $out/build.log)"; exit 1; }
  say "build: $(( $(date +%s) - t0 )) s"
  loom=$root/$build/bin/loom
  gpu_tests=$root/$build/bin/loom_gpu_tests
  # samples/snake with its CUDA kernels, out of tree against this build's SDK.
  snake_dir=$root/$build/sample-snake
  { cmake --install "$build" --prefix "$root/$build/sdk-install" &&
    cmake -S samples/snake -B "$snake_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$root/$build/sdk-install" -DSNAKE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" &&
    cmake --build "$snake_dir"; } >"$out/sample-snake.log" 2>&1 || say "samples/snake did not build (see $out/sample-snake.log)"
fi

# Every library found, every plugin loaded (a plugin that fails to load, e.g. comm/nccl on
# an NCCL older than the one it was compiled with, is otherwise noticed only by the checks
# that need it, some of which need 2 GPUs).
say "== libraries and plugins"
plugin_dir=$(dirname "$loom")/../lib/loom/plugins
missing=$(ldd "$loom" "$gpu_tests" "$plugin_dir"/*.so 2>&1 | grep "not found" | sort -u)
if [ -n "$missing" ]; then
  fail "libraries not found (LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}):"; say "$missing"
  exit 1
fi
ldd "$plugin_dir"/loom_device_cuda.so "$plugin_dir"/loom_comm_nccl.so 2>/dev/null |
  grep -E "libcudart|libcublas\.|libnccl" | sed 's/ (0x.*//; s/^[[:space:]]*/  /' | sort -u
if "$loom" plugins list >"$out/plugins.log" 2>"$out/plugins.err" && ! grep -q . "$out/plugins.err"; then
  missing=""
  for p in device/cpu device/cuda comm/local comm/nccl; do
    grep -q "^$p " "$out/plugins.log" || missing+=" $p"
  done
  if [ -z "$missing" ]; then pass "$(wc -l <"$out/plugins.log") plugins load (device/cuda, comm/nccl among them)"
  else fail "plugins missing:$missing (see $out/plugins.log)"; fi
else
  fail "plugins fail to load:"; cat "$out/plugins.err"
fi

# ---- 2. GPU tests ---------------------------------------------------------------------
if want tests; then
  phase tests "GPU tests ($gpu_tests)"
  limited "$gpu_tests" --gtest_brief=1 2>&1 | tee "$out/gpu_tests.log"
  if [ "${PIPESTATUS[0]}" -eq 0 ]; then
    pass "GPU tests"
  else
    fail "GPU tests (see $out/gpu_tests.log)"
  fi
  grep "SKIPPED" "$out/gpu_tests.log" | head -20
  # nvidia-smi sees a GPU but the CUDA runtime none (a driver older than the runtime, no
  # device nodes in a container): every test would skip and pass.
  if grep -q "no CUDA GPU visible" "$out/gpu_tests.log"; then
    fail "nvidia-smi shows $gpus GPU(s) but the CUDA runtime sees none: $(grep -m1 -o "no CUDA GPU visible[^]]*" "$out/gpu_tests.log")"
  fi
fi

# ---- 3. training equivalence ----------------------------------------------------------
# compare A.jsonl B.jsonl TOL WHAT [MEAN_TOL]: every step's loss, relative difference <= TOL
# (and their mean <= MEAN_TOL when given).
compare() {
  python3 - "$1" "$2" "$3" "$4" "${5:-inf}" <<'EOF'
import json, sys
a_path, b_path, tol, what, mean_tol = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], float(sys.argv[5])
def load(p):
    with open(p) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
a, b = load(a_path), load(b_path)
if not a or sorted(a) != sorted(b):
    print(f"{what}: steps differ: {sorted(a)} vs {sorted(b)}"); sys.exit(1)
worst = total = 0.0
for s in sorted(a):
    rel = abs(a[s] - b[s]) / max(abs(b[s]), 1e-12)
    worst = max(worst, rel)
    total += rel
    print(f"  step {s:3d}: {a[s]:.7f} vs {b[s]:.7f}  rel {rel:.2e}")
mean = total / len(a)
print(f"{what}: worst relative difference {worst:.2e} (tolerance {tol:g}), mean {mean:.2e} (tolerance {mean_tol:g})")
sys.exit(0 if worst <= tol and mean <= mean_tol and all(x == x for x in a.values()) else 1)
EOF
}

run() {  # run NAME ARGS...: loom run with metrics into $out/NAME.jsonl, log into $out/NAME.log
  local name=$1; shift
  rm -f "$out/$name.jsonl"  # never compare against an earlier invocation's metrics
  limited "$loom" run "$@" --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1
}
# once NAME ARGS...: `run`, the first time only: the eager device/cuda runs that later
# phases compare against, made by the equivalence phase or, without it, by the first
# phase that needs them.
declare -A ran=()
once() {
  local name=$1
  [ -n "${ran[$name]:-}" ] || { run "$@"; ran[$name]=$?; }
  return "${ran[$name]}"
}

# The runs every phase shares.
common=(configs/quickstart.toml --set run.steps=10 --set run.eval_every=0 --set run.log_every=1
        --set parallel.dp=1)
# MoE blocks (layer/moe: host routing, row gather/scatter, per-expert GEMMs, aux loss).
moe=(configs/quickstart_moe.toml --set run.steps=10 --set run.eval_every=0 --set run.log_every=1
     --set parallel.dp=1)

if want equivalence; then
phase equivalence "training equivalence (10 steps, fp32, loss within 1e-4)"
if run cpu_dp1 "${common[@]}" --set device.kind=cpu && once cuda_dp1 "${common[@]}" --set device.kind=cuda; then
  if compare "$out/cuda_dp1.jsonl" "$out/cpu_dp1.jsonl" 1e-4 "cuda vs cpu, dp=1"; then pass "cuda fp32 = cpu (dp=1)"
  else fail "cuda fp32 vs cpu losses differ (dp=1)"; fi
else
  fail "equivalence runs failed (see $out/cpu_dp1.log, $out/cuda_dp1.log)"; tail -n 5 "$out/cpu_dp1.log" "$out/cuda_dp1.log" 2>/dev/null
fi
if run cpu_moe "${moe[@]}" --set device.kind=cpu && once cuda_moe "${moe[@]}" --set device.kind=cuda; then
  if compare "$out/cuda_moe.jsonl" "$out/cpu_moe.jsonl" 1e-4 "cuda vs cpu, MoE, dp=1"; then pass "cuda fp32 = cpu with MoE blocks"
  else fail "cuda fp32 vs cpu losses differ with MoE blocks"; fi
else
  fail "MoE equivalence runs failed (see $out/cpu_moe.log, $out/cuda_moe.log)"; tail -n 5 "$out/cpu_moe.log" "$out/cuda_moe.log" 2>/dev/null
fi
# ... with expert capacity (dropped slots combine a zero row).
cap=(--set model.layer.moe.capacity_factor=0.5)
if run cpu_moe_cap "${moe[@]}" "${cap[@]}" --set device.kind=cpu &&
   run cuda_moe_cap "${moe[@]}" "${cap[@]}" --set device.kind=cuda; then
  if compare "$out/cuda_moe_cap.jsonl" "$out/cpu_moe_cap.jsonl" 1e-4 "cuda vs cpu, MoE with capacity"; then
    pass "cuda fp32 = cpu with MoE blocks and expert capacity"
  else fail "cuda fp32 vs cpu losses differ with MoE capacity"; fi
else
  fail "MoE capacity runs failed (see $out/cpu_moe_cap.log, $out/cuda_moe_cap.log)"; tail -n 5 "$out/cpu_moe_cap.log" "$out/cuda_moe_cap.log" 2>/dev/null
fi
# ... with DeepSeek-V3's router: sigmoid scores, groups, and the auxiliary-loss-free
# expert bias (layer state updated at each step's end).
ds=(--set 'model.layer.moe.score_function="sigmoid"' --set model.layer.moe.num_groups=2
    --set model.layer.moe.group_topk=1 --set model.layer.moe.expert_bias=true
    --set model.layer.moe.expert_bias_update_rate=0.01)
if run cpu_moe_bias "${moe[@]}" "${ds[@]}" --set device.kind=cpu &&
   run cuda_moe_bias "${moe[@]}" "${ds[@]}" --set device.kind=cuda; then
  if compare "$out/cuda_moe_bias.jsonl" "$out/cpu_moe_bias.jsonl" 1e-4 "cuda vs cpu, MoE with the expert bias"; then
    pass "cuda fp32 = cpu with DeepSeek-V3's router (sigmoid, groups, expert bias)"
  else fail "cuda fp32 vs cpu losses differ with the expert bias"; fi
else
  fail "MoE expert-bias runs failed (see $out/cpu_moe_bias.log, $out/cuda_moe_bias.log)"; tail -n 5 "$out/cpu_moe_bias.log" "$out/cuda_moe_bias.log" 2>/dev/null
fi
# DeepSeek-V3's blocks: multi-latent attention (packed heads padded, latents gathered)
# before sigmoid-routed experts with the expert bias and a shared expert.
deepseek=(configs/deepseek_quickstart.toml --set run.steps=10 --set run.eval_every=0 --set run.log_every=1
          --set parallel.dp=1)
if run cpu_deepseek "${deepseek[@]}" --set device.kind=cpu && run cuda_deepseek "${deepseek[@]}" --set device.kind=cuda; then
  if compare "$out/cuda_deepseek.jsonl" "$out/cpu_deepseek.jsonl" 1e-4 "cuda vs cpu, DeepSeek-V3 blocks"; then
    pass "cuda fp32 = cpu with DeepSeek-V3 blocks (multi-latent attention, sigmoid-routed experts)"
  else fail "cuda fp32 vs cpu losses differ with DeepSeek-V3 blocks"; fi
else
  fail "DeepSeek block runs failed (see $out/cpu_deepseek.log, $out/cuda_deepseek.log)"; tail -n 5 "$out/cpu_deepseek.log" "$out/cuda_deepseek.log" 2>/dev/null
fi
# Qwen3's blocks: RMSNorm, SwiGLU, rotary embeddings, grouped queries, q/k RMSNorm-ed per head.
qwen3=(configs/qwen3_quickstart.toml --set run.steps=10 --set run.eval_every=0 --set run.log_every=1
       --set parallel.dp=1)
if run cpu_qwen3 "${qwen3[@]}" --set device.kind=cpu && run cuda_qwen3 "${qwen3[@]}" --set device.kind=cuda; then
  if compare "$out/cuda_qwen3.jsonl" "$out/cpu_qwen3.jsonl" 1e-4 "cuda vs cpu, Qwen3 blocks"; then
    pass "cuda fp32 = cpu with Qwen3 blocks (rmsnorm, swiglu, rope, gqa, qk_norm)"
  else fail "cuda fp32 vs cpu losses differ with Qwen3 blocks"; fi
else
  fail "Qwen3 block runs failed (see $out/cpu_qwen3.log, $out/cuda_qwen3.log)"; tail -n 5 "$out/cpu_qwen3.log" "$out/cuda_qwen3.log" 2>/dev/null
fi
# The same blocks on lines of text (each line a document: data.reset_attention_mask and
# reset_position_ids) with a sliding window of 5: the attention op's window and key_start.
python3 -c "
import random
random.seed(5)
with open('$out/lines.txt', 'w') as f:
    for _ in range(2000):
        f.write(''.join(random.choice('abcdefghij ') for _ in range(random.randint(3, 40))) + '\n')
"
docs=("${qwen3[@]}" --set 'data.kind="text"' --set "data.path=\"$out/lines.txt\"" --set data.eod_token=10
      --set data.reset_attention_mask=true --set data.reset_position_ids=true --set model.seq_length=32
      --set model.layer.attention.sliding_window=5)
if run cpu_docs "${docs[@]}" --set device.kind=cpu && run cuda_docs "${docs[@]}" --set device.kind=cuda; then
  if compare "$out/cuda_docs.jsonl" "$out/cpu_docs.jsonl" 1e-4 "cuda vs cpu, documents and a sliding window"; then
    pass "cuda fp32 = cpu with packed documents and a sliding window"
  else fail "cuda fp32 vs cpu losses differ with packed documents and a sliding window"; fi
else
  fail "document runs failed (see $out/cpu_docs.log, $out/cuda_docs.log)"; tail -n 5 "$out/cpu_docs.log" "$out/cuda_docs.log" 2>/dev/null
fi
if [ "$gpus" -ge 2 ]; then
  dp2=(configs/quickstart.toml --set run.steps=10 --set run.eval_every=0 --set run.log_every=1 --set parallel.dp=2)
  if run cpu_dp2 "${dp2[@]}" --set device.kind=cpu &&
     run nccl_dp2 "${dp2[@]}" --set device.kind=cuda --set comm.backend=nccl; then
    if compare "$out/nccl_dp2.jsonl" "$out/cpu_dp2.jsonl" 1e-4 "cuda+nccl vs cpu, dp=2"; then pass "cuda+nccl dp=2 = cpu dp=2"
    else fail "cuda+nccl dp=2 vs cpu dp=2 losses differ"; fi
  else
    fail "dp=2 runs failed (see $out/cpu_dp2.log, $out/nccl_dp2.log)"; tail -5 "$out/nccl_dp2.log"
  fi
  # Context parallelism over NCCL (K/V all-gathered over cp, windowed attention) against
  # the serial CPU run of the same data.
  cp2=(configs/quickstart.toml --set run.steps=10 --set run.eval_every=0 --set run.log_every=1 --set parallel.dp=1)
  if run cpu_cp1 "${cp2[@]}" --set device.kind=cpu &&
     run nccl_cp2 "${cp2[@]}" --set parallel.cp=2 --set device.kind=cuda --set comm.backend=nccl; then
    if compare "$out/nccl_cp2.jsonl" "$out/cpu_cp1.jsonl" 1e-4 "cuda+nccl cp=2 vs cpu serial"; then
      pass "cuda+nccl cp=2 = cpu serial"
    else fail "cuda+nccl cp=2 vs cpu serial losses differ"; fi
  else
    fail "cp=2 runs failed (see $out/cpu_cp1.log, $out/nccl_cp2.log)"; tail -5 "$out/nccl_cp2.log"
  fi
  # Expert parallelism over NCCL (all_to_all_v as grouped send/recv; all_gather and
  # reduce_scatter for the other dispatcher) against the CPU without ep.
  moe2=(configs/quickstart_moe.toml --set run.steps=10 --set run.eval_every=0 --set run.log_every=1
        --set parallel.dp=2)
  if run cpu_moe_dp2 "${moe2[@]}" --set device.kind=cpu; then
    for d in expert expert.allgather; do
      if run "nccl_moe_ep2_$d" "${moe2[@]}" --set parallel.ep=2 --set parallel.expert="$d" --set device.kind=cuda \
           --set comm.backend=nccl; then
        if compare "$out/nccl_moe_ep2_$d.jsonl" "$out/cpu_moe_dp2.jsonl" 1e-4 "cuda+nccl ep=2 ($d) vs cpu ep=1"; then
          pass "cuda+nccl MoE dp=2 x ep=2 ($d dispatcher) = cpu dp=2"
        else fail "cuda+nccl MoE ep=2 ($d) vs cpu losses differ"; fi
      else
        fail "MoE ep=2 over nccl ($d) failed (see $out/nccl_moe_ep2_$d.log)"; tail -5 "$out/nccl_moe_ep2_$d.log"
      fi
    done
  else
    fail "the CPU MoE dp=2 run failed (see $out/cpu_moe_dp2.log)"
  fi
  # One process per rank: the NCCL ids travel over MPI.
  if [ "$mpi" != ON ]; then
    say "SKIPPED: comm/nccl with one process per rank: this comm/nccl was built without MPI (a pack of scripts/gpu-pack.sh, or no MPI found by CMake)"
  elif command -v mpirun >/dev/null; then
    mpi_flags=(--oversubscribe); [ "$(id -u)" -eq 0 ] && mpi_flags+=(--allow-run-as-root)
    rm -f "$out/nccl_mpi_dp2.jsonl"
    if limited mpirun "${mpi_flags[@]}" -np 2 "$loom" run "${dp2[@]}" --set device.kind=cuda --set comm.backend=nccl \
         --metrics "$out/nccl_mpi_dp2.jsonl" >"$out/nccl_mpi_dp2.log" 2>&1; then
      if compare "$out/nccl_mpi_dp2.jsonl" "$out/cpu_dp2.jsonl" 1e-4 "cuda+nccl under mpirun vs cpu, dp=2"; then
        pass "cuda+nccl dp=2, one process per rank = cpu dp=2"
      else fail "cuda+nccl under mpirun vs cpu dp=2 losses differ"; fi
    else
      fail "mpirun -np 2 with comm/nccl failed (see $out/nccl_mpi_dp2.log)"; tail -5 "$out/nccl_mpi_dp2.log"
    fi
  else
    say "SKIPPED: comm/nccl with one process per rank needs mpirun"
  fi
else
  say "SKIPPED: dp=2 and MoE ep=2 over comm/nccl (threads and mpirun) need 2 GPUs"
fi
fi  # equivalence

# ---- every parallel layout on one GPU -----------------------------------------------------
# Ranks as threads sharing the GPU, comm/local: the engine stages each collective's
# device buffers through host memory (runtime::DeviceStaging). Each layout against the
# CPU run of the same layout.
if want layouts; then
phase layouts "every layout on one GPU (comm/local, staged through host memory) against the CPU, loss within 1e-4"
lay=(configs/quickstart.toml --set run.steps=10 --set run.eval_every=0 --set run.log_every=1)
layout_row() {  # layout_row NAME MANIFEST-ARGS...
  local name=$1; shift
  if run "cpu_$name" "$@" --set device.kind=cpu && run "local_$name" "$@" --set device.kind=cuda; then
    if compare "$out/local_$name.jsonl" "$out/cpu_$name.jsonl" 1e-4 "cuda+local vs cpu, $name"; then
      pass "one GPU, comm/local, $name = cpu"
    else fail "one GPU, comm/local, $name: losses differ from the CPU's"; fi
  else
    fail "one GPU, comm/local, $name: a run failed (see $out/cpu_$name.log, $out/local_$name.log)"
    tail -n 5 "$out/local_$name.log" 2>/dev/null
  fi
}
layout_row dp2 "${lay[@]}" --set parallel.dp=2
layout_row dp2_distributed "${lay[@]}" --set parallel.dp=2 --set optimizer.strategy='"distributed"' \
  --set optimizer.overlap_grad_reduce=true --set optimizer.overlap_param_gather=true --set optimizer.bucket_size=20000
layout_row tp2_sp "${lay[@]}" --set parallel.dp=1 --set parallel.tp=2 --set parallel.sequence_parallel=true
layout_row cp2 "${lay[@]}" --set parallel.dp=1 --set parallel.cp=2
layout_row pp2_vpp2 "${lay[@]}" --set parallel.dp=1 --set parallel.pp=2 --set parallel.vpp=2 \
  --set pipeline.schedule='"interleaved"'
layout_row moe_ep2 configs/quickstart_moe.toml --set run.steps=10 --set run.eval_every=0 --set run.log_every=1 \
  --set parallel.dp=2 --set parallel.ep=2
fi  # layouts

# ---- 4. bf16, partial graphs, recomputation ---------------------------------------------
if want bf16; then
phase bf16 "bf16 run (device.param_dtype = bf16) against fp32"
if ! once cuda_dp1 "${common[@]}" --set device.kind=cuda; then
  fail "the fp32 device/cuda run bf16 is compared against failed (see $out/cuda_dp1.log)"; tail -5 "$out/cuda_dp1.log"
elif run cuda_bf16 "${common[@]}" --set device.kind=cuda --set device.param_dtype=bf16 --set device.grad_dtype=bf16; then
  # The criteria of tests/unit/mixed_precision_test.cpp on the CPU: within 5% at every
  # step and 2.5% on average; identical losses would mean bf16 was not applied.
  if cmp -s <(python3 -c 'import json,sys; [print(json.loads(l)["loss"]) for l in open(sys.argv[1])]' "$out/cuda_bf16.jsonl") \
            <(python3 -c 'import json,sys; [print(json.loads(l)["loss"]) for l in open(sys.argv[1])]' "$out/cuda_dp1.jsonl"); then
    fail "the bf16 losses are bit-identical to fp32: device.param_dtype = bf16 was not applied"
  elif compare "$out/cuda_bf16.jsonl" "$out/cuda_dp1.jsonl" 5e-2 "bf16 vs fp32" 2.5e-2; then
    pass "bf16 tracks fp32 (within 5% per step, 2.5% on average)"
  else
    fail "bf16 loss does not track fp32"
  fi
else
  fail "bf16 run failed (see $out/cuda_bf16.log)"; tail -5 "$out/cuda_bf16.log"
fi
fi  # bf16

if want graphs; then
phase graphs "partial graphs (exec.mode = partial_graph) against eager, device/cuda fp32"
if ! once cuda_dp1 "${common[@]}" --set device.kind=cuda; then
  fail "the eager device/cuda run partial graphs are compared against failed (see $out/cuda_dp1.log)"; tail -5 "$out/cuda_dp1.log"
elif run cuda_graph "${common[@]}" --set device.kind=cuda --set exec.mode=partial_graph; then
  # The graphs replay the launches eager makes, on the same stream; the tolerance only
  # covers cuBLAS choosing another algorithm under capture.
  if compare "$out/cuda_graph.jsonl" "$out/cuda_dp1.jsonl" 1e-6 "partial_graph vs eager"; then
    grep "^exec " "$out/cuda_graph.log" || true
    pass "partial_graph = eager on the GPU"
  else fail "partial_graph losses differ from eager on the GPU"; fi
else
  fail "partial_graph run failed (see $out/cuda_graph.log)"; tail -5 "$out/cuda_graph.log"
fi
# The speed of both, at dp = 1 (the quickstart's dp = 2 is refused on device/cuda with comm/local).
speed=(configs/quickstart.toml --set run.steps=60 --set run.eval_every=0 --set run.log_every=1 --set parallel.dp=1
       --set device.kind=cuda)
if run speed_eager "${speed[@]}" && run speed_graph "${speed[@]}" --set exec.mode=partial_graph; then
  if python3 - "$out/speed_eager.jsonl" "$out/speed_graph.jsonl" <<'EOF'
import json, sys
def ms(path):
    rows = [json.loads(l) for l in open(path)][10:]  # after warm-up and capture
    return sum(r["ms"] for r in rows) / len(rows)
e, g = ms(sys.argv[1]), ms(sys.argv[2])
print(f"  quickstart model, steps 11-60: eager {e:.2f} ms/step, partial_graph {g:.2f} ms/step ({e / g:.2f}x)")
EOF
  then pass "partial_graph and eager ms/step measured"
  else fail "no ms/step from $out/speed_eager.jsonl, $out/speed_graph.jsonl"; fi
else
  fail "the speed runs failed (see $out/speed_eager.log, $out/speed_graph.log)"
  tail -n 5 "$out/speed_eager.log" "$out/speed_graph.log" 2>/dev/null
fi
# MoE blocks: their router parts are captured as moe_router sub-steps (ABI 1.7), routing
# and experts run eagerly between the replays, on the addresses of the capture.
if ! once cuda_moe "${moe[@]}" --set device.kind=cuda; then
  fail "the eager device/cuda MoE run failed (see $out/cuda_moe.log)"; tail -5 "$out/cuda_moe.log"
elif run cuda_moe_graph "${moe[@]}" --set device.kind=cuda --set exec.mode=partial_graph; then
  if compare "$out/cuda_moe_graph.jsonl" "$out/cuda_moe.jsonl" 1e-6 "partial_graph vs eager, MoE"; then
    grep "^exec " "$out/cuda_moe_graph.log" || true
    pass "partial_graph = eager on the GPU with MoE router sub-steps"
  else fail "partial_graph losses differ from eager on the GPU with MoE blocks"; fi
else
  fail "partial_graph MoE run failed (see $out/cuda_moe_graph.log)"; tail -5 "$out/cuda_moe_graph.log"
fi
fi  # graphs

if want recompute; then
phase recompute "activation recomputation (uniform groups of 2) against keeping activations, device/cuda"
# The recomputed forward repeats the same kernels on the same inputs: equal losses.
if ! once cuda_dp1 "${common[@]}" --set device.kind=cuda; then
  fail "the device/cuda run recomputation is compared against failed (see $out/cuda_dp1.log)"; tail -5 "$out/cuda_dp1.log"
elif run cuda_recompute "${common[@]}" --set device.kind=cuda --set model.recompute_granularity=full \
     --set model.recompute_method=uniform --set model.recompute_num_layers=2; then
  if compare "$out/cuda_recompute.jsonl" "$out/cuda_dp1.jsonl" 1e-6 "recompute vs kept activations"; then
    pass "recomputation = keeping activations on the GPU"
  else fail "recomputation changes the losses on the GPU"; fi
else
  fail "recompute run failed (see $out/cuda_recompute.log)"; tail -5 "$out/cuda_recompute.log"
fi
fi  # recompute

# ---- a plugin's own kernels ----------------------------------------------------------------
if want samples; then
phase samples "a plugin's own CUDA kernels: samples/snake in every block, against device/cpu and under partial graphs"
snake=(configs/quickstart.toml --set run.steps=10 --set run.eval_every=0 --set run.log_every=1 --set parallel.dp=1
       "--set=model.block=[\"attention\", \"mlp\", \"snake\"]")
if [ ! -e "$snake_dir/loom_layer_snake.so" ]; then
  fail "samples/snake is not built ($snake_dir/loom_layer_snake.so)"
else
  export LOOM_PLUGIN_PATH=$snake_dir${LOOM_PLUGIN_PATH:+:$LOOM_PLUGIN_PATH}
  if run snake_cpu "${snake[@]}" --set device.kind=cpu && run snake_cuda "${snake[@]}" --set device.kind=cuda; then
    if compare "$out/snake_cuda.jsonl" "$out/snake_cpu.jsonl" 1e-4 "snake: cuda vs cpu"; then
      pass "samples/snake's CUDA kernels train as its CPU host tasks do"
    else fail "samples/snake: cuda losses differ from cpu"; fi
    if run snake_cuda_graph "${snake[@]}" --set device.kind=cuda --set exec.mode=partial_graph &&
       compare "$out/snake_cuda_graph.jsonl" "$out/snake_cuda.jsonl" 1e-6 "snake: partial_graph vs eager"; then
      grep "^exec " "$out/snake_cuda_graph.log" || true
      pass "samples/snake's kernels are captured and replayed on the GPU"
    else fail "samples/snake under partial_graph (see $out/snake_cuda_graph.log)"; tail -5 "$out/snake_cuda_graph.log"; fi
  else
    fail "samples/snake runs failed (see $out/snake_cpu.log, $out/snake_cuda.log)"
    tail -n 5 "$out/snake_cpu.log" "$out/snake_cuda.log" 2>/dev/null
  fi
fi
fi  # samples

# ---- generation and evaluation ---------------------------------------------------------
if want generate; then
phase generate "loom generate (key/value cache) and loom eval on device/cuda against device/cpu"
ids() {  # ids NAME ARGS...: the greedy ids loom generate writes from $gen_ckpt, into $out/NAME.json
  local name=$1; shift
  limited "$loom" generate "$gen_ckpt" --prompt "123+456=" --temperature 0 --max-new-tokens 6 --json "$@" \
    >"$out/$name.json" 2>"$out/$name.err"
  sed -n 's/.*"ids":\(\[[0-9,]*\]\).*/\1/p' "$out/$name.json"
}
same_tokens() {  # same_tokens PREFIX WHAT: the GPU's greedy ids, cached and not, are the CPU's
  local cpu cuda recompute
  cpu=$(ids "$1_cpu" --set device.kind=cpu)
  cuda=$(ids "$1_cuda" --set device.kind=cuda --set 'device.options={}')
  recompute=$(ids "$1_cuda_nocache" --set device.kind=cuda --set 'device.options={}' --no-cache)
  if [ -n "$cpu" ] && [ "$cuda" = "$cpu" ] && [ "$recompute" = "$cpu" ]; then
    pass "$2 writes the CPU's tokens $cpu"
  else
    fail "$2: cpu $cpu, cuda $cuda, cuda --no-cache $recompute (see $out/$1_*.err)"
  fi
}
gen_ckpt=$out/gen_ckpt
rm -rf "$gen_ckpt"
if run gen_train configs/quickstart.toml --set run.steps=100 --set run.eval_every=0 --set parallel.dp=1 \
     --set device.kind=cpu --set "checkpoint.dir=\"$gen_ckpt\""; then
  same_tokens gen "loom generate on the GPU (cache and no cache)"
  printf '%s' "123+456=9750|321+654=5790|111+222=3330|" > "$out/eval.txt"
  loss() {  # loss NAME ARGS...: loom eval's loss over eval.txt
    local name=$1; shift
    limited "$loom" eval "$gen_ckpt" --data "$out/eval.txt" --stride 4 --json "$@" >"$out/$name.json" 2>"$out/$name.err"
    sed -n 's/.*"loss":\([^,}]*\).*/\1/p' "$out/$name.json"
  }
  cpu_loss=$(loss eval_cpu --set device.kind=cpu)
  cuda_loss=$(loss eval_cuda --set device.kind=cuda --set 'device.options={}')
  if [ -n "$cpu_loss" ] && awk -v a="$cpu_loss" -v b="$cuda_loss" 'BEGIN { d = a - b; exit !(b != "" && d < 1e-4 && d > -1e-4) }'; then
    pass "loom eval on the GPU: loss $cuda_loss (cpu $cpu_loss)"
  else fail "loom eval: cpu loss '$cpu_loss', cuda '$cuda_loss' (see $out/eval_*.err)"; fi
else
  fail "training the generation checkpoint failed (see $out/gen_train.log)"; tail -5 "$out/gen_train.log"
fi
# Multi-latent attention's latent cache (the up projections absorbed), after a dense
# first block (model.block_pattern), as DeepSeek-V2/V3.
gen_ckpt=$out/gen_mla_ckpt
rm -rf "$gen_ckpt"
mla=(--set 'model.blocks.dense=["attention", "mlp"]' --set 'model.block_pattern=["dense", "block*3"]'
     --set model.layer.mlp.norm=rmsnorm --set model.layer.mlp.activation=swiglu --set model.layer.mlp.bias=false
     --set model.layer.mlp.norm_epsilon=1e-6)
if run gen_mla_train configs/deepseek_quickstart.toml --set run.steps=100 --set run.eval_every=0 --set parallel.dp=1 \
     --set device.kind=cpu --set "checkpoint.dir=\"$gen_ckpt\"" "${mla[@]}"; then
  same_tokens gen_mla "loom generate with multi-latent attention's latent cache on the GPU (cache and no cache)"
else
  fail "training the multi-latent attention checkpoint failed (see $out/gen_mla_train.log)"; tail -5 "$out/gen_mla_train.log"
fi
fi  # generate

# ---- 5. benchmark ------------------------------------------------------------------------
if want bench; then
phase bench "benchmark: GPT-2 124M shape, sequence 1024"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
peak=494.7  # TF32 dense TFLOP/s of H100 SXM / H200 (the engine trains fp32 storage; GEMMs on TF32)
case "$name" in
  *H100*PCIe*) peak=378.0 ;;
  *A100*) peak=156.0 ;;
esac
head -c 2000000 /dev/urandom | base64 >"$out/bench.txt"  # ~2.7 MB of text: enough distinct windows
best=""
for mbs in 64 32 24 16 8 4 2 1; do
  run "bench_mbs$mbs" configs/gpt2_124m.toml --set run.steps=12 --set batch.micro_batch_size=$mbs \
    --set batch.global_batch_size=$mbs --set device.peak_tflops=$peak --set data.path="\"$out/bench.txt\""
  rc=$?
  if [ "$rc" -eq 0 ]; then
    best=$mbs
    break
  fi
  if [ "$rc" -eq 124 ]; then
    say "  micro-batch $mbs: out of time"; tail -1 "$out/bench_mbs$mbs.log"
    break
  elif grep -qi "out of memory\|OUT_OF_MEMORY\|cudaErrorMemoryAllocation\|CUBLAS_STATUS_ALLOC_FAILED" "$out/bench_mbs$mbs.log"; then
    say "  micro-batch $mbs: out of memory"
  else
    say "  micro-batch $mbs: failed (not OOM):"; tail -3 "$out/bench_mbs$mbs.log"
  fi
done
if [ -z "$best" ]; then
  fail "benchmark: no micro-batch size ran (see $out/bench_mbs*.log)"
elif python3 - "$out/bench_mbs$best.jsonl" "$best" "$name" "$peak" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steady = rows[2:] if len(rows) > 4 else rows  # the first steps include warm-up (cuBLAS heuristics, allocator)
ms = sum(r["ms"] for r in steady) / len(steady)
tok = sum(r["tokens_per_s"] for r in steady) / len(steady)
mfu = sum(r["mfu"] for r in steady) / len(steady)
peak_mem = max(r["mem_peak_bytes"] for r in rows) / 2**30
print(f"benchmark: GPT-2 124M, seq 1024, micro-batch {sys.argv[2]}, 1 x {sys.argv[3]}")
print(f"  {ms:.1f} ms/step | {tok:,.0f} tokens/s | MFU {100*mfu:.1f}% of {sys.argv[4]} TFLOP/s | peak memory {peak_mem:.1f} GiB")
EOF
then
  pass "benchmark"
else
  fail "benchmark: no figures from $out/bench_mbs$best.jsonl"
fi
fi  # bench

# ---- 6. the step-time estimate against the measured step ------------------------------------
if want perf; then
phase perf "loom plan --perf: estimated against measured step time, single-GPU models (within 20%)"
head -c 2000000 /dev/urandom | base64 >"$out/perf.txt"
perf_row() {  # perf_row NAME MANIFEST ARGS...: estimate, measurement, ratio; the profile kept in $out
  local name=$1 manifest=$2; shift 2
  if limited "$loom" plan "$manifest" --perf --check 12 --json --save-profile "$out/$name.profile.json" \
       --set data.path="\"$out/perf.txt\"" --set data.kind='"text"' "$@" >"$out/$name.json" 2>"$out/$name.err" &&
     python3 - "$out/$name.json" "$name" <<'EOF'
import json, sys
t = json.load(open(sys.argv[1]))
e, m = t["step_ms"], t["measured_step_ms"]
print(f"  {sys.argv[2]}: estimate {e:.1f} ms/step, measured {m:.1f}, ratio {e / m:.2f}")
sys.exit(0 if abs(e / m - 1) <= 0.2 else 3)
EOF
  then pass "loom plan --perf, $name: within 20% of the measured step"
  else fail "loom plan --perf, $name: not within 20% (or failed; see $out/$name.json, $out/$name.err)"; fi
}
perf_row perf_gpt2_124m configs/gpt2_124m.toml --set batch.micro_batch_size=8 --set batch.global_batch_size=16
perf_row perf_gpt_1p3b configs/gpt_1p3b.toml --set batch.global_batch_size=8
fi  # perf

for p in $all_phases; do want "$p" || say "not selected (LOOM_GPU_PHASES): $p"; done
say "== gpu-check: $failures failure(s); logs in $out"
[ "$failures" -eq 0 ]
