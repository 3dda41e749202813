"""Builds the published-format quantized checkpoints under tests/fixtures/{gptq,awq,fp8,
compressed_tensors}/ and their golden outputs (model/quantized_checkpoint.h describes each format).

Each variant takes a tiny parity fixture (tests/fixtures/models/, tools/make_parity_fixtures.py),
quantizes its decoder layers' linear weights and writes them in one format's published checkpoint
layout, by this script's own implementation of that layout (no auto-gptq / autoawq /
compressed-tensors import):
  GPTQ   <prefix>.qweight int32 [in / p, out] (p = 32 / bits, packed along the input, lowest bits
         first), .qzeros int32 [G, out / p] (packed along the output; checkpoint_format "gptq" (v1)
         stores zero - 1, "gptq_v2" the zero), .scales f16 [G, out], .g_idx int32 [in] (a
         permutation's groups with desc_act); w = scales[g] * (q - zero), g = g_idx[i].
  AWQ    (version gemm, 4 bits) .qweight int32 [in, out / 8] and .qzeros int32 [G, out / 8],
         packed along the output in AWQ's order (nibble j holds output 8 w + [0,2,4,6,1,3,5,7][j]),
         zeros stored as they are; .scales f16 [G, out].
  compressed-tensors pack-quantized: .weight_packed int32 [out, in / p] (packed along the input,
         each value + 2^(bits-1)), .weight_scale [out, G], .weight_zero_point int32 [out / p, G]
         (asymmetric only: zero + 2^(bits-1) packed along the output), .weight_shape int64 [2];
         float-quantized: .weight F8_E4M3 [out, in], .weight_scale bf16 [out, 1]; `ignore`
         modules stay plain.
  FP8    .weight F8_E4M3 [out, in], .weight_scale_inv f32 [ceil(out / bo), ceil(in / bi)]
         (weight_block_size [bo, bi]); w = weight * weight_scale_inv[block].

The integer quantizer is plain round-to-nearest per group (GPTQ's own Quantizer.find_params ranges:
asymmetric [min(0, lo), max(0, hi)], symmetric +-max|w| with zero 2^(bits-1)), not the GPTQ / AWQ
algorithms' error feedback or scaling search: what is tested is the format and its loading, not
their rounding. fp8 values round to the nearest e4m3 (ties to even), scales amax / 448.
Embeddings, norms, biases and the LM head are stored in float16, as these checkpoints do.

The goldens come from Hugging Face transformers running the *dequantized* weights (exact in
float32: an f16 / bf16 / f32 scale times a small integer or an e4m3 value) and the float16 tensors
widened to float32, with the same prompt and greedy recipe as make_parity_fixtures.py.
Deterministic: a re-run rewrites every file byte for byte. safetensors files are written by this
script (numpy has no float8 or bfloat16 to hand to safetensors.numpy).

Usage (from the repository root):
    tools/fixtures-env.sh && .venv-fixtures/bin/python tools/make_quantized_fixtures.py [name ...]
"""

import dataclasses
import json
import math
import pathlib
import re
import shutil
import sys

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from safetensors.torch import load_file

import make_parity_fixtures as parity

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = REPO_ROOT / "tests" / "fixtures" / "models"
FIXTURES = REPO_ROOT / "tests" / "fixtures"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ int32 holds output 8 w + AWQ_ORDER[j]
E4M3_MAX = 448.0


@dataclasses.dataclass
class Variant:
    name: str
    base: str            # a fixture under tests/fixtures/models
    bits: int
    group_size: int      # -1: one group (per channel)
    sym: bool
    desc_act: bool
    v2: bool             # GPTQ checkpoint_format gptq_v2
    seed: int
    note: str
    method: str = "gptq"  # gptq, awq, ct-pack (compressed-tensors pack-quantized), ct-fp8, fp8
    block: tuple = ()     # fp8: weight_block_size
    ignore: tuple = ()    # compressed-tensors: modules stored plain besides lm_head


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
    Variant("awq_llama_g128", "llama3_rope", 4, 128, False, False, True, 21,
            "AWQ gemm, Llama, 4-bit, group_size 128: the int4 path", method="awq"),
    Variant("awq_qwen2_g32", "qwen2_tied_bias", 4, 32, False, False, True, 22,
            "AWQ gemm, Qwen2, 4-bit, group_size 32: dequantized", method="awq"),
    Variant("fp8_qwen2_block32x64", "qwen2_tied_bias", 8, -1, True, False, False, 31,
            "FP8 e4m3 with weight_block_size [32, 64] (block scales indexed along both axes): dequantized",
            method="fp8", block=(32, 64)),
    Variant("ct_int4_sym_g128_llama", "llama3_rope", 4, 128, True, False, False, 41,
            "compressed-tensors pack-quantized int4, symmetric, group 128: the int4 path", method="ct-pack"),
    Variant("ct_int4_asym_g32_qwen2", "qwen2_tied_bias", 4, 32, False, False, False, 42,
            "compressed-tensors pack-quantized int4, asymmetric (packed zero points), group 32: dequantized",
            method="ct-pack"),
    Variant("ct_int8_channel_qwen2", "qwen2_tied_bias", 8, -1, True, False, False, 43,
            "compressed-tensors pack-quantized int8, symmetric, per channel: dequantized", method="ct-pack"),
    Variant("ct_fp8_channel_qwen2", "qwen2_tied_bias", 8, -1, True, False, False, 44,
            "compressed-tensors float-quantized fp8 per channel, bf16 scales; layer 0's down_proj ignored "
            "(a re: pattern) and stored plain: dequantized", method="ct-fp8",
            ignore=(r"re:.*layers\.0\.mlp\.down_proj$",)),
]

FORMAT_DIRS = {"gptq": "gptq", "awq": "awq", "fp8": "fp8", "ct-pack": "compressed_tensors",
               "ct-fp8": "compressed_tensors"}


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
    """[in, out] float32, exactly as model/quantized_checkpoint.cc: float32(q - zero) * float32(scale)."""
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


def e4m3_table() -> np.ndarray:
    """float32 value of each e4m3 code 0..0x7e (non-negative; 0x7f is NaN)."""
    codes = np.arange(0x7F)
    exp, mant = codes >> 3, codes & 7
    return np.where(exp == 0, mant / 8.0 * 2.0 ** -6, (1 + mant / 8.0) * 2.0 ** (exp - 7)).astype(np.float32)


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3 codes (uint8): nearest, ties to the even code, saturating at 448."""
    table = e4m3_table()
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(table, a), 1, len(table) - 1)
    lo = hi - 1
    d_lo, d_hi = a - table[lo], table[hi] - a
    code = np.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi).astype(np.uint8)
    return code | np.where(x < 0, 0x80, 0).astype(np.uint8)


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    v = e4m3_table()[codes & 0x7F]
    return np.where(codes & 0x80, -v, v).astype(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


# A tensor for write_safetensors: (safetensors dtype, shape, raw bytes).
SAFETENSORS_DTYPES = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32",
                      np.dtype(np.int64): "I64"}


def raw(a: np.ndarray, dtype: str = "") -> tuple:
    return (dtype or SAFETENSORS_DTYPES[a.dtype], list(a.shape), np.ascontiguousarray(a).tobytes())


def write_safetensors(path: pathlib.Path, tensors: dict) -> None:
    """The safetensors layout: 8-byte little-endian header length, the JSON header (padded with
    spaces to 8 bytes), then each tensor's bytes in name order."""
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def quantize_linear(prefix: str, w: np.ndarray, v: Variant, rng: np.random.Generator):
    """w: [out, in] float32. Returns ({tensor name: raw tensor}, dequantized [out, in] float32)."""
    if v.method in ("gptq", "awq", "ct-pack"):
        q, zeros, scales, g_idx = quantize(w.T.copy(), v, rng)
        deq = dequantize(q, zeros, scales, g_idx).T.copy()
        if v.method == "gptq":
            stored = zeros if v.v2 else (zeros - 1)
            assert stored.min() >= 0 and stored.max() <= (1 << v.bits) - 1
            return {prefix + ".qweight": raw(pack(q, v.bits, 0)), prefix + ".qzeros": raw(pack(stored, v.bits, 1)),
                    prefix + ".scales": raw(scales), prefix + ".g_idx": raw(g_idx)}, deq
        if v.method == "awq":
            def awq_pack(values):  # [rows, out] -> [rows, out / 8]
                x = values.astype(np.uint32).reshape(values.shape[0], -1, 8)
                packed = np.zeros(x.shape[:2], dtype=np.uint32)
                for j in range(8):
                    packed |= x[:, :, AWQ_ORDER[j]] << np.uint32(4 * j)
                return packed.view(np.int32)
            return {prefix + ".qweight": raw(awq_pack(q)), prefix + ".qzeros": raw(awq_pack(zeros)),
                    prefix + ".scales": raw(scales)}, deq
        # compressed-tensors: unsigned values are the signed ones + 2^(bits-1), so the unsigned
        # RTN values and zeros above are what it stores.
        out = {prefix + ".weight_packed": raw(pack(q.T.copy(), v.bits, 1)),
               prefix + ".weight_scale": raw(np.ascontiguousarray(scales.T)),
               prefix + ".weight_shape": raw(np.array(w.shape, dtype=np.int64))}
        if not v.sym:
            out[prefix + ".weight_zero_point"] = raw(pack(np.ascontiguousarray(zeros.T), v.bits, 0))
        return out, deq
    if v.method == "fp8":
        bo, bi = v.block
        m, k = w.shape
        s = np.zeros(((m + bo - 1) // bo, (k + bi - 1) // bi), dtype=np.float32)
        for r in range(s.shape[0]):
            for c in range(s.shape[1]):
                amax = np.abs(w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]).max()
                s[r, c] = np.float32(amax / E4M3_MAX) if amax > 0 else np.float32(1)
        full = np.repeat(np.repeat(s, bo, 0), bi, 1)[:m, :k]
        codes = encode_e4m3(w / full)
        deq = (decode_e4m3(codes) * full).astype(np.float32)
        return {prefix + ".weight": raw(codes, "F8_E4M3"), prefix + ".weight_scale_inv": raw(s)}, deq
    assert v.method == "ct-fp8"
    amax = np.abs(w).max(axis=1, keepdims=True)
    s_bits = to_bf16(np.where(amax > 0, amax / E4M3_MAX, 1).astype(np.float32))
    s = from_bf16(s_bits)
    codes = encode_e4m3(w / s)
    deq = (decode_e4m3(codes) * s).astype(np.float32)
    return {prefix + ".weight": raw(codes, "F8_E4M3"), prefix + ".weight_scale": ("BF16", list(s.shape), s_bits.tobytes())}, deq


def quantization_config(v: Variant) -> dict:
    if v.method == "gptq":
        return {"quant_method": "gptq", "bits": v.bits, "group_size": v.group_size, "sym": v.sym,
                "desc_act": v.desc_act, "checkpoint_format": "gptq_v2" if v.v2 else "gptq", "damp_percent": 0.01,
                "true_sequential": True}
    if v.method == "awq":
        return {"quant_method": "awq", "bits": v.bits, "group_size": v.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if v.method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(v.block)}
    if v.method == "ct-pack":
        weights = {"num_bits": v.bits, "type": "int", "symmetric": v.sym,
                   "strategy": "group" if v.group_size > 0 else "channel",
                   "group_size": v.group_size if v.group_size > 0 else None, "actorder": None, "dynamic": False,
                   "observer": "minmax"}
        fmt, acts = "pack-quantized", None
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                   "observer": "minmax"}
        fmt = "float-quantized"
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": ["lm_head", *v.ignore], "kv_cache_scheme": None, "sparsity_config": {}}


def ignored(module: str, v: Variant) -> bool:
    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in v.ignore)


def build(v: Variant) -> None:
    out = FIXTURES / FORMAT_DIRS[v.method] / v.name
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
        prefix = name[: -len(".weight")]
        if name.startswith("model.layers.") and proj in LINEARS and not ignored(prefix, v):
            stored, deq = quantize_linear(prefix, t.float().numpy(), v, rng)
            tensors.update(stored)
            dequantized[name] = torch.from_numpy(deq)
        else:
            t16 = t.to(torch.float16)
            tensors[name] = raw(t16.numpy())
            dequantized[name] = t16.float()
    if v.method == "gptq":  # as these fixtures were first written (safetensors' own writer)
        save_file({k: np.frombuffer(b, dtype={"F16": np.float16, "I32": np.int32}[d]).reshape(s)
                   for k, (d, s, b) in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        write_safetensors(out / "model.safetensors", tensors)

    config["torch_dtype"] = "float16"
    config["quantization_config"] = quantization_config(v)
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
    parity.write_checked_golden(
        out,
        v.name,
        model,
        prompt,
        {"model": v.name, "base": v.base, "note": v.note, "architecture": config["architectures"][0]},
    )


def main() -> None:
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    names = set(sys.argv[1:])
    for v in VARIANTS:
        if not names or v.name in names:
            build(v)


if __name__ == "__main__":
    main()
