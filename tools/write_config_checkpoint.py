#!/usr/bin/env python3
"""Writes a bf16 safetensors checkpoint of any size from a Llama / Qwen2 config.json, fast.

    tools/write_config_checkpoint.py --config CONFIG.json --out DIR [--seed S] [--json FILE]

For the real load path at real sizes where no checkpoint can be downloaded (issue 29's cold start:
`launch` to SERVING from a 16 GB safetensors file on the GPU machine's own disk): DIR gets
config.json (CONFIG's) and model.safetensors with the tensors Hugging Face's LlamaForCausalLM /
Qwen2ForCausalLM store (embedding, per layer the norms, q/k/v/o, gate/up/down, the q/k/v biases
where the config has them, the final norm, lm_head unless the embedding is tied), in bfloat16.

Values: every matrix and bias draws from one 1 MiB block of N(0, 0.02) bf16 values (the bench
model's table, tools/make_bench_model.py), each tensor starting at its own offset into the block
(from --seed and its name) and repeating it; every RMSNorm weight is 1. The activations stay
finite as the bench model's do; the text is gibberish (no tokenizer: send token ids). Writing is
the disk's speed: the block is written again and again, nothing is computed per value.
Standard library only. Prints (and with --json writes) the bytes and the seconds it took.
"""
import argparse
import json
import os
import random
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_bench_model import BF16_ONE, normal_table, numel, safetensors_header  # noqa: E402

BLOCK_VALUES = 1 << 19  # 1 MiB of bf16


def tensors(c):
    """(name, shape, kind) in file order, kind "normal" or "ones", as Hugging Face stores them."""
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim") or hidden // heads
    inter, vocab = c["intermediate_size"], c["vocab_size"]
    bias = c.get("attention_bias", c.get("model_type") == "qwen2")
    out = [("model.embed_tokens.weight", [vocab, hidden], "normal")]
    for i in range(layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", [hidden], "ones"))
        for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            out.append((p + f"self_attn.{proj}_proj.weight", [rows, hidden], "normal"))
            if bias:
                out.append((p + f"self_attn.{proj}_proj.bias", [rows], "normal"))
        out += [
            (p + "self_attn.o_proj.weight", [hidden, heads * head_dim], "normal"),
            (p + "post_attention_layernorm.weight", [hidden], "ones"),
            (p + "mlp.gate_proj.weight", [inter, hidden], "normal"),
            (p + "mlp.up_proj.weight", [inter, hidden], "normal"),
            (p + "mlp.down_proj.weight", [hidden, inter], "normal"),
        ]
    out.append(("model.norm.weight", [hidden], "ones"))
    if not c.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", [vocab, hidden], "normal"))
    return out


def write_tensor(f, n, kind, start, block, ones):
    """n bf16 values: ones, or the block repeated from value `start` on."""
    left = 2 * n
    if kind == "ones":
        while left > 0:
            f.write(ones[: min(left, len(ones))])
            left -= min(left, len(ones))
        return
    first = block[2 * start:]
    f.write(first[: min(left, len(first))])
    left -= min(left, len(first))
    while left > 0:
        f.write(block[: min(left, len(block))])
        left -= min(left, len(block))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write {bytes, seconds, tensors} here too")
    args = ap.parse_args()
    with open(args.config) as f:
        c = json.load(f)
    t0 = time.monotonic()
    specs = tensors(c)
    header_bytes, offset = safetensors_header(specs)

    table = normal_table()
    rng = random.Random(f"{args.seed}/block")
    block = struct.pack(f"<{BLOCK_VALUES}H", *(table[rng.getrandbits(16)] for _ in range(BLOCK_VALUES)))
    ones = struct.pack("<H", BF16_ONE) * BLOCK_VALUES

    os.makedirs(args.out, exist_ok=True)
    tmp = os.path.join(args.out, "model.safetensors.tmp")
    with open(tmp, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, shape, kind in specs:
            start = random.Random(f"{args.seed}/{name}").randrange(BLOCK_VALUES)
            write_tensor(f, numel(shape), kind, start, block, ones)
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(args.out, "model.safetensors"))
    c = dict(c, torch_dtype="bfloat16")
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    total = 8 + len(header_bytes) + offset
    seconds = time.monotonic() - t0
    print(f"write_config_checkpoint: {len(specs)} tensors, {total / 1e9:.2f} GB in {seconds:.1f} s "
          f"({total / 1e9 / max(seconds, 1e-9):.2f} GB/s) to {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint_bytes": total, "write_s": round(seconds, 2), "tensors": len(specs)}, f)


if __name__ == "__main__":
    main()
