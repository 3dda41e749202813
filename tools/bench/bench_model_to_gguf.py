#!/usr/bin/env python3
"""Writes the benchmark model as a float32 GGUF file, for running a peer (llama.cpp) on the same weights.

    tools/bench/bench_model_to_gguf.py [MODEL_DIR] OUT.gguf      (MODEL_DIR default: build/bench-model)

Needs numpy and gguf from PyPI (gguf 0.17.1 tested). Used only for the side-by-side serving figures
in docs/performance.md; nothing in shardserve reads GGUF.

MODEL_DIR is what tools/fixtures/make_bench_model.py writes: a Llama checkpoint (config.json, one
model.safetensors of bfloat16 or float32 tensors, the demo model's byte-level BPE tokenizer.json).
Every tensor is written as float32, so that the peer computes on the same values as a shardserve
CPU worker with float32 products. The tied embedding serves as the LM head, as in the checkpoint.
The rows of the query and key projections are permuted from Hugging Face's rotate-half layout to
GGML's interleaved one, as llama.cpp's own converter does for Llama.
"""
import json
import struct
import sys

import gguf
import numpy as np


def read_safetensors(path):
    """{name: float32 array} from a safetensors file of BF16 or F32 tensors."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        begin, end = h["data_offsets"]
        buf = raw[8 + n + begin:8 + n + end]
        if h["dtype"] == "BF16":
            x = (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif h["dtype"] == "F32":
            x = np.frombuffer(buf, dtype=np.float32)
        else:
            sys.exit(f"{path}: tensor {name} is {h['dtype']}; only BF16 and F32 are converted")
        out[name] = x.reshape(h["shape"])
    return out


def rope_rows(w, heads):
    """Each head's rows from rotate-half order (x0..x31, y0..y31) to interleaved (x0, y0, x1, ...)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def main():
    args = sys.argv[1:]
    if len(args) == 1:
        args = ["build/bench-model"] + args
    if len(args) != 2:
        sys.exit(__doc__)
    src, dst = args
    cfg = json.load(open(f"{src}/config.json"))
    if cfg.get("architectures") != ["LlamaForCausalLM"] or not cfg.get("tie_word_embeddings"):
        sys.exit(f"{src}: expected a LlamaForCausalLM with tied embeddings, as tools/fixtures/make_bench_model.py writes")
    t = read_safetensors(f"{src}/model.safetensors")
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    w = gguf.GGUFWriter(dst, "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    tok = json.load(open(f"{src}/tokenizer.json"))
    tokens = [None] * cfg["vocab_size"]
    types = [gguf.TokenType.NORMAL] * cfg["vocab_size"]
    for text, i in tok["model"]["vocab"].items():
        tokens[i] = text
    for a in tok["added_tokens"]:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = gguf.TokenType.CONTROL
    w.add_tokenizer_model("gpt2")  # byte-level BPE
    w.add_tokenizer_pre("gpt-2")  # GPT-2's split, as the tokenizer.json's ByteLevel pre-tokenizer
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(True)  # the tokenizer.json's post-processor adds <|begin_of_text|>

    f32 = lambda name: np.ascontiguousarray(t[name], dtype=np.float32)
    w.add_tensor("token_embd.weight", f32("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", f32("model.norm.weight"))
    for i in range(layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", f32(p + "input_layernorm.weight"))
        w.add_tensor(f"blk.{i}.attn_q.weight", rope_rows(f32(p + "self_attn.q_proj.weight"), heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", rope_rows(f32(p + "self_attn.k_proj.weight"), kv_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", f32(p + "self_attn.v_proj.weight"))
        w.add_tensor(f"blk.{i}.attn_output.weight", f32(p + "self_attn.o_proj.weight"))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", f32(p + "post_attention_layernorm.weight"))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", f32(p + "mlp.gate_proj.weight"))
        w.add_tensor(f"blk.{i}.ffn_up.weight", f32(p + "mlp.up_proj.weight"))
        w.add_tensor(f"blk.{i}.ffn_down.weight", f32(p + "mlp.down_proj.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
