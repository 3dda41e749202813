"""Builds the tiny Hugging Face checkpoints under tests/fixtures/models/ and their golden outputs.

Each fixture is a random-weight model saved with transformers' `save_pretrained` (config.json,
generation_config.json, safetensors), plus a golden.json that records what transformers computes
for a fixed prompt: the logits at the last prompt position, 32 greedy tokens, and the logits that
chose the last of them. The C++ parity tests load the same checkpoint and compare against these.

Everything is deterministic: fixed seeds for the weights and the prompts, one CPU thread so the
float32 reductions run in the same order each time.

Usage (from the repository root):
    tools/fixtures-env.sh && .venv-fixtures/bin/python tools/make_parity_fixtures.py
"""

import argparse
import dataclasses
import json
import math
import pathlib
import shutil
from typing import Optional

import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# transformers 5 (tools/make_parity_fixtures_tf5.py builds with it) renamed from_pretrained's
# torch_dtype to dtype, writes only safetensors (no safe_serialization switch) and keeps RoPE's base
# in rope_parameters (config.rope_scaling there) rather than in config.rope_theta.
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
FLOAT32 = {"dtype" if TRANSFORMERS_5 else "torch_dtype": torch.float32}

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "models"

GREEDY_STEPS = 32
# A greedy continuation with fewer distinct tokens than this is a degenerate loop that would let
# a broken forward pass match by luck; raise the fixture's init_std if it trips.
MIN_DISTINCT_TOKENS = 8
# Smallest allowed gap between the best and second-best logit at every greedy step, so a correct
# float32 implementation that sums in another order cannot pick a different token.
MIN_GREEDY_MARGIN = 1e-3

# Shape shared by all fixtures unless a fixture overrides it.
BASE_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    max_position_embeddings=256,
)


@dataclasses.dataclass
class Fixture:
    name: str
    model_cls: type[PreTrainedModel]
    config: PretrainedConfig
    seed: int  # seeds the weights; the prompt uses seed + 1
    # Std of the normal init of every non-norm parameter. At 0.1 and below (HF uses 0.02) greedy
    # decoding of a model this small loops on a few tokens; 0.2 gives varied continuations.
    init_std: float = 0.2
    prompt_len: int = 12
    save_dtype: torch.dtype = torch.float32  # dtype of the safetensors weights
    max_shard_size: Optional[str] = None  # set to split the checkpoint into several files
    # Greedy tokens by a KV-cached decode (the prompt in one call, then one token a call) instead of
    # full recompute: for RoPE that depends on the call (longrope picks its factors from the
    # call's longest position), where only the cached decode is what a server computes.
    cached_decode: bool = False


def fixtures() -> list[Fixture]:
    return [
        # GQA (2 query heads per KV head), untied LM head, 5 layers.
        Fixture(
            name="llama_gqa",
            model_cls=LlamaForCausalLM,
            config=LlamaConfig(
                **BASE_SHAPE,
                num_key_value_heads=2,
                head_dim=16,
                num_hidden_layers=5,
                rope_theta=10000.0,
                rms_norm_eps=1e-5,
                tie_word_embeddings=False,
            ),
            seed=1000,
        ),
        # q/k/v biases, LM head tied to the embedding (no lm_head.weight in the file), and a
        # single KV head, so TP=2 has more ranks than KV heads and must replicate it.
        # sliding_window stays at its default 4096 with use_sliding_window false, as in real Qwen2
        # configs; the sequences here are far shorter, so the window never applies.
        Fixture(
            name="qwen2_tied_bias",
            model_cls=Qwen2ForCausalLM,
            config=Qwen2Config(
                **BASE_SHAPE,
                num_key_value_heads=1,
                num_hidden_layers=3,
                tie_word_embeddings=True,
            ),
            seed=2000,
        ),
        # Llama 3.1 RoPE scaling. With head_dim 16, theta 5e5 and an original context of 64, the
        # 8 frequencies fall into all three branches (kept, smoothed, divided by factor); the
        # script checks that. 40 prompt tokens reach past the original context of 64 by the
        # end of the greedy continuation.
        Fixture(
            name="llama3_rope",
            model_cls=LlamaForCausalLM,
            config=LlamaConfig(
                **{**BASE_SHAPE, "max_position_embeddings": 1024},
                num_key_value_heads=2,
                head_dim=16,
                num_hidden_layers=2,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                rms_norm_eps=1e-5,
                tie_word_embeddings=False,
            ),
            seed=3000,
            prompt_len=40,
        ),
        # A checkpoint split into several safetensors files with an index.
        Fixture(
            name="mistral_sharded",
            model_cls=MistralForCausalLM,
            config=MistralConfig(
                **BASE_SHAPE,
                num_key_value_heads=2,
                num_hidden_layers=4,
                sliding_window=None,
                tie_word_embeddings=False,
            ),
            seed=4000,
            max_shard_size="300KB",
        ),
        # bfloat16 weights on disk; goldens come from the weights widened to float32, as the
        # C++ CPU path widens them at load.
        Fixture(
            name="llama_bf16",
            model_cls=LlamaForCausalLM,
            config=LlamaConfig(
                **BASE_SHAPE,
                num_key_value_heads=2,
                head_dim=16,
                num_hidden_layers=3,
                rope_theta=10000.0,
                rms_norm_eps=1e-5,
                tie_word_embeddings=False,
            ),
            seed=5000,
            init_std=0.15,  # at 0.2 this seed has a greedy near-tie
            save_dtype=torch.bfloat16,
        ),
    ]


def randomize_parameters(model: PreTrainedModel, std: float) -> None:
    """Overwrites transformers' init, which leaves biases at 0 and RMSNorm scales at exactly 1:
    a forward pass that skipped them would still match. Norm scales are drawn from [0.5, 1.5),
    everything else from N(0, std). A tied LM head is the embedding's parameter, set once."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, std)


def describe_llama3_rope(model: PreTrainedModel, config: PretrainedConfig) -> None:
    """Prints which RoPE frequencies llama3 scaling kept, smoothed or divided by the factor,
    and fails unless all three branches are exercised."""
    dim = config.head_dim
    theta = config.rope_scaling["rope_theta"] if TRANSFORMERS_5 else config.rope_theta
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaled = model.model.rotary_emb.inv_freq
    factor = config.rope_scaling["factor"]
    kinds = []
    for i, (b, s) in enumerate(zip(base.tolist(), scaled.tolist())):
        if s == b:
            kind = "kept"
        elif math.isclose(s, b / factor, rel_tol=1e-6):
            kind = "divided by factor"
        else:
            kind = "smoothed"
        kinds.append(kind)
        wavelength = 2 * math.pi / b
        print(f"    rope pair {i}: wavelength {wavelength:9.2f}  inv_freq {b:.6g} -> {s:.6g}  {kind}")
    missing = {"kept", "smoothed", "divided by factor"} - set(kinds)
    if missing:
        raise SystemExit(f"llama3 rope fixture does not exercise: {sorted(missing)}")


@torch.no_grad()
def greedy(model: PreTrainedModel, prompt: list[int], cached: bool = False) -> dict:
    """Greedy decoding by full recompute of the sequence each step (or, `cached`, by the prompt in
    one call and then one token a call over the KV cache): no generate(), so neither EOS nor
    generation_config can change the result."""
    ids = list(prompt)
    prompt_last_logits = final_logits = None
    min_margin = math.inf
    past = None
    for step in range(GREEDY_STEPS):
        if cached:
            out = model(torch.tensor([ids if past is None else ids[-1:]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
        else:
            logits = model(torch.tensor([ids])).logits[0, -1]
        if not torch.isfinite(logits).all():
            raise SystemExit(f"non-finite logits at greedy step {step}")
        top2 = torch.topk(logits, 2).values
        min_margin = min(min_margin, (top2[0] - top2[1]).item())
        if step == 0:
            prompt_last_logits = logits.tolist()
        if step == GREEDY_STEPS - 1:
            final_logits = logits.tolist()
        ids.append(int(torch.argmax(logits)))
    return {
        "prompt_last_logits": prompt_last_logits,
        "greedy_ids": ids[len(prompt) :],
        "final_logits": final_logits,
        "greedy_min_margin": min_margin,
    }


def write_golden(path: pathlib.Path, golden: dict) -> None:
    """One key per line. Logits are float32 values held in Python floats, so repr is exact."""
    lines = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in golden.items()]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def build(fixture: Fixture, out_root: pathlib.Path) -> None:
    out = out_root / fixture.name
    print(f"{fixture.name}:")
    if out.exists():
        shutil.rmtree(out)  # drop files a previous run may have written (e.g. other shard counts)

    # Build with random weights and save in the fixture's storage dtype.
    torch.manual_seed(fixture.seed)
    model = fixture.model_cls._from_config(fixture.config, attn_implementation="eager", **FLOAT32)
    randomize_parameters(model, fixture.init_std)
    model.to(fixture.save_dtype)
    save_kwargs = {"max_shard_size": fixture.max_shard_size} if fixture.max_shard_size else {}
    if not TRANSFORMERS_5:
        save_kwargs["safe_serialization"] = True
    model.save_pretrained(out, **save_kwargs)

    # Goldens come from the checkpoint as written, read back and computed in float32.
    model = fixture.model_cls.from_pretrained(out, attn_implementation="eager", **FLOAT32).eval()
    config = model.config
    if (getattr(config, "rope_scaling", None) or {}).get("rope_type") == "llama3":
        describe_llama3_rope(model, config)

    generator = torch.Generator().manual_seed(fixture.seed + 1)
    # A multimodal model's vocabulary is its text model's.
    prompt = torch.randint(1, config.get_text_config().vocab_size, (fixture.prompt_len,), generator=generator)
    prompt = prompt.tolist()
    write_checked_golden(
        out,
        fixture.name,
        model,
        prompt,
        {"model": fixture.name, "architecture": config.architectures[0]},
        fixture.cached_decode,
    )


def write_checked_golden(
    out: pathlib.Path, name: str, model: PreTrainedModel, prompt: list[int], fields: dict, cached: bool = False
) -> None:
    """Greedy-decodes `prompt`, refuses a degenerate continuation or a near-tie (which float
    rounding could flip), and writes out/golden.json: `fields`, the library versions, the prompt and
    the greedy tokens and logits. Shared by tools/make_quantized_fixtures.py."""
    result = greedy(model, prompt, cached)
    distinct = len(set(result["greedy_ids"]))
    margin = result["greedy_min_margin"]
    print(f"    greedy: {distinct} distinct of {GREEDY_STEPS}, min top-2 margin {margin:.4g}")
    if distinct < MIN_DISTINCT_TOKENS:
        raise SystemExit(f"{name}: degenerate greedy continuation; raise init_std or change the seed")
    if margin < MIN_GREEDY_MARGIN:
        raise SystemExit(f"{name}: near-tie in greedy decoding; change the seed")
    write_golden(
        out / "golden.json",
        {
            **fields,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "prompt_ids": prompt,
            **result,
        },
    )
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"    wrote {sorted(f.name for f in out.iterdir())}, {size} bytes")


def main(all_fixtures=fixtures, doc: str = __doc__, build_one=build) -> None:
    """Builds (build_one) the fixtures of all_fixtures() that the command line names (all by default)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=DEFAULT_OUT, help="fixtures root directory"
    )
    parser.add_argument("names", nargs="*", help="fixtures to build (default: all)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()  # silence init notices
    transformers.logging.disable_progress_bar()  # and the shard-loading bar
    chosen = [f for f in all_fixtures() if not args.names or f.name in args.names]
    unknown = set(args.names) - {f.name for f in chosen}
    if unknown:
        raise SystemExit(f"unknown fixtures: {sorted(unknown)}")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for fixture in chosen:
        build_one(fixture, args.out)


if __name__ == "__main__":
    main()
