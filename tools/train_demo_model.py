"""Trains the demo model under models/demo/: a small Llama on the King James Bible, on CPU.

`tools/demo.sh` serves this model on a local TP=2 x PP=2 cluster, so its shape is chosen for
that split: 4 layers (PP=2 gives 2 + 2), 2 KV heads (TP=2 gives each rank one), 6 query heads
(3 a rank), and a vocabulary, hidden and intermediate size that divide by 2. It is kept
small because the budget is compute, not size: 25 minutes of one shared CPU
core see ~1.4-2 M tokens, which a 2.4M-parameter model uses better than a larger one. It writes
readable, if repetitive, King James English, which makes a broken forward pass or tokenizer easy
to see.

What it does:
  1. Dumps the text of the King James Bible (public domain) from Debian's bible-kjv-text package
     with the package's own reader, `bible` (package bible-kjv): its data file is compressed in
     the reader's own format, so `bible` is the simplest way to read it. One verse per line.
  2. Trains a byte-level BPE tokenizer on it with Hugging Face `tokenizers` (GPT-2's ByteLevel
     pre-tokenizer and regex, ByteLevel decoder, <|begin_of_text|> / <|end_of_text|> as in
     Llama 3, a TemplateProcessing post-processor that prepends BOS).
  3. Trains a LlamaForCausalLM from scratch (AdamW, linear warm-up then cosine decay) on windows
     that start with BOS at the start of a verse, like a prompt does at inference time.
  4. Saves a standard Hugging Face directory with weights in bfloat16, reloads it in float32 and
     prints greedy and sampled completions, which also go into the directory's README.md.

Training stops at --steps or after --minutes of wall time, whichever comes first; the learning
rate schedule follows whichever of the two is further along, so a run cut by the clock still
ends its cosine decay. Seeds fix the data order and the initial weights; a run that --minutes
stops is only as reproducible as the machine's speed (pass --minutes 0 for a step-count-only
run).

Usage (from the repository root; about 25 minutes on one CPU core):
    tools/fixtures-env.sh && .venv-fixtures/bin/python tools/train_demo_model.py
"""

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "demo"

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
# The demo model's chat template (tokenizer_config.json), so that the OpenAI API's chat endpoint and
# tools/demo.sh can show a conversation. The vocabulary has no chat tokens: turns are plain text
# ("User: ...", "Assistant:"), which a model trained on prose continues as prose.
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] | capitalize }}: "
    "{{ message['content'] | trim }}\n\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")

PROMPTS = [
    "And the LORD said unto Moses,",
    "In the beginning",
    "Blessed are the",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    p.add_argument("--minutes", type=float, default=25.0, help="wall-clock budget for training; 0 = none")
    p.add_argument("--steps", type=int, default=4000, help="most optimizer steps")
    p.add_argument("--threads", type=int, default=1, help="torch and tokenizers threads (at most 2 on shared machines)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--new-tokens", type=int, default=60, help="tokens per sample completion")
    return p.parse_args()


# --- 1. The text --------------------------------------------------------------------------------

def read_kjv() -> list[str]:
    """Returns the 31,102 verses of the King James Bible, in order, without their references.

    `bible -f` (pretty-printing off) prints one verse per line as "Ge1:1 In the beginning ...",
    "1Sa3:4 That the LORD called Samuel ...": a book abbreviation, chapter:verse, a space, then
    the verse. The text itself has no other markup (no italics or footnotes), so dropping that
    reference is all it takes to leave plain prose.
    """
    if shutil.which("bible") is None:
        sys.exit("train_demo_model: `bible` not found; run tools/fixtures-env.sh (it installs bible-kjv)")
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, check=True).stdout
    reference = re.compile(r"^\d?[A-Za-z]+\d+:\d+ ")
    verses = []
    for line in out.splitlines():
        if not line.strip():
            continue
        m = reference.match(line)
        if m is None:
            sys.exit(f"train_demo_model: unexpected line from `bible -f`: {line[:80]!r}")
        verses.append(line[m.end():].strip())
    if len(verses) != 31102:
        sys.exit(f"train_demo_model: expected 31102 verses, got {len(verses)}")
    return verses


# --- 2. The tokenizer ---------------------------------------------------------------------------

def train_tokenizer(verses: list[str], vocab_size: int, max_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # GPT-2's byte-level scheme: the GPT-2 regex splits words (a leading space stays with its
    # word), every byte maps to a printable character, and no prefix space is added, so a prompt
    # starting with "And" at the start of a verse encodes as the training text does.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unknown
        show_progress=False,
    )
    tok.train_from_iterator((v + "\n" for v in verses), trainer=trainer, length=len(verses))
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()

    from transformers import PreTrainedTokenizerFast
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        add_bos_token=True,  # documents what the post-processor does; readers such as llama.cpp look here
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,  # decode must give back the text byte for byte
    )
    return hf_tok, bos_id, eos_id


# --- 3. Training --------------------------------------------------------------------------------

def build_stream(hf_tok, verses: list[str]):
    """Encodes each verse followed by its newline; returns the flat token stream and the stream
    offset where each verse starts."""
    import torch
    enc = hf_tok.backend_tokenizer.encode_batch([v + "\n" for v in verses], add_special_tokens=False)
    starts, ids = [], []
    for e in enc:
        starts.append(len(ids))
        ids.extend(e.ids)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.long)


def sample_batch(stream, starts, n: int, seq_len: int, bos_id: int, gen):
    """n windows of seq_len tokens: BOS, then the seq_len - 1 tokens from a random verse start."""
    import torch
    pick = starts[torch.randint(0, len(starts), (n,), generator=gen)]
    body = torch.stack([stream[s:s + seq_len - 1] for s in pick.tolist()])
    return torch.cat([torch.full((n, 1), bos_id, dtype=torch.long), body], dim=1)


def lr_at(step: int, progress: float, a: argparse.Namespace) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * cos)


def main() -> None:
    a = parse_args()
    # Before tokenizers loads: its Rust thread pool reads these once.
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if a.threads > 1 else "false"

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    transformers.logging.set_verbosity_error()
    t_start = time.time()

    verses = read_kjv()
    print(f"text: {len(verses)} verses, {sum(len(v) + 1 for v in verses) / 1e6:.2f} MB", flush=True)

    hf_tok, bos_id, eos_id = train_tokenizer(verses, a.vocab_size, 512)
    stream, starts = build_stream(hf_tok, verses)
    # The last 1% of verses (the end of Revelation) are held out to report a validation loss.
    split = int(len(verses) * 0.99)
    limit = len(stream) - a.seq_len  # every window must fit in the stream
    train_starts = starts[:split][starts[:split] + a.seq_len <= starts[split]]
    val_starts = starts[split:][starts[split:] <= limit]
    print(f"tokenizer: vocab {hf_tok.backend_tokenizer.get_vocab_size()}, {len(stream)} tokens "
          f"({sum(len(v) + 1 for v in verses) / len(stream):.2f} bytes/token); "
          f"{len(train_starts)} train / {len(val_starts)} val windows "
          f"({time.time() - t_start:.1f} s)", flush=True)

    config = LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        # Tied: the LM head is the embedding matrix, which saves vocab x hidden parameters (0.8M,
        # a third of this model), and makes the demo exercise the server's tied path (the last PP stage
        # loads its own slice of embed_tokens as its LM head).
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({n_params * 2 / 2**20:.1f} MiB in bfloat16)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(a.seed)
    val_gen = torch.Generator().manual_seed(a.seed + 1)
    val_batches = [sample_batch(stream, val_starts, a.batch, a.seq_len, bos_id, val_gen) for _ in range(4)]

    def val_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = [model(input_ids=x, labels=x).loss.item() for x in val_batches]
        model.train()
        return sum(losses) / len(losses)

    budget_s = a.minutes * 60
    t_train = time.time()
    model.train()
    step, running, last_loss = 0, 0.0, float("nan")
    while step < a.steps:
        elapsed = time.time() - t_train
        if budget_s > 0 and elapsed >= budget_s:
            print(f"stopping at the {a.minutes:g}-minute budget", flush=True)
            break
        progress = max(step / a.steps, elapsed / budget_s if budget_s > 0 else 0.0)
        lr = lr_at(step, progress, a)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sample_batch(stream, train_starts, a.batch, a.seq_len, bos_id, gen)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        running += loss.item()
        if step % a.log_every == 0:
            last_loss = running / a.log_every
            running = 0.0
            el = time.time() - t_train
            tok_s = step * a.batch * a.seq_len / el
            msg = f"step {step:5d}  loss {last_loss:.3f}  lr {lr:.2e}  {el / 60:5.1f} min  {tok_s:.0f} tok/s"
            if step % a.eval_every == 0:
                msg += f"  val {val_loss():.3f}"
            print(msg, flush=True)
    train_s = time.time() - t_train
    final_val = val_loss()
    tokens_seen = step * a.batch * a.seq_len
    print(f"trained {step} steps ({tokens_seen / 1e6:.2f} M tokens, {tokens_seen / len(stream):.2f} epochs) "
          f"in {train_s / 60:.1f} min; last train loss {last_loss:.3f}, val loss {final_val:.3f}", flush=True)

    # --- 4. Save, reload, sample ---------------------------------------------------------------
    out: pathlib.Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    for name in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "README.md"]:
        (out / name).unlink(missing_ok=True)
    model.eval()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out, legacy_format=False)
    (out / "special_tokens_map.json").unlink(missing_ok=True)  # tokenizer_config.json says it all
    # save_pretrained writes the class name without "Fast"; name the fast class, which is the one
    # tokenizer.json belongs to.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = DEMO_CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    (out / "model.safetensors").chmod(0o644)  # written 0600 by way of a temporary file
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16", cfg["torch_dtype"]
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert gen_cfg["bos_token_id"] == bos_id and gen_cfg["eos_token_id"] == eos_id, gen_cfg

    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(out)
    samples = []
    for i, prompt in enumerate(PROMPTS):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids[0, 0].item() == bos_id, "the tokenizer must prepend BOS"
        assert tok.decode(ids[0], skip_special_tokens=True) == prompt, "encode/decode must round-trip"
        greedy = generate(model, ids, a.new_tokens, eos_id)
        sampled = generate(model, ids, a.new_tokens, eos_id, temperature=0.8, top_k=40,
                           gen=torch.Generator().manual_seed(a.seed + i))
        g = tok.decode(greedy[0], skip_special_tokens=True)
        s = tok.decode(sampled[0], skip_special_tokens=True)
        samples.append((prompt, g, s))
        print(f"\n=== {prompt!r}\n--- greedy:\n{g}\n--- sampled (temperature 0.8, top_k 40):\n{s}", flush=True)

    write_model_card(out, a, cfg, n_params, step, tokens_seen, len(stream), train_s, last_loss,
                     final_val, samples[0])
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"\nsaved {out} ({size / 2**20:.2f} MiB); total wall time {(time.time() - t_start) / 60:.1f} min",
          flush=True)


def generate(model, ids, new_tokens: int, eos_id: int, temperature: float = 0.0, top_k: int = 0, gen=None):
    """Greedy (temperature 0) or top-k sampling, one full forward per token. transformers'
    generate() cannot run here: with Debian's torch 1.13 on Python 3.11 it fails importing
    torch.distributed.fsdp."""
    import torch
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=ids).logits[0, -1].float()
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                top = torch.topk(logits / temperature, top_k)
                probs = torch.softmax(top.values, dim=-1)
                nxt = int(top.indices[torch.multinomial(probs, 1, generator=gen)])
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            if nxt == eos_id:
                break
    return ids


def write_model_card(out, a, cfg, n_params, steps, tokens_seen, n_tokens, train_s, train_loss, val_loss,
                     sample) -> None:
    prompt, greedy, _ = sample
    text = f"""# shardserve demo model

A small Llama-architecture language model trained from scratch on the King James Bible, with its
own byte-level BPE tokenizer. `tools/demo.sh` serves it on a local TP=2 x PP=2 cluster on CPU.
It writes King James-style English: readable, repetitive, often ungrammatical, with no knowledge
of anything. It exists to make a broken forward pass or tokenizer visible, not to be useful.

## Shape

| | |
|---|---|
| architecture | LlamaForCausalLM, {n_params:,} parameters, weights in bfloat16 |
| layers | {cfg['num_hidden_layers']} (PP=2: 2 + 2) |
| hidden / intermediate | {cfg['hidden_size']} / {cfg['intermediate_size']} |
| attention | {cfg['num_attention_heads']} query heads, {cfg['num_key_value_heads']} KV heads (TP=2: one each), head_dim {cfg['hidden_size'] // cfg['num_attention_heads']} |
| vocabulary | {cfg['vocab_size']}, byte-level BPE (GPT-2 pre-tokenizer), BOS `{BOS}` = {cfg['bos_token_id']}, EOS `{EOS}` = {cfg['eos_token_id']} |
| context | {cfg['max_position_embeddings']} positions, RoPE theta {cfg['rope_theta']:g} |
| embeddings | tied (the LM head is `model.embed_tokens.weight`) |

## Training

- Text: the King James Version of the Bible (1611) as Debian's `bible-kjv-text` package ships
  it, read with its `bible` program, verse references removed, one verse per line; the last 1%
  of verses held out for validation.
- Tokenizer: Hugging Face `tokenizers` byte-level BPE trained on the same text
  ({n_tokens / 1e6:.2f} M tokens).
- Model: float32 on one CPU core; AdamW (betas 0.9/0.95, weight decay {a.weight_decay}), peak
  learning rate {a.lr:g}, {a.warmup} warm-up steps then cosine decay to {a.min_lr_ratio:g}x;
  batch {a.batch} x {a.seq_len} tokens, each window BOS + the text from a random verse start;
  seed {a.seed}.
- Run: {steps} steps, {tokens_seen / 1e6:.2f} M tokens ({tokens_seen / n_tokens:.1f} epochs), {train_s / 60:.0f} minutes;
  final training loss {train_loss:.2f}, validation loss {val_loss:.2f}.

Rebuild (from the repository root; the result differs in detail from machine to machine, since
the run stops on a wall-clock budget):

```sh
tools/fixtures-env.sh && .venv-fixtures/bin/python tools/train_demo_model.py
```

## License

The King James Bible is in the public domain (outside the United Kingdom, where the Crown's
letters patent still apply to printing it); Debian ships it as such. The model and tokenizer are
derived only from that text and from random initialisation.

## Sample

Greedy, {a.new_tokens} new tokens, transformers in float32:

```
{greedy}
```
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
