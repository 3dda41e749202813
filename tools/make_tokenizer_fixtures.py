"""Builds the tokenizer parity fixtures under tests/fixtures/tokenizers/<kind>/.

For each kind of tokenizer.json that Llama, Qwen2/2.5 and Mistral checkpoints use, this trains a
small BPE model with Hugging Face `tokenizers`, writes tokenizer.json with the same pipeline and
the same file structure as the real checkpoints (normalizer, pre-tokenizer, post-processor,
decoder, model options, special tokens), writes tokenizer_config.json and generation_config.json
as those checkpoints have them, and records what `tokenizers` computes for a corpus of hard
strings (cases.json): ids with and without special tokens, their decodes with and without
special tokens, the pre-tokenizer's pieces, and the decodes of random id sequences (which split
characters across tokens).
The C++ tests (tests/tokenizer_test.cc) must reproduce every one.

Kinds:
  gpt2     byte-level BPE, ByteLevel pre-tokenizer (GPT-2 regex), no BOS
  llama3   byte-level BPE, Split(Llama 3 regex) + ByteLevel, ignore_merges, BOS by TemplateProcessing
  qwen2    byte-level BPE, NFC normalizer, Split(Qwen2 regex) + ByteLevel, no BOS, non-special added tokens
  llama2   SentencePiece-style BPE with byte fallback, legacy: Prepend + Replace normalizers, BOS
  mistral  SentencePiece-style BPE with byte fallback, Metaspace(prepend_scheme=first), BOS, [INST] controls
and two kinds that no real checkpoint has, made to cover the other supported components:
  features_bytelevel  NFKC + Lowercase + Replace(regex) + Strip normalizers; Split with every
                      delimiter behaviour and invert (CLIP's pattern); ByteLevel(add_prefix_space);
                      added tokens with lstrip, rstrip, single_word and normalized; [CLS] $A [SEP]
  features_metaspace  NFD + Replace normalizers; Split + Metaspace(split, prepend always); no byte
                      fallback, so unknown characters become a fused <unk>; Metaspace decoder; $A </s>

Training text: the King James Bible (public domain), from Debian's bible-kjv package, read with
its `bible` program (`bible -l0 Gen1:1-Rev22:21`, which decodes /usr/lib/bible.data), plus a few
lines of non-Latin text (TRAINING_EXTRA).

Usage (from the repository root):
    tools/install-deps.sh          # bible-kjv
    tools/tokenizer-env.sh && .venv-tokenizers/bin/python tools/make_tokenizer_fixtures.py
"""

import argparse
import json
import pathlib
import random
import shutil
import subprocess

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "tokenizers"

VOCAB_SIZE = 2048  # small fixtures: about 1,800 merges each
RANDOM_DECODES = 40
SEED = 20240601

# Pre-tokenizer regexes, as in the real tokenizer.json files.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Strings that have broken tokenizer ports before. Every kind encodes all of them; special tokens
# of one kind are plain text to the others.
HARD_STRINGS = [
    "",
    " ",
    "Hello world",
    "Hello, world! How are you today?",
    " Hello",
    "  leading two spaces",
    "trailing spaces   ",
    "a" + " " * 40 + "b",
    " " * 17,
    "\t\ttabbed\tline\t",
    "line one\nline two\r\nline three\n\n\nafter blank lines",
    "\n",
    "  \n\t \n  ",
    "mixed\u00a0nbsp and\u3000ideographic space",
    "line\u2028separator and\u2029paragraph",
    "mongolian\u180evowel separator",
    "x\u180e\u180e! end  \u180e",  # U+180E is not whitespace to Oniguruma (it is to PCRE2's \s)
    "next\u0085line",
    "1234567890",
    "3.14159265358979323846",
    "In the year 2024, 1,000,000 people paid $12.50 each.",
    "phone: +1 (555) 123-4567, x\u0662\u0663 arabic-indic digits",
    "I'm sure you're right; he's gone, we've seen it, they'll come, I'd go, can't won't.",
    "DON'T SHOUT, IT'S RUDE. 'S 'T 'RE 'll",
    "rock 'n' roll ''quoted'' \"double\" \u2018curly\u2019",
    "你好，世界！这是一个测试。",
    "日本語のテキストです。カタカナとひらがな。",
    "한국어 텍스트입니다",
    "Привет, мир! Как дела?",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "mixed RTL: abc אבג 123 مرحبا!",
    "हिन्दी पाठ",
    "ภาษาไทย",
    "Ünïcödé façade naïve café résumé",
    "e\u0301 vs \u00e9 and A\u030a vs \u00c5, \u1100\u1161 jamo",
    "Z\u0335\u0321\u0327\u0355a\u0337l\u0338g\u0335o\u0336 text",
    "\ufb01 ligature \u2460 circled \uff21\uff22 fullwidth \u2126 ohm",
    "\u0130stanbul \u017fs long s",
    "👍",
    "👍🏽 thumbs",
    "👨‍👩‍👧‍👦 family ZWJ sequence",
    "🏳️‍🌈 flag and 🇺🇸🇯🇵 regional indicators",
    "👩🏽‍💻 coder",
    "emoji at end 😀",
    "\u200d lone zwj \u200b zero width space \ufeff bom",
    "\ufffd replacement char",
    "control \x00\x01\x1b[31mred\x1b[0m",
    "\u2581 lower one eighth block, the SentencePiece space \u2581\u2581",
    "<0x41> looks like a byte token <0xZZ>",
    "def f(x):\n    return x ** 2  # square\n",
    "https://example.com/path?query=1&b=2#frag",
    "snake_case camelCase PascalCase kebab-case",
    "Supercalifragilisticexpialidocious" * 9,
    "In the beginning God created the heaven and the earth.",
    "And God said, Let there be light: and there was light.",
    # Special tokens of the various kinds, inside text, adjacent, and look-alikes.
    "<|endoftext|>",
    "text<|endoftext|>more text<|endoftext|>",
    "<|endoftext",
    "<|endoftext|",
    "< |endoftext|>",
    "<s>",
    "<s>Hello</s>",
    "Hello <s> world </s> again",
    "<s><s></s>",
    "<s >",
    "</s",
    "<unk> is a token too",
    "<s>[INST] Hello [/INST] Hi</s>[INST]again[/INST]",
    "[INST",
    "[TOOL_CALLS][{\"name\": \"f\"}]",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "<|begin_of_text|",
    "<|reserved_special_token_0|><|reserved_special_token_1|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<tool_call>{\"a\": 1}</tool_call>",
    "<|im_start|",
    "|im_start|>",
    # Added-token options (lstrip, rstrip, single_word, normalized) of the features kinds.
    "fill the   <mask> here, [R]   then [SEP] done",
    "say hello, hello!hello and Hello; not helloworld or ohello",
    "ABC abc ＡＢＣ xABCx",
]


# A little non-Latin text in the training data, so that the small vocabularies hold some
# multi-byte pieces. The hard strings themselves stay unseen: characters of theirs that are not in
# a SentencePiece-style vocabulary exercise byte fallback.
TRAINING_EXTRA = [
    "你好，世界！我们在这里。中文文本。",
    "日本語の文章です。",
    "Привет, мир! Это русский текст.",
    "Ünïcödé façade naïve café",
    "مرحبا",
]


def read_training_text():
    bible = shutil.which("bible")
    if bible is None:
        raise SystemExit("make_tokenizer_fixtures: `bible` not found; install Debian's bible-kjv (tools/install-deps.sh)")
    print("make_tokenizer_fixtures: training text from /usr/lib/bible.data via `bible -l0 Gen1:1-Rev22:21`")
    text = subprocess.run([bible, "-l0", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True).stdout
    return text.splitlines() + TRAINING_EXTRA * 20


def train(lines, pre_tokenizer, normalizer=None, special_tokens=(), initial_alphabet=(), limit_alphabet=None):
    """Trains a BPE model; returns its vocab (token -> id) and merges [(a, b)] in rank order."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    options = {} if limit_alphabet is None else {"limit_alphabet": limit_alphabet}
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(special_tokens),
                                  initial_alphabet=list(initial_alphabet), show_progress=False, **options)
    tok.train_from_iterator(lines, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m) for m in model["merges"]]


def byte_level_bpe(lines, pre_tokenizer, normalizer=None, **bpe_options):
    vocab, merges = train(lines, pre_tokenizer, normalizer, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    return Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, **bpe_options))


def sentencepiece_bpe(lines, control_tokens):
    """Llama 2 / Mistral layout: control tokens, then <0x00>..<0xFF>, then learned pieces (▁word)."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab, merges = train(lines, pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
                          special_tokens=control_tokens + byte_tokens)
    return Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token="<unk>", fuse_unk=True,
                                byte_fallback=True))


def special(content, normalized=False):
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=normalized, special=True)


def bos_template(bos, bos_id):
    return processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                         special_tokens=[(bos, bos_id)])


def sentencepiece_decoder():
    return decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                              decoders.Strip(content=" ", left=1, right=0)])


def build_gpt2(lines):
    tok = byte_level_bpe(lines, pre_tokenizers.ByteLevel(add_prefix_space=False),
                         continuing_subword_prefix="", end_of_word_suffix="")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True)
    tok.add_special_tokens([special("<|endoftext|>", normalized=True)])  # as GPT-2's file has it
    eos = tok.token_to_id("<|endoftext|>")
    config = {"add_prefix_space": False, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
              "unk_token": "<|endoftext|>", "model_max_length": 1024, "tokenizer_class": "GPT2Tokenizer"}
    generation = {"bos_token_id": eos, "eos_token_id": eos}
    return tok, config, generation, True  # True: write merges as "a b" strings, as GPT-2's file


def build_llama3(lines):
    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False)
    tok = byte_level_bpe(lines, pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                          use_regex=False)]),
                         ignore_merges=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    tok.add_special_tokens([special(n) for n in names])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        bos_template("<|begin_of_text|>", bos)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
              "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    generation = {"bos_token_id": bos, "eos_token_id": [tok.token_to_id(t) for t in
                                                        ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")],
                  "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    return tok, config, generation, False


def build_qwen2(lines):
    split = pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok = byte_level_bpe(lines, pre_tokenizers.Sequence([split, byte_level]), normalizers.NFC(),
                         continuing_subword_prefix="", end_of_word_suffix="", byte_fallback=False)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([special(n) for n in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    # Qwen2.5's tool and fill-in-the-middle markers are added tokens that are not special.
    tok.add_tokens([AddedToken(n, single_word=False, lstrip=False, rstrip=False, normalized=False, special=False)
                    for n in ("<tool_call>", "</tool_call>", "<|fim_prefix|>")])
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    config = {"add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "errors": "replace", "split_special_tokens": False, "model_max_length": 131072,
              "tokenizer_class": "Qwen2Tokenizer"}
    generation = {"bos_token_id": eot, "pad_token_id": eot, "eos_token_id": [im_end, eot], "do_sample": True}
    return tok, config, generation, True


# Fields that the Python API cannot set but the real files have: Qwen2's ByteLevel decoder is
# serialized with all options false (they do not change decoding).
JSON_OVERRIDES = {
    "qwen2": {"decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}},
}


def build_llama2(lines):
    controls = ["<unk>", "<s>", "</s>"]
    tok = sentencepiece_bpe(lines, controls)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = None
    tok.add_special_tokens([special(n) for n in controls])
    tok.post_processor = bos_template("<s>", tok.token_to_id("<s>"))
    tok.decoder = sentencepiece_decoder()

    def added(content):  # tokenizer_config.json of Llama 2 spells its tokens as AddedToken objects
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
                "rstrip": False, "single_word": False}
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": added("<s>"), "eos_token": added("</s>"),
              "unk_token": added("<unk>"), "pad_token": None, "clean_up_tokenization_spaces": False,
              "legacy": True, "model_max_length": 1000000000000000019884624838656, "tokenizer_class": "LlamaTokenizer"}
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "temperature": 0.6, "top_p": 0.9}
    return tok, config, generation, False


def build_mistral(lines):
    controls = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"] + [f"[control_{i}]" for i in range(8, 16)]
    tok = sentencepiece_bpe(lines, controls)
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.add_special_tokens([special(n) for n in controls])
    tok.post_processor = bos_template("<s>", tok.token_to_id("<s>"))
    tok.decoder = sentencepiece_decoder()
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "clean_up_tokenization_spaces": False, "legacy": False,
              "model_max_length": 1000000000000000019884624838656, "tokenizer_class": "LlamaTokenizer"}
    generation = {"bos_token_id": 1, "eos_token_id": 2}
    return tok, config, generation, False


def build_features_bytelevel(lines):
    normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(),
                                       normalizers.Replace(Regex(r" {3,}"), "  "), normalizers.Strip(left=False, right=True)])
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"), behavior="removed",
                             invert=True),
        pre_tokenizers.Split("-", behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"[.!?]"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="contiguous"),
        pre_tokenizers.Split(Regex(r"[,;]"), behavior="removed"),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False),
    ])
    tok = byte_level_bpe(lines, pre_tokenizer, normalizer)
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([special("[CLS]"), special("[SEP]"),
                            AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False, special=True),
                            AddedToken("[R]", lstrip=False, rstrip=True, normalized=False, special=True)])
    tok.add_tokens([AddedToken("hello", single_word=True, normalized=True, special=False),
                    AddedToken("\uff21\uff22\uff23", normalized=True, special=False)])  # matched as "abc"
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    return tok, {"bos_token": "[CLS]", "eos_token": "[SEP]"}, {}, False


def build_features_metaspace(lines):
    normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Replace("\t", " ")])
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
    ])
    vocab, merges = train(lines, pre_tokenizer, normalizer, special_tokens=["<unk>", "</s>"], limit_alphabet=90)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=False))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.add_special_tokens([special("<unk>"), special("</s>")])
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B:1 </s>:1",
                                                       special_tokens=[("</s>", tok.token_to_id("</s>"))])
    return tok, {"eos_token": "</s>", "unk_token": "<unk>"}, {"eos_token_id": tok.token_to_id("</s>")}, False


KINDS = {"gpt2": build_gpt2, "llama3": build_llama3, "qwen2": build_qwen2, "llama2": build_llama2,
         "mistral": build_mistral, "features_bytelevel": build_features_bytelevel,
         "features_metaspace": build_features_metaspace}


def write_tokenizer_json(tok, path, legacy_merges, overrides):
    """Saves tok; with legacy_merges, merges are written as "a b" strings, as older files have them."""
    doc = json.loads(tok.to_str())
    doc.update(overrides)
    if legacy_merges:
        assert all(" " not in a and " " not in b for a, b in doc["model"]["merges"])
        doc["model"]["merges"] = [f"{a} {b}" for a, b in doc["model"]["merges"]]
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def byte_token_ids(tok):
    """Ids whose decode is one raw byte: GPT-2 alphabet characters, or <0xXX> byte-fallback tokens."""
    vocab = tok.get_vocab()
    fallback = [vocab[f"<0x{b:02X}>"] for b in range(256) if f"<0x{b:02X}>" in vocab]
    if fallback:
        return fallback
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return sorted(i for t, i in vocab.items() if len(t) == 1 and t in alphabet)


def record_cases(tok):
    encode = []
    for text in HARD_STRINGS:
        ids = tok.encode(text, add_special_tokens=True).ids
        case = {
            "text": text,
            "ids": ids,
            "ids_no_special": tok.encode(text, add_special_tokens=False).ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        }
        # The pre-tokenizer alone on the raw text: checks the regex splits directly, which a small
        # vocabulary can hide (pieces split differently may still encode to the same bytes).
        if tok.pre_tokenizer is not None:
            case["pre_tokenized"] = [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        encode.append(case)
    # Random id sequences: half over the whole vocabulary, half mostly single-byte tokens, which
    # split UTF-8 characters (valid, incomplete and invalid sequences).
    rng = random.Random(SEED)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    byte_ids = byte_token_ids(tok)
    decode = []
    for i in range(RANDOM_DECODES):
        n = rng.randint(1, 24)
        if i % 2 == 0:
            ids = [rng.randrange(vocab_size) for _ in range(n)]
        else:
            ids = [rng.choice(byte_ids) if rng.random() < 0.8 else rng.randrange(vocab_size) for _ in range(n)]
        decode.append({"ids": ids, "text": tok.decode(ids, skip_special_tokens=False),
                       "text_skip_special": tok.decode(ids, skip_special_tokens=True)})
    return {"tokenizers_version": tokenizers.__version__, "encode": encode, "decode": decode}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    args = parser.parse_args()
    lines = read_training_text()
    for kind in args.kinds:
        tok, config, generation, legacy_merges = KINDS[kind](lines)
        out = args.out / kind
        out.mkdir(parents=True, exist_ok=True)
        write_tokenizer_json(tok, out / "tokenizer.json", legacy_merges, JSON_OVERRIDES.get(kind, {}))
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        # Record from the file as written, so the cases describe exactly what is committed.
        cases = record_cases(Tokenizer.from_file(str(out / "tokenizer.json")))
        (out / "cases.json").write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"make_tokenizer_fixtures: {kind}: vocab {tok.get_vocab_size()}, "
              f"{len(cases['encode'])} strings, {len(cases['decode'])} random decodes -> {out}")


if __name__ == "__main__":
    main()
