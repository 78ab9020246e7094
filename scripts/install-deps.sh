#!/usr/bin/env bash
# Installs what loom needs from Debian packages, only what is missing (idempotent).
set -euo pipefail
# OpenMPI: comm/mpi and its tests (CI runs them with mpirun --oversubscribe --allow-run-as-root).
required=(cmake ninja-build g++ pkg-config libboost-dev libboost-filesystem-dev libtomlplusplus-dev
          libgoogle-glog-dev libgtest-dev libgmock-dev libopenblas-dev libdlpack-dev nlohmann-json3-dev
          binutils libopenmpi-dev openmpi-bin libsentencepiece-dev libicu-dev
          sentencepiece)  # spm_encode: the reference the tokenizer test compares with
missing=()
for p in "${required[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
