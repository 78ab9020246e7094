"""GPT-2's vocabulary and merges written as Hugging Face tokenizer.json files of the
forms GPT-2's, Llama 3's and Qwen2's repositories ship (their pre-tokenizer patterns,
added tokens), for the text tests: the same BPE under each model family's conventions.
"""
import json
import os

# Llama 3's pre-tokenizer pattern (OpenAI's cl100k), and Qwen2's (single digits).
LLAMA3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
          "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2 = LLAMA3.replace("\\p{N}{1,3}", "\\p{N}")


def gpt2(tok):
    """GPT-2's encoder.json vocabulary and vocab.bpe merges from the directory `tok`."""
    vocab = json.load(open(f"{tok}/encoder.json", encoding="utf-8"))
    merges = [l for l in open(f"{tok}/vocab.bpe", encoding="utf-8").read().split("\n")[1:] if l]
    return vocab, merges


def added(i, content):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def split(pattern):
    """A Split by `pattern` then byte-level bytes, as Llama 3's and Qwen2's pre-tokenizers."""
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


def write(directory, model, pre, extra_added=(), normalizer=None, config=None):
    """DIRECTORY/tokenizer.json of a BPE `model` behind `pre`, <|endoftext|> (50256) and
    `extra_added` as added tokens; DIRECTORY/tokenizer_config.json when `config` is given."""
    os.makedirs(directory, exist_ok=True)
    j = {"version": "1.0", "truncation": None, "padding": None,
         "added_tokens": [added(50256, "<|endoftext|>")] + list(extra_added),
         "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": None,
         "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
         "model": dict({"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                        "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False}, **model)}
    json.dump(j, open(f"{directory}/tokenizer.json", "w", encoding="utf-8"), ensure_ascii=False)
    if config:
        json.dump(config, open(f"{directory}/tokenizer_config.json", "w"))


def write_with_specials(directory, vocab, merges, pattern, specials, config):
    """GPT-2's BPE behind `pattern` with `specials` as added tokens 50257, 50258, ..."""
    ids = {s: 50257 + k for k, s in enumerate(specials)}
    write(directory, {"vocab": dict(vocab, **ids), "merges": merges}, split(pattern),
          [added(i, s) for s, i in ids.items()], config=config)
