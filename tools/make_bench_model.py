#!/usr/bin/env python3
"""Writes the benchmark model: a deterministic random-weights Llama checkpoint of 78.7M parameters.

    tools/make_bench_model.py [DIR] [--seed S]        (DIR default: build/bench-model)

A Hugging Face directory that `shardserve` loads like any other (`shardserve bench --compare ...
--model DIR`, tools/bench_serving.sh): config.json (LlamaForCausalLM, hidden 768, 12 layers, 12
heads, 4 KV heads, intermediate 2048, vocabulary 4096 as the demo model's, tied embeddings, 2048
positions, bfloat16), model.safetensors, and the demo model's tokenizer files copied from
models/demo, so text prompts work too (the weights are random, so the text is gibberish).

Big enough that a decode step costs real matrix work (about 150 MB of weights per token), small
enough to load in seconds and to fit a CPU worker.

Weights: every matrix N(0, 0.02), every RMSNorm weight 1. Standard library only (numpy is not
needed): for speed, each value is drawn by inverse-CDF sampling from a 16-bit uniform (the quantile
at (k + 0.5) / 65536 of N(0, 0.02), tails truncated at about 4.3 sigma), rounded to float32 and
then to bfloat16 (upper 16 bits, round to nearest even). Each tensor draws from its own
random.Random seeded with "<seed>/<tensor name>", so the file is a function of --seed only:
the same bytes on every machine and Python >= 3.9.

safetensors layout, written by hand: 8-byte little-endian header length, the JSON header (padded
with spaces to a multiple of 8), then the tensors' bytes back to back in header order.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import struct
import sys
from array import array

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models", "demo")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, MAX_POS = 768, 12, 12, 4, 2048, 4096, 2048
HEAD_DIM = HIDDEN // HEADS
STD = 0.02
BF16_ONE = 0x3F80


def bf16_bits(x):
    """float -> float32 -> bfloat16 bits, round to nearest even (finite inputs)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def normal_table():
    """bf16 bits of the N(0, STD) quantile at (k + 0.5) / 65536, k = 0 .. 65535."""
    dist = statistics.NormalDist(0.0, STD)
    return [bf16_bits(dist.inv_cdf((k + 0.5) / 65536.0)) for k in range(65536)]


def tensors():
    """(name, shape, kind) in file order; kind "normal" or "ones". Shapes as Hugging Face stores them."""
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN], "normal")]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", [HIDDEN], "ones"),
            (p + "self_attn.q_proj.weight", [HEADS * HEAD_DIM, HIDDEN], "normal"),
            (p + "self_attn.k_proj.weight", [KV_HEADS * HEAD_DIM, HIDDEN], "normal"),
            (p + "self_attn.v_proj.weight", [KV_HEADS * HEAD_DIM, HIDDEN], "normal"),
            (p + "self_attn.o_proj.weight", [HIDDEN, HEADS * HEAD_DIM], "normal"),
            (p + "post_attention_layernorm.weight", [HIDDEN], "ones"),
            (p + "mlp.gate_proj.weight", [INTERMEDIATE, HIDDEN], "normal"),
            (p + "mlp.up_proj.weight", [INTERMEDIATE, HIDDEN], "normal"),
            (p + "mlp.down_proj.weight", [HIDDEN, INTERMEDIATE], "normal"),
        ]
    out.append(("model.norm.weight", [HIDDEN], "ones"))
    return out


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def safetensors_header(specs):
    """The header (JSON padded with spaces to a multiple of 8) of bf16 tensors (name, shape, kind)
    stored back to back in that order, and the length of their data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in specs:
        size = 2 * numel(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    return header_bytes + b" " * (-len(header_bytes) % 8), offset


def tensor_bytes(name, n, kind, seed, table):
    if kind == "ones":
        values = array("H", [BF16_ONE]) * n
    else:
        uniforms = array("H", random.Random(f"{seed}/{name}").randbytes(2 * n))
        if sys.byteorder == "big":
            uniforms.byteswap()  # the uniforms are defined as little-endian 16-bit words
        values = array("H", map(table.__getitem__, uniforms))
    if sys.byteorder == "big":
        values.byteswap()  # safetensors data is little-endian
    return values.tobytes()


def config():
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": STD,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default=os.path.join(ROOT, "build", "bench-model"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    with open(os.path.join(DEMO, "config.json")) as f:
        demo_vocab = json.load(f)["vocab_size"]
    if demo_vocab != VOCAB:
        sys.exit(f"make_bench_model: the demo tokenizer has {demo_vocab} ids, this script assumes {VOCAB}")

    os.makedirs(args.dir, exist_ok=True)
    specs = tensors()
    header_bytes, _ = safetensors_header(specs)

    table = normal_table()
    tmp = os.path.join(args.dir, "model.safetensors.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, shape, kind in specs:
            f.write(tensor_bytes(name, numel(shape), kind, args.seed, table))
    os.replace(tmp, os.path.join(args.dir, "model.safetensors"))
    with open(os.path.join(args.dir, "config.json"), "w") as f:
        json.dump(config(), f, indent=2)
        f.write("\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(DEMO, name), os.path.join(args.dir, name))

    params = sum(numel(shape) for _, shape, _ in specs)
    print(f"make_bench_model: {args.dir}: LlamaForCausalLM, {params:,} parameters "
          f"({params * 2 / 2**20:.1f} MiB in bfloat16), hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, "
          f"{KV_HEADS} KV heads, intermediate {INTERMEDIATE}, vocab {VOCAB}, seed {args.seed}")


if __name__ == "__main__":
    main()
