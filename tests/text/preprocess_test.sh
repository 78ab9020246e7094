#!/usr/bin/env bash
# loom tokenize / preprocess against references worked out independently: GPT-2 ids
# from a JavaScript encoder (tests/text/gpt2_reference.js, the Unicode pattern in
# V8's regex engine), Megatron's .idx/.bin and llm.c's .bin bytes packed by Python's
# struct module from those ids, and clear errors for bad input.
#   preprocess_test.sh LOOM SOURCE_DIR
set -uo pipefail
loom=$1
src=$2
tok="$src/.cache/tokenizers/gpt2"
"$src/scripts/fetch-gpt2-tokenizer.sh" "$tok" >/dev/null || { echo "SKIP: the GPT-2 tokenizer files could not be fetched"; exit 77; }
command -v node >/dev/null || { echo "SKIP: node is needed for the reference encoder"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# 1. Known ids, and the reference encoder on Shakespeare and on text that exercises
#    every branch of the pattern (contractions, numbers of several scripts, symbols,
#    runs of white space of several kinds, 4-byte characters).
[ "$("$loom" tokenize --tokenizer "$tok" --text "Hello world")" = "15496 995" ] || fail "Hello world is not 15496 995"
printf "It's 2026! They'll've  Über naïve   café\n\tend \n٣٤ ½ Ⅻ 日本語のテキスト 🚀🚀 x\u00a0y  \n\n  z's '' \r\n a\u0085're \ufeff's\n" \
  > "$work/unicode.txt"
cp "$src/../shared/data/tinyshakespeare.txt" "$work/shakespeare.txt" 2>/dev/null ||
  head -c 200000 /dev/urandom | base64 > "$work/shakespeare.txt"
for f in unicode.txt shakespeare.txt; do
  node "$src/tests/text/gpt2_reference.js" "$tok" "$work/$f" > "$work/$f.want"
  "$loom" tokenize --tokenizer "$tok" --file "$work/$f" > "$work/$f.got" || fail "tokenize $f exited $?"
  cmp -s "$work/$f.want" "$work/$f.got" || fail "$f: ids differ from the reference encoder"
  "$loom" tokenize --tokenizer "$tok" --decode --file "$work/$f.got" > "$work/$f.back"
  cmp -s "$work/$f" "$work/$f.back" || fail "$f: decode(encode(text)) is not the text"
done

# 1b. Hugging Face tokenizer.json: GPT-2's vocabulary and merges written as the files
#     GPT-2's, Llama 3's and Qwen2's repositories ship (their pre-tokenizers, merges as
#     strings or pairs, ignore_merges, added tokens, Qwen2's NFC normaliser), each checked
#     against the JavaScript encoder of tests/text/hf_reference.js; the GPT-2 form also
#     against loom's GPT-2 tokenizer, and read from a model directory.
python3 - "$tok" "$work" "$src/tests/text" <<'PY'
import sys
tok, work = sys.argv[1], sys.argv[2]
sys.dont_write_bytecode = True  # nothing written into the source tree
sys.path.insert(0, sys.argv[3])
from hf_forms import LLAMA3 as llama3, QWEN2 as qwen2, added, gpt2, split
import hf_forms
vocab, merges = gpt2(tok)
write = lambda name, *a, **k: hf_forms.write(f"{work}/{name}", *a, **k)
write("hf_gpt2", {"vocab": vocab, "merges": merges},
      {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True})
v3 = dict(vocab, **{"<|begin_of_text|>": 50257, "<|end_of_text|>": 50258})
write("hf_llama3", {"vocab": v3, "merges": [m.split(" ") for m in merges], "ignore_merges": True}, split(llama3),
      [added(50257, "<|begin_of_text|>"), added(50258, "<|end_of_text|>")],
      config={"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>"}})
write("hf_qwen2", {"vocab": dict(vocab, **{"<|im_start|>": 50257}), "merges": merges}, split(qwen2),
      [added(50257, "<|im_start|>")], {"type": "NFC"}, config={"eos_token": "<|endoftext|>"})
PY
printf "It's 2026! THEY'LL 1234567 Über naïve   café\n\tend \n٣٤ ½ Ⅻ 日本語のテキスト 🚀🚀 x\u00a0y  \n\n  z's '' \r\n" \
  > "$work/hf.txt"
printf "a\u0085're \ufeff's x'\u017fa (x) ((y\n\n\n 12 <|end_of_text|>tail<|begin_of_text|> <|im_start|>e\u0301 cafe\u0301<|endoftext|>\n" \
  >> "$work/hf.txt"
for flavour in hf_gpt2 hf_llama3 hf_qwen2; do
  for f in hf.txt shakespeare.txt; do
    node "$src/tests/text/hf_reference.js" "$work/$flavour/tokenizer.json" "$work/$f" > "$work/$flavour.$f.want"
    "$loom" tokenize --tokenizer "$work/$flavour/tokenizer.json" --file "$work/$f" > "$work/$flavour.$f.got" ||
      fail "tokenize $flavour $f exited $?"
    cmp -s "$work/$flavour.$f.want" "$work/$flavour.$f.got" || fail "$flavour $f: ids differ from the reference encoder"
  done
done
# (unicode.txt has no "<|endoftext|>", which tokenizer.json reads as its added token.)
"$loom" tokenize --tokenizer "$work/hf_gpt2" --file "$work/unicode.txt" > "$work/hf_gpt2.dir.got" || fail "a model directory"
"$loom" tokenize --tokenizer "$tok" --file "$work/unicode.txt" > "$work/gpt2.hf.got"
cmp -s "$work/hf_gpt2.dir.got" "$work/gpt2.hf.got" || fail "GPT-2's tokenizer.json encodes unlike its encoder.json + vocab.bpe"
"$loom" tokenize --tokenizer "$work/hf_llama3" --decode --file "$work/hf_llama3.hf.txt.got" > "$work/hf_llama3.back"
cmp -s "$work/hf.txt" "$work/hf_llama3.back" || fail "Llama 3 form: decode(encode(text)) is not the text"
python3 -c "import sys, unicodedata
t = open(sys.argv[1], encoding='utf-8', newline='').read()
sys.stdout.buffer.write(unicodedata.normalize('NFC', t).encode())" "$work/hf.txt" > "$work/hf.nfc"
"$loom" tokenize --tokenizer "$work/hf_qwen2" --decode --file "$work/hf_qwen2.hf.txt.got" > "$work/hf_qwen2.back"
cmp -s "$work/hf.nfc" "$work/hf_qwen2.back" || fail "Qwen2 form: decode(encode(text)) is not the text's NFC"
# The Llama 3 form's special tokens (tokenizer_config.json): a preprocess ends each
# document with its eos, <|end_of_text|> (50258).
printf '%s\n' '{"text": "Hello world"}' '{"text": "naïve café"}' > "$work/l3docs.jsonl"
"$loom" preprocess --tokenizer "$work/hf_llama3" --input "$work/l3docs.jsonl" --output-prefix "$work/l3" --append-eod \
  2>/dev/null || fail "preprocess with a tokenizer.json exited $?"
python3 - "$work/l3" <<'PY' || fail "the tokenizer.json dataset's documents do not end with <|end_of_text|>"
import struct, sys
code = open(sys.argv[1] + ".idx", "rb").read()[17]
b = open(sys.argv[1] + ".bin", "rb").read()
ids = struct.unpack(f"<{len(b) // 2}H", b) if code == 8 else struct.unpack(f"<{len(b) // 4}i", b)
assert ids.count(50258) == 2 and ids[-1] == 50258, ids
PY

# 2. Megatron's indexed dataset: three JSONL documents (one empty) with --append-eod,
#    on 3 workers, against bytes packed independently.
printf '%s\n' '{"text": "Hello world"}' '{"id": 2, "text": ""}' '{"text": "naïve café, 2026 🚀"}' > "$work/docs.jsonl"
"$loom" preprocess --tokenizer "$tok" --input "$work/docs.jsonl" --output-prefix "$work/ds" --append-eod \
  --workers 3 2>"$work/log" || fail "preprocess exited $?: $(cat "$work/log")"
grep -q "3 documents" "$work/log" || fail "preprocess did not report 3 documents: $(cat "$work/log")"
for t in "Hello world" "" "naïve café, 2026 🚀"; do
  printf '%s' "$t" > "$work/doc"
  node "$src/tests/text/gpt2_reference.js" "$tok" "$work/doc"
done > "$work/doc_ids"
python3 - "$work/doc_ids" "$work/want" <<'PY'
import struct, sys
# Megatron's preprocess_data.py: --append-eod ends a non-empty document; the builder
# writes each non-empty document as one sequence and an empty one as none (its entry
# of the document index repeats the sequence count).
docs = [[int(x) for x in line.split()] for line in open(sys.argv[1])]
docs = [d + [50256] if d else [] for d in docs]
lens = [len(d) for d in docs if d]
ptrs = [2 * sum(lens[:i]) for i in range(len(lens))]
doc_index = [0]
for d in docs:
    doc_index.append(doc_index[-1] + (1 if d else 0))
idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
idx += struct.pack("<Q", len(lens)) + struct.pack("<Q", len(docs) + 1)
idx += struct.pack(f"<{len(lens)}i", *lens) + struct.pack(f"<{len(lens)}q", *ptrs)
idx += struct.pack(f"<{len(docs) + 1}q", *doc_index)
open(sys.argv[2] + ".idx", "wb").write(idx)
open(sys.argv[2] + ".bin", "wb").write(b"".join(struct.pack(f"<{len(d)}H", *d) for d in docs))
# llm.c: header of 256 int32 (magic, version, count), then uint16 tokens.
flat = [t for d in docs for t in d]
open(sys.argv[2] + ".llmc", "wb").write(struct.pack("<256i", 20240520, 1, len(flat), *([0] * 253)) +
                                        struct.pack(f"<{len(flat)}H", *flat))
PY
cmp -s "$work/want.idx" "$work/ds.idx" || fail "ds.idx differs from Megatron's layout"
cmp -s "$work/want.bin" "$work/ds.bin" || fail "ds.bin differs from Megatron's layout"
"$loom" preprocess --tokenizer "$tok" --input "$work/docs.jsonl" --output-prefix "$work/llmc" --append-eod \
  --format llmc 2>/dev/null || fail "preprocess --format llmc exited $?"
cmp -s "$work/want.llmc" "$work/llmc.bin" || fail "llmc.bin differs from llm.c's layout"
# A .idx that cannot be replaced (here a directory) leaves the earlier .bin as it was.
cp "$work/ds.bin" "$work/keep.bin" && mkdir -p "$work/keep.idx/sub"
printf 'other words\n' > "$work/other.txt"
"$loom" preprocess --tokenizer "$tok" --input "$work/other.txt" --output-prefix "$work/keep" > "$work/keep.out" 2>&1 &&
  fail "preprocess replaced a directory .idx"
cmp -s "$work/ds.bin" "$work/keep.bin" && ! ls "$work"/keep.bin.* 2>/dev/null ||
  fail "a failed .idx rename lost the earlier .bin or left files: $(cat "$work/keep.out"; ls "$work"/keep.*)"
# --json-key: the text under another field gives the same dataset.
sed 's/"text"/"body"/' "$work/docs.jsonl" > "$work/body.jsonl"
"$loom" preprocess --tokenizer "$tok" --input "$work/body.jsonl" --output-prefix "$work/body" --append-eod \
  --json-key body 2>"$work/log" || fail "preprocess --json-key body exited $?: $(cat "$work/log")"
cmp -s "$work/ds.bin" "$work/body.bin" && cmp -s "$work/ds.idx" "$work/body.idx" || fail "--json-key body: another dataset"
# An llm.c file written over a Megatron dataset's .bin takes its stale .idx away.
cp "$work/ds.idx" "$work/stale.idx"
"$loom" preprocess --tokenizer "$tok" --input "$work/docs.jsonl" --output-prefix "$work/stale" --append-eod \
  --format llmc 2>/dev/null || fail "preprocess --format llmc over a stale index exited $?"
[ -e "$work/stale.idx" ] && fail "the stale stale.idx was left beside the new llm.c stale.bin"

# 2b. SentencePiece: a model trained here encodes each line as spm_encode (the
#     sentencepiece package's own tool) does, and decodes back.
if command -v spm_encode >/dev/null; then
  "$loom" tokenizer-train --input "$work/shakespeare.txt" --model-prefix "$work/spm" --vocab-size 400 \
    --workers 2 2>/dev/null || fail "tokenizer-train exited $?"
  head -40 "$work/shakespeare.txt" | grep -v '^$' > "$work/lines.txt"
  printf 'naïve café 🚀 ½\n' >> "$work/lines.txt"
  spm_encode --model="$work/spm.model" --output_format=id < "$work/lines.txt" > "$work/spm.want"
  while IFS= read -r line; do
    "$loom" tokenize --tokenizer "$work/spm.model" --text "$line"
  done < "$work/lines.txt" > "$work/spm.got"
  cmp -s "$work/spm.want" "$work/spm.got" || fail "SentencePiece ids differ from spm_encode's"
  back=$("$loom" tokenize --tokenizer "$work/spm.model" --decode --text "$(tail -1 "$work/spm.got")")
  [ "$back" = "naïve café 🚀 ½" ] || fail "SentencePiece decode(encode(text)) is '$back'"
  "$loom" preprocess --tokenizer "$work/spm.model" --input "$work/docs.jsonl" --output-prefix "$work/spm_ds" \
    --append-eod 2>/dev/null || fail "preprocess with SentencePiece exited $?"
  python3 - "$work/spm_ds.idx" <<'PY' || fail "the SentencePiece dataset's index is not 3 documents (2 sequences ending in </s>)"
import struct, sys
idx = open(sys.argv[1], "rb").read()
assert idx[:9] == b"MMIDIDX\x00\x00" and idx[17] == 8, idx[:18]
assert struct.unpack_from("<QQ", idx, 18) == (2, 4)  # the empty document is no sequence
PY
else
  echo "note: spm_encode not installed (Debian package sentencepiece); SentencePiece checks skipped"
fi
# tokenizer-train refuses what SentencePiece's trainer would misread: a comma in an
# input path (its inputs are one comma-separated list), a model prefix in a missing
# directory.
cp "$work/shakespeare.txt" "$work/a,b.txt"
"$loom" tokenizer-train --input "$work/a,b.txt" --model-prefix "$work/c" --vocab-size 300 > "$work/comma.out" 2>&1 &&
  fail "tokenizer-train took an input path with a comma"
grep -q "a path with a comma cannot be given" "$work/comma.out" || fail "comma refusal: $(cat "$work/comma.out")"
"$loom" tokenizer-train --input "$work/shakespeare.txt" --model-prefix "$work/nodir/m" --vocab-size 300 \
  > "$work/nodir.out" 2>&1 && fail "tokenizer-train wrote into a missing directory"
grep -q "nodir does not exist" "$work/nodir.out" || fail "missing-directory refusal: $(cat "$work/nodir.out")"
# Both files or neither: PREFIX.vocab a directory is refused before training, and no
# PREFIX.model appears; a vocabulary smaller than the text's characters says how large.
mkdir -p "$work/half.vocab"
"$loom" tokenizer-train --input "$work/shakespeare.txt" --model-prefix "$work/half" --vocab-size 300 \
  > "$work/half.out" 2>&1 && fail "tokenizer-train wrote over a directory"
grep -q "half.vocab is a directory" "$work/half.out" || fail "directory refusal: $(cat "$work/half.out")"
[ ! -e "$work/half.model" ] || fail "a failed tokenizer-train left half.model"
python3 -c "print('\n'.join(''.join(chr(0x4e00 + (7 * i + j) % 400) for j in range(30)) for i in range(2000)))" \
  > "$work/han.txt"
"$loom" tokenizer-train --input "$work/han.txt" --model-prefix "$work/han" --vocab-size 300 > "$work/han.out" 2>&1 &&
  fail "tokenizer-train took a vocabulary smaller than the text's characters"
grep -q "smaller than the [0-9]* it needs before any merge: one for each distinct character" "$work/han.out" || fail "small vocabulary: $(cat "$work/han.out")"
ls "$work"/han.* | grep -qv "han.txt\|han.out" && fail "a failed tokenizer-train left files: $(ls "$work"/han.*)"
# Every line is trained on, however long (SentencePiece skips lines over its
# max_sentence_length): words in lines of 5000 bytes are learnt.
python3 -c "import random; random.seed(7); w = ('the king and queen of a land far away said to his men when they came '
     'home from war with gold silver horses swords bread wine over under river mountain castle tower gate night').split()
t = ' '.join(random.choice(w) for _ in range(250000))
print('\n'.join(t[i:i + 5000] for i in range(0, len(t), 5000)))" > "$work/long_lines.txt"
"$loom" tokenizer-train --input "$work/long_lines.txt" --model-prefix "$work/ll" --vocab-size 400 2>/dev/null ||
  fail "tokenizer-train on long lines exited $?"
[ "$("$loom" tokenize --tokenizer "$work/ll.model" --text " the king" | wc -w)" -le 3 ] ||
  fail "long lines were not trained on: ' the king' is $("$loom" tokenize --tokenizer "$work/ll.model" --text " the king")"
# The model is not written over an input; a vocabulary the text cannot fill says how large.
cp "$work/shakespeare.txt" "$work/in.vocab"
"$loom" tokenizer-train --input "$work/in.vocab" --model-prefix "$work/in" --vocab-size 300 > "$work/over.out" 2>&1 &&
  fail "tokenizer-train wrote over its input"
cmp -s "$work/shakespeare.txt" "$work/in.vocab" && grep -q "which is the input" "$work/over.out" ||
  fail "an output over the input: $(cat "$work/over.out")"
printf 'ab\ncd\n' > "$work/tiny.txt"
"$loom" tokenizer-train --input "$work/tiny.txt" --model-prefix "$work/tiny" --vocab-size 2000 > "$work/tiny.out" 2>&1 &&
  fail "tokenizer-train took a vocabulary the text cannot fill"
grep -q "give a vocabulary size of at most [0-9]" "$work/tiny.out" || fail "a vocabulary too large: $(cat "$work/tiny.out")"

# 3. What preprocess writes trains: a few steps of the quickstart model on the
#    Shakespeare dataset start near ln(50257) = 10.8 and fall.
"$loom" preprocess --tokenizer "$tok" --input "$work/shakespeare.txt" --output-prefix "$work/shakespeare" \
  --append-eod 2>/dev/null || fail "preprocess shakespeare exited $?"
"$loom" run "$src/configs/quickstart.toml" --set data.kind=indexed --set "data.path=\"$work/shakespeare\"" \
  --set run.steps=8 --set run.eval_every=0 --set model.seq_length=32 --set optimizer.lr=0.003 \
  --set optimizer.warmup_steps=0 --metrics "$work/m.jsonl" >/dev/null 2>"$work/run.log" ||
  fail "training on the indexed dataset exited $?: $(tail -3 "$work/run.log")"
python3 - "$work/m.jsonl" <<'PY' || fail "the loss on the indexed dataset did not start near 10.8 and fall"
import json, sys
loss = [json.loads(l)["loss"] for l in open(sys.argv[1])]
assert 10.0 < loss[0] < 11.5 and loss[-1] < loss[0] - 0.5, loss
PY

# 3b. A Hugging Face tokenizer end to end: Llama-shaped blocks trained on the text as the
#     Llama 3 form of the tokenizer encodes it, exported with that tokenizer.json, then
#     sampled from the Hugging Face directory as it stands: the same tokens and text as
#     from the checkpoint.
"$loom" preprocess --tokenizer "$work/hf_llama3" --input "$work/shakespeare.txt" --output-prefix "$work/l3shk" \
  --append-eod 2>/dev/null || fail "preprocess with the Llama 3 form exited $?"
"$loom" run "$src/configs/llama_quickstart.toml" --set data.kind=indexed --set "data.path=\"$work/l3shk\"" \
  --set "data.tokenizer=\"$work/hf_llama3\"" --set run.steps=4 --set run.eval_every=0 --set model.seq_length=32 \
  --set parallel.dp=1 --set batch.global_batch_size=8 --set "checkpoint.dir=\"$work/l3ck\"" --set checkpoint.every=4 \
  >/dev/null 2>"$work/l3run.log" || fail "training Llama blocks on tokenizer.json data exited $?: $(tail -3 "$work/l3run.log")"
"$loom" export "$work/l3ck" --format hf "$work/l3hf" > /dev/null 2>&1 || fail "export with the run's tokenizer.json"
[ -f "$work/l3hf/tokenizer.json" ] || fail "the export has no tokenizer.json: $(ls "$work/l3hf")"
from_ck=$("$loom" generate "$work/l3ck" --prompt "ROMEO:" --max-new-tokens 6 --temperature 0 --json 2>/dev/null)
from_hf=$("$loom" generate "$work/l3hf" --prompt "ROMEO:" --max-new-tokens 6 --temperature 0 --json 2>/dev/null)
strip() { sed 's/"source":"[^"]*",//; s/"prefill_ms".*//'; }
[ -n "$from_hf" ] && [ "$(echo "$from_ck" | strip)" = "$(echo "$from_hf" | strip)" ] ||
  fail "generate from the Hugging Face directory differs from the checkpoint: $from_hf vs $from_ck"

# 4. Bad input: a clear message, exit 1 (2 for usage), and no files under the final names.
printf '%s\n' '{"text": "ok"}' '{"body": "no text"}' > "$work/bad.jsonl"
out=$("$loom" preprocess --tokenizer "$tok" --input "$work/bad.jsonl" --output-prefix "$work/bad" 2>&1)
rc=$?
[ $rc -eq 1 ] || fail "a line without text exited $rc"
[[ "$out" == *"bad.jsonl:2: no string field \"text\""* ]] || fail "no file:line for a line without text: $out"
[ ! -e "$work/bad.bin" ] && [ ! -e "$work/bad.idx" ] || fail "a failed preprocess left files"
out=$("$loom" preprocess --tokenizer "$work/nowhere" --input "$work/docs.jsonl" --output-prefix "$work/x" 2>&1)
[ $? -eq 1 ] && [[ "$out" == *"fetch-gpt2-tokenizer.sh"* ]] || fail "a missing tokenizer does not say how to get one: $out"
out=$("$loom" preprocess --tokenizer "$tok" --input "$work/docs.jsonl" --output-prefix "$work/no/such/dir/x" 2>&1)
[ $? -eq 1 ] && [[ "$out" == *"no/such/dir does not exist"* ]] || fail "a prefix in a missing directory: $out"
"$loom" preprocess --tokenizer "$tok" --input "$work/docs.jsonl" --output-prefix "$work/x" --format parquet \
  >/dev/null 2>&1
[ $? -eq 2 ] || fail "an unknown --format is not a usage error"
"$loom" tokenize --tokenizer "$tok" --decode --text "15496 nine" >/dev/null 2>&1
[ $? -eq 2 ] || fail "decoding a non-number is not a usage error"
# A signal ends preprocess at once (a document cannot stop half encoded), saying so,
# with no file under the final names or the temporary ones.
for i in $(seq 192); do cat "$work/shakespeare.txt"; done > "$work/long.txt"  # 52 MB: seconds of encoding at 16 MB/s
set -m
"$loom" preprocess --tokenizer "$tok" --input "$work/long.txt" --output-prefix "$work/long" > /dev/null \
  2> "$work/long.err" &
pid=$!
set +m
sleep 1
kill -TERM "$pid"
start=$(date +%s)
wait "$pid"
rc=$?
[ $rc -eq 130 ] || fail "preprocess stopped by SIGTERM exited $rc"
[ $(( $(date +%s) - start )) -le 5 ] || fail "preprocess took more than 5 s to stop after SIGTERM"
grep -q "interrupted by a signal" "$work/long.err" || fail "preprocess did not say it was interrupted: $(cat "$work/long.err")"
ls "$work"/long.* | grep -v "long.txt\|long.err" && fail "an interrupted preprocess left files"
# A printed result that cannot be written is a failure, not exit 0.
"$loom" tokenize --tokenizer "$tok" --text "Hello world" > /dev/full 2> "$work/full.err"
[ $? -eq 1 ] && grep -q "could not write the output" "$work/full.err" || fail "output to /dev/full: $(cat "$work/full.err")"
# An output that would overwrite an input is refused, and the input is untouched.
cp "$work/docs.jsonl" "$work/in.bin"
"$loom" preprocess --tokenizer "$tok" --input "$work/in.bin" --output-prefix "$work/in" >/dev/null 2>&1
[ $? -eq 2 ] && cmp -s "$work/docs.jsonl" "$work/in.bin" || fail "an output over an input was not refused"
# vocab.bpe with CRLF line ends gives the same ids; one without merges is refused.
mkdir -p "$work/crlf" "$work/nomerge"
cp "$tok/encoder.json" "$work/crlf/" && sed 's/$/\r/' "$tok/vocab.bpe" > "$work/crlf/vocab.bpe"
[ "$("$loom" tokenize --tokenizer "$work/crlf" --text "Hello world")" = "15496 995" ] || fail "CRLF vocab.bpe"
cp "$tok/encoder.json" "$work/nomerge/" && echo "#version: 0.2" > "$work/nomerge/vocab.bpe"
out=$("$loom" tokenize --tokenizer "$work/nomerge" --text "Hello" 2>&1)
[ $? -eq 1 ] && [[ "$out" == *"holds no merges"* ]] || fail "a vocab.bpe without merges: $out"

[ $fails -eq 0 ] && echo "preprocess: all checks passed"
exit $((fails > 0))
