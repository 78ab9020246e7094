#!/usr/bin/env bash
# Each plugin must export exactly its ABI entry point(s) and must not need any
# symbol from the engine (plugins get everything through the host table).
set -euo pipefail
dir=$1
shopt -s nullglob
files=("$dir"/loom_*.so)
[ ${#files[@]} -gt 0 ] || { echo "no plugins in $dir"; exit 1; }
status=0
for f in "${files[@]}"; do
  exported=$(nm -D --defined-only "$f" | awk '$2 ~ /^[TDBRVW]$/ {print $3}' | grep -v '^_init$\|^_fini$' || true)
  if [ "$exported" != "loom_plugin_init_v1" ]; then
    echo "FAIL $f exports: $(echo $exported | tr '\n' ' ') (expected only loom_plugin_init_v1)"; status=1
  fi
  engine=$(nm -D --undefined-only "$f" | awk '{print $2}' | grep -E '^(loom_|_ZN4loom)' || true)
  if [ -n "$engine" ]; then
    echo "FAIL $f needs engine symbols: $engine"; status=1
  fi
  [ $status -eq 0 ] && echo "ok   $f"
done
exit $status
