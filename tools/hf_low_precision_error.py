"""How far Hugging Face transformers itself moves from its float32 goldens in bf16 and f16.

For every parity fixture (tests/fixtures/models/*/golden.json, made by make_parity_fixtures.py)
this loads the checkpoint with transformers in bfloat16 and in float16 (eager attention, on the
GPU when torch sees one, else the CPU), computes the last-position logits of the two contexts
that tests/llama_parity_test.cc's LlamaLowPrecision suite checks (the prompt; the prompt followed
by the first 31 golden greedy tokens), and prints their normalized error (max|a - b| / max|b|)
against the float32 goldens. These are the errors that rounding alone causes in transformers,
the yardstick for shardserve's own bf16 / f16 errors and for the suite's tolerance.

Usage (from the repository root; needs torch and transformers, e.g. tools/fixtures-env.sh):
    python3 tools/hf_low_precision_error.py [--device cuda|cpu] [--json FILE]
"""

import argparse
import json
import pathlib

import torch
import transformers
from transformers import AutoModelForCausalLM

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models"


def normalized_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max())


def last_logits(model, ids, device) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids], device=device))
    return out.logits[0, -1].float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=pathlib.Path, help="also write the table as JSON here")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    # transformers 4.56 renamed from_pretrained's torch_dtype to dtype.
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if version >= (4, 56) else "torch_dtype"

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {args.device}")
    print(f"{'fixture':<18} {'dtype':<9} {'prompt':>10} {'+31 tokens':>10}")
    rows = []
    for golden_path in sorted(FIXTURES.glob("*/golden.json")):
        golden = json.loads(golden_path.read_text())
        prompt, greedy = golden["prompt_ids"], golden["greedy_ids"]
        for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            model = AutoModelForCausalLM.from_pretrained(
                golden_path.parent, attn_implementation="eager", **{dtype_key: dtype}
            ).to(args.device).eval()
            prefill = normalized_error(last_logits(model, prompt, args.device),
                                       torch.tensor(golden["prompt_last_logits"]))
            decode = normalized_error(last_logits(model, prompt + greedy[:31], args.device),
                                      torch.tensor(golden["final_logits"]))
            rows.append({"fixture": golden_path.parent.name, "dtype": name, "prompt": prefill,
                         "prompt_and_31_tokens": decode})
            print(f"{golden_path.parent.name:<18} {name:<9} {prefill:>10.3g} {decode:>10.3g}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
