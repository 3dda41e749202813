#!/usr/bin/env python3
"""`shardserve plan` as a user runs it (stdlib only; no process but the CLI itself).

1. The worked example of docs/planner.md: Qwen2.5-72B on 1x2xA100-80GB fits as TP=2 x PP=1 with
   KV cache for 17,520 tokens; exit 0; `--json` says the same and names the cluster's bandwidth.
2. A model that does not fit (72B on one L4-24GB): exit 1, "DOES NOT FIT" and the reason.
3. Bad flags: exit 2 and a message naming the flag (or the unknown GPU): unknown flags, an unknown
   GPU, bandwidths that are negative, NaN, or outside [0.001, 1e6] GB/s, an unknown --quantization.
4. --quantization int4 (issue 25): 72B fits on one A100-80GB with KV cache left, and the plan says
   that bf16 does not; a forced TP=2 that cuts int4 groups is refused with the numbers.
5. The itemised memory (issue 29 part 3): Llama-3-8B on one H100-80GB prints a row per GPU with
   each item, and in --json the nine items add up to the GPU's memory, weights 2 bytes a parameter;
   with --quantization int4 a tenth, the dequantize scratch of the CUDA quantized products (64 MiB).
6. --speculative mtp: DeepSeek-V3 on 8 H200 counts its multi-token-prediction layer on GPU 0 only
   (the item mtp_layer, a column and the plan's explanation), its items still add up, the model's
   cache is smaller; a model without the layer is refused (exit 1), naming why.
7. --speculative eagle3: Llama-3.1-8B's published EAGLE-3 head on one H200 is an item of its own, the
   hidden states kept for it 48 MiB of the step buffers; a head as a draft, a model as a head, a head
   of another model and a missing --draft-model are refused.
8. gpt-oss-120b's model line names its experts' MXFP4 format beside the bf16 of the rest.

usage: plan_cli_test.py BIN_DIR
"""
import json
import os
import sys

from cli_check import check, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "tests/fixtures/configs/qwen2.5-72b-instruct.json")


def plan(*args, config=CONFIG):
    return run([os.path.join(BIN, "shardserve"), "plan", "--config", config, *args])


def main():
    rc, out, err = plan("--cluster", "1x2xA100-80GB")
    check(rc == 0, f"the worked example exits 0, got {rc}", out + err)
    check("TP=2 x PP=1 on 2 GPUs" in out and "KV cache 17,520 tokens" in out, "the worked example's layout", out)
    check("HBM 2039 GB/s" in out, "the A100's bandwidth in the table", out)
    rc, out, err = plan("--cluster", "1x2xA100-80GB", "--json")
    check(rc == 0, f"--json exits 0, got {rc}", err)
    j = json.loads(out)
    check(j["fits"] and j["tp"] == 2 and j["pp"] == 1 and j["kv_cache_tokens"] == 17520, "the JSON plan", out)
    check(j["cluster"]["hbm_bytes_per_s"] == 2039e9, "the JSON cluster's bandwidth", out)

    rc, out, err = plan("--cluster", "1x1xL4-24GB")
    check(rc == 1, f"a plan that does not fit exits 1, got {rc}", out + err)
    check("DOES NOT FIT" in out and "does not fit on 1 node" in out, "the reason it does not fit", out)

    rc, out, err = plan("--cluster", "1x1xA100-80GB", "--quantization", "int4")
    check(rc == 0, f"int4 on one A100 exits 0, got {rc}", out + err)
    check("TP=1 x PP=1 on 1 GPU" in out and "linear layers int4" in out, "int4 on one A100: the layout", out)
    words = " ".join(out.split())  # the table wraps its notes
    check("int4 against bf16" in words and "in bf16 does not fit on this cluster" in words, "int4 against bf16", out)
    rc, out, err = plan("--cluster", "1x1xA100-80GB", "--quantization", "int4", "--json")
    j = json.loads(out)
    check(rc == 0 and j["fits"] and j["kv_cache_tokens"] > 32768 and j["quantization"] == "int4",
          "the int4 JSON plan holds a 32k sequence", out)
    check(j["unquantized"]["fits"] is False, "the int4 JSON plan says bf16 does not fit", out)
    rc, out, err = plan("--cluster", "1x2xA100-80GB", "--quantization", "int4", "--tp", "2")
    check(rc != 0 and "14784 per rank, not a whole number of groups of 128" in err, "int4 TP=2 refused", out + err)

    llama = os.path.join(ROOT, "tests/fixtures/configs/llama-3-8b.json")
    rc, out, err = plan("--cluster", "1x1xH100-80GB", config=llama)
    check(rc == 0, f"Llama-3-8B on one H100 exits 0, got {rc}", out + err)
    check("memory per GPU, itemised (adds up to 79.65 GiB):" in out, "the itemised memory's heading", out)
    header = next((l for l in out.splitlines() if "cuBLAS ws" in l), "")
    check(all(w in header for w in ["weights", "KV cache", "step bufs", "graphs", "NCCL", "context", "free",
                                    "held back"]), "the itemised memory's columns", out)
    rows = out.split(header, 1)[1].splitlines()[1:2] if header else []
    check(rows and "14.96 GiB" in rows[0] and "32.00 MiB" in rows[0], "the GPU's row: weights, cuBLAS workspace", out)
    rc, out, err = plan("--cluster", "1x1xH100-80GB", "--json", config=llama)
    j = json.loads(out)
    memory = j["per_gpu"][0]["memory"]
    names = {"weights", "kv_cache", "step_buffers", "cublas_workspace", "cuda_graph_pools", "nccl_buffers",
             "cuda_context", "runtime_slack", "free", "held_back"}
    check(rc == 0 and set(memory) == names, "the JSON memory items", out)
    check(sum(memory.values()) == j["cluster"]["gpu_memory_bytes"], "the JSON memory items add up to the GPU", out)
    check(memory["weights"] == 2 * 8030261248 and memory["nccl_buffers"] == 0, "the JSON weights and NCCL", out)
    check(memory["cuda_context"] == 623706112 and memory["runtime_slack"] == (1 << 30) - (32 << 20) - 623706112,
          "Hopper: the context as measured on an H200, the rest of the reserve as slack", out)
    check(0 <= memory["free"] < 16 * 131072, "the KV cache leaves less than a block free", out)
    # int4 weights on CUDA: the quantized products' dequantize scratch is a column and an item of its own
    # (64 MiB for the 8B's bf16 rows), taken out of the runtime slack's share of the 1 GiB reserve.
    rc, out, err = plan("--cluster", "1x1xH100-80GB", "--quantization", "int4", config=llama)
    header = next((l for l in out.splitlines() if "cuBLAS ws" in l), "")
    rows = out.split(header, 1)[1].splitlines()[1:2] if header else []
    check(rc == 0 and "dequant" in header and header.index("cuBLAS ws") < header.index("dequant") <
          header.index("graphs") and rows and "64.00 MiB" in rows[0], "the int4 plan's dequant column", out + err)
    rc, out, err = plan("--cluster", "1x1xH100-80GB", "--quantization", "int4", "--json", config=llama)
    memory = json.loads(out)["per_gpu"][0]["memory"]
    check(rc == 0 and set(memory) == names | {"dequant_scratch"} and memory["dequant_scratch"] == 64 << 20 and
          memory["runtime_slack"] == (1 << 30) - (32 << 20) - (64 << 20) - 623706112 and
          sum(memory.values()) == json.loads(out)["cluster"]["gpu_memory_bytes"], "the int4 plan's JSON items", out)

    # --speculative mtp: DeepSeek-V3's multi-token-prediction layer on GPU 0 of 8 H200, the worker that
    # samples; an item of its own, 0 on the other GPUs, and a model cache smaller than without it.
    deepseek = os.path.join(ROOT, "tests/fixtures/configs/deepseek-v3.json")
    rc, out, err = plan("--cluster", "1x8xH200", "--json", config=deepseek)
    check(rc == 0, f"DeepSeek-V3 on 8 H200 exits 0, got {rc}", out + err)
    plain = json.loads(out)
    rc, out, err = plan("--cluster", "1x8xH200", "--speculative", "mtp", "--json", config=deepseek)
    check(rc == 0, f"DeepSeek-V3 --speculative mtp on 8 H200 exits 0, got {rc}", out + err)
    j = json.loads(out)
    layer = [g["memory"].get("mtp_layer") for g in j["per_gpu"]]
    check(layer[0] and layer[0] > 14 << 30 and layer[1:] == [0] * 7, "the layer's item: GPU 0's, 0 elsewhere", out)
    check(all(sum(g["memory"].values()) == j["cluster"]["gpu_memory_bytes"] and g["memory"]["free"] >= 0
              for g in j["per_gpu"]), "the items with the layer add up to each GPU", out)
    check(j["kv_cache_tokens"] < plain["kv_cache_tokens"], "the layer leaves the model's cache smaller", out)
    check(j["max_model_len"] == plain["max_model_len"] == 163840, "the layer's cache is per token: the length stays", out)
    rc, out, err = plan("--cluster", "1x8xH200", "--speculative", "mtp", config=deepseek)
    words = " ".join(out.split())
    check(rc == 0 and "MTP layer" in out and "The multi-token-prediction layer takes" in words and
          "a token of the model's cache, one layer's latent row" in words, "the table's MTP column and explanation",
          out)
    rc, out, err = plan("--cluster", "1x2xA100-80GB", "--speculative", "mtp")
    check(rc == 1 and "--speculative mtp needs the model's multi-token-prediction layer" in err,
          "a model without the layer is refused", out + err)
    # --speculative eagle3: the published head for Llama-3.1-8B on one H200 is counted on that GPU (an
    # item of its own, the plan's explanation, the hidden states kept for it in the step buffers); a
    # head is not a draft model, nor a model a head.
    llama31 = os.path.join(ROOT, "tests/fixtures/configs/llama-3.1-8b.json")
    head = os.path.join(ROOT, "tests/fixtures/configs/eagle3-llama-3.1-8b.json")
    rc, out, err = plan("--cluster", "1x1xH200", "--json", config=llama31)
    check(rc == 0, f"Llama-3.1-8B on one H200 exits 0, got {rc}", out + err)
    plain = json.loads(out)
    rc, out, err = plan("--cluster", "1x1xH200", "--speculative", "eagle3", "--draft-model", head, "--json",
                        config=llama31)
    check(rc == 0, f"Llama-3.1-8B --speculative eagle3 on one H200 exits 0, got {rc}", out + err)
    j = json.loads(out)
    memory, before = j["per_gpu"][0]["memory"], plain["per_gpu"][0]["memory"]
    # (the head: its one layer's K and V beside each token of the model's 32 layers' cache, and under
    # 3 GiB of bf16 weights, the model's embedding copied in among them, and buffers)
    check(memory["kv_cache"] // 32 < memory.get("eagle3_head", 0) < memory["kv_cache"] // 32 + (3 << 30),
          "the head's item", out)
    check(memory["step_buffers"] - before["step_buffers"] == 3 * 2048 * 4096 * 2,
          "the hidden states kept at three layers: 48 MiB of step buffers", out)
    check(sum(memory.values()) == j["cluster"]["gpu_memory_bytes"] and memory["free"] >= 0,
          "the items with the head add up to the GPU", out)
    check(j["kv_cache_tokens"] < plain["kv_cache_tokens"], "the head leaves the model's cache smaller", out)
    rc, out, err = plan("--cluster", "1x1xH200", "--speculative", "eagle3", "--draft-model", head, config=llama31)
    words = " ".join(out.split())
    check(rc == 0 and "EAGLE-3 head" in out and "The EAGLE-3 head takes" in words and
          "every GPU keeps the model's hidden states at the head's 3 layers for it, 48.00 MiB" in words,
          "the table's EAGLE-3 column and explanation", out)
    rc, out, err = plan("--cluster", "1x1xH200", "--draft-model", head, config=llama31)
    check(rc == 1 and "is an EAGLE-3 head (LlamaForCausalLMEagle3): plan it with --speculative eagle3" in err,
          "an EAGLE-3 head as a draft model", out + err)
    rc, out, err = plan("--cluster", "1x1xH200", "--speculative", "eagle3", "--draft-model", llama31, config=llama31)
    check(rc == 1 and "is not an EAGLE-3 head (LlamaForCausalLM): plan it with --speculative draft" in err,
          "a model as an EAGLE-3 head", out + err)
    rc, out, err = plan("--cluster", "1x1xH200", "--speculative", "eagle3",
                        config=os.path.join(ROOT, "tests/fixtures/configs/qwen3-32b.json"))
    check(rc == 2 and "--speculative eagle3 needs --draft-model DIR (the EAGLE-3 head's config.json)" in err,
          "--speculative eagle3 without its head", out + err)
    rc, out, err = plan("--cluster", "1x1xH200", "--speculative", "eagle3", "--draft-model", head,
                        config=os.path.join(ROOT, "tests/fixtures/configs/qwen3-32b.json"))
    check(rc == 1 and "target_hidden_size" in err, "a head of another model's width is refused", out + err)
    # gpt-oss-120b's experts are held in MXFP4 as published, the rest in bf16: the model line says so.
    gpt_oss = os.path.join(ROOT, "tests/fixtures/configs/gpt-oss-120b.json")
    rc, out, err = plan("--cluster", "1x1xH100-80GB", config=gpt_oss)
    check(rc == 0 and "60.77 GiB in bf16 with the experts' products in mxfp4" in out, "gpt-oss's model line", out + err)

    bad = [
        (["--cluster", "1x2xA100-80GB", "--speculative", "eagle"], "--speculative must be ngram, draft, mtp or eagle3"),
        (["--cluster", "1x2xA100-80GB", "--speculative", "draft"], "--speculative draft needs --draft-model DIR"),
        (["--cluster", "1x2xA100-80GB", "--quantization", "int3"], "quantization must be none, int8, int4 or fp8"),
        (["--cluster", "1x2xA100-80GB", "--foo", "1"], "unknown flag --foo"),
        (["--cluster", "1x2xB999"], 'unknown GPU "B999"'),
        (["--cluster", "1x2xA100"], 'GPU "A100" is ambiguous: say which of A100-40GB, A100-80GB'),
        (["--cluster", "1x2xA100-80GB", "--decode-batch", "0"], "--decode-batch must be an integer in [1, 4096]"),
        (["--cluster", "1x2xA100-80GB", "--hbm-gbps", "-3"], "--hbm-gbps must be a positive number"),
        (["--cluster", "1x2xA100-80GB", "--hbm-gbps", "nan"], "--hbm-gbps must be a positive number"),
        (["--cluster", "1x2xA100-80GB", "--hbm-gbps", "1e-300"], "--hbm-gbps must be in [0.001, 1e6] GB/s"),
        (["--cluster", "1x2xA100-80GB", "--intra-node-gbps", "1e7"], "--intra-node-gbps must be in [0.001, 1e6] GB/s"),
        (["--cluster", "1x2xA100-80GB", "--inter-node-gbps", "0.0001"], "--inter-node-gbps must be in [0.001, 1e6]"),
    ]
    for args, message in bad:
        rc, out, err = plan(*args)
        check(rc == 2, f"{args}: exit 2, got {rc}", out + err)
        check(message in err, f"{args}: the message names {message!r}", err)
    print(f"PASS: 3 checks of the worked example, 1 that does not fit, 3 of int4, 9 of itemised memory, "
          f"6 of --speculative mtp, 1 of gpt-oss's model line, {len(bad)} bad flags")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    BIN = sys.argv[1]
    main()
