#!/usr/bin/env bash
# `loom serve` end to end: a model trained on the quickstart task, served over HTTP,
# answers as `loom generate` does (greedy and seeded samples, streamed or not, on one
# connection or several at once); bad requests and bad HTTP get clear errors; SIGTERM
# ends the server in good order with status 0. Usage: serve_test.sh LOOM SOURCE_DIR
set -uo pipefail
loom=$1
src=$2
work=$(mktemp -d)
server=""
cleanup() {
  [ -n "$server" ] && kill -9 "$server" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  [ -f "$work/serve.err" ] && tail -20 "$work/serve.err" >&2
  exit 1
}

# Usage errors come before anything loads.
for bad in "" "ck --port 70000" "ck --host not-an-address" "ck --chat-template vicuna" "ck --max-connections 0"; do
  # shellcheck disable=SC2086
  "$loom" serve $bad >/dev/null 2>"$work/usage.err"
  [ $? -eq 2 ] || fail "loom serve $bad did not exit 2: $(cat "$work/usage.err")"
done

"$loom" run "$src/configs/quickstart.toml" --set run.steps=300 --set parallel.dp=1 --set run.log_every=300 \
  --set run.eval_every=0 --set "checkpoint.dir=\"$work/ck\"" --set checkpoint.every=300 >"$work/train.log" 2>&1 ||
  fail "training exited $?: $(tail -3 "$work/train.log")"

"$loom" serve "$work/ck" --port 0 --model-name adder --set parallel.tp=2 >"$work/serve.out" 2>"$work/serve.err" &
server=$!
for _ in $(seq 600); do
  grep -q "on http://" "$work/serve.err" && break
  kill -0 "$server" 2>/dev/null || fail "loom serve exited before listening"
  sleep 0.1
done
port=$(grep -o "127.0.0.1:[0-9]*" "$work/serve.err" | head -1 | cut -d: -f2)
[ -n "$port" ] || fail "loom serve printed no address"

# A port in use is said at once, before the model loads.
"$loom" serve "$work/ck" --port "$port" >/dev/null 2>"$work/inuse.err"
[ $? -eq 1 ] && grep -q "cannot listen on 127.0.0.1:$port" "$work/inuse.err" ||
  fail "a second server on port $port: $(cat "$work/inuse.err")"

# What loom generate writes for the same requests.
gen() { "$loom" generate "$work/ck" --json --max-new-tokens 8 "$@" 2>/dev/null; }
greedy=$(gen --prompt "12+34=" --temperature 0)
seeded7=$(gen --prompt "98+7=" --seed 7 --top-k 3)
seeded8=$(gen --prompt "98+7=" --seed 8 --top-k 3)

python3 - "$port" "$greedy" "$seeded7" "$seeded8" <<'PY' || fail "the HTTP checks failed"
import http.client, json, socket, sys, threading
port = int(sys.argv[1])
greedy, seeded7, seeded8 = (json.loads(a) for a in sys.argv[2:5])

def call(method, path, body=None, conn=None, raw=None):
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    c.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    text = r.read().decode()
    return r.status, text, r

def ok(path, body, method="POST"):
    status, text, _ = call(method, path, body)
    assert status == 200, (path, body, status, text)
    return json.loads(text)

assert ok("/health", None, "GET")["status"] == "ok"
assert ok("/v1/models", None, "GET")["data"][0]["id"] == "adder"

# Greedy, as loom generate: the same text and count (max_tokens 8).
j = ok("/v1/completions", {"model": "adder", "prompt": "12+34=", "max_tokens": 8, "temperature": 0})
assert j["choices"][0]["text"] == greedy["text"], (j, greedy)
assert j["usage"]["completion_tokens"] == len(greedy["ids"]), (j, greedy)
assert j["usage"]["prompt_tokens"] == len(greedy["prompt_ids"])
# The prompt as token ids gives the same.
j = ok("/v1/completions", {"prompt": greedy["prompt_ids"], "max_tokens": 8, "temperature": 0})
assert j["choices"][0]["text"] == greedy["text"], j
# Seeded samples: choice i draws with seed + i, as loom generate --seed does.
j = ok("/v1/completions", {"prompt": "98+7=", "max_tokens": 8, "seed": 7, "top_k": 3, "n": 2})
assert [c["text"] for c in j["choices"]] == [seeded7["text"], seeded8["text"]], (j, seeded7, seeded8)
# Megatron-LM's API: the prompt and what follows it.
j = ok("/api", {"prompts": ["12+34="], "tokens_to_generate": 8, "top_k": 1}, "PUT")
assert j["text"] == ["12+34=" + greedy["text"]], j

# Streamed: the events' texts are the answer's; then [DONE].
status, text, r = call("POST", "/v1/completions", {"prompt": "12+34=", "max_tokens": 8, "temperature": 0,
                                                  "stream": True, "stream_options": {"include_usage": True}})
assert status == 200 and r.getheader("Content-Type") == "text/event-stream", (status, text)
events = [e[len("data: "):] for e in text.split("\n\n") if e]
assert events[-1] == "[DONE]", events
chunks = [json.loads(e) for e in events[:-1]]
assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == greedy["text"], chunks
assert chunks[-1]["usage"]["completion_tokens"] == len(greedy["ids"]), chunks[-1]

# Several clients at once: each gets what it would alone (requests take turns).
answers = [None] * 6
def client(i):
    answers[i] = ok("/v1/completions", {"prompt": "12+34=", "max_tokens": 8, "temperature": 0})["choices"][0]["text"]
threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
assert answers == [greedy["text"]] * 6, answers

# Keep-alive: several requests on one connection, a refused one among them.
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
for body, want in [({"prompt": "1+1=", "max_tokens": 2}, 200), ({"prompt": "1", "logprobs": 1}, 400),
                   ({"prompt": "1+1=", "max_tokens": 2}, 200)]:
    status, text, _ = call("POST", "/v1/completions", body, conn)
    assert status == want, (body, status, text)

# Refusals: each a status and an OpenAI-shaped error naming the problem.
for method, path, body, raw, want, says in [
        ("POST", "/v1/completions", None, "{not json", 400, "not JSON"),
        ("POST", "/v1/completions", {"prompt": "1", "temprature": 0}, None, 400, "unrecognized request argument"),
        ("POST", "/v1/completions", {"prompt": [99]}, None, 400, "outside the vocabulary"),
        ("POST", "/v1/completions", {"prompt": "1", "model": "gpt-4"}, None, 404, "not served here"),
        ("POST", "/v1/completions", {"prompt": "12+34=" * 4}, None, 400, "seq_length"),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None, 400, "no chat"),
        ("GET", "/v1/completions", None, None, 405, "takes POST"),
        ("POST", "/nowhere", {}, None, 404, "no such path")]:
    status, text, _ = call(method, path, body, raw=raw)
    assert status == want and says in json.loads(text)["error"]["message"], (path, body, raw, status, text)

# A body over the limit, and bytes that are not HTTP.
def raw_reply(data):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(data)
    reply = s.recv(4096).decode(errors="replace")
    s.close()
    return reply
reply = raw_reply(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % (9 << 20))
assert reply.startswith("HTTP/1.1 413") and "over 8388608 bytes" in reply, reply
reply = raw_reply(b"GARBAGE\r\n\r\n")
assert reply.startswith("HTTP/1.1 400") and "not HTTP/1.1" in reply, reply
# A transfer coding the server does not read would leave the body to be taken for the
# next request (request smuggling): refused.
reply = raw_reply(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"
                  b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
assert reply.startswith("HTTP/1.1 501") and reply.count("HTTP/1.1") == 1, reply
# JSON nested past any use is refused before anything copies it (the copy recurses).
status, text, _ = call("POST", "/v1/completions", raw='{"prompt": ' + "[" * 100000 + "]" * 100000 + "}")
assert status == 400 and "nests deeper" in text, (status, text[:200])
assert ok("/health", None, "GET")["status"] == "ok"
print("http checks passed")
PY

# OpenAI's own client (npm `openai`, no dependencies; fetched once and checked) reads
# the answers as loom generate's, streamed or not, and a refusal as its BadRequestError.
openai="$src/.cache/npm/openai-5.23.2"
"$src/tests/support/fetch_npm.sh" openai@5.23.2 a2aa74ff8be1a80a215af201a3d2228e999464d166c1eaec2c9ca313395fbef1 "$openai"
case $? in
  0)
    got=$(node "$src/tests/cli/openai_client.js" "$openai" "$port" adder completions "12+34=") ||
      fail "OpenAI's client failed against loom serve"
    python3 - "$got" "$greedy" <<'PY' || fail "OpenAI's client read $got"
import json, sys
got, want = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert got["text"] == got["streamed"] == want["text"], (got, want)
assert got["finish_reason"] == "length" and got["usage"]["completion_tokens"] == len(want["ids"]), got
assert got["models"] == ["adder"], got
r = got["refusal"]
assert r["status"] == 400 and r["kind"] == "BadRequestError" and "'logprobs' is not supported" in r["message"], r
PY
    ;;
  77) echo "note: npm could not fetch openai@5.23.2; OpenAI's client was not tried" ;;
  *) fail "openai@5.23.2's tarball has another sha256" ;;
esac

# SIGTERM with a client idle on an open connection: the server stops, status 0.
exec 3<>"/dev/tcp/127.0.0.1/$port" || fail "could not connect to the server"
kill -TERM "$server"
for _ in $(seq 100); do
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$server" 2>/dev/null && fail "loom serve did not stop within 10 s of SIGTERM"
wait "$server"
status=$?
server=""
exec 3<&-
[ $status -eq 0 ] || fail "loom serve exited $status after SIGTERM"
grep -q "loom serve: stopped" "$work/serve.err" || fail "loom serve did not say it stopped"
grep -q "tp 2" "$work/serve.err" || fail "the --set layout was not the one served"
grep -q "POST /v1/completions 200" "$work/serve.err" || fail "requests were not logged"
echo "serve test passed"
