#!/usr/bin/env bash
# The two commands of the README:
#   scripts/dev.sh quickstart   install what is missing, build, run configs/quickstart.toml
#   scripts/dev.sh test         install what is missing, build (plain and ASan+UBSan), run every test
# Build trees: build/ (RelWithDebInfo) and build-asan/. Parallelism: LOOM_JOBS (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
jobs=${LOOM_JOBS:-$(nproc)}

build() {  # build DIR [cmake args...]
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
}

case "$mode" in
  quickstart)
    scripts/install-deps.sh
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
    cmake --build build -j "$jobs" --target loom_runtime  # the CLI and the plugins, no tests
    build/bin/loom run configs/quickstart.toml "${@:2}"
    ;;
  test)
    scripts/install-deps.sh
    build build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_WERROR=ON
    build/bin/loom validate configs/quickstart.toml >/dev/null
    (cd build && ctest --output-on-failure -j "$jobs" --timeout 900)
    # The same suite under AddressSanitizer + UndefinedBehaviorSanitizer.
    build build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_SANITIZE=ON -DLOOM_WITH_CUDA=OFF -DLOOM_WERROR=ON
    (cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
       ctest --output-on-failure -j "$jobs" --timeout 1800)
    ;;
  *)
    echo "usage: scripts/dev.sh quickstart|test" >&2
    exit 2
    ;;
esac
