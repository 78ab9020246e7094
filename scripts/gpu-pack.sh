#!/usr/bin/env bash
# Build here, run on a GPU machine: builds loom with CUDA on this machine (Debian 12; no
# GPU needed, only the CUDA toolkit with NCCL in /usr/local/cuda) and stages into DIR
# (default .gpu-pack/, git-ignored) everything a GPU machine needs to run
# scripts/gpu-check.sh without building anything:
#
#   bin/loom, bin/loom_gpu_tests (and the other GPU programs built: loom_attention_bench)
#   lib/loom/plugins/*.so        every plugin; device/cuda for CUDA_ARCHITECTURES $LOOM_CUDA_ARCH
#   samples/loom_layer_snake.so  samples/snake with its CUDA kernels (built against the SDK)
#   debs/*.deb                   runtime libraries a bare Ubuntu 24.04 lacks (Boost 1.74,
#                                TOML++, glog, gflags, libunwind, OpenBLAS and its libgfortran)
#   configs/, scripts/           what the checks run
#   run-gpu-check.sh             the runner: LOOM_GPU_PREBUILT=DIR DIR/scripts/gpu-check.sh
#   PACK-INFO                    what it was built from (commit, compiler, CUDA, NCCL, ...)
#
#   scripts/gpu-pack.sh                       # here
#   (carry .gpu-pack to the GPU machine)      # e.g. the device tool's `carry`
#   .gpu-pack/run-gpu-check.sh                # there
#
# Binaries and plugins are stripped (no debug info: the pack stays small enough to
# carry). CUDA, cuBLAS and NCCL are not packed: they come with the GPU machine
# (/usr/local/cuda, PyTorch's nvidia-nccl wheel), and comm/nccl refuses to load on an
# NCCL older than the one it was compiled with here (PACK-INFO says which). MPI is left
# out (-DLOOM_WITH_MPI=OFF): an image without OpenMPI could not load it; the >= 2 GPU
# mpirun check then says SKIPPED.
#
# Before finishing it checks that the staged files resolve every library they need from
# the unpacked .debs alone (plus glibc, libstdc++, libgcc_s, zlib/xz/zstd and CUDA/NCCL,
# which the GPU machine has), and that they need no newer glibc (2.39) or libstdc++
# (GCC 13) than Ubuntu 24.04's.
#
# Environment: LOOM_JOBS (build parallelism, default 2), LOOM_CUDA_ARCH (default 90),
# LOOM_GPU_PACK_BUILD (build tree, default build-gpu-pack), LOOM_GPU_PACK_TYPE
# (RelWithDebInfo, default, or Release), LOOM_NCCL_ROOT (NCCL to build against; default:
# the CUDA toolkit's), LOOM_GPU_DEPS (where .deb files already downloaded by
# scripts/gpu-deps.sh are taken from when apt-get cannot download; default .gpu-deps).
set -uo pipefail
pack=${1:-}  # relative to where the caller stands; default: the repository's .gpu-pack
case "$pack" in /* | "") ;; *) pack=$PWD/$pack ;; esac
cd "$(dirname "$0")/.." || exit 1
root=$PWD
pack=${pack:-$root/.gpu-pack}
build=${LOOM_GPU_PACK_BUILD:-build-gpu-pack}
jobs=${LOOM_JOBS:-2}
arch=${LOOM_CUDA_ARCH:-90}
type=${LOOM_GPU_PACK_TYPE:-RelWithDebInfo}
say() { printf 'gpu-pack: %s\n' "$*"; }
die() { printf 'gpu-pack: %s\n' "$*" >&2; exit 1; }

# The runtime packages (shared libraries only; headers are not needed to run). ldd of the
# staged files decides: the check at the end names any library still missing. Boost's
# system and atomic are not needed by filesystem 1.74 today, but small (0.4 MB); libgfortran5
# and libquadmath0 are OpenBLAS's (dlopened by device/cpu, so ldd of the binaries misses it).
packages=(
  libboost-filesystem1.74.0 libboost-system1.74.0 libboost-atomic1.74.0
  libtomlplusplus3
  libgoogle-glog0v6 libgflags2.2 libunwind8
  libopenblas0-pthread libgfortran5 libquadmath0
  libsentencepiece0
)
# Libraries the GPU machine has itself (Ubuntu 24.04: glibc 2.39, GCC 13/14's libstdc++ and
# libgcc_s, zlib, xz, zstd; CUDA in /usr/local/cuda; NCCL from the wheel).
host_libs='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|lib(c|m|dl|pthread|rt|resolv)\.so\.[0-9]+|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libz\.so\.1|liblzma\.so\.5|libzstd\.so\.1|libcuda\.so\.1|libcudart\.so\.[0-9]+|libcublas(Lt)?\.so\.[0-9]+|libnccl\.so\.2)$'
max_glibc=2.39
max_glibcxx=3.4.32  # GCC 13

# DIR is emptied first: only a folder that is new, empty, or an earlier pack.
if [ -e "$pack" ] && [ ! -f "$pack/PACK-INFO" ] && [ -n "$(ls -A "$pack" 2>/dev/null)" ]; then
  die "$pack exists and is not a pack (no PACK-INFO); give a new folder"
fi

# ---- 1. build ---------------------------------------------------------------------------
mkdir -p "$build"
say "configuring $build ($type, CUDA arch $arch, MPI off)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="$type" -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DLOOM_WITH_CUDA=ON -DLOOM_WITH_MPI=OFF -DLOOM_BUILD_TESTS=ON -DLOOM_NCCL_ROOT="${LOOM_NCCL_ROOT:-}" \
  >"$build/pack-configure.log" 2>&1 || { cat "$build/pack-configure.log"; die "configure failed"; }
grep -E "^-- loom:" "$build/pack-configure.log"
# A pack without device/cuda or comm/nccl could not run the checks it is made for.
grep -q "loom: CUDA ON" "$build/pack-configure.log" || die "CMake found no CUDA toolkit (/usr/local/cuda)"
grep -q "loom: NCCL ON" "$build/pack-configure.log" ||
  die "CMake found no NCCL (comm/nccl would be missing); set LOOM_NCCL_ROOT to an NCCL install"
# Only what the pack holds: the loom binary, the GPU programs and every plugin (the unit
# tests are not needed there, and take most of the build time).
targets=$(ninja -C "$build" -t targets all 2>/dev/null)
plugin_outputs=$(grep -oE '^lib/loom/plugins/loom_[^:]+\.so' <<<"$targets" | sort -u)
[ -n "$plugin_outputs" ] || die "no plugin targets found in $build"
programs=(loom loom_gpu_tests)
grep -q '^loom_attention_bench:' <<<"$targets" && programs+=(loom_attention_bench)
t0=$(date +%s)
# shellcheck disable=SC2086  # one target per line
cmake --build "$build" -j "$jobs" --target "${programs[@]}" $plugin_outputs || die "build failed"
say "build: $(( $(date +%s) - t0 )) s"
# samples/snake (a layer with its own CUDA kernels), built out of tree against this
# build's SDK as a plugin author builds it; gpu-check's samples phase runs it on the GPU.
sdk=$root/$build/sdk-install
cmake --install "$build" --prefix "$sdk" >"$build/pack-sdk-install.log" 2>&1 || die "SDK install failed"
cmake -S samples/snake -B "$build/sample-snake" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$sdk" \
  -DSNAKE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" >"$build/pack-snake.log" 2>&1 &&
  cmake --build "$build/sample-snake" >>"$build/pack-snake.log" 2>&1 ||
  { cat "$build/pack-snake.log"; die "samples/snake failed to build"; }

# ---- 2. stage ---------------------------------------------------------------------------
rm -rf "$pack" && mkdir -p "$pack/bin" "$pack/lib/loom/plugins" "$pack/debs" || die "cannot create $pack"
for p in "${programs[@]}"; do
  strip -o "$pack/bin/$p" "$build/bin/$p" || die "strip $p failed"
done
mkdir -p "$pack/samples" && strip --strip-unneeded -o "$pack/samples/loom_layer_snake.so" \
  "$build/sample-snake/loom_layer_snake.so" || die "strip samples/snake failed"
for f in $plugin_outputs; do
  strip --strip-unneeded -o "$pack/$f" "$build/$f" || die "strip $f failed"
done
cp -r configs "$pack/configs"
mkdir -p "$pack/scripts" && cp scripts/*.sh "$pack/scripts/"
[ -d scripts/bench ] && mkdir -p "$pack/scripts/bench" && cp scripts/bench/*.py "$pack/scripts/bench/" 2>/dev/null
cat >"$pack/run-gpu-check.sh" <<'EOF'
#!/usr/bin/env bash
# Runs scripts/gpu-check.sh on this pack's binaries (made by scripts/gpu-pack.sh): nothing is
# built; debs/ is unpacked into sysroot/ here (never into /); logs go to gpu-check/ here
# unless LOOM_GPU_CHECK_DIR says otherwise. LOOM_GPU_PHASES, LOOM_GPU_TIMEOUT: see the
# script's header.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOOM_GPU_PREBUILT=$here exec "$here/scripts/gpu-check.sh" "$@"
EOF
chmod +x "$pack/run-gpu-check.sh"

# The runtime .debs: downloaded, or taken from scripts/gpu-deps.sh's folder when offline.
deps=${LOOM_GPU_DEPS:-.gpu-deps}
(cd "$pack/debs" && apt-get download "${packages[@]}" 2>&1 | grep -v "^W: Download is performed unsandboxed") >/dev/null
for p in "${packages[@]}"; do
  if ! ls "$pack/debs/${p}_"*.deb >/dev/null 2>&1; then
    ls "$deps/${p}_"*.deb >/dev/null 2>&1 && cp "$deps/${p}_"*.deb "$pack/debs/" ||
      die "$p could not be downloaded (apt-get download) nor found in $deps"
  fi
done

# ---- 3. check: every library resolves from the .debs or the GPU machine's own ------------
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
for f in "$pack"/debs/*.deb; do dpkg-deb -x "$f" "$check" || die "cannot unpack $f"; done
libdir=$check/usr/lib/x86_64-linux-gnu
problems=0
staged=("$pack"/bin/* "$pack"/lib/loom/plugins/*.so "$pack"/samples/*.so)
for f in "${staged[@]}" "$libdir"/*.so.* "$libdir"/openblas-pthread/*.so.*; do
  [ -f "$f" ] && [ ! -L "$f" ] || continue
  # Only the unpacked prefix and CUDA on the path: whatever else resolves comes from this
  # machine's system and must be one of host_libs.
  while read -r soname _ path _; do
    if [ "$path" = "not" ]; then
      say "MISSING: ${f#"$pack"/} needs $soname, which no .deb provides"; problems=$((problems + 1))
    elif [ -n "$path" ] && [ "${path#"$check"/}" = "$path" ] && [ "${path#/usr/local/cuda}" = "$path" ] &&
         ! [[ $soname =~ $host_libs ]]; then
      say "MISSING on Ubuntu 24.04: ${f#"$pack"/} needs $soname (here from $path, package $(dpkg -S "$(readlink -f "$path")" 2>/dev/null | cut -d: -f1 | head -1))"
      problems=$((problems + 1))
    fi
  done < <(LD_LIBRARY_PATH=$libdir:$libdir/openblas-pthread:/usr/local/cuda/lib64 ldd "$f" 2>/dev/null | grep "=>")
  glibc=$(objdump -T "$f" 2>/dev/null | grep -oE 'GLIBC_2\.[0-9]+' | sort -uV | tail -1)
  glibcxx=$(objdump -T "$f" 2>/dev/null | grep -oE 'GLIBCXX_3\.4\.[0-9]+' | sort -uV | tail -1)
  if [ -n "$glibc" ] && [ "$(printf '%s\n' "${glibc#GLIBC_}" "$max_glibc" | sort -V | tail -1)" != "$max_glibc" ]; then
    say "TOO NEW: ${f##*/} needs $glibc (Ubuntu 24.04 has $max_glibc)"; problems=$((problems + 1))
  fi
  if [ -n "$glibcxx" ] && [ "$(printf '%s\n' "${glibcxx#GLIBCXX_}" "$max_glibcxx" | sort -V | tail -1)" != "$max_glibcxx" ]; then
    say "TOO NEW: ${f##*/} needs $glibcxx (GCC 13's libstdc++ has $max_glibcxx)"; problems=$((problems + 1))
  fi
done
[ "$problems" -eq 0 ] || die "$problems problem(s) with the staged libraries (see above); add the packages to this script"
say "libraries: every staged binary and plugin resolves from debs/ (+ glibc, libstdc++, CUDA, NCCL)"

# ---- 4. what it is ----------------------------------------------------------------------
nccl=$(sed -n 's/^-- loom: NCCL ON \([0-9.]*\).*/\1/p' "$build/pack-configure.log")
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && commit="$commit+local changes"
{
  echo "# made by scripts/gpu-pack.sh; read by scripts/gpu-check.sh (key=value)"
  echo "commit=$commit"
  echo "date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host=$( (. /etc/os-release && echo "$PRETTY_NAME") 2>/dev/null), $(ldd --version | head -1)"
  echo "compiler=$(c++ --version | head -1)"
  echo "cuda=$(/usr/local/cuda/bin/nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  echo "cuda_arch=$arch"
  echo "build_type=$type"
  echo "nccl=$nccl"
  echo "mpi=OFF"
  echo "needs=NVIDIA driver for CUDA $(/usr/local/cuda/bin/nvcc --version | sed -n 's/.*release \([0-9]*\).*/\1/p').x; libcudart/libcublas of that major version; NCCL >= $nccl"
} >"$pack/PACK-INFO"
say "$(du -sh "$pack" | cut -f1) in $pack: $(ls "$pack/bin" | tr '\n' ' ')+ $(ls "$pack/lib/loom/plugins" | wc -l) plugins, $(ls "$pack/debs" | wc -l) .deb files"
du -sh "$pack/bin" "$pack/lib" "$pack/debs" "$pack/configs" "$pack/scripts" | sed 's/^/  /'
say "run it on the GPU machine: ${pack#"$root"/}/run-gpu-check.sh"
