#!/usr/bin/env python3
"""Records xgrammar's verdicts as fixtures for tests/grammar_test.cc (grammar/).

For every case of tests/fixtures/grammar/cases.json (JSON Schemas, regular expressions, lists of
choices, GBNF grammars) over the Qwen2 tokenizer fixture (tests/fixtures/tokenizers/qwen2):
  * texts: xgrammar's verdict on each sample text (a valid prefix or not; complete or not), and
    python jsonschema's (or re's) verdict on the complete ones;
  * paths: seeded random walks over xgrammar's token masks, with the mask of every step
    (its count, an FNV-1a hash of the sorted allowed ids, and the ids when few).
Run with a Python that has xgrammar and jsonschema (pip install xgrammar jsonschema):
  python3 tools/make_grammar_fixtures.py  # writes tests/fixtures/grammar/xgrammar.json
"""
import json
import os
import random
import re
import sys

import jsonschema
import xgrammar as xgr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(ROOT, "tests/fixtures/tokenizers/qwen2")
CASES = os.path.join(ROOT, "tests/fixtures/grammar/cases.json")
OUT = os.path.join(ROOT, "tests/fixtures/grammar/xgrammar.json")
STEPS = 40
PATHS = 3


def byte_decoder():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def load_vocab():
    tok = json.load(open(os.path.join(TOKENIZER_DIR, "tokenizer.json")))
    gen = json.load(open(os.path.join(TOKENIZER_DIR, "generation_config.json")))
    dec = byte_decoder()
    size = max(list(tok["model"]["vocab"].values()) + [a["id"] for a in tok["added_tokens"]]) + 1
    vocab = [b""] * size
    for text, i in tok["model"]["vocab"].items():
        vocab[i] = bytes(dec[c] for c in text)
    for a in tok["added_tokens"]:
        # Special tokens never match a grammar: empty here, as the C++ side leaves them out.
        vocab[a["id"]] = b"" if a["special"] else a["content"].encode()
    eos = gen["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    return vocab, eos


def fnv1a(ids):
    h = 0xcbf29ce484222325
    for b in ",".join(str(i) for i in ids).encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def grammar_of(case):
    kind, src = case["kind"], case["source"]
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(json.dumps(src), any_whitespace=False, separators=(",", ":"), strict_mode=True)
    if kind == "regex":
        return xgr.Grammar.from_regex(src)
    if kind == "choices":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in src))
    if kind == "gbnf":
        return xgr.Grammar.from_ebnf(src)
    raise ValueError(kind)


def valid_complete(case, text):
    """The outside check of a complete text: jsonschema for schemas, re.fullmatch for regexes."""
    if case["kind"] == "json_schema":
        try:
            jsonschema.validate(json.loads(text), case["source"])
            return True
        except (ValueError, jsonschema.ValidationError):
            return False
    if case["kind"] == "regex":
        return re.fullmatch(case["source"], text) is not None
    if case["kind"] == "choices":
        return text in case["source"]
    return None


def allowed_ids(matcher, bitmask, vocab_size):
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].tolist()
    return [i for i in range(vocab_size) if (words[i >> 5] >> (i & 31)) & 1]


def main():
    vocab, eos = load_vocab()
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info)
    cases = json.load(open(CASES))
    out = {"tokenizer": "tests/fixtures/tokenizers/qwen2", "vocab_size": len(vocab), "eos": eos, "cases": []}
    for case in cases:
        compiled = compiler.compile_grammar(grammar_of(case))
        record = {"name": case["name"], "texts": [], "paths": []}
        for text in case.get("texts", []):
            m = xgr.GrammarMatcher(compiled)
            prefix = m.accept_string(text)
            complete = prefix and m.accept_token(eos[0])
            record["texts"].append({"text": text, "prefix": bool(prefix), "complete": bool(complete),
                                    "outside_valid": valid_complete(case, text) if complete else None})
        rng = random.Random(case["name"])
        bitmask = xgr.allocate_token_bitmask(1, len(vocab))
        for _ in range(PATHS):
            m = xgr.GrammarMatcher(compiled)
            tokens, masks, text = [], [], b""
            for _ in range(STEPS):
                ids = allowed_ids(m, bitmask, len(vocab))
                entry = {"count": len(ids), "hash": fnv1a(ids)}
                if len(ids) <= 48:
                    entry["ids"] = ids
                masks.append(entry)
                if not ids:
                    break
                stops = [i for i in ids if i in eos]
                if stops and rng.random() < 0.3:
                    t = stops[0]
                else:
                    others = [i for i in ids if i not in eos] or stops
                    t = rng.choice(others)
                assert m.accept_token(t)
                tokens.append(t)
                if t in eos:
                    break
                text += vocab[t]
            terminated = m.is_terminated()
            path = {"tokens": tokens, "masks": masks, "terminated": terminated}
            if terminated:
                path["outside_valid"] = valid_complete(case, text.decode("utf-8", "replace"))
            record["paths"].append(path)
        out["cases"].append(record)
        print(case["name"], [len(p["tokens"]) for p in record["paths"]], file=sys.stderr)
    with open(OUT, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
