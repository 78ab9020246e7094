#!/usr/bin/env bash
# Fetches an npm package's tarball (npm pack: the package alone, no dependencies),
# checks its sha256 and unpacks it into DEST, once: a DEST that holds package.json is
# kept. Exit 0: DEST holds the package; 77: npm could not fetch it (no network, no
# npm); 1: the tarball has another sha256.
#   fetch_npm.sh NAME@VERSION SHA256 DEST
set -uo pipefail
spec=$1
sha=$2
dest=$3
[ -f "$dest/package.json" ] && exit 0
command -v npm >/dev/null || exit 77
dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT
(cd "$dl" && npm pack --silent "$spec" >/dev/null 2>&1) || exit 77
tarball=$(ls "$dl"/*.tgz 2>/dev/null | head -1)
[ -n "$tarball" ] || exit 77
if [ "$(sha256sum "$tarball" | cut -d' ' -f1)" != "$sha" ]; then
  echo "$spec: the tarball has another sha256 than $sha" >&2
  exit 1
fi
mkdir -p "$dest" && tar xzf "$tarball" -C "$dest" --strip-components=1
