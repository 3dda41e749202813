"""Encoding speed of Hugging Face tokenizers (and tiktoken) beside ours (tools/bench/bench_tokenizer.cc), side by side.

For each fixture kind of a real checkpoint's pipeline (tests/fixtures/tokenizers/), encodes the
same text with the same files in both implementations on one thread: the text is cut into
chunks of about --chunk-bytes bytes ending at newlines (as bench_tokenizer does), each chunk is
encoded with special tokens. The peer of the tokenizer.json kinds is Hugging Face `tokenizers`,
timed through its two single-threaded APIs: one `Tokenizer.encode` call per chunk, and one
`encode_batch_fast` call for all chunks (no offsets) with RAYON_NUM_THREADS=1. The peer of kimi_k2
(tiktoken.model, Kimi K2's format) is `tiktoken` with Kimi's regex and special tokens, what Kimi's
TikTokenTokenizer calls (without the class's Python around it): one `encode` call per chunk, and one
`encode_batch` call with one thread (chunks this short are never cut by the class's 25,000-character
rule). Each figure is the median of --repeat timed passes after a warm-up pass;
the implementations alternate kind by kind, so that both see the same machine load. Prints a
Markdown table with tokens/s and MB/s (10^6 bytes) of each, and checks that both produced the same
ids (FNV-1a checksum over all ids).

The default text is the King James Bible from Debian's bible-kjv package (`bible -l0
Gen1:1-Rev22:21`, about 4.3 MB of ASCII), the same source as the fixtures' training text.

Usage (from the repository root, after building bench_tokenizer):
    tools/fixtures/tokenizer-env.sh
    .venv-tokenizers/bin/python tools/bench/bench_tokenizer_hf.py --ours build/bin/bench_tokenizer
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["RAYON_NUM_THREADS"] = "1"  # single-threaded baseline, encode_batch_fast included
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import tiktoken  # noqa: E402
import tiktoken.load  # noqa: E402
import tokenizers  # noqa: E402  (after the thread settings)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "tokenizers"
KINDS = ["gpt2", "llama3", "qwen2", "llama2", "mistral", "kimi_k2"]

sys.path.insert(0, str(REPO_ROOT / "tools" / "fixtures"))
from make_tokenizer_fixtures import KIMI_PATTERN  # noqa: E402  (the regex the fixture was recorded with)


def chunks(data: bytes, size: int):
    """The same cut as bench_tokenizer.cc: at least `size` bytes, ending at a newline."""
    out, begin = [], 0
    while begin < len(data):
        end = data.find(b"\n", min(begin + size, len(data)) - 1)
        end = len(data) if end < 0 else end + 1
        out.append(data[begin:end].decode("utf-8"))
        begin = end
    return out


def peer(kind):
    """The peer's two ways to encode for `kind`: (one text -> ids, all texts -> anything)."""
    if kind != "kimi_k2":
        tok = tokenizers.Tokenizer.from_file(str(FIXTURES / kind / "tokenizer.json"))
        return (lambda text: tok.encode(text).ids), tok.encode_batch_fast
    ranks = tiktoken.load.load_tiktoken_bpe(str(FIXTURES / kind / "tiktoken.model"))
    with open(FIXTURES / kind / "tokenizer_config.json") as f:
        specials = {t["content"]: int(i) for i, t in json.load(f)["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding(name="kimi_k2", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    return ((lambda text: enc.encode(text, allowed_special="all")),
            (lambda texts: enc.encode_batch(texts, num_threads=1, allowed_special="all")))


def bench_peer(kind, texts, repeat):
    """Median seconds per pass of the peer's encode (one call per chunk) and of its batch call (one
    call for all chunks, one thread), tokens and checksum."""
    encode, encode_batch = peer(kind)
    checksum, tokens = 14695981039346656037, 0
    for text in texts:  # warm-up, and the checksum
        ids = encode(text)
        tokens += len(ids)
        for i in ids:
            checksum = ((checksum ^ i) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    encode_batch(texts)  # warm-up

    def median_seconds(one_pass):
        seconds = []
        for _ in range(repeat):
            start = time.perf_counter()
            one_pass()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    return {"encode_s": median_seconds(lambda: [encode(text) for text in texts]),
            "batch_s": median_seconds(lambda: encode_batch(texts)),
            "tokens": tokens, "checksum": f"{checksum:016x}"}


def bench_ours(binary, kind, text_path, chunk_bytes, repeat):
    out = subprocess.run([binary, "--model", str(FIXTURES / kind), "--text", str(text_path),
                          "--chunk-bytes", str(chunk_bytes), "--repeat", str(repeat)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ours", required=True, help="path to the bench_tokenizer binary")
    parser.add_argument("--text", type=pathlib.Path, help="text file (default: the KJV Bible via `bible`)")
    parser.add_argument("--kinds", nargs="*", default=KINDS)
    parser.add_argument("--chunk-bytes", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        text_path = args.text
        if text_path is None:
            text_path = pathlib.Path(tmp) / "kjv.txt"
            with open(text_path, "wb") as f:
                subprocess.run(["bible", "-l0", "Gen1:1-Rev22:21"], check=True, stdout=f)
        data = text_path.read_bytes()
        texts = chunks(data, args.chunk_bytes)
        print(f"text: {len(data)} bytes in {len(texts)} chunks of ~{args.chunk_bytes} bytes; "
              f"tokenizers {tokenizers.__version__}, tiktoken {tiktoken.__version__} (kimi_k2's peer); "
              f"{platform.processor() or platform.machine()}; median of {args.repeat} passes after one warm-up\n")
        print("| kind | tokens | shardserve tokens/s | MB/s | peer encode tokens/s | MB/s "
              "| peer batch tokens/s | MB/s | shardserve vs faster peer | same ids |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")

        def rates(seconds, tokens):
            return f"{tokens / seconds:,.0f} | {len(data) / seconds / 1e6:.2f}"

        for kind in args.kinds:
            ours = bench_ours(args.ours, kind, text_path, args.chunk_bytes, args.repeat)
            other = bench_peer(kind, texts, args.repeat)
            same = ours["checksum"] == other["checksum"] and ours["tokens"] == other["tokens"]
            faster = min(other["encode_s"], other["batch_s"])
            print(f"| {kind} | {other['tokens']} | {rates(ours['median_s'], ours['tokens'])} | "
                  f"{rates(other['encode_s'], other['tokens'])} | {rates(other['batch_s'], other['tokens'])} | "
                  f"{faster / ours['median_s']:.1f}x | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
