#!/usr/bin/env bash
# Fetches, on this (Debian 12) machine, the Debian packages loom builds against that a
# GPU machine's CUDA image may lack (Boost, TOML++, nlohmann JSON, SentencePiece, ICU, glog, GoogleTest,
# OpenBLAS, DLPack), into DIR (default .gpu-deps/, git-ignored). scripts/gpu-check.sh unpacks
# them into a private prefix (never into /) when it finds DIR, so a machine that
# cannot download anything can still build and run the checks:
#
#   scripts/gpu-deps.sh                      # here: ~20 MB of .deb files
#   (carry .gpu-deps to the GPU machine)     # e.g. the device tool's `carry`
#   scripts/gpu-check.sh                     # there
#
# MPI is left out (only the >= 2 GPU mpirun check needs it); NCCL and the CUDA
# toolkit come with the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-deps}
packages=(
  libboost1.74-dev libboost-filesystem1.74-dev libboost-filesystem1.74.0 libboost-system1.74-dev
  libboost-system1.74.0 libboost-atomic1.74.0
  libtomlplusplus-dev libtomlplusplus3
  nlohmann-json3-dev
  libgoogle-glog-dev libgoogle-glog0v6 libgflags-dev libgflags2.2 libunwind-dev libunwind8
  libgtest-dev
  libopenblas0-pthread
  libdlpack-dev
  libsentencepiece-dev libsentencepiece0
  libicu-dev libicu72
)
mkdir -p "$dir"
# apt-get download writes into the current directory; as root it warns that the
# _apt user cannot write there, which is harmless.
(cd "$dir" && apt-get download "${packages[@]}" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
missing=0
for p in "${packages[@]}"; do
  ls "$dir/${p}_"*.deb >/dev/null 2>&1 || { echo "gpu-deps: $p was not downloaded" >&2; missing=1; }
done
[ "$missing" -eq 0 ] || exit 1
echo "gpu-deps: $(ls "$dir"/*.deb | wc -l) packages, $(du -sh "$dir" | cut -f1) in $dir"
