#!/usr/bin/env python3
"""An independent reimplementation of --load-format dummy's weights (model/dummy_weights.cc,
kernels/counter_uniform.h), in Python: where tests/dummy_weights_test.cc's KnownValues come from.

Element i of tensor NAME with seed S: key = SplitMix64(S ^ SplitMix64(FNV-1a-64(NAME))); bits =
SplitMix64(key + (i + 1) * 0x9E3779B97F4A7C15); k = bits >> 40 (24 bits); u = float32(2k + 1) / 2^24
- 1; the value is a * u with a = float32(1 / sqrt(columns)), 0.1 for biases, and 1.0 for norms
(u unused). Every step rounds to float32 as C++ does (round to nearest even).

    python3 tools/ci/dummy_weights_reference.py                                 # prints the values
    python3 tools/ci/dummy_weights_reference.py --check tests/dummy_weights_test.cc  # compares them
"""
import argparse
import math
import re
import struct
import sys

MASK = (1 << 64) - 1


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def fnv1a64(name: str) -> int:
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & MASK
    return h


def splitmix64_mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def element(seed: int, name: str, columns: int, index: int) -> float:
    if name.endswith("norm.weight"):
        return 1.0
    scale = f32(0.1) if name.endswith(".bias") else f32(1.0 / math.sqrt(columns))
    key = splitmix64_mix(seed ^ splitmix64_mix(fnv1a64(name)))
    bits = splitmix64_mix((key + (index + 1) * 0x9E3779B97F4A7C15) & MASK)
    u = f32(f32(f32(2 * (bits >> 40) + 1) * f32(1.0 / 16777216.0)) - 1.0)
    return f32(scale * u)


def c_hex(x: float) -> str:
    """As the C++ test writes a float literal: 0x1.962148p-4f."""
    sign = "-" if x < 0 else ""
    mantissa, exponent = abs(x).hex()[2:].split("p")
    whole, frac = mantissa.split(".")
    return f"{sign}0x{whole}.{frac[:6]}p{int(exponent)}f"  # a float32's 23 fraction bits: 6 hex digits


# (seed, tensor, columns, index): the qwen2_tied_bias fixture (hidden 64, intermediate 128) with seed 7.
CASES = [
    (7, "model.embed_tokens.weight", 64, 0),
    (7, "model.embed_tokens.weight", 64, 1),
    (7, "model.embed_tokens.weight", 64, 12345),
    (7, "model.layers.2.mlp.down_proj.weight", 128, 0),
    (7, "model.layers.2.mlp.down_proj.weight", 128, 7),
    (7, "model.layers.2.mlp.down_proj.weight", 128, 8191),
    (7, "model.layers.0.self_attn.q_proj.bias", 64, 0),
    (7, "model.layers.0.self_attn.q_proj.bias", 64, 63),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", help="a C++ file whose w.Element(NAME, I) expectations must equal these values")
    args = ap.parse_args()
    values = {(name, index): element(seed, name, cols, index) for seed, name, cols, index in CASES}
    if not args.check:
        for (name, index), v in values.items():
            print(f'EXPECT_EQ(w.Element("{name}", {index}), {c_hex(v)});')
        return 0
    text = open(args.check).read()
    pinned = {(m.group(1), int(m.group(2))): float.fromhex(m.group(3)[:-1])
              for m in re.finditer(r'w\.Element\("([^"]+)", (\d+)\), (-?0x[0-9a-f.]+p-?\d+f)\)', text)}
    bad = 0
    for key, v in values.items():
        if pinned.get(key) != v:
            print(f"{args.check}: Element{key} is {pinned.get(key)}; the reference computes {c_hex(v)}")
            bad += 1
    if set(pinned) != set(values):
        print(f"{args.check}: pins {sorted(set(pinned) - set(values))} beyond the reference's cases")
        bad += 1
    print(f"dummy_weights_reference: {len(values) - bad} of {len(values)} pinned values equal the reference's")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
