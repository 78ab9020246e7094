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

// Bytes to printable characters, as GPT-2's bytes_to_unicode.
const byteChar = [];
let extra = 0;
for (let b = 0; b < 256; b++) {
  const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
  byteChar.push(String.fromCodePoint(printable ? b : 256 + extra++));
}

function bpe(piece) {
  let word = Array.from(Buffer.from(piece, 'utf8'), b => byteChar[b]);
  for (;;) {
    let best = Infinity, at = -1;
    for (let i = 0; i + 1 < word.length; i++) {
      const r = ranks.get(word[i] + ' ' + word[i + 1]);
      if (r !== undefined && r < best) { best = r; at = i; }
    }
    if (at < 0) break;
    const [a, b] = [word[at], word[at + 1]];
    const merged = [];
    for (let i = 0; i < word.length; i++) {
      if (i + 1 < word.length && word[i] === a && word[i + 1] === b) { merged.push(a + b); i++; }
      else merged.push(word[i]);
    }
    word = merged;
  }
  return word.map(s => encoder.get(s));
}

// \s as Python's regex module matches it in encoder.py: Unicode's White_Space (JavaScript's
// \s would add U+FEFF and leave out U+0085).
const pattern =
    /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\p{White_Space}\p{L}\p{N}]+|\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+/gu;
const text = fs.readFileSync(file, 'utf8');
const ids = [];
for (const m of text.matchAll(pattern)) ids.push(...bpe(m[0]));
process.stdout.write(ids.join(' ') + '\n');
