// An independent GPT-2 BPE encoder for the tokenizer test: JavaScript's own Unicode
// regex (the pattern of GPT-2's encoder.py) and a plain merge loop, so loom's C++
// pre-tokenizer, byte map and merges are checked against another implementation.
//   node gpt2_reference.js TOKENIZER_DIR TEXT_FILE   -> ids, space-separated
const fs = require('fs');
const [dir, file] = process.argv.slice(2);
const encoder = new Map(Object.entries(JSON.parse(fs.readFileSync(`${dir}/encoder.json`, 'utf8'))));
const ranks = new Map();
fs.readFileSync(`${dir}/vocab.bpe`, 'utf8').split('\n').slice(1).filter(l => l.length > 0)
    .forEach((line, i) => ranks.set(line, i));

const { bpe } = require('./byte_level_reference.js');

// \s as Python's regex module matches it in encoder.py: Unicode's White_Space (JavaScript's
// \s would add U+FEFF and leave out U+0085).
const pattern =
    /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\p{White_Space}\p{L}\p{N}]+|\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+/gu;
const text = fs.readFileSync(file, 'utf8');
const ids = [];
for (const m of text.matchAll(pattern)) ids.push(...bpe(m[0], encoder, ranks));
process.stdout.write(ids.join(' ') + '\n');
