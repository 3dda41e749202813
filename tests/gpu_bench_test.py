#!/usr/bin/env python3
"""The cheap parts of tools/gpu/gpu-bench.sh's dry run and of the GPU tools (ctest gpu_bench_dry_run; no GPU).

1. tools/gpu/gpu-bench.sh: no verb, an unknown verb or extra arguments are a usage error (exit 2).
2. gpu_bench_report.py junit on canned gtest XML: a case skipped for want of a GPU fails the step on a
   GPU machine (--gpu) and names the case; without --gpu it is counted, not failed; a skip whose message
   matches --allow-skip (the CPU's own bf16 instructions) is allowed; a file with no case fails.
3. gpu_bench_report.py record + report on canned records and a canned worker log: the memory lines
   are read (planned, measured, ratio; "not measured" kept as such), the decode rate comes from the
   inter-token latency, the roofline fraction from the measured bandwidth (3000 GB/s over 16e9 bytes a
   step is 187.5 tokens/s; 125 tokens/s is 0.667 of it), the markdown lists every step in order with
   '|' in notes escaped, and a failed step makes the report exit 1.
4. tools/bench/bench_hf_generate.py --check on the Llama-3-8B config (no torch needed) and its refusals.
5. tools/gpu/gpu-tests.sh run's gtest steps use the same judgement (judge_gtest): a fake kernels_cuda_test
   that exits 0 with every case skipped fails on a machine with a GPU, and passes (counted) without one.
6. tools/fixtures/write_config_checkpoint.py (the cold-start step's checkpoint) on small Llama and Qwen2 configs:
   Hugging Face's tensor names and shapes back to back in the header, lm_head only when untied, the
   q/k/v biases for Qwen2, the norms bf16 ones; with BIN_DIR, `shardserve generate-ids` loads each
   (the real load path on the CPU) and generates 3 ids.
7. A bundle split into pieces (tools/gpu/gpu-tests.sh split_bundle, as gpu-bench.sh pack does where the
   bundle and the tree exceed one copy) is joined and unpacked by setup's unpack to the same files,
   the pieces then removed (kept with `keep`); a missing piece, pieces of two packs, and pieces of
   two packs with the same count (which do not join) are refused by name; a bundle that fits is not
   split.
8. tools/gpu/sass_census.py's reading of nvdisasm output (canned, two kernels): a kernel's instructions
   counted without its labels, a loop found at a backward branch (not at a forward one or a branch
   to itself) with its length and opcodes, predicates and modifiers stripped.

usage: gpu_bench_test.py [BIN_DIR]
"""
import json
import os
import random
import shutil
import sys
import tempfile

from cli_check import check, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests/fixtures/gpu_bench")
REPORT = [sys.executable, os.path.join(ROOT, "tools/gpu/gpu_bench_report.py")]


def main():
    checks = 0
    script = os.path.join(ROOT, "tools/gpu/gpu-bench.sh")
    for args in ([], ["frobnicate"], ["run", "a", "b"]):
        rc, out, err = run(["bash", script, *args])
        check(rc == 2 and "tools/gpu/gpu-bench.sh dry-run" in err, f"gpu-bench.sh {args}: usage, exit 2 (got {rc})", err)
        checks += 1

    xml = os.path.join(FIX, "cuda_ops.xml")
    rc, out, err = run([*REPORT, "junit", xml, "--gpu"])
    check(rc == 1 and "Dtypes/CudaTest.Attention/BF16" in err, "a skipped CUDA case fails on a GPU, by name", out + err)
    counts = json.loads(out)
    check(counts["tests"] == 3 and counts["skipped"] == 1 and counts["failures"] == 0, "the counts", out)
    rc, out, err = run([*REPORT, "junit", xml])
    check(rc == 0, "without a GPU a skipped case is counted, not failed", out + err)
    rc, out, err = run([*REPORT, "junit", os.path.join(FIX, "parity.xml"), "--gpu", "--allow-skip", "no AVX-512"])
    check(rc == 0 and json.loads(out)["skipped"] == 0, "a CPU-only skip is allowed by --allow-skip", out + err)
    rc, out, err = run([*REPORT, "junit", os.path.join(FIX, "parity.xml"), "--gpu"])
    check(rc == 1, "the same skip without --allow-skip fails on a GPU", out + err)
    with tempfile.TemporaryDirectory() as tmp:
        empty = os.path.join(tmp, "empty.xml")
        with open(empty, "w") as f:
            f.write('<?xml version="1.0"?><testsuites tests="0"></testsuites>\n')
        rc, out, err = run([*REPORT, "junit", empty])
        check(rc == 1 and "no test case" in err, "an XML with no case fails", out + err)
    checks += 5

    # tools/gpu/gpu-tests.sh run judges its gtest steps as gpu-bench.sh does (judge_gtest, one home): a fake
    # kernels_cuda_test that exits 0 after skipping every case fails the step on a machine with a GPU
    # (GPUS=1), naming a case; without one (GPUS empty) the skips are counted and the step passes.
    all_skipped = os.path.join(FIX, "cuda_ops_all_skipped.xml")
    with tempfile.TemporaryDirectory() as tmp:
        fake = os.path.join(tmp, "kernels_cuda_test")
        with open(fake, "w") as f:
            f.write(f'#!/bin/sh\nfor a; do case "$a" in --gtest_output=xml:*) cp "{all_skipped}" "${{a#--gtest_output=xml:}}";; '
                    f'esac; done\necho "[  PASSED  ] 0 tests."\nexit 0\n')
        os.chmod(fake, 0o755)
        gpu_tests = os.path.join(ROOT, "tools/gpu/gpu-tests.sh")
        for gpus, want_failed in (("1", "1"), ("", "0")):
            script = (f'source "{gpu_tests}" && logs="{tmp}" failed=0 GPUS="{gpus}" && '
                      f'run_gtest kernels_cuda_test "{fake}" --gtest_filter="$CUDA_OPS_FILTER" && echo "failed=$failed"')
            rc, out, err = run(["bash", "-c", script])
            with open(os.path.join(tmp, "kernels_cuda_test.log")) as f:
                log = f.read()
            check(rc == 0 and out.strip().endswith(f"failed={want_failed}"),
                  f"gpu-tests.sh, every CUDA case skipped, GPUS={gpus!r}: failed={want_failed}", out + err + log)
            if gpus:
                check("FAILED by its XML" in out and "Ops/CudaQuant.MatMulMatchesTheDequantizedReference/int4_BF16" in log,
                      "the failure names a skipped case", out + log)
        rc, out, err = run(["bash", "-c", f'source "{gpu_tests}" && GPUS=1 judge_gtest "{all_skipped}"'])
        check(rc == 1 and json.loads(out)["skipped"] == 4, "judge_gtest: 4 skipped cases on a GPU fail", out + err)
    checks += 4

    with tempfile.TemporaryDirectory() as tmp:
        records = os.path.join(tmp, "records")
        shutil.copytree(os.path.join(FIX, "records"), records)
        rc, out, err = run([*REPORT, "record", records, "06-llama8b-c64", "passed", "80", "--metric", "batch=64",
                            "--metric", "itl_p50_s=0.02", "--memory", os.path.join(FIX, "logs/llama8b-b1"),
                            "--note", "canned"])
        check(rc == 0, "record", out + err)
        with open(os.path.join(records, "06-llama8b-c64.json")) as f:
            rec = json.load(f)
        mem = rec["memory"]["worker0-node0.log"]
        check(mem["weights"] == {"planned": 16060522496, "measured": 16060522496, "ratio": 1.0,
                                 "how": "the shard's own count"}, "the weights line", json.dumps(mem))
        check(mem["cuda_context"]["ratio"] == round(566231040 / 1040187392, 4), "the context's ratio", json.dumps(mem))
        check(mem["cublas_workspace"]["measured"] is None and "not measured" in mem["cublas_workspace"]["how"],
              "an item not measured stays so", json.dumps(mem))
        # The H200's (2026-11-27) free and held_back lines: free after loading against free + held_back
        # + the workspace still to come.
        check(mem["free_after_load"]["planned"] == 605696 + 15010988032 + 33554432 and
              mem["free_after_load"]["measured"] == 15329263616 and mem["free_after_load"]["ratio"] == 1.0189,
              "free after loading, derived", json.dumps(mem))
        # A canned log in the form of the planner with a measured context (runtime_slack) and the
        # worker's after_steps lines (the H200's figures of 2026-11-28; the after_steps figures made
        # up): the slack counts as free after loading, the last after_steps line is the one kept.
        rc, out, err = run([*REPORT, "memory", os.path.join(FIX, "logs/llama8b-b1-slack/worker0-node0.log")])
        mem = json.loads(out)["worker0-node0.log"] if rc == 0 else {}
        check(mem.get("free_after_load", {}).get("planned") == 605696 + 15010988032 + 33554432 + 416481280 and
              mem["free_after_load"]["ratio"] == round(15329263616 / (605696 + 15010988032 + 33554432 + 416481280), 4),
              "free after loading counts the runtime slack as free", out + err)
        check(mem.get("after_steps", {}).get("measured") == 159383552 and mem["after_steps"]["planned"] == 450035712 and
              mem["cuda_context"]["ratio"] == 1.0, "the last after_steps line, and the measured context", out + err)
        rc, out, err = run([*REPORT, "record", records, "x", "great", "1"])
        check(rc == 2 and "is not one of" in err, "a bad status is refused", err)

        out_json, out_md = os.path.join(tmp, "results.json"), os.path.join(tmp, "results.md")
        rc, out, err = run([*REPORT, "report", records, out_json, out_md])
        check(rc == 0, "the report of passed steps exits 0", out + err)
        with open(out_json) as f:
            res = json.load(f)
        steps = {s["step"]: s for s in res["steps"]}
        b1 = steps["05-llama8b-b1"]["metrics"]
        check(b1["decode_tokens_per_s"] == 125.0 and b1["roofline_tokens_per_s"] == 187.5 and
              b1["roofline_fraction"] == 0.667, "decode rate and roofline", json.dumps(b1))
        check(steps["06-llama8b-c64"]["metrics"]["decode_tokens_per_s"] == 3200.0, "64 streams: batch / ITL", out)
        with open(out_md) as f:
            md = f.read()
        order = [md.find(f"| {s} |") for s in ("00-gpu", "01-membw", "05-llama8b-b1", "06-llama8b-c64",
                                                  "09-tp-on-one-gpu")]
        check(all(i >= 0 for i in order) and order == sorted(order), "every step in the table, in order", md)
        check("a \\| in the note" in md, "'|' in a note is escaped", md)
        check("| 06-llama8b-c64 | worker0-node0.log | weights | 14.96 GiB | 14.96 GiB | 1.0 |" in md,
              "the memory table", md)
        check("of roofline 0.667" in md and "GB/s best 3000" in md, "the figures in the table", md)

        rc, out, err = run([*REPORT, "record", records, "07-hf-b1", "failed", "3", "--note", "boom"])
        rc, out, err = run([*REPORT, "report", records, out_json, out_md])
        check(rc == 1 and "07-hf-b1" in err, "a failed step fails the report, by name", out + err)
    checks += 13

    hf = [sys.executable, os.path.join(ROOT, "tools/bench/bench_hf_generate.py")]
    cfg = os.path.join(ROOT, "tests/fixtures/configs/llama-3-8b.json")
    rc, out, err = run([*hf, "--config", cfg, "--batch", "64", "--input-len", "512", "--check"])
    check(rc == 0 and json.loads(out)["layers"] == 32, "the HF script's --check", out + err)
    rc, out, err = run([*hf, "--config", cfg, "--batch", "0", "--check"])
    check(rc == 2 and "--batch must be in" in err, "the HF script refuses batch 0", err)
    rc, out, err = run([*hf, "--config", cfg, "--input-len", "8192", "--check"])
    check(rc == 2 and "max_position_embeddings" in err, "the HF script refuses a context beyond the model's", err)
    checks += 3

    # tools/fixtures/write_config_checkpoint.py (llama8b-cold-safetensors) on small Llama (untied) and Qwen2
    # (tied, q/k/v biases) configs: the safetensors header lists Hugging Face's tensors with their
    # shapes, back to back, the file's size is the header's last offset, the norms are bf16 ones.
    writer = [sys.executable, os.path.join(ROOT, "tools/fixtures/write_config_checkpoint.py")]
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=300, bos_token_id=1, eos_token_id=2)
    for src, tied, bias in (("llama-3-8b.json", False, False), ("qwen2.5-0.5b.json", True, True)):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(ROOT, "tests/fixtures/configs", src)) as f:
                c = dict(json.load(f), **small)
            c.pop("head_dim", None)
            cfg_path, out_dir = os.path.join(tmp, "config.json"), os.path.join(tmp, "ckpt")
            with open(cfg_path, "w") as f:
                json.dump(c, f)
            rc, out, err = run([*writer, "--config", cfg_path, "--out", out_dir, "--json", os.path.join(tmp, "w.json")])
            check(rc == 0 and "tensors" in out, f"{src}: the checkpoint written", out + err)
            path = os.path.join(out_dir, "model.safetensors")
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
                data = f.read()
            header.pop("__metadata__")
            end = 0
            for name, t in header.items():
                check(t["dtype"] == "BF16" and t["data_offsets"][0] == end, f"{src}: {name} back to back", t)
                count = 1
                for d in t["shape"]:
                    count *= d
                end = t["data_offsets"][1]
                check(end - t["data_offsets"][0] == 2 * count, f"{src}: {name}'s bytes match its shape", t)
            check(len(data) == end, f"{src}: the data is the header's last offset long", (len(data), end))
            check(header["model.layers.1.mlp.down_proj.weight"]["shape"] == [64, 96], f"{src}: down's shape", header)
            check(header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [32, 64], f"{src}: k's shape", header)
            check(("lm_head.weight" in header) == (not tied), f"{src}: lm_head only when untied", list(header))
            check(("model.layers.0.self_attn.q_proj.bias" in header) == bias, f"{src}: q/k/v biases", list(header))
            norm = header["model.norm.weight"]["data_offsets"]
            check(data[norm[0]:norm[1]] == b"\x80\x3f" * 64, f"{src}: the final norm is ones", data[norm[0]:norm[0] + 8])
            with open(os.path.join(out_dir, "config.json")) as f:
                check(json.load(f)["torch_dtype"] == "bfloat16", f"{src}: config.json says bfloat16", "")
            checks += 8
            if len(sys.argv) > 1:
                rc, out, err = run([os.path.join(sys.argv[1], "shardserve"), "generate-ids", "--model", out_dir,
                                    "--max-new-tokens", "3", "1", "2", "3"])
                ids = out.split()
                check(rc == 0 and len(ids) == 3 and all(0 <= int(i) < 300 for i in ids),
                      f"{src}: the checkpoint loads and generates 3 ids", out + err)
                checks += 1
    checks += bundle_pieces_checks()
    checks += sass_census_checks()
    print(f"PASS: {checks} checks")


def bundle_pieces_checks():
    gpu_tests = os.path.join(ROOT, "tools/gpu/gpu-tests.sh")

    def sh(cmd, cwd):
        return run(["bash", "-c", f'source "{gpu_tests}" && cd "{cwd}" && {cmd}'])

    with tempfile.TemporaryDirectory() as tmp:
        def pack(seed):  # a bundle of 6 KiB of incompressible bytes, as tar.xz
            src = os.path.join(tmp, "src")
            shutil.rmtree(src, ignore_errors=True)
            os.makedirs(os.path.join(src, "bin"))
            with open(os.path.join(src, "bin", "tool"), "wb") as f:
                f.write(random.Random(seed).randbytes(6144))
            with open(os.path.join(src, "source-dir"), "w") as f:
                f.write(f"/src/{seed}\n")
            rc, out, err = run(["tar", "-C", src, "-cJf", os.path.join(tmp, "b.tar.xz"), "bin", "source-dir"])
            check(rc == 0, "tar", out + err)

        def pieces():
            return sorted(n for n in os.listdir(tmp) if ".part" in n)

        pack(1)
        rc, out, err = sh("split_bundle b.tar.xz 2500", tmp)
        check(rc == 0 and pieces() == ["b.tar.xz.part1of3", "b.tar.xz.part2of3", "b.tar.xz.part3of3"] and
              not os.path.exists(os.path.join(tmp, "b.tar.xz")) and
              all(os.path.getsize(os.path.join(tmp, p)) <= 2500 for p in pieces()),
              "split_bundle: three pieces of at most 2500 bytes, the whole removed", out + err + str(pieces()))
        rc, out, err = sh("unpack b keep", tmp)
        with open(os.path.join(tmp, "b", "source-dir")) as f:
            kept = f.read()
        with open(os.path.join(tmp, "b", "bin", "tool"), "rb") as f:
            same = f.read() == random.Random(1).randbytes(6144)
        check(rc == 0 and kept == "/src/1\n" and same and len(pieces()) == 3,
              "unpack keep: the pieces joined into the same files, kept", out + err)
        rc, out, err = sh("unpack b", tmp)
        check(rc == 0 and pieces() == [], "unpack: the pieces removed once unpacked", out + err + str(pieces()))

        pack(1)
        sh("split_bundle b.tar.xz 2500", tmp)
        os.remove(os.path.join(tmp, "b.tar.xz.part2of3"))
        rc, out, err = sh("setup b", tmp)
        check(rc == 1 and "b.tar.xz.part2of3 is missing" in err, "a missing piece is named", out + err)
        stale = {p: open(os.path.join(tmp, p), "rb").read() for p in pieces()}
        pack(2)
        sh("split_bundle b.tar.xz 3500", tmp)  # part1of2, part2of2 (removing the earlier pieces) ...
        for p, data in stale.items():  # ... and the earlier pack's part1of3 and part3of3 back beside them
            with open(os.path.join(tmp, p), "wb") as f:
                f.write(data)
        rc, out, err = sh("unpack b", tmp)
        check(rc == 1 and "more than one pack" in err, "pieces of two packs are refused", out + err)
        for p in pieces():
            os.remove(os.path.join(tmp, p))
        pack(3)
        sh("split_bundle b.tar.xz 3500", tmp)
        os.rename(os.path.join(tmp, "b.tar.xz.part2of2"), os.path.join(tmp, "third.part2of2"))
        pack(4)
        sh("split_bundle b.tar.xz 3500", tmp)
        os.replace(os.path.join(tmp, "third.part2of2"), os.path.join(tmp, "b.tar.xz.part2of2"))
        rc, out, err = sh("unpack b", tmp)
        check(rc == 1 and "do not join into one bundle" in err, "pieces of two packs with the same count are refused",
              out + err)
        for p in pieces():
            os.remove(os.path.join(tmp, p))
        pack(5)
        rc, out, err = sh("split_bundle b.tar.xz 1000000 && unpack b", tmp)
        with open(os.path.join(tmp, "b", "source-dir")) as f:
            kept = f.read()
        check(rc == 0 and pieces() == [] and kept == "/src/5\n", "a bundle that fits stays whole and unpacks",
              out + err + str(pieces()))
    return 7


SASS = """\
\t.text._Z3oneiPf:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x1, PT ;
        /*0020*/               @P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0030*/                   FFMA R2, R3, R4, R2 ;
        /*0040*/                   PRMT R3, R5, 0x7044, R6 ;
        /*0050*/              @!P1 FFMA R2, R3, R4, R2 ;
        /*0060*/                   LDG.E.64.CONSTANT R4, desc[UR6][R8.64] ;
        /*0070*/               @P2 BRA `(.L_x_0) ;
.L_x_1:
        /*0080*/                   EXIT ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_2);
\t.text._Z3twov:
        /*0000*/                   EXIT ;
"""


def sass_census_checks():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "gpu"))
    import sass_census
    funcs = sass_census.functions(SASS)
    check(sorted(funcs) == ["_Z3oneiPf", "_Z3twov"], "sass_census: both kernels", sorted(funcs))
    total, loops = sass_census.census(funcs["_Z3oneiPf"])
    check(total == 10, "sass_census: ten instructions, labels not counted", total)
    check(len(loops) == 1 and loops[0][:2] == (3, 5), "sass_census: one loop, five instructions from 0x30",
          loops)
    ops = loops[0][2]
    check(ops == {"FFMA": 2, "PRMT": 1, "LDG": 1, "BRA": 1}, "sass_census: the loop's opcodes", dict(ops))
    check(sass_census.census(funcs["_Z3twov"]) == (1, []), "sass_census: no loop", funcs["_Z3twov"])
    return 5


if __name__ == "__main__":
    main()
