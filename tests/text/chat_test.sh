#!/usr/bin/env bash
# Conversations: loom's chat templates against the models' own Jinja chat templates
# rendered by Hugging Face's Jinja implementation (tests/text/chat_reference.js), the
# tokens and targets of a conversation worked out from its text, supervised fine-tuning
# (data.kind = "chat") that learns to answer from the assistant's turns alone, and
# `loom generate --chat` and `loom serve`'s chat completions giving the answers; bad
# input gets a clear error.
#   chat_test.sh LOOM SOURCE_DIR [sanitized]
set -uo pipefail
loom=$1
src=$2
mode=${3:-}
tok="$src/.cache/tokenizers/gpt2"
"$src/scripts/fetch-gpt2-tokenizer.sh" "$tok" >/dev/null || { echo "SKIP: the GPT-2 tokenizer files could not be fetched"; exit 77; }
command -v node >/dev/null || { echo "SKIP: node is needed for the reference"; exit 77; }
# @huggingface/jinja from npm, its tarball checked.
jinja="$src/.cache/npm/huggingface-jinja-0.5.11"
"$src/tests/support/fetch_npm.sh" @huggingface/jinja@0.5.11 \
  c92401a23cdef23be5a2773eafc22db6723e113380aa02fedd0ca40ceb123f29 "$jinja"
case $? in
  0) ;;
  77) echo "SKIP: npm could not fetch @huggingface/jinja"; exit 77 ;;
  *) echo "FAIL: @huggingface/jinja 0.5.11's tarball has another sha256"; exit 1 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# Tokenizer directories: GPT-2's vocabulary and merges as Qwen2's and Llama 3's
# tokenizer.json (their pre-tokenizers and special tokens), each with a chat template
# as the models' tokenizer_config.json ships it: a plain ChatML one, Qwen2-Instruct's
# (a default system message unless the first is one) and Llama-3-Instruct's.
python3 - "$tok" "$work" "$src/tests/text" <<'PY'
import json, sys
tok, work = sys.argv[1], sys.argv[2]
sys.dont_write_bytecode = True  # nothing written into the source tree
sys.path.insert(0, sys.argv[3])
from hf_forms import LLAMA3, QWEN2, gpt2, write_with_specials
vocab, merges = gpt2(tok)
chatml = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
qwen2_instruct = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                  "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
                  "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
llama3_instruct = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                   "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
                   "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
def write(name, pattern, specials, config):
    write_with_specials(f"{work}/{name}", vocab, merges, pattern, specials, config)
write("chatml", QWEN2, ["<|im_start|>", "<|im_end|>"], {"eos_token": "<|endoftext|>", "chat_template": chatml})
write("qwen2", QWEN2, ["<|im_start|>", "<|im_end|>"], {"eos_token": "<|im_end|>", "chat_template": qwen2_instruct})
write("llama3", LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>"],
      {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": llama3_instruct})
# Conversations: one turn and many, text around the content that Llama 3's trim
# removes (Python's and JavaScript's white space agree on these), content that starts
# with the newline a header ends with, contractions, numbers, other scripts.
conversations = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}],
    [{"role": "user", "content": "  Über café naïve \n\n"}, {"role": "assistant", "content": " \tIt's 2026!  "}],
    [{"role": "system", "content": "Count."}, {"role": "user", "content": "1234567 and 89?"},
     {"role": "assistant", "content": "Two numbers:\n\n1234567\n89"}, {"role": "user", "content": "日本語のテキスト 🚀"},
     {"role": "assistant", "content": "\nA rocket, they'll've said."}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "y\n"}],
]
with open(f"{work}/conv.jsonl", "w", encoding="utf-8") as f:
    for c in conversations:
        f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
PY

# 1. Rendering: loom's text = the Jinja template's, with and without the generation
#    prompt; the template recognised in each directory's tokenizer_config.json, with
#    Qwen2's default system message where a conversation has none.
for dir in chatml qwen2 llama3; do
  conv="$work/conv.jsonl"
  for prompt in "" generation-prompt; do
    node "$src/tests/text/chat_reference.js" "$jinja" "$work/$dir/tokenizer_config.json" "$conv" $prompt \
      > "$work/$dir.$prompt.want" || fail "the Jinja reference failed for $dir"
    "$loom" tokenize --tokenizer "$work/$dir" --chat --file "$conv" --json ${prompt:+--generation-prompt} \
      > "$work/$dir.$prompt.got" || fail "loom tokenize --chat exited $? for $dir"
    python3 - "$work/$dir.$prompt.want" "$work/$dir.$prompt.got" <<'PY' || fail "$dir ${prompt:-}: loom's text is not the Jinja template's"
import json, sys
want = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8")]
got = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8")]
assert len(want) == len(got) and want, (len(want), len(got))
for w, g in zip(want, got):
    assert w == g, f"\nwant {w!r}\ngot  {g!r}"
PY
  done
done

# 2. Tokens and targets: the turn-by-turn tokens are those of the whole text
#    (loom tokenize on it, the tokenizer itself checked in preprocess_test.sh), and the
#    targets are each assistant turn after its header: its content (trimmed for Llama 3)
#    and the token ending the turn (ChatML's newline after it too), worked out here from
#    the messages.
for dir in chatml:50256 llama3:50258; do
  python3 - "$loom" "$work/${dir%%:*}" "$work/${dir%%:*}..got" "$work/conv.jsonl" "${dir%%:*}" "${dir#*:}" <<'PY' || fail "${dir%%:*}: tokens or targets are wrong"
import json, subprocess, sys
loom, tokdir, got, conv, kind, eod = sys.argv[1:]
def ids(text):
    out = subprocess.run([loom, "tokenize", "--tokenizer", tokdir, "--text", text, "--json"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)["tokens"]
def decode(tokens):
    return subprocess.run([loom, "tokenize", "--tokenizer", tokdir, "--decode", "--text",
                           " ".join(map(str, tokens))], check=True, capture_output=True, text=True).stdout
lines = [json.loads(l) for l in open(got, encoding="utf-8")]
convs = [json.loads(l)["messages"] for l in open(conv, encoding="utf-8")]
for line, messages in zip(lines, convs):
    # Training ends the conversation with the end of a document (<|endoftext|>, or
    # <|end_of_text|> where the eos <|eot_id|> ends every turn), a target.
    assert line["tokens"][-1] == int(eod) and line["targets"][-1] == 1, (line["tokens"][-3:], eod)
    line["tokens"], line["targets"] = line["tokens"][:-1], line["targets"][:-1]
    assert line["tokens"] == ids(line["text"]), f"turn-by-turn tokens differ from the whole text's: {line['text']!r}"
    runs, run = [], []
    for t, m in zip(line["tokens"], line["targets"]):
        if m: run.append(t)
        elif run: runs.append(run); run = []
    if run: runs.append(run)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(answers), (len(runs), answers)
    for r, a in zip(runs, answers):
        want = a + "<|im_end|>\n" if kind == "chatml" else a.strip(" \t\n") + "<|eot_id|>"
        text = decode(r)
        # A header's last newline merged with content that starts with one is a target.
        assert text == want or (text.endswith(want) and text[:-len(want)] == "\n" and a.startswith("\n")), (text, want)
PY
done

# 3. Supervised fine-tuning: each user message is random letters and a name; the
#    assistant answers with the name's colour. Only the answers are targets, so the
#    loss can fall near zero although the questions cannot be predicted; greedy
#    replies to new questions name the right colour, with and without the cache,
#    written with the template the tokenizer declares.
python3 - "$work/sft.jsonl" <<'PY'
import json, random, sys
rng = random.Random(7)
colours = {"alice": "red", "bob": "green", "carol": "blue", "dave": "black"}
with open(sys.argv[1], "w") as f:
    for i in range(512):
        name = rng.choice(sorted(colours))
        noise = "".join(rng.choice("qwxzjkvb") for _ in range(rng.randint(3, 9)))
        messages = [{"role": "user", "content": f"{noise} {name}"},
                    {"role": "assistant", "content": colours[name]}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer with a colour."})
        f.write(json.dumps({"messages": messages}) + "\n")
PY
sft=(--set data.kind='"chat"' --set "data.path=\"$work/sft.jsonl\"" --set "data.tokenizer=\"$work/chatml\""
     --set model.seq_length=40 --set parallel.dp=1 --set batch.micro_batch_size=16 --set batch.global_batch_size=16
     --set run.steps=120 --set run.log_every=20 --set run.eval_every=60 --set optimizer.warmup_steps=10
     --set optimizer.lr=0.01 --set "checkpoint.dir=\"$work/sftck\"")
# (Under the sanitizers the fine-tuning runs are left out: they run the training code
# the unit tests run there, at 2.5 times the cost; the other sections still run.)
if [ "$mode" != sanitized ]; then
"$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set run.sample_every=120 --set run.sample_tokens=2 \
  --metrics "$work/sft.m" >"$work/sft.log" 2>&1 ||
  fail "fine-tuning on conversations exited $?: $(tail -3 "$work/sft.log")"
grep -q "chat template chatml" "$work/sft.log" || fail "the run does not say which chat template wrote the data: $(head -5 "$work/sft.log")"
# The sample during training is a held-out question and the model's answer to it.
python3 - "$work/sft.log" <<'PY' || fail "the sample at step 120 is not a question and its answer: $(grep -A6 'sample at' "$work/sft.log")"
import re, sys
log = open(sys.argv[1]).read()
m = re.search(r"sample at step 120: .*<\|im_start\|>user\n\w+ (\w+)<\|im_end\|>\n<\|im_start\|>assistant\n -> (\w+)<\|im_end\|>",
              log, re.S)
colours = {"alice": "red", "bob": "green", "carol": "blue", "dave": "black"}
assert m and colours[m.group(1)] == m.group(2), m and m.groups()
PY
python3 - "$work/sft.m" <<'PY' || fail "the loss on the answers did not fall near zero"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
loss = [r["loss"] for r in rows if "loss" in r]
assert loss[0] > 3 and loss[-1] < 0.05, loss
PY
for q in "zzq alice:red" "kkvvxq dave:black" "b carol:blue" "qqqqqqqqq bob:green"; do
  prompt=${q%%:*}
  want=${q#*:}
  for cache in "" --no-cache; do
    got=$("$loom" generate "$work/sftck" --chat --prompt "$prompt" --temperature 0 --max-new-tokens 4 $cache 2>/dev/null)
    [ "$got" = "$want" ] || fail "generate --chat $cache answered '$got' to '$prompt', not '$want'"
  done
done
j=$("$loom" generate "$work/sftck" --chat --system "Answer with a colour." --prompt "jj bob" --temperature 0 \
    --max-new-tokens 4 --json 2>/dev/null)
python3 -c 'import json,sys; j=json.loads(sys.argv[1]); assert j["reply"]=="green" and j["ids"][-1]==50258, j' "$j" ||
  fail "generate --chat --json: no reply 'green' ending at <|im_end|>: $j"

# generate --chat --interactive: a conversation from stdin, a reply a line; the second
# turn reuses the first from the key/value cache and still answers right.
got=$(printf 'zzq alice\n\nkkvvxq dave\n' | "$loom" generate "$work/sftck" --chat --interactive --temperature 0 \
      --max-new-tokens 4 2>/dev/null)
[ "$got" = "$(printf 'red\nblack')" ] || fail "generate --chat --interactive answered '$got'"
got=$(printf 'kkvvxq dave\n' | "$loom" generate "$work/sftck" --chat --interactive --prompt "zzq alice" --json \
      --temperature 0 --max-new-tokens 4 2>/dev/null)
python3 -c '
import json, sys
t = [json.loads(l) for l in sys.argv[1].splitlines()]
assert [x["reply"] for x in t] == ["red", "black"] and t[0]["reused"] == 0 and t[1]["reused"] > t[0]["prompt_tokens"], t
' "$got" || fail "generate --chat --interactive --json: $got"

# loom serve's chat completions: the answers generate --chat gives, whole or streamed,
# after earlier turns of the conversation too.
"$loom" serve "$work/sftck" --port 0 >/dev/null 2>"$work/serve.err" &
server=$!
for _ in $(seq 600); do grep -q "on http://" "$work/serve.err" && break; sleep 0.1; done
port=$(grep -o "127.0.0.1:[0-9]*" "$work/serve.err" | head -1 | cut -d: -f2)
python3 - "${port:-0}" <<'PY' || fail "loom serve's chat completions: $(tail -5 "$work/serve.err")"
import http.client, json, sys
port = int(sys.argv[1])
def chat(messages, **extra):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/chat/completions", json.dumps({"messages": messages, "temperature": 0, **extra}))
    r = c.getresponse()
    body = r.read().decode()
    assert r.status == 200, body
    return body
j = json.loads(chat([{"role": "user", "content": "zzq alice"}]))
assert j["object"] == "chat.completion" and j["choices"][0]["message"] == {"role": "assistant", "content": "red"}, j
assert j["choices"][0]["finish_reason"] == "stop", j
# A next turn: the earlier turn and its reply come from the key/value cache (all but the
# reply's end of turn, which was drawn last and never run), not computed again.
t = json.loads(chat([{"role": "user", "content": "b carol"}]))
assert t["choices"][0]["message"]["content"] == "blue", t
j = json.loads(chat([{"role": "user", "content": "b carol"}, {"role": "assistant", "content": "blue"},
                     {"role": "user", "content": "jj dave"}]))
assert j["choices"][0]["message"]["content"] == "black", j
cached = j["usage"]["prompt_tokens_details"]["cached_tokens"]
assert cached == t["usage"]["prompt_tokens"] + 1, (cached, t["usage"], j["usage"])
events = [e[len("data: "):] for e in chat([{"role": "user", "content": "qqqqqqqqq bob"}], stream=True).split("\n\n") if e]
assert events[-1] == "[DONE]", events
chunks = [json.loads(e) for e in events[:-1]]
assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, chunks[0]
assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "green", chunks
assert chunks[-1]["choices"][0]["finish_reason"] == "stop", chunks[-1]
PY
openai="$src/.cache/npm/openai-5.23.2"
if "$src/tests/support/fetch_npm.sh" openai@5.23.2 a2aa74ff8be1a80a215af201a3d2228e999464d166c1eaec2c9ca313395fbef1 \
  "$openai"; then
  got=$(node "$src/tests/cli/openai_client.js" "$openai" "${port:-0}" "$work/sftck" chat "kkvvxq dave")
  python3 -c 'import json,sys; j=json.loads(sys.argv[1]); assert j["content"]==j["streamed"]=="black" and j["role"]=="assistant" and j["finish_reason"]=="stop", j' \
    "$got" || fail "OpenAI's client read the chat reply as $got"
fi
kill -TERM "$server"
wait "$server" || fail "loom serve exited $? after SIGTERM"

# Exported, the model carries its chat template: transformers' apply_chat_template
# (the Jinja reference here) writes what loom does, and generate --chat from the
# Hugging Face directory answers as from the checkpoint.
mkdir -p "$work/sfthf"  # an earlier export's template, which would win over tokenizer_config.json's
printf "{%% for m in messages %%}<start_of_turn>{{ m['content'] }}{%% endfor %%}" > "$work/sfthf/chat_template.jinja"
"$loom" export "$work/sftck" --format hf "$work/sfthf" >/dev/null 2>&1 || fail "export of the fine-tuned model exited $?"
[ ! -e "$work/sfthf/chat_template.jinja" ] || fail "the export left an earlier chat_template.jinja"
node "$src/tests/text/chat_reference.js" "$jinja" "$work/sfthf/tokenizer_config.json" "$work/conv.jsonl" \
  generation-prompt > "$work/hf.want" || fail "the exported tokenizer_config.json has no chat template to render"
"$loom" tokenize --tokenizer "$work/sfthf" --chat --file "$work/conv.jsonl" --json --generation-prompt \
  | python3 -c 'import json,sys; [print(json.dumps(json.loads(l)["text"], ensure_ascii=False)) for l in sys.stdin]' \
  > "$work/hf.got"
python3 -c 'import json,sys; a=[json.loads(l) for l in open(sys.argv[1])]; b=[json.loads(l) for l in open(sys.argv[2])]; assert a and a == b' \
  "$work/hf.want" "$work/hf.got" || fail "the exported chat template writes otherwise than loom"
got=$("$loom" generate "$work/sfthf" --chat --prompt "zzq alice" --temperature 0 --max-new-tokens 4 2>/dev/null)
[ "$got" = "red" ] || fail "generate --chat from the exported directory answered '$got'"

# Packed and kept apart, with Llama 3's template: several conversations a sample
# (data.chat_packing), each attending to itself only and counting positions from its
# start (data.reset_attention_mask, reset_position_ids). The Instruct tokenizer's eos is
# <|eot_id|>, which ends every turn: conversations end with <|end_of_text|> (50258)
# instead, where the documents end.
"$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set "data.tokenizer=\"$work/llama3\"" \
  --set data.chat_packing=true --set data.reset_attention_mask=true --set data.reset_position_ids=true \
  --set model.seq_length=96 --set batch.micro_batch_size=8 --set batch.global_batch_size=8 --set optimizer.lr=0.003 \
  --set "checkpoint.dir=\"$work/packck\"" --metrics "$work/pack.m" >"$work/pack.log" 2>&1 ||
  fail "packed fine-tuning exited $?: $(tail -3 "$work/pack.log")"
grep -q "packed" "$work/pack.log" && grep -q "documents end at token 50258" "$work/pack.log" ||
  fail "the packed run does not end conversations with <|end_of_text|>: $(grep data: "$work/pack.log")"
grep -q "warning" "$work/pack.log" && fail "the packed run warns: $(grep warning "$work/pack.log")"
python3 - "$work/pack.m" <<'PY' || fail "the loss of the packed run did not fall far below the questions' own"
import json, sys
loss = [json.loads(l)["loss"] for l in open(sys.argv[1]) if '"loss"' in l]
# (Llama 3's turns learn more slowly here than ChatML's, and at lr 0.01 the model can
# sit on the plateau of not yet reading the name, (ln 4) / 3; the random letters alone
# would keep a loss that counted them above 1.)
assert loss[0] > 3 and sum(loss[-10:]) / 10 < 0.25, loss
PY
for q in "zzq alice:red" "kkvvxq dave:black"; do
  got=$("$loom" generate "$work/packck" --chat --prompt "${q%%:*}" --temperature 0 --max-new-tokens 4 2>/dev/null)
  [ "$got" = "${q#*:}" ] || fail "generate --chat (llama3, packed) answered '$got' to '${q%%:*}'"
done

# loom eval --task chat: held-out questions answered right are exact answers with a
# small loss; the same questions with the wrong colours are none, with a large one; the
# same numbers at tp 2 and micro-batches of 3.
python3 - "$work" <<'PY'
import json, sys
colours = {"alice": "red", "bob": "green", "carol": "blue", "dave": "black"}
wrong = {"alice": "green", "bob": "blue", "carol": "black", "dave": "red"}
for name, answers in (("right", colours), ("wrong", wrong)):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        for i, who in enumerate(sorted(colours) * 3):
            f.write(json.dumps({"messages": [{"role": "user", "content": "jq" * (i % 4 + 1) + " " + who},
                                             {"role": "assistant", "content": answers[who]}]}) + "\n")
PY
right=$("$loom" eval "$work/sftck" --task chat --data "$work/right.jsonl" --json 2>/dev/null)
wrong=$("$loom" eval "$work/sftck" --task chat --data "$work/wrong.jsonl" --json 2>/dev/null)
tp2=$("$loom" eval "$work/sftck" --task chat --data "$work/right.jsonl" --json --set parallel.tp=2 \
  --set batch.micro_batch_size=3 2>/dev/null)
python3 - "$right" "$wrong" "$tp2" <<'PY' || fail "eval --task chat: right $right, wrong $wrong, tp 2 $tp2"
import json, sys
r, w, t = (json.loads(a) for a in sys.argv[1:])
assert r["conversations"] == w["conversations"] == 12 and r["tokens"] == 12 * 4, (r, w)
assert r["exact_answers"] == 1.0 and r["loss"] < 0.1, r
assert w["exact_answers"] == 0.0 and w["loss"] > 1.0, w
assert t["exact_answers"] == 1.0 and abs(t["loss"] - r["loss"]) < 1e-5 * max(r["loss"], 1e-3) + 1e-7, (t, r)
PY

# The same run at dp 2 and tp 2 reads the same samples: the same losses (within the
# reduction order).
"$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set run.steps=6 --set "checkpoint.dir=\"\"" \
  --set run.eval_every=0 --set run.log_every=1 --metrics "$work/s1.m" >/dev/null 2>&1 || fail "a serial chat run exited $?"
"$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set run.steps=6 --set "checkpoint.dir=\"\"" \
  --set run.eval_every=0 --set run.log_every=1 --set parallel.dp=2 --set parallel.tp=2 --set batch.micro_batch_size=4 \
  --metrics "$work/s4.m" >/dev/null 2>&1 || fail "a dp 2 x tp 2 chat run exited $?"
python3 - "$work/s1.m" "$work/s4.m" <<'PY' || fail "dp 2 x tp 2 on conversations does not train as the serial run"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if '"loss"' in l] for p in sys.argv[1:])
assert len(a) == len(b) == 6 and all(abs(x - y) < 1e-4 * max(1, abs(x)) for x, y in zip(a, b)), (a, b)
PY
fi

# 4. Bad input: the file and line, the template's missing token, no template; a
#    sequence too short for the conversations is said.
out=$("$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set model.seq_length=20 --set run.steps=1 \
  --set run.eval_every=0 --set "checkpoint.dir=\"\"" 2>&1)
[[ "$out" == *" of 512 lines of conversations are longer than seq_length + 1 = 21 tokens"* ]] ||
  fail "conversations cut at the sequence length are not said: $out"
out=$("$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set model.seq_length=8 --set run.steps=1 \
  --set run.eval_every=0 --set "checkpoint.dir=\"\"" 2>&1)
[ $? -eq 1 ] && [[ "$out" == *"none of the 461 training lines keeps a token to learn in seq_length + 1 = 9"* ]] ||
  fail "a sequence too short for any answer trains: $out"
out=$("$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set data.eod_token=50258 --set run.steps=1 2>&1)
[ $? -eq 1 ] && [[ "$out" == *"<|im_end|>, which ends every turn"* ]] || fail "an eod_token that ends every turn: $out"
printf '%s\n' '{"messages": [{"role": "user", "content": "ok"}]}' '{"messages": [{"role": "tool", "content": "x"}]}' \
  > "$work/bad.jsonl"
out=$("$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set "data.path=\"$work/bad.jsonl\"" 2>&1)
[ $? -eq 1 ] && [[ "$out" == *"bad.jsonl:2: message 1: role \"tool\""* ]] || fail "a tool message: $out"
printf '%s\n' '{"messages": [{"role": "user", "content": "ok"}' > "$work/cut.jsonl"
out=$("$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set "data.path=\"$work/cut.jsonl\"" 2>&1)
[ $? -eq 1 ] && [[ "$out" == *"cut.jsonl:1: not JSON"* ]] || fail "a line cut short: $out"
out=$("$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set data.chat_template='"llama3"' 2>&1)
[ $? -eq 1 ] && [[ "$out" == *"<|begin_of_text|>"*"not one token"* ]] || fail "llama3 on a ChatML tokenizer: $out"
out=$("$loom" run "$src/configs/llama_quickstart.toml" "${sft[@]}" --set "data.tokenizer=\"$tok\"" 2>&1)
[ $? -eq 1 ] && [[ "$out" == *"declares none"*"data.chat_template"* ]] || fail "a tokenizer without a template: $out"
out=$("$loom" validate "$src/configs/llama_quickstart.toml" --set data.kind='"chat"' --set "data.path=\"$work/sft.jsonl\"" 2>&1)
[ $? -ne 0 ] && [[ "$out" == *"data.tokenizer"* ]] || fail "kind chat without a tokenizer validates: $out"
out=$("$loom" validate "$src/configs/llama_quickstart.toml" --set data.chat_template='"chatml"' 2>&1)
[ $? -ne 0 ] && [[ "$out" == *"only data.kind = \"chat\""* ]] || fail "a chat template on other data validates: $out"
out=$("$loom" generate "$work/sftck" --chat --prompt-ids 1,2 2>&1)
[ $? -eq 2 ] || fail "--chat with --prompt-ids is not a usage error: $out"
out=$("$loom" generate "$work/sftck" --chat --prompt x --chat-template vicuna 2>&1)
[ $? -eq 2 ] && [[ "$out" == *"--chat-template vicuna is not a template loom writes (chatml, llama3)"* ]] ||
  fail "an unknown --chat-template is not a usage error naming the templates: $out"

[ $fails -eq 0 ] && echo "chat: all checks passed"
exit $((fails > 0))
