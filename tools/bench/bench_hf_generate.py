#!/usr/bin/env python3
"""Hugging Face transformers on the same GPU and config as shardserve's dummy-weight benchmark
(issue 29 part 5; tools/gpu/gpu-bench.sh runs it): random init in bf16 from a config.json alone,
`generate` with the static KV cache, which makes transformers (>= 4.48) compile the decoding
forward itself (torch.compile, CUDA graphs), greedy, a fixed number of new tokens. (Compiling
`model.forward` by hand, the older recipe, failed on the H200 with transformers 5.17 on 2026-11-28:
the static cache's tensors, made lazily inside the compiled prefill, were CUDA graph outputs
overwritten by the next call.) --no-compile sets generation_config.disable_compile.

usage: bench_hf_generate.py --config CONFIG.json [--batch B] [--input-len N] [--output-len M]
                            [--reps R] [--out FILE] [--no-compile] [--check]

Prints (and with --out writes) one JSON object: batch, lengths, the seconds of a prefill-only
generate (1 new token) and of the full one, each the median of --reps (default 3) after two
warm-ups (which compile), and decode_tokens_per_s = batch x (M - 1) / (full - prefill). --check
reads the arguments and the config and prints what would run, importing neither torch nor
transformers (the CI rehearsal). Runs on the GPU machine's own python3 (torch 2.11, transformers
5.17 there), nothing installed.
"""
import argparse
import json
import statistics
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--check", action="store_true")
    a = p.parse_args()
    for name, v, lo, hi in (("--batch", a.batch, 1, 1024), ("--input-len", a.input_len, 1, 1 << 17),
                            ("--output-len", a.output_len, 2, 1 << 16), ("--reps", a.reps, 1, 100)):
        if not lo <= v <= hi:
            p.error(f"{name} must be in [{lo}, {hi}], got {v}")
    try:
        with open(a.config) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        p.error(f"--config {a.config}: {e}")
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if key not in config:
            p.error(f"--config {a.config} has no {key}")
    if a.input_len + a.output_len > config.get("max_position_embeddings", 1 << 30):
        p.error(f"--input-len + --output-len exceed the config's max_position_embeddings")
    return a, config


def main():
    a, config = parse()
    summary = {"config": a.config, "model_type": config["model_type"], "layers": config["num_hidden_layers"],
               "batch": a.batch, "input_len": a.input_len, "output_len": a.output_len,
               "compile": not a.no_compile, "cache": "static", "dtype": "bfloat16"}
    if a.check:
        print(json.dumps({"check": "ok", **summary}))
        return 0

    import torch
    import transformers

    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")}
    cfg = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    torch.cuda.synchronize()
    summary["init_s"] = round(time.perf_counter() - start, 2)
    summary["transformers"] = transformers.__version__
    summary["torch"] = torch.__version__
    summary["device"] = torch.cuda.get_device_name(0)
    model.generation_config.cache_implementation = "static"
    # The static cache makes generate compile the decoding steps (its compile_config: fullgraph,
    # reduce-overhead) and run the prefill eagerly.
    model.generation_config.disable_compile = a.no_compile
    ids = torch.randint(0, config["vocab_size"], (a.batch, a.input_len), device="cuda")
    mask = torch.ones_like(ids)

    def generate(new_tokens):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        assert out.shape == (a.batch, a.input_len + new_tokens), out.shape
        return time.perf_counter() - t

    start = time.perf_counter()
    for n in (1, a.output_len):  # warm-ups: compile and capture both shapes
        generate(n)
        generate(n)
    summary["warmup_s"] = round(time.perf_counter() - start, 2)
    prefill = statistics.median(generate(1) for _ in range(a.reps))
    full = statistics.median(generate(a.output_len) for _ in range(a.reps))
    summary["prefill_s"] = round(prefill, 5)
    summary["generate_s"] = round(full, 5)
    summary["decode_tokens_per_s"] = round(a.batch * (a.output_len - 1) / max(full - prefill, 1e-9), 2)
    summary["output_tokens_per_s"] = round(a.batch * a.output_len / full, 2)
    summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    text = json.dumps(summary)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
