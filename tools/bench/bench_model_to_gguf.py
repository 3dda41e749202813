#!/usr/bin/env python3
"""Writes a benchmark model as a float32 GGUF file, for running a peer (llama.cpp) on the same weights.

    tools/bench/bench_model_to_gguf.py [MODEL_DIR] OUT.gguf      (MODEL_DIR default: build/bench-model)

Needs numpy and gguf (the gguf-py that tools/bench/build-llamacpp.sh installs from the llama.cpp it
builds, 0.19.0; PyPI's gguf 0.17.1 writes the Llama too). Used only for the side-by-side serving
figures in docs/performance.md; nothing in shardserve reads GGUF.

MODEL_DIR is what tools/fixtures/make_bench_model.py writes (config.json, one model.safetensors of
bfloat16 or float32 tensors, the demo model's byte-level BPE tokenizer.json), of one of its families:

  LlamaForCausalLM     GGUF architecture llama
  Qwen3ForCausalLM     qwen3
  Gemma3ForCausalLM    gemma3
  Qwen3MoeForCausalLM  qwen3moe

written as llama.cpp's own converter (convert_hf_to_gguf.py, conversion/{llama,qwen,gemma}.py of the
llama.cpp build-llamacpp.sh builds) writes them: the tensor names from gguf-py's TensorNameMap for the
architecture (what that converter uses), the metadata keys its set_gguf_parameters writes for these
configs, and its transforms: Llama's query and key rows permuted from Hugging Face's rotate-half
layout to GGML's interleaved one (the others are NEOX-RoPE architectures in llama.cpp and keep the
Hugging Face order), Gemma's RMSNorm weights plus 1 (Gemma3RMSNorm scales by 1 + w, GGML's RMS norm by
w), and each Qwen3-MoE layer's experts stacked into one [experts, rows, cols] tensor per projection.
Every tensor is written as float32, so that the peer computes on the same values as a shardserve CPU
worker with float32 products, one tensor at a time (the MoE's 10 GB are never all in memory). A
tied embedding serves as the LM head, as in the checkpoint; an LM head of its own is output.weight.
"""
import json
import struct
import sys

import gguf
import numpy as np

ARCHS = {  # config.json's architecture: GGUF architecture
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3moe",
}


class Safetensors:
    """The tensors of one safetensors file of BF16 or F32 tensors, read through a memory map."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(n))
        self.header.pop("__metadata__", None)
        self.raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)

    def names(self):
        return list(self.header)

    def f32(self, name):
        """The tensor as a new float32 array."""
        h = self.header.get(name)
        if h is None:
            sys.exit(f"{self.path}: no tensor {name}")
        begin, end = h["data_offsets"]
        buf = self.raw[begin:end]
        if h["dtype"] == "BF16":
            x = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif h["dtype"] == "F32":
            x = np.array(buf.view(np.float32))
        else:
            sys.exit(f"{self.path}: tensor {name} is {h['dtype']}; only BF16 and F32 are converted")
        return x.reshape(h["shape"])


def rope_rows(w, heads):
    """Each head's rows from rotate-half order (x0..x31, y0..y31) to interleaved (x0, y0, x1, ...)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(cfg, st):
    """[(Hugging Face name, or for stacked experts the name convert_hf_to_gguf gives the stack, its shape,
    a function returning its float32 array)], in checkpoint order; each array made only when called."""
    arch = cfg["architectures"][0]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out, stacked = [], set()
    for name in st.names():
        shape = st.header[name]["shape"]
        load = (lambda n: lambda: st.f32(n))(name)
        if arch == "LlamaForCausalLM" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            h = heads if ".q_proj." in name else kv_heads
            load = (lambda f, h: lambda: rope_rows(f(), h))(load, h)
        elif arch == "Gemma3ForCausalLM" and name.endswith("norm.weight"):
            load = (lambda f: lambda: f() + np.float32(1.0))(load)
        elif ".mlp.experts." in name:
            # model.layers.L.mlp.experts.E.P.weight -> model.layers.L.mlp.experts.P.weight, all E at once
            prefix, rest = name.split(".mlp.experts.", 1)
            proj = rest.split(".")[1]
            stack = f"{prefix}.mlp.experts.{proj}.weight"
            if stack in stacked:
                continue
            stacked.add(stack)
            names = [f"{prefix}.mlp.experts.{e}.{proj}.weight" for e in range(cfg["num_experts"])]
            load = (lambda ns: lambda: np.stack([st.f32(n) for n in ns]))(names)
            name, shape = stack, [len(names)] + shape
        out.append((name, shape, load))
    return out


def rope_theta(cfg):
    """RoPE's base as transformers 4 writes it (rope_theta) or 5 (rope_parameters: one plain RoPE
    only; a scaled one, or one per layer type, is not what llama.cpp's metadata here says)."""
    if "rope_theta" in cfg:
        return cfg["rope_theta"]
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        sys.exit(f"rope_parameters {rope}: only one unscaled RoPE (rope_type default) converts here")
    return rope["rope_theta"]


def add_metadata(w, cfg, arch):
    """The keys convert_hf_to_gguf.py writes for this config (TextModel.set_gguf_parameters and the
    family's own), less those of an ordinary general.* description."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope_theta(cfg))
    if arch == "llama":
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    else:  # an explicit head_dim, which may differ from hidden / heads
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "gemma3":
        w.add_rope_freq_base_swa(cfg["rope_local_base_freq"])
        w.add_sliding_window(cfg["sliding_window"])
        # llama.cpp's gemma3 takes the global layers as every 6th (its default sliding_window_pattern,
        # as the converter leaves it); check that config.json's layer_types say the same.
        want = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(cfg["num_hidden_layers"])]
        if cfg.get("layer_types", want) != want:
            sys.exit("gemma3: layer_types is not five sliding layers to one global, which llama.cpp assumes")
        if cfg.get("query_pre_attn_scalar") != cfg["head_dim"]:
            sys.exit("gemma3: llama.cpp scales the queries by head_dim^-0.5 (it has no key for query_pre_attn_scalar); "
                     f"query_pre_attn_scalar is {cfg.get('query_pre_attn_scalar')}, head_dim {cfg['head_dim']}")
        for k in ("attn_logit_softcapping", "final_logit_softcapping", "rope_scaling"):
            if cfg.get(k) is not None:
                sys.exit(f"gemma3: {k} is set; the bench model has none and this script writes none")
    if arch == "qwen3moe":
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        # llama.cpp's qwen3moe always renormalizes the top-k weights and has every layer sparse.
        if not cfg.get("norm_topk_prob") or cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            sys.exit("qwen3moe: llama.cpp's graph wants norm_topk_prob, no mlp_only_layers, decoder_sparse_step 1")
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def add_tokenizer(w, cfg, src):
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


def main():
    args = sys.argv[1:]
    if len(args) == 1:
        args = ["build/bench-model"] + args
    if len(args) != 2:
        sys.exit(__doc__)
    src, dst = args
    cfg = json.load(open(f"{src}/config.json"))
    archs = cfg.get("architectures") or [None]
    if archs[0] not in ARCHS or len(archs) != 1:
        sys.exit(f"{src}: expected one of {', '.join(ARCHS)}, as tools/fixtures/make_bench_model.py writes; "
                 f"got {archs}")
    arch = ARCHS[archs[0]]
    st = Safetensors(f"{src}/model.safetensors")
    if bool(cfg.get("tie_word_embeddings")) == ("lm_head.weight" in st.header):
        sys.exit(f"{src}: tie_word_embeddings is {cfg.get('tie_word_embeddings')} but the checkpoint "
                 f"{'has' if 'lm_head.weight' in st.header else 'has no'} lm_head.weight")
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    tensors = []
    for hf_name, shape, load in hf_tensors(cfg, st):
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if name is None:
            sys.exit(f"{src}: gguf-py's TensorNameMap has no {arch} name for {hf_name}")
        tensors.append((name, shape, load))

    w = gguf.GGUFWriter(dst, arch)
    add_metadata(w, cfg, arch)
    add_tokenizer(w, cfg, src)
    # Tensor infos first (shapes from the safetensors header, no data read), then the data one tensor at
    # a time, each array checked against its info's shape.
    for name, shape, _ in tensors:
        w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, load in tensors:
        x = np.ascontiguousarray(load(), dtype=np.float32)
        if list(x.shape) != shape:
            sys.exit(f"{name}: {list(x.shape)}, its info says {shape}")
        w.write_tensor_data(x)
    w.close()


if __name__ == "__main__":
    main()
