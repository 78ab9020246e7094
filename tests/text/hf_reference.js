// An independent encoder for Hugging Face tokenizer.json files (byte-level BPE) for the
// tokenizer test: JavaScript's own Unicode regexes for the pre-tokenizer patterns,
// String.prototype.normalize for NFC, and a plain merge loop, so loom's C++ reading of
// the file is checked against another implementation.
//   node hf_reference.js TOKENIZER_JSON TEXT_FILE   -> ids, space-separated
const fs = require('fs');
const [file, textFile] = process.argv.slice(2);
const tok = JSON.parse(fs.readFileSync(file, 'utf8'));
const vocab = new Map(Object.entries(tok.model.vocab));
const ranks = new Map();
tok.model.merges.forEach((m, i) => ranks.set(Array.isArray(m) ? m.join(' ') : m, i));
const added = (tok.added_tokens || []).map(a => [a.content, a.id]).sort((a, b) => b[0].length - a[0].length);

const { bpe } = require('./byte_level_reference.js');

// \s as White_Space; (?i:'s|...) spelled out (JavaScript of this age has no inline flags),
// with U+017F (long s), which Unicode case folding makes an s.
const S = '\\p{White_Space}', NS = '\\P{White_Space}';
const contractions = "'[sS\u017F]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]";
const patterns = {
  gpt2: `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^${S}\\p{L}\\p{N}]+|${S}+(?!${NS})|${S}+`,
  llama3: `${contractions}|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^${S}\\p{L}\\p{N}]+[\\r\\n]*|${S}*[\\r\\n]+|` +
          `${S}+(?!${NS})|${S}+`,
  qwen2: `${contractions}|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^${S}\\p{L}\\p{N}]+[\\r\\n]*|${S}*[\\r\\n]+|` +
         `${S}+(?!${NS})|${S}+`,
};
const pre = tok.pre_tokenizer;
let kind = 'gpt2', prefix = false;
if (pre.type === 'Sequence') {
  const p = pre.pretokenizers[0].pattern.Regex;
  kind = p.includes('\\p{N}{1,3}') ? 'llama3' : 'qwen2';
  prefix = pre.pretokenizers[1].add_prefix_space;
} else {
  prefix = pre.add_prefix_space;
}
const regex = new RegExp(patterns[kind], 'gu');
const nfc = tok.normalizer && tok.normalizer.type === 'NFC';

function encodeText(text, ids) {
  if (text.length === 0) return;
  if (nfc) text = text.normalize('NFC');
  if (prefix && !text.startsWith(' ')) text = ' ' + text;
  for (const m of text.matchAll(regex)) ids.push(...bpe(m[0], vocab, ranks, tok.model.ignore_merges));
}

const text = fs.readFileSync(textFile, 'utf8');
const ids = [];
let start = 0;
for (let i = 0; i < text.length;) {
  const hit = added.find(([c]) => text.startsWith(c, i));
  if (!hit) { i++; continue; }
  encodeText(text.slice(start, i), ids);
  ids.push(hit[1]);
  i += hit[0].length;
  start = i;
}
encodeText(text.slice(start), ids);
process.stdout.write(ids.join(' ') + '\n');
