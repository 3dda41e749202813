"""Checkpoints of every served family, with sizes no test uses, against transformers' greedy tokens.

For each family (Llama 3.x, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 text, Gemma 3 as published
(Gemma3ForConditionalGeneration), Phi-3, Phi-4-mini) this draws sizes at random from --seed
(printed; a run with the same seed draws the same): query and KV head counts with odd GQA ratios,
head dims that are not powers of two, a vocabulary that is not one, hidden and intermediate sizes
that TP=2 splits, and the family's own knobs (RoPE scaling, sliding windows shorter than the
sequence, soft-capping, tied or untied heads, float32 or bfloat16 weights). It makes a random-weight
model with transformers 5, saves it with save_pretrained, takes transformers' greedy tokens for a
random prompt (float32, eager attention, the weights as saved; a KV-cached decode for LongRoPE,
whose factors transformers picks per call), then serves the checkpoint with `shardserve launch`
(a coordinator and TP x PP CPU workers on 127.0.0.1) in every layout of --layouts and compares
`shardserve generate`'s tokens. A draw whose greedy tokens have a near-tie or loop on a few tokens
is redrawn (with the next weight seed) and says so; one that never settles is reported, not passed.

Usage (from the repository root, after building shardserve, shardserve-coordinator and
shardserve-worker; needs transformers 5: tools/fixtures5-env.sh):
    .venv-fixtures5/bin/python tools/check_family_sizes.py [--seed S] [--bin build-cpu/bin]
        [--families llama3,gemma3_cg,...] [--layouts tp1xpp1,tp2xpp1,tp1xpp2,tp2xpp2]
Exit status 0 when every family matched in every layout.
"""

import argparse
import dataclasses
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import make_parity_fixtures  # noqa: E402  (greedy decoding, random weights, the checks on them)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYOUTS = ["tp1xpp1", "tp2xpp1", "tp1xpp2", "tp2xpp2"]
# Phi3Config's special tokens default to 32000 and up, outside a small vocabulary.
PHI_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
ATTEMPTS = 8  # weight seeds tried per family before a draw is reported as unusable
# The smallest sliding_window the server takes (model/config.cc); drawn windows lie just above it,
# under sequences (prompt + 32 greedy tokens) that pass them.
MIN_WINDOW = 32
START_TIMEOUT_S = 180
GENERATE_TIMEOUT_S = 120


@dataclasses.dataclass
class Draw:
    family: str
    model_cls: type
    config: object
    save_dtype: torch.dtype
    prompt_len: int
    cached: bool  # greedy by KV-cached decode (LongRoPE)
    sizes: str    # what was drawn, printed


def pick_heads(rng: random.Random) -> tuple[int, int]:
    """KV heads 1, 2 or 4 (TP=2 divides them or is divided by them), GQA ratio 1 to 5 (3 and 5
    odd), query heads even so that TP=2 splits them."""
    while True:
        kv = rng.choice([1, 2, 4])
        ratio = rng.choice([1, 2, 3, 5])
        if (kv * ratio) % 2 == 0 and kv * ratio <= 12:
            return kv * ratio, kv


def pick_vocab(rng: random.Random) -> int:
    while True:
        v = rng.randrange(257, 700)
        if v & (v - 1):
            return v


def even(rng: random.Random, lo: int, hi: int) -> int:
    """An even number in [lo, hi) that is not a power of two."""
    while True:
        n = rng.randrange(lo, hi) & ~1
        if n >= lo and n & (n - 1):
            return n


def hidden_for(rng: random.Random, heads: int) -> int:
    """A hidden size of its own (the head dim is given apart), even and a multiple of the query heads
    (transformers' configs check that)."""
    return heads * rng.choice([k for k in range(4, 40) if heads * k % 2 == 0 and 40 <= heads * k <= 160])


def draw(family: str, rng: random.Random) -> Draw:
    heads, kv = pick_heads(rng)
    # A head dim that is not a power of two, with heads x head_dim (the hidden size of the families
    # that derive one from the other) from 48 to 240: narrower random models loop on a token.
    head_dim = rng.choice([d for d in (8, 12, 20, 24, 40) if 48 <= heads * d <= 240])
    vocab = pick_vocab(rng)
    inter = even(rng, 48, 200)
    layers = rng.randrange(2, 5)
    tie = rng.random() < 0.5
    save_dtype = rng.choice([torch.float32, torch.bfloat16])
    prompt_len = rng.randrange(8, 24)
    cached = False
    common = dict(vocab_size=vocab, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                  num_hidden_layers=layers, max_position_embeddings=1024)
    if family == "llama3":
        original = rng.choice([32, 48, 64])
        config = LlamaConfig(hidden_size=heads * head_dim, head_dim=head_dim, tie_word_embeddings=tie,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": original}, **common)
        cls = LlamaForCausalLM
    elif family == "qwen2":
        config = Qwen2Config(hidden_size=heads * head_dim, tie_word_embeddings=tie,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)
        cls = Qwen2ForCausalLM
    elif family == "qwen3":
        config = Qwen3Config(hidden_size=hidden_for(rng, heads), head_dim=head_dim, tie_word_embeddings=tie,
                             attention_bias=rng.random() < 0.5,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)
        cls = Qwen3ForCausalLM
    elif family == "mistral":
        prompt_len = rng.randrange(MIN_WINDOW + 4, MIN_WINDOW + 24)
        config = MistralConfig(hidden_size=heads * head_dim, head_dim=head_dim, tie_word_embeddings=tie,
                               sliding_window=rng.randrange(MIN_WINDOW, MIN_WINDOW + 8), **common)
        cls = MistralForCausalLM
    elif family == "gemma2":
        prompt_len = rng.randrange(MIN_WINDOW + 4, MIN_WINDOW + 24)
        config = Gemma2Config(hidden_size=hidden_for(rng, heads), head_dim=head_dim, tie_word_embeddings=False,
                              query_pre_attn_scalar=rng.choice([head_dim, 2 * head_dim, 48]),
                              attn_logit_softcapping=float(rng.randrange(5, 50)),
                              final_logit_softcapping=float(rng.randrange(5, 30)),
                              sliding_window=rng.randrange(MIN_WINDOW, MIN_WINDOW + 8), **common)
        cls = Gemma2ForCausalLM
    elif family in ("gemma3", "gemma3_cg"):
        prompt_len = rng.randrange(MIN_WINDOW + 4, MIN_WINDOW + 24)
        text = dict(common, num_hidden_layers=rng.randrange(6, 8), hidden_size=hidden_for(rng, heads), head_dim=head_dim,
                    query_pre_attn_scalar=rng.choice([head_dim, 2 * head_dim, 48]),
                    sliding_window=rng.randrange(MIN_WINDOW, MIN_WINDOW + 8),
                    rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                        "factor": float(rng.choice([2, 4, 8]))},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
        if family == "gemma3":
            config = Gemma3TextConfig(tie_word_embeddings=tie, **text)
            cls = Gemma3ForCausalLM
        else:  # as published: tied, a vision tower beside it
            config = Gemma3Config(text_config=dict(text, tie_word_embeddings=True),
                                  vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=28, patch_size=14),
                                  mm_tokens_per_image=4)
            cls = Gemma3ForConditionalGeneration
    elif family == "phi3":
        config = Phi3Config(hidden_size=heads * head_dim, tie_word_embeddings=False, **PHI_TOKENS,
                            rope_parameters={"rope_type": "default", "rope_theta": 250000.0}, **common)
        cls = Phi3ForCausalLM
    elif family == "phi4_mini":
        # Partial rotary 0.75 (an even rotary dim: head_dim a multiple of 8) with LongRoPE crossing
        # its original context of 32 within the sequence.
        head_dim = rng.choice([16, 24, 40])
        half = head_dim * 3 // 4 // 2
        factors = lambda lo, hi: [round(lo * (hi / lo) ** (i / (half - 1)), 4) for i in range(half)]  # noqa: E731
        config = Phi3Config(hidden_size=heads * head_dim, tie_word_embeddings=True, **PHI_TOKENS,
                            **dict(common, max_position_embeddings=4096),
                            original_max_position_embeddings=32, partial_rotary_factor=0.75,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                             "short_factor": factors(1.0, 1.5), "long_factor": factors(1.0, 24.0),
                                             "partial_rotary_factor": 0.75})
        cls = Phi3ForCausalLM
        cached = True
    else:
        raise SystemExit(f"unknown family {family}")
    text_config = config.get_text_config()
    sizes = (f"vocab {text_config.vocab_size}, hidden {text_config.hidden_size}, "
             f"intermediate {text_config.intermediate_size}, {text_config.num_hidden_layers} layers, "
             f"{text_config.num_attention_heads} query / {text_config.num_key_value_heads} KV heads of "
             f"{getattr(text_config, 'head_dim', None) or text_config.hidden_size // text_config.num_attention_heads}, "
             f"tied {config.tie_word_embeddings if family != 'gemma3_cg' else True}, "
             f"{str(save_dtype).replace('torch.', '')}, prompt {prompt_len}")
    return Draw(family, cls, config, save_dtype, prompt_len, cached, sizes)


def save_and_decode(d: Draw, out: pathlib.Path, seed: int) -> dict | str:
    """Saves a random-weight checkpoint at `out` and returns transformers' greedy decode, or why the
    draw is unusable (a near-tie or a loop)."""
    if out.exists():
        shutil.rmtree(out)
    torch.manual_seed(seed)
    model = d.model_cls._from_config(d.config, attn_implementation="eager", **make_parity_fixtures.FLOAT32)
    make_parity_fixtures.randomize_parameters(model, 0.2)
    text = d.config.get_text_config()
    if d.family.startswith("gemma") and text.tie_word_embeddings:
        # Gemma scales the embeddings by sqrt(hidden): at the others' std they swamp the residual
        # stream, and a tied head then repeats the last token. Drawn 2 / sqrt(hidden) narrower, a
        # token's embedding enters at std 0.4.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(2 / text.hidden_size ** 0.5)
    model.to(d.save_dtype)
    model.save_pretrained(out)
    model = d.model_cls.from_pretrained(out, attn_implementation="eager", **make_parity_fixtures.FLOAT32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(1, model.config.get_text_config().vocab_size, (d.prompt_len,), generator=generator).tolist()
    result = make_parity_fixtures.greedy(model, prompt, d.cached)
    if len(set(result["greedy_ids"])) < make_parity_fixtures.MIN_DISTINCT_TOKENS:
        return "a greedy loop"
    if result["greedy_min_margin"] < make_parity_fixtures.MIN_GREEDY_MARGIN:
        return f"a near-tie (top-2 margin {result['greedy_min_margin']:.2g})"
    result["prompt_ids"] = prompt
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_generate(bin_dir: pathlib.Path, model_dir: pathlib.Path, layout: str, prompt: list[int], steps: int,
                       log_dir: pathlib.Path) -> list[int] | str:
    """Starts `shardserve launch` in `layout` ("tp2xpp1"), generates `steps` greedy tokens, stops it.
    Returns the tokens or what went wrong."""
    tp, pp = (int(x) for x in re.fullmatch(r"tp(\d+)xpp(\d+)", layout).groups())
    address = f"127.0.0.1:{free_port()}"
    shardserve = str(bin_dir / "shardserve")
    threads = max(1, (os.cpu_count() or 1) // (tp * pp))
    launch = subprocess.Popen(
        [shardserve, "launch", "--model", str(model_dir), "--nodes", str(pp), "--gpus-per-node", str(tp),
         "--device", "cpu", "--insecure", "--address", address, "--http-port", "0", "--metrics-port-base", "0",
         "--worker-matmul-dtype", "f32", "--worker-threads", str(threads), "--log-dir", str(log_dir)],
        stdout=subprocess.DEVNULL, stderr=open(log_dir.parent / f"{log_dir.name}.launch.log", "w"),
        start_new_session=True)
    client = ["--address", address, "--insecure"]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while subprocess.run([shardserve, "status", *client], capture_output=True).returncode != 0:
            if launch.poll() is not None:
                return f"launch exited with {launch.returncode} (logs in {log_dir})"
            if time.monotonic() > deadline:
                return f"not serving after {START_TIMEOUT_S} s (logs in {log_dir})"
            time.sleep(0.5)
        r = subprocess.run([shardserve, "generate", *client, "--prompt-ids", ",".join(map(str, prompt)),
                            "--max-tokens", str(steps), "--ignore-eos", "--show-ids"],
                           capture_output=True, text=True, timeout=GENERATE_TIMEOUT_S)
        if r.returncode != 0:
            return f"generate failed: {r.stderr.strip()[-400:]}"
        return [int(x) for x in re.findall(r"\[(\d+)\]", r.stdout)]
    finally:
        if launch.poll() is None:
            launch.send_signal(signal.SIGTERM)
            try:
                launch.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(launch.pid, signal.SIGKILL)
                launch.wait()


def main() -> int:
    families = ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gemma3_cg", "phi3", "phi4_mini"]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="draws the sizes (default: a random one, printed)")
    parser.add_argument("--bin", type=pathlib.Path, default=REPO_ROOT / "build-cpu" / "bin")
    parser.add_argument("--families", default=",".join(families))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--keep", type=pathlib.Path, help="keep the checkpoints and logs here")
    args = parser.parse_args()
    if int(transformers.__version__.split(".")[0]) < 5:
        raise SystemExit(f"transformers {transformers.__version__}: this needs 5 (tools/fixtures5-env.sh)")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    chosen = args.families.split(",")
    layouts = args.layouts.split(",")
    unknown = set(chosen) - set(families)
    if unknown:
        raise SystemExit(f"unknown families {sorted(unknown)}; known: {families}")
    for layout in layouts:
        if not re.fullmatch(r"tp\d+xpp\d+", layout):
            raise SystemExit(f"layout {layout!r} is not tpNxppM")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    print(f"check_family_sizes: seed {seed}, transformers {transformers.__version__}, torch {torch.__version__}")
    work = args.keep or pathlib.Path(tempfile.mkdtemp(prefix="check_family_sizes_"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        for i, family in enumerate(chosen):
            rng = random.Random(f"{seed}/{family}")
            d = draw(family, rng)
            print(f"{family}: {d.model_cls.__name__}, {d.sizes}", flush=True)
            golden = None
            for attempt in range(ATTEMPTS):
                weight_seed = seed * 100 + i * 10 + attempt
                golden = save_and_decode(d, work / family, weight_seed)
                if isinstance(golden, dict):
                    break
                print(f"    weight seed {weight_seed}: {golden}; redrawn", flush=True)
            if not isinstance(golden, dict):
                results[family] = {layout: f"no usable draw ({golden})" for layout in layouts}
                continue
            steps = len(golden["greedy_ids"])
            results[family] = {}
            for layout in layouts:
                got = serve_and_generate(args.bin, work / family, layout, golden["prompt_ids"], steps,
                                         work / f"{family}.{layout}.logs")
                if isinstance(got, str):
                    verdict = got
                elif got == golden["greedy_ids"]:
                    verdict = "ok"
                else:
                    first = next((j for j, (a, b) in enumerate(zip(got, golden["greedy_ids"])) if a != b), len(got))
                    verdict = f"differs from token {first}: {got} vs transformers' {golden['greedy_ids']}"
                results[family][layout] = verdict
                print(f"    {layout}: {verdict if verdict != 'ok' else f'{steps} greedy tokens equal transformers'}",
                      flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    passed = sum(v == "ok" for r in results.values() for v in r.values())
    total = len(chosen) * len(layouts)
    print(f"check_family_sizes: seed {seed}: {passed} of {total} family x layout runs equal transformers' greedy "
          f"tokens ({len(chosen)} families x {len(layouts)} layouts)")
    for family, r in results.items():
        bad = [layout for layout, v in r.items() if v != "ok"]
        if bad:
            print(f"    {family}: failed in {', '.join(bad)}")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
