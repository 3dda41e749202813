"""Builds the GPTQ checkpoints under tests/fixtures/gptq/ and their golden outputs.

Each variant takes a tiny parity fixture (tests/fixtures/models/, tools/make_parity_fixtures.py),
quantizes its decoder layers' linear weights and writes them in GPTQ's published checkpoint
layout, by this script's own implementation of that layout (model/gptq.h describes it):
    <prefix>.qweight  int32 [in / p, out]  p = 32 / bits values per int32, packed along the input
                                           (value i in bits (i % p) * bits upward of row i / p)
    <prefix>.qzeros   int32 [G, out / p]   zero points packed along the output; checkpoint_format
                                           "gptq" (v1) stores zero - 1, "gptq_v2" the zero
    <prefix>.scales   float16 [G, out]
    <prefix>.g_idx    int32 [in]           group of each input (a permutation's groups with desc_act)
and w[c][i] = scales[g][c] * (q[i][c] - zero[g][c]) with g = g_idx[i].

The quantizer is plain round-to-nearest per group (GPTQ's own Quantizer.find_params ranges:
asymmetric [min(0, lo), max(0, hi)], symmetric +-max|w| with zero 2^(bits-1)), not the GPTQ
algorithm's error feedback: what is tested is the format and its loading, not GPTQ's rounding.
Embeddings, norms, biases and the LM head are stored in float16, as GPTQ checkpoints do.

The goldens come from Hugging Face transformers running the *dequantized* weights (exact in
float32: an f16 scale times a small integer) and the float16 tensors widened to float32, with
the same prompt and greedy recipe as make_parity_fixtures.py. Deterministic: a re-run rewrites
every file byte for byte.

Usage (from the repository root):
    tools/fixtures-env.sh && .venv-fixtures/bin/python tools/make_gptq_fixtures.py
"""

import dataclasses
import json
import math
import pathlib
import shutil

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from safetensors.torch import load_file

import make_parity_fixtures as parity

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = REPO_ROOT / "tests" / "fixtures" / "models"
OUT = REPO_ROOT / "tests" / "fixtures" / "gptq"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class Variant:
    name: str
    base: str            # a fixture under tests/fixtures/models
    bits: int
    group_size: int      # -1: one group
    sym: bool
    desc_act: bool
    v2: bool             # checkpoint_format gptq_v2
    seed: int
    note: str


VARIANTS = [
    # 4 bits, groups of 128, no reorder: the int4 kernel's own layout (rows of 64 inputs are one
    # short group, rows of 128 one whole group), so the loader maps it without dequantizing.
    Variant("llama_sym4_g128_v1", "llama3_rope", 4, 128, True, False, False, 11,
            "Llama, 4-bit symmetric, group_size 128, checkpoint_format gptq (v1): the int4 path"),
    Variant("qwen2_asym4_g128_v2", "qwen2_tied_bias", 4, 128, False, False, True, 12,
            "Qwen2 (biases, tied), 4-bit asymmetric, group_size 128, gptq_v2: the int4 path"),
    Variant("qwen2_asym4_g32_desc_act_v1", "qwen2_tied_bias", 4, 32, False, True, False, 13,
            "Qwen2, 4-bit asymmetric, group_size 32, desc_act with a shuffled g_idx, v1: dequantized"),
    Variant("qwen2_sym4_gall_v1", "qwen2_tied_bias", 4, -1, True, False, False, 14,
            "Qwen2, 4-bit symmetric, group_size -1 (one group per row), v1: dequantized"),
    Variant("qwen2_asym8_g32_v2", "qwen2_tied_bias", 8, 32, False, False, True, 15,
            "Qwen2, 8-bit asymmetric, group_size 32, gptq_v2: dequantized"),
]


def quantize(w_t: np.ndarray, v: Variant, rng: np.random.Generator):
    """w_t: [in, out] float32 (a Linear weight transposed). Returns (q [in, out], zeros [G, out],
    scales_f16 [G, out], g_idx [in])."""
    k, m = w_t.shape
    maxq = (1 << v.bits) - 1
    gs = v.group_size if v.group_size > 0 else k
    groups = (k + gs - 1) // gs
    if v.desc_act:
        order = rng.permutation(k)  # order[j]: the input quantized j-th
        g_idx = np.empty(k, dtype=np.int32)
        g_idx[order] = np.arange(k) // gs
    else:
        g_idx = (np.arange(k) // gs).astype(np.int32)
    q = np.zeros((k, m), dtype=np.int64)
    zeros = np.zeros((groups, m), dtype=np.int64)
    scales = np.zeros((groups, m), dtype=np.float16)
    for g in range(groups):
        rows = np.nonzero(g_idx == g)[0]
        x = w_t[rows]  # [n, out]
        if v.sym:
            xmax = np.abs(x).max(axis=0)
            xmax = np.where(xmax == 0, 1.0, xmax)
            s = (2 * xmax / maxq).astype(np.float16)
            z = np.full(m, (maxq + 1) // 2, dtype=np.int64)
        else:
            lo = np.minimum(x.min(axis=0), 0)
            hi = np.maximum(x.max(axis=0), 0)
            both0 = (lo == 0) & (hi == 0)
            lo, hi = np.where(both0, -1, lo), np.where(both0, 1, hi)
            s = ((hi - lo) / maxq).astype(np.float16)
            z = np.rint(-lo / s.astype(np.float32)).astype(np.int64)
            # v1 stores zero - 1: a zero of 0 would be stored as -1 (AutoGPTQ's v1 defect), so v1
            # variants keep zeros in [1, maxq].
            z = np.clip(z, 0 if v.v2 else 1, maxq)
        assert np.all(np.isfinite(s)) and np.all(s != 0)
        q[rows] = np.clip(np.rint(x / s.astype(np.float32)) + z, 0, maxq)
        zeros[g], scales[g] = z, s
    return q, zeros, scales, g_idx


def dequantize(q, zeros, scales, g_idx) -> np.ndarray:
    """[in, out] float32, exactly as model/gptq.cc: float32(q - zero) * float32(scale)."""
    s = scales.astype(np.float32)[g_idx]
    return ((q - zeros[g_idx]).astype(np.float32) * s).astype(np.float32)


def pack(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Packs non-negative ints < 2^bits, 32 / bits per int32 along `axis`, lowest bits first."""
    p = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    assert v.shape[0] % p == 0
    v = v.reshape(v.shape[0] // p, p, *v.shape[1:])
    packed = np.zeros((v.shape[0], *v.shape[2:]), dtype=np.uint32)
    for j in range(p):
        packed |= v[:, j] << np.uint32(bits * j)
    return np.ascontiguousarray(np.moveaxis(packed, 0, axis)).view(np.int32)


def build(v: Variant) -> None:
    out = OUT / v.name
    print(f"{v.name}:")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    base = MODELS / v.base
    config = json.loads((base / "config.json").read_text())
    weights = load_file(str(base / "model.safetensors"))
    rng = np.random.default_rng(v.seed)
    tensors, dequantized = {}, {}
    for name, t in sorted(weights.items()):
        proj = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if name.startswith("model.layers.") and proj in LINEARS:
            prefix = name[: -len(".weight")]
            w_t = t.float().numpy().T.copy()  # [in, out]
            q, zeros, scales, g_idx = quantize(w_t, v, rng)
            mask = (1 << v.bits) - 1
            stored = zeros if v.v2 else (zeros - 1)
            assert stored.min() >= 0 and stored.max() <= mask
            tensors[prefix + ".qweight"] = pack(q, v.bits, 0)
            tensors[prefix + ".qzeros"] = pack(stored, v.bits, 1)
            tensors[prefix + ".scales"] = scales
            tensors[prefix + ".g_idx"] = g_idx
            dequantized[name] = torch.from_numpy(dequantize(q, zeros, scales, g_idx).T.copy())
        else:
            t16 = t.to(torch.float16)
            tensors[name] = t16.numpy()
            dequantized[name] = t16.float()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config["torch_dtype"] = "float16"
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": v.bits,
        "group_size": v.group_size,
        "sym": v.sym,
        "desc_act": v.desc_act,
        "checkpoint_format": "gptq_v2" if v.v2 else "gptq",
        "damp_percent": 0.01,
        "true_sequential": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # Goldens: transformers in float32 on the dequantized weights.
    hf_config = transformers.AutoConfig.from_pretrained(base)
    model_cls = getattr(transformers, config["architectures"][0])
    model = model_cls._from_config(hf_config, attn_implementation="eager", torch_dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(dequantized, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    generator = torch.Generator().manual_seed(v.seed + 1)
    prompt = torch.randint(1, hf_config.vocab_size, (12,), generator=generator).tolist()
    result = parity.greedy(model, prompt)
    distinct = len(set(result["greedy_ids"]))
    margin = result["greedy_min_margin"]
    print(f"    greedy: {distinct} distinct of {parity.GREEDY_STEPS}, min top-2 margin {margin:.4g}")
    if distinct < parity.MIN_DISTINCT_TOKENS:
        raise SystemExit(f"{v.name}: degenerate greedy continuation")
    if margin < parity.MIN_GREEDY_MARGIN:
        raise SystemExit(f"{v.name}: near-tie in greedy decoding; change the seed")
    parity.write_golden(
        out / "golden.json",
        {
            "model": v.name,
            "base": v.base,
            "note": v.note,
            "architecture": config["architectures"][0],
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "prompt_ids": prompt,
            **result,
        },
    )
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"    wrote {sorted(f.name for f in out.iterdir())}, {size} bytes")


def main() -> None:
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for v in VARIANTS:
        build(v)


if __name__ == "__main__":
    main()
