// The text a model's own chat template writes for each conversation, rendered by
// Hugging Face's Jinja implementation (@huggingface/jinja, what transformers.js uses
// for apply_chat_template): the reference loom's chat templates are checked against.
//   node chat_reference.js JINJA_DIR TOKENIZER_CONFIG CONVERSATIONS.jsonl [generation-prompt]
// Prints one JSON string per conversation line.
"use strict";
const fs = require("fs");
const path = require("path");
const [jinjaDir, configPath, conversationsPath, prompt] = process.argv.slice(2);
const { Template } = require(path.resolve(jinjaDir, "dist/index.cjs"));
const config = JSON.parse(fs.readFileSync(configPath, "utf8"));
const token = (t) => (t && typeof t === "object" ? t.content : t);
const template = new Template(config.chat_template);
for (const line of fs.readFileSync(conversationsPath, "utf8").split("\n")) {
  if (!line.trim()) continue;
  const { messages } = JSON.parse(line);
  const text = template.render({
    messages,
    bos_token: token(config.bos_token) || "",
    eos_token: token(config.eos_token) || "",
    add_generation_prompt: prompt === "generation-prompt",
  });
  console.log(JSON.stringify(text));
}
