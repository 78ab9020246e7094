#!/usr/bin/env bash
# Benchmark loom beside PyTorch on one GPU and print one table (docs/gpu.md "Benchmark beside
# PyTorch"). For each model, precision and engine selected:
#   models   gpt2-124m (configs/gpt2_124m.toml: L12 C768 H12, T 1024, B 16)
#            gpt-1.3b  (configs/gpt_1p3b.toml:  L24 C2048 H16, T 2048, B 4)
#            llama-1b  (configs/llama_1b.toml:  L16 C2048 H32 in 8 groups, SwiGLU 8192, vocab 128256, T 2048, B 4)
#   dtypes   bf16: loom device.param_dtype = bf16, device.grad_dtype = fp32 (fp32 master weights);
#                  torch autocast bf16 over fp32 weights
#            fp32: loom fp32 with device.options.tf32 = true; torch fp32 with TF32 allowed
#   engines  loom ($LOOM_BIN run, metrics from --metrics), loom-base (a baseline for before/after
#            figures from one run: the same with $LOOM_BENCH_BASE_SET, default the fused attention
#            kernels off, and the plugins of $LOOM_BENCH_BASE_PLUGIN_PATH in place of loom's own,
#            e.g. an older build's device/cuda), loom-graph (loom with exec.mode = partial_graph: each layer's
#            forward and backward replayed as CUDA graphs), torch-eager, torch-compile
#            (scripts/bench/torch_gpt.py: the same model, AdamW fused, SDPA causal attention)
# Each row: median ms/step over the timed steps (after the warm-up steps), tokens/s = B*T / step,
# MFU with one FLOP formula for every row (loom's Model::forward_flops() x 3; see torch_gpt.py),
# peak device memory, and the ratio of its tokens/s to the reference row of the same model and
# dtype: torch-compile for bf16, torch-eager for fp32 (> 1: faster than the reference).
#
# Needs: a CUDA build of loom (scripts/gpu-check.sh makes build-gpu/), python3 with torch. Nothing
# is downloaded. Environment (defaults in brackets; relative paths from the current directory):
#   LOOM_BIN [build-gpu/bin/loom; in a pack of scripts/gpu-pack.sh (LOOM_GPU_PREBUILT=DIR, or this
#     script run as DIR/scripts/bench-gpu.sh) DIR/bin/loom]; LOOM_PLUGIN_PATH is passed through.
#     Libraries as scripts/gpu-check.sh finds them: BIN/../sysroot (a pack's debs/ unpacked there
#     if needed), /usr/local/cuda/lib64, PyTorch's NCCL wheel
#   LOOM_BENCH_DIR [build-gpu/bench; DIR/bench in a pack]  logs, metrics, results.jsonl (a JSON
#     row per phase), table.md
#   LOOM_BENCH_MODELS ["gpt2-124m gpt-1.3b llama-1b"]  LOOM_BENCH_DTYPES ["bf16 fp32"]
#   LOOM_BENCH_ENGINES ["loom torch-eager torch-compile"]
#   LOOM_BENCH_STEPS [20] timed steps     LOOM_BENCH_WARMUP [5] warm-up steps (compile: at least 3)
#   LOOM_BENCH_TIMEOUT [1200] seconds per phase (timeout(1))
#   LOOM_BENCH_PEAK_BF16 / LOOM_BENCH_PEAK_FP32 [989.4 / 494.7: dense bf16 / TF32 of H100 SXM and
#     H200; H100 PCIe 756 / 378, A100 312 / 156, by the GPU's name] TFLOP/s for MFU, both engines
#   LOOM_BENCH_GRAD_DTYPE [fp32] loom's device.grad_dtype in bf16 runs
#   LOOM_BENCH_BASE_SET ["device.options.fused_attention=false"; set but empty: none] the --set
#     options (space-separated) of the loom-base engine
#   LOOM_BENCH_BASE_PLUGIN_PATH [none] ':'-separated folders whose plugin files replace loom's
#     own of the same file name for the loom-base engine: loom and its plugins are copied into
#     $LOOM_BENCH_DIR/base-install, the baseline's files over them (a plugin found in two
#     folders is an error, so the baseline cannot simply go first on the search path)
#   LOOM_BENCH_PYTHON [python3]
# Smoke test without a GPU (the loom half and the table on the CPU, tiny shapes):
#   LOOM_BENCH_DEVICE [cuda]  device.kind for loom (and --device for torch_gpt.py): cpu
#   LOOM_BENCH_SEQ, LOOM_BENCH_BATCH  override every model's T and B
#   LOOM_BIN=build/bin/loom LOOM_BENCH_DIR=build/bench-smoke LOOM_BENCH_DEVICE=cpu \
#     LOOM_BENCH_ENGINES=loom LOOM_BENCH_MODELS=gpt2-124m LOOM_BENCH_SEQ=64 LOOM_BENCH_BATCH=2 \
#     LOOM_BENCH_STEPS=3 LOOM_BENCH_WARMUP=1 scripts/bench-gpu.sh
# Exit status: 0 when every phase ran, 1 when one failed (FAIL and its log tail are printed at
# once; the table still shows every phase, the failed ones as FAIL).
set -uo pipefail
caller=$PWD
abs() { case "$1" in /* | "") printf '%s' "$1" ;; */*) printf '%s' "$caller/$1" ;; *) printf '%s' "$1" ;; esac; }
LOOM_BIN=$(abs "${LOOM_BIN:-}")  # relative paths given are the caller's; the defaults the tree's
LOOM_GPU_PREBUILT=$(abs "${LOOM_GPU_PREBUILT:+$LOOM_GPU_PREBUILT/}")
[ -n "${LOOM_BENCH_DIR:-}" ] && LOOM_BENCH_DIR=$(abs "$LOOM_BENCH_DIR/")
cd "$(dirname "$0")/.."
root=$PWD
# The loom binary: $LOOM_BIN; else a pack's (scripts/gpu-pack.sh: $LOOM_GPU_PREBUILT/bin/loom, or
# bin/loom when this script runs from inside the pack); else build-gpu/'s.
pack=""
if [ -n "${LOOM_BIN:-}" ]; then loom=$LOOM_BIN
elif [ -n "${LOOM_GPU_PREBUILT:-}" ]; then loom=$LOOM_GPU_PREBUILT/bin/loom pack=$LOOM_GPU_PREBUILT
elif [ ! -e build-gpu/bin/loom ] && [ -x bin/loom ]; then loom=bin/loom pack=$root
else loom=build-gpu/bin/loom
fi
case "$loom" in /*) ;; */*) loom=$root/$loom ;; esac  # a bare name is looked up on PATH
out=${LOOM_BENCH_DIR:-$([ -n "$pack" ] && echo "$pack/bench" || echo build-gpu/bench)}
models=${LOOM_BENCH_MODELS:-gpt2-124m gpt-1.3b llama-1b}
dtypes=${LOOM_BENCH_DTYPES:-bf16 fp32}
engines=${LOOM_BENCH_ENGINES:-loom torch-eager torch-compile}
steps=${LOOM_BENCH_STEPS:-20}
warmup=${LOOM_BENCH_WARMUP:-5}
limit=${LOOM_BENCH_TIMEOUT:-1200}
device=${LOOM_BENCH_DEVICE:-cuda}
python=${LOOM_BENCH_PYTHON:-python3}
grad_dtype=${LOOM_BENCH_GRAD_DTYPE:-fp32}
failures=0
say() { printf '%s\n' "$*"; }

mkdir -p "$out" || exit 1
out=$(cd "$out" && pwd)
results=$out/results.jsonl
: >"$results"

gpu=""
command -v nvidia-smi >/dev/null && gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
peak_bf16=989.4 peak_fp32=494.7
case "$gpu" in
  *H100*PCIe*) peak_bf16=756.0 peak_fp32=378.0 ;;
  *A100*) peak_bf16=312.0 peak_fp32=156.0 ;;
esac
peak_bf16=${LOOM_BENCH_PEAK_BF16:-$peak_bf16}
peak_fp32=${LOOM_BENCH_PEAK_FP32:-$peak_fp32}

# The libraries scripts/gpu-check.sh runs loom with: the Debian packages of its build
# (build-gpu/sysroot) or of a pack (debs/, unpacked into the pack's sysroot/ here if
# gpu-check has not yet), /usr/local/cuda/lib64, and PyTorch's NCCL wheel when the CUDA
# toolkit has none.
top=$(cd "$(dirname "$(command -v "$loom" 2>/dev/null || echo "$loom")")/.." 2>/dev/null && pwd)
sysroot=$top/sysroot
libdir=$sysroot/usr/lib/x86_64-linux-gnu
if [ -n "$top" ] && [ ! -d "$libdir" ] && ls "$top"/debs/*.deb >/dev/null 2>&1; then
  mkdir -p "$sysroot" || exit 1
  for f in "$top"/debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$f" "$sysroot" || exit 1
    else  # a .deb is an ar archive holding data.tar.*
      tmp=$(mktemp -d) && (cd "$tmp" && ar x "$f") && tar -xf "$tmp"/data.tar.* -C "$sysroot" && rm -rf "$tmp" ||
        exit 1
    fi
  done
fi
[ -d "$libdir" ] && export LD_LIBRARY_PATH=$libdir:$libdir/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ "$device" = cuda ]; then
  [ -d /usr/local/cuda/lib64 ] && export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64
  if ! ls /usr/local/cuda/lib64/libnccl.so* >/dev/null 2>&1; then
    nccl=$("$python" -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl"); print(list(s.submodule_search_locations)[0] if s else "")' 2>/dev/null || true)
    [ -n "$nccl" ] && export LD_LIBRARY_PATH=$nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
fi

say "bench-gpu: ${gpu:-no GPU (nvidia-smi)}; device $device; loom $loom; peak TFLOP/s bf16 $peak_bf16, fp32 (TF32) $peak_fp32"
say "bench-gpu: models [$models] dtypes [$dtypes] engines [$engines]; $warmup warm-up + $steps timed steps; logs in $out"
say "bench-gpu: torch $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not importable')"

data=$out/bench.txt
if [ ! -s "$data" ]; then  # ~4 MB of text: enough distinct windows for any batch here
  head -c 3000000 /dev/urandom | base64 >"$data" || exit 1
fi

# fail_row NAME MODEL DTYPE ENGINE B T WHY: a result row for a phase that did not run through.
fail_row() {
  "$python" -c 'import json, sys; n, m, d, e, b, t, why = sys.argv[1:]; print(json.dumps({"phase": n, "model": m, "dtype": d, "engine": e, "B": int(b), "T": int(t), "fail": why}))' "$@" >>"$results"
}
# failed NAME LOG RC MODEL DTYPE ENGINE B T
failed() {
  local name=$1 log=$2 rc=$3 why
  why="exit $rc"
  [ "$rc" -eq 124 ] && why="timeout ${limit}s"
  grep -qi "out of memory\|OUT_OF_MEMORY\|cudaErrorMemoryAllocation\|CUBLAS_STATUS_ALLOC_FAILED" "$log" 2>/dev/null && why="$why, out of memory"
  say "FAIL: $name ($why); last lines of $log:"
  tail -15 "$log" 2>/dev/null | sed 's/^/  | /'
  failures=$((failures + 1))
  fail_row "$name" "$4" "$5" "$6" "$7" "$8" "$why"
}

for model in $models; do
  case "$model" in
    gpt2-124m) manifest=configs/gpt2_124m.toml B=16 T=1024 ;;
    gpt-1.3b) manifest=configs/gpt_1p3b.toml B=4 T=2048 ;;
    llama-1b) manifest=configs/llama_1b.toml B=4 T=2048 ;;
    *) say "FAIL: unknown model '$model' (gpt2-124m, gpt-1.3b, llama-1b)"; failures=$((failures + 1)); continue ;;
  esac
  B=${LOOM_BENCH_BATCH:-$B}
  T=${LOOM_BENCH_SEQ:-$T}
  for dtype in $dtypes; do
    case "$dtype" in
      bf16) peak=$peak_bf16 dtype_set=(--set device.param_dtype=bf16 --set device.grad_dtype="$grad_dtype") ;;
      fp32) peak=$peak_fp32 dtype_set=(--set device.param_dtype=fp32 --set device.grad_dtype=fp32) ;;
      *) say "FAIL: unknown dtype '$dtype' (bf16, fp32)"; failures=$((failures + 1)); continue ;;
    esac
    # TF32 for fp32 GEMMs (a device/cuda option; device/cpu has none).
    [ "$device" = cuda ] && dtype_set+=(--set device.options.tf32=true)
    for engine in $engines; do
      name="${model}_${dtype}_${engine}"
      log=$out/$name.log
      say "== $model $dtype $engine (B $B, T $T)"
      case "$engine" in
        loom | loom-base | loom-graph)
          metrics=$out/$name.jsonl
          rm -f "$metrics"
          opts=(--set run.steps=$((warmup + steps)) --set run.log_every=1 --set run.eval_every=0
                --set batch.micro_batch_size="$B" --set batch.global_batch_size="$B" --set model.seq_length="$T"
                --set device.kind="$device" --set device.peak_tflops="$peak" --set data.path="\"$data\""
                "${dtype_set[@]}")
          [ "$device" = cuda ] || opts+=(--set 'device.options={}')
          plugin_path=${LOOM_PLUGIN_PATH:-} run_loom=$loom
          [ "$engine" = loom-graph ] && opts+=(--set exec.mode=partial_graph)
          if [ "$engine" = loom-base ]; then
            for kv in ${LOOM_BENCH_BASE_SET-device.options.fused_attention=false}; do opts+=(--set "$kv"); done
            if [ -n "${LOOM_BENCH_BASE_PLUGIN_PATH:-}" ]; then
              base=$out/base-install
              rm -rf "$base" && mkdir -p "$base/bin" "$base/lib/loom/plugins" && cp "$loom" "$base/bin/loom" &&
                cp "$(dirname "$loom")"/../lib/loom/plugins/*.so "$base/lib/loom/plugins/" || exit 1
              IFS=: read -ra base_dirs <<<"$LOOM_BENCH_BASE_PLUGIN_PATH"
              for d in "${base_dirs[@]}"; do cp "$d"/*.so "$base/lib/loom/plugins/" || exit 1; done
              run_loom=$base/bin/loom plugin_path=""
            fi
          fi
          LOOM_PLUGIN_PATH=$plugin_path timeout "$limit" "$run_loom" run "$manifest" "${opts[@]}" --metrics "$metrics" \
            >"$log" 2>&1
          rc=$?
          if [ "$rc" -ne 0 ]; then failed "$name" "$log" "$rc" "$model" "$dtype" "$engine" "$B" "$T"; continue; fi
          # Steps after the warm-up, in the row format of torch_gpt.py; the FLOPs loom counted
          # (flops_per_s * ms) must equal torch_gpt.py's formula.
          if ! "$python" - "$metrics" "$warmup" "$model" "$dtype" "$B" "$T" "$peak" "$engine" >>"$results" 2>"$out/$name.err" <<'EOF'
import json, os, statistics, sys
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.join(os.getcwd(), "scripts", "bench"))
import torch_gpt
path, warmup, model, dtype, B, T, peak, engine = sys.argv[1:]
warmup, B, T, peak = int(warmup), int(B), int(T), float(peak)
rows = [json.loads(l) for l in open(path) if l.strip()]
timed = [r for r in rows if r["step"] > warmup] or rows
ms = statistics.median(r["ms"] for r in timed)
flops = torch_gpt.model_flops_per_step(model, B, T)
loom_flops = statistics.median(r["flops_per_s"] * r["ms"] / 1e3 for r in timed)
if abs(loom_flops - flops) > 1e-3 * flops:
    sys.exit(f"loom counts {loom_flops:.6e} FLOPs/step, torch_gpt.py's formula {flops:.6e}")
print(json.dumps({"engine": "loom", "model": model, "dtype": dtype, "mode": engine, "B": B, "T": T,
                  "ms_step": round(ms, 3), "tokens_s": round(B * T / (ms / 1e3), 1),
                  "mfu": round(statistics.median(r["mfu"] for r in timed), 5),
                  "peak_mem_gib": round(max(r["mem_peak_bytes"] for r in rows) / 2**30, 3),
                  "flops_step": loom_flops, "peak_tflops": peak, "loss": timed[-1]["loss"],
                  "steps": len(timed)}))
EOF
          then
            cat "$out/$name.err" >>"$log"; rm -f "$out/$name.err"
            failed "$name" "$log" 1 "$model" "$dtype" "$engine" "$B" "$T"
            continue
          fi
          rm -f "$out/$name.err"
          ;;
        torch-eager | torch-compile)
          mode=${engine#torch-}
          timeout "$limit" "$python" scripts/bench/torch_gpt.py --model "$model" --dtype "$dtype" --mode "$mode" \
            --batch "$B" --seq "$T" --steps "$steps" --warmup "$warmup" --peak-tflops "$peak" --device "$device" \
            >"$log" 2>&1
          rc=$?
          row=$(grep '^{.*"ms_step"' "$log" | tail -1)
          if [ "$rc" -ne 0 ] || [ -z "$row" ]; then
            failed "$name" "$log" "$rc" "$model" "$dtype" "$engine" "$B" "$T"
            continue
          fi
          say "$row" >>"$results"
          ;;
        *)
          say "FAIL: unknown engine '$engine' (loom, loom-base, loom-graph, torch-eager, torch-compile)"
          failures=$((failures + 1))
          continue
          ;;
      esac
      tail -1 "$results"
    done
  done
done

# The table: every phase in the order it ran; ratio = tokens/s over the reference row's.
"$python" - "$results" "$out/table.md" "$gpu" "$device" <<'EOF'
import json, sys
results, table_path, gpu, device = sys.argv[1:]
rows = [json.loads(l) for l in open(results) if l.strip()]
def engine(r):
    if "fail" in r:
        return r["engine"]
    return r["mode"] if r["engine"] == "loom" else "torch " + r["mode"]
ref_name = {"bf16": "torch compile", "fp32": "torch eager"}
ref = {(r["model"], r["dtype"]): r for r in rows if "fail" not in r and engine(r) == ref_name.get(r["dtype"])}
head = ["model", "dtype", "engine/mode", "B", "T", "ms/step", "tokens/s", "MFU", "peak memory GiB", "ratio"]
lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
for r in rows:
    cells = [r["model"], r["dtype"] + (" (TF32)" if r["dtype"] == "fp32" and device == "cuda" else ""), engine(r),
             str(r["B"]), str(r["T"])]
    if "fail" in r:
        cells += ["FAIL: " + r["fail"], "", "", "", ""]
    else:
        base = ref.get((r["model"], r["dtype"]))
        ratio = f"{r['tokens_s'] / base['tokens_s']:.2f}x {ref_name[r['dtype']]}" if base else "n/a"
        cells += [f"{r['ms_step']:.1f}", f"{r['tokens_s']:,.0f}", f"{100 * r['mfu']:.1f}%",
                  f"{r['peak_mem_gib']:.2f}", ratio]
    lines.append("| " + " | ".join(cells) + " |")
peaks = sorted({(r["dtype"], r["peak_tflops"]) for r in rows if "peak_tflops" in r})
note = (f"{gpu or 'no GPU'} ({device}). MFU = FLOPs/step / (step time x peak); FLOPs/step = "
        "6*N*(L*(4C^2 + 2CF) + C*Vp) + 12*L*N*T*C with N = B*T tokens (loom's forward_flops x 3); peak "
        + ", ".join(f"{d} {p:g} TFLOP/s" for d, p in peaks)
        + ". ratio = tokens/s over torch compile's (bf16) or torch eager's (fp32), same model.")
text = "\n".join(lines) + "\n\n" + note + "\n"
open(table_path, "w").write(text)
print(text, end="")
EOF
say "bench-gpu: $failures failed phase(s); table in $out/table.md"
[ "$failures" -eq 0 ]
