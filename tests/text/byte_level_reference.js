// The byte-level BPE both reference encoders share (GPT-2's bytes_to_unicode and a
// plain merge loop: every occurrence of the lowest-ranked pair, left to right), written
// apart from loom's C++ so the tokenizer test compares two implementations.
const byteChar = [];
let extra = 0;
for (let b = 0; b < 256; b++) {
  const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
  byteChar.push(String.fromCodePoint(printable ? b : 256 + extra++));
}

// The ids of one piece: `vocab` token -> id (a Map), `ranks` "left right" -> rank.
function bpe(piece, vocab, ranks, ignoreMerges = false) {
  let word = Array.from(Buffer.from(piece, 'utf8'), b => byteChar[b]);
  if (ignoreMerges && vocab.has(word.join(''))) return [vocab.get(word.join(''))];
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
  return word.map(s => vocab.get(s));
}

module.exports = { bpe };
