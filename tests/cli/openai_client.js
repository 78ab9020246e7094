// OpenAI's own Node client (the npm package `openai`, fetched by the test) against
// `loom serve`: what the client makes of the answers, printed as one JSON object for
// the calling test to compare with `loom generate`'s.
//   node openai_client.js OPENAI_PACKAGE_DIR PORT MODEL completions PROMPT
//   node openai_client.js OPENAI_PACKAGE_DIR PORT MODEL chat USER_MESSAGE
const [pkg, port, model, mode, prompt] = process.argv.slice(2);
const OpenAI = require(pkg);
const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: "unused", maxRetries: 0 });

async function streamed(stream, pick) {
  let text = "";
  for await (const chunk of stream) if (chunk.choices.length) text += pick(chunk.choices[0]) ?? "";
  return text;
}

async function completions() {
  const args = { model, prompt, max_tokens: 8, temperature: 0 };
  const whole = await client.completions.create(args);
  const stream = await client.completions.create({ ...args, stream: true });
  const models = [];
  for await (const m of client.models.list()) models.push(m.id);
  let refusal = null;
  try {
    await client.completions.create({ ...args, logprobs: 2 });
  } catch (e) {
    refusal = { status: e.status, kind: e.constructor.name, message: e.message };
  }
  return {
    text: whole.choices[0].text,
    finish_reason: whole.choices[0].finish_reason,
    usage: whole.usage,
    streamed: await streamed(stream, (c) => c.text),
    models,
    refusal,
  };
}

async function chat() {
  const args = { model, messages: [{ role: "user", content: prompt }], temperature: 0 };
  const whole = await client.chat.completions.create(args);
  const stream = await client.chat.completions.create({ ...args, stream: true });
  return {
    content: whole.choices[0].message.content,
    role: whole.choices[0].message.role,
    finish_reason: whole.choices[0].finish_reason,
    streamed: await streamed(stream, (c) => c.delta.content),
  };
}

(mode === "chat" ? chat() : completions())
  .then((r) => console.log(JSON.stringify(r)))
  .catch((e) => {
    console.error("openai client:", e);
    process.exit(1);
  });
