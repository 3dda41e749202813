"""Builds the parity fixtures whose checkpoints transformers 5 writes (tests/fixtures/models/*_tf5):
config.json as current releases save it, RoPE in "rope_parameters" (base and scaling together),
"dtype" for "torch_dtype", "layer_types" where the family has it; and the families that need
transformers 5 to run at all (Qwen3), one of them with its config.json rewritten as transformers 4.x
wrote it (rope_theta, torch_dtype), checked to read back as the same config; Phi-3's fused
qkv_proj and gate_up_proj; Mistral's sliding window, shorter than the prompt; Gemma 2; the RoPE
types linear, yarn and longrope (Phi-3.5- and Phi-4-mini-shaped, the latter with partial rotary),
longrope's goldens by cached decode; the mixtures of experts (Qwen3-MoE with dense layers among
sparse ones, Mixtral, Qwen2-MoE with its shared expert); Gemma 3 as published (Gemma3ForConditionalGeneration: the text
model in text_config beside a tiny vision tower), goldens by its text-only forward, saved by
transformers 5 (tensors under language_model.model.) and rewritten as transformers 4.52-4.57 saved
it (model.language_model., config.json in the 4.x format; transformers 4.49 of tools/fixtures-env.sh
has no Gemma 3), the rewrite read back by transformers 5 to the same greedy tokens and logits. The checkpoint,
golden.json and their checks are those of tools/make_parity_fixtures.py (random weights, 32 greedy
tokens, logits, no near-ties), with sizes no other fixture uses; make_parity_fixtures.py's build
and command line.

Usage (from the repository root):
    tools/fixtures5-env.sh && .venv-fixtures5/bin/python tools/make_parity_fixtures_tf5.py
"""

import dataclasses
import json
import pathlib

import torch
import transformers
from transformers import (
    AutoConfig,
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
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import make_parity_fixtures
from make_parity_fixtures import Fixture


# Gemma 3 27B's RoPE per layer type: the global layers base 1e6 with linear scaling 8, the sliding
# ones base 1e4.
GEMMA3_27B_ROPE = {
    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}


def fixtures() -> list[Fixture]:
    return [
        # Llama 3.1 RoPE (llama3 scaling, theta 5e5) written in rope_parameters, as a Llama 3 checkpoint
        # saved by transformers 5 has it; 3 query heads per KV head, head_dim 16, 2 layers.
        Fixture(
            name="llama3_rope_tf5",
            model_cls=LlamaForCausalLM,
            config=LlamaConfig(
                vocab_size=384,
                hidden_size=96,
                intermediate_size=160,
                num_attention_heads=6,
                num_key_value_heads=2,
                head_dim=16,
                num_hidden_layers=2,
                max_position_embeddings=2048,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
            ),
            seed=6000,
            prompt_len=40,
        ),
        # Qwen2 with its RoPE base 1e6 in rope_parameters, q/k/v biases, tied LM head, bf16 weights,
        # "layer_types" (all full attention) as transformers 5 writes for it.
        Fixture(
            name="qwen2_tf5",
            model_cls=Qwen2ForCausalLM,
            config=Qwen2Config(
                vocab_size=448,
                hidden_size=128,
                intermediate_size=144,
                num_attention_heads=8,
                num_key_value_heads=2,
                num_hidden_layers=3,
                max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=True,
            ),
            seed=7000,
            init_std=0.15,
            save_dtype=torch.bfloat16,
        ),
        # Qwen3: q_norm / k_norm per head before RoPE, an explicit head_dim (4 heads x 32 = 128, wider
        # than hidden 80), tied LM head, bf16 weights.
        Fixture(
            name="qwen3_tf5",
            model_cls=Qwen3ForCausalLM,
            config=Qwen3Config(
                vocab_size=352,
                hidden_size=80,
                intermediate_size=192,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                num_hidden_layers=3,
                max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=True,
            ),
            seed=8000,
            save_dtype=torch.bfloat16,
        ),
        # Qwen3 with q/k/v biases (attention_bias), an untied LM head and float32 weights; its
        # config.json rewritten as transformers 4.x wrote it (LegacyConfigFixture).
        LegacyConfigFixture(
            name="qwen3_tf4",
            model_cls=Qwen3ForCausalLM,
            config=Qwen3Config(
                vocab_size=320,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=6,
                num_key_value_heads=2,
                head_dim=24,
                num_hidden_layers=2,
                max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 250000.0},
                attention_bias=True,
                tie_word_embeddings=False,
            ),
            seed=9000,
        ),
        # Phi-3 / Phi-4: q, k and v fused in qkv_proj, gate and up in gate_up_proj; 6 query / 2 KV
        # heads, RoPE base 2.5e5 as Phi-4's, untied.
        Fixture(
            name="phi3_tf5",
            model_cls=Phi3ForCausalLM,
            config=Phi3Config(
                vocab_size=400,
                hidden_size=96,
                intermediate_size=160,
                num_attention_heads=6,
                num_key_value_heads=2,
                num_hidden_layers=3,
                max_position_embeddings=1024,
                original_max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 250000.0},
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=None,
                tie_word_embeddings=False,
            ),
            seed=10000,
        ),
        # Mistral with a sliding window of 32 (the smallest config.json may give) under a 48-token
        # prompt and 32 greedy tokens: every position past 31 attends to its window only.
        Fixture(
            name="mistral_window_tf5",
            model_cls=MistralForCausalLM,
            config=MistralConfig(
                vocab_size=416,
                hidden_size=64,
                intermediate_size=112,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_hidden_layers=2,
                max_position_embeddings=1024,
                sliding_window=32,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                tie_word_embeddings=False,
            ),
            seed=11000,
            prompt_len=48,
        ),
        # Gemma 2: (1 + w) RMSNorms, four a layer; embeddings times sqrt(hidden); GeGLU with tanh
        # gelu; attention scaled by query_pre_attn_scalar 24 (not head_dim 32) and soft-capped at 5;
        # even layers sliding within 32 under a 48-token prompt; logits soft-capped at 8. Untied: with
        # random weights a tied head over embeddings scaled by 8 repeats the last token.
        Fixture(
            name="gemma2_tf5",
            model_cls=Gemma2ForCausalLM,
            config=Gemma2Config(
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                num_hidden_layers=4,
                max_position_embeddings=1024,
                query_pre_attn_scalar=24,
                sliding_window=32,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=8.0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                tie_word_embeddings=False,
            ),
            seed=12000,
            prompt_len=48,
        ),
        # Phi-3.5-shaped LongRoPE: original context 32 (at the top level, where Phi-3.5 has it) under
        # a 12-token prompt and 32 greedy tokens, so the decode crosses it: positions from 32 on take
        # the long factors; attention factor sqrt(1 + ln(4096 / 32) / ln 32) on cos and sin. Goldens
        # by cached decode (longrope picks its factors per forward call in transformers).
        Fixture(
            name="phi3_longrope_tf5",
            model_cls=Phi3ForCausalLM,
            config=Phi3Config(
                vocab_size=432,
                hidden_size=96,
                intermediate_size=176,
                num_attention_heads=6,
                num_key_value_heads=2,
                num_hidden_layers=2,
                max_position_embeddings=4096,
                original_max_position_embeddings=32,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": longrope_factors(8, 1.0, 1.3),
                    "long_factor": longrope_factors(8, 1.0, 40.0),
                },
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=None,
                tie_word_embeddings=False,
            ),
            seed=13000,
            cached_decode=True,
        ),
        # Phi-4-mini-shaped: partial_rotary_factor 0.75 (RoPE on 24 of head_dim 32, the rest passed
        # through) with LongRoPE crossing its original context 32 as above; tied LM head, bf16.
        Fixture(
            name="phi4_mini_tf5",
            model_cls=Phi3ForCausalLM,
            config=Phi3Config(
                vocab_size=464,
                hidden_size=128,
                intermediate_size=160,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_hidden_layers=2,
                max_position_embeddings=4096,
                original_max_position_embeddings=32,
                partial_rotary_factor=0.75,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.75,
                    "short_factor": longrope_factors(12, 1.0, 1.2),
                    "long_factor": longrope_factors(12, 1.0, 24.0),
                },
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=None,
                tie_word_embeddings=True,
            ),
            seed=14000,
            save_dtype=torch.bfloat16,
            cached_decode=True,
        ),
        # Llama with YaRN (factor 4 over an original context of 2048, head_dim 32): frequencies 0-3
        # kept, 4-10 blended, 11-15 divided by 4 (correction range [4, 11]); attention factor
        # 0.1 ln 4 + 1 on cos and sin.
        Fixture(
            name="llama_yarn_tf5",
            model_cls=LlamaForCausalLM,
            config=LlamaConfig(
                vocab_size=368,
                hidden_size=112,
                intermediate_size=144,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                num_hidden_layers=2,
                max_position_embeddings=8192,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 2048,
                },
                tie_word_embeddings=False,
            ),
            seed=15001,
        ),
        # Llama with linear RoPE scaling (factor 4): every frequency divided by 4; head_dim 12.
        Fixture(
            name="llama_linear_tf5",
            model_cls=LlamaForCausalLM,
            config=LlamaConfig(
                vocab_size=336,
                hidden_size=72,
                intermediate_size=120,
                num_attention_heads=6,
                num_key_value_heads=2,
                num_hidden_layers=2,
                max_position_embeddings=1024,
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                tie_word_embeddings=False,
            ),
            seed=16000,
        ),
        # Gemma 3 text: Gemma 2's layer with q_norm / k_norm per head ((1 + w), before RoPE), no
        # soft-capping, layer_types five sliding (window 32, under a 48-token prompt) to one global
        # over 6 layers, and a RoPE per layer type: the global layer base 1e6 with linear scaling 8
        # (as the 27B), the sliding ones base 1e4; attention scaled by query_pre_attn_scalar 48.
        Fixture(
            name="gemma3_tf5",
            model_cls=Gemma3ForCausalLM,
            config=Gemma3TextConfig(
                vocab_size=480,
                hidden_size=64,
                intermediate_size=96,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                num_hidden_layers=6,
                max_position_embeddings=1024,
                query_pre_attn_scalar=48,
                sliding_window=32,
                rope_parameters=GEMMA3_27B_ROPE,
                tie_word_embeddings=False,
            ),
            seed=17000,
            prompt_len=48,
        ),
        # Gemma 3 with its config.json as transformers 4.x wrote it: rope_theta 1e6 (global),
        # rope_local_base_freq 1e4 (sliding), rope_scaling null, sliding_window_pattern 2 for
        # layer_types (sliding, full, sliding, full), torch_dtype; q/k/v/o biases, bf16 weights.
        LegacyConfigFixture(
            name="gemma3_tf4",
            model_cls=Gemma3ForCausalLM,
            config=Gemma3TextConfig(
                vocab_size=496,
                hidden_size=96,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=32,
                num_hidden_layers=4,
                max_position_embeddings=1024,
                query_pre_attn_scalar=32,
                sliding_window=32,
                sliding_window_pattern=2,
                attention_bias=True,
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
                tie_word_embeddings=False,
            ),
            seed=18000,
            prompt_len=48,
            save_dtype=torch.bfloat16,
            legacy_fields={"sliding_window_pattern": 2},
        ),
        # Qwen3-MoE: 5 experts (odd), 2 a token renormalised (norm_topk_prob), experts of 32 beside a
        # dense MLP of 64 in layer 1 (mlp_only_layers), 3 layers, 4 query / 2 KV heads, float32.
        Fixture(
            name="qwen3_moe_tf5",
            model_cls=Qwen3MoeForCausalLM,
            config=Qwen3MoeConfig(
                vocab_size=256,
                hidden_size=48,
                intermediate_size=64,
                moe_intermediate_size=32,
                num_experts=5,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[1],
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_hidden_layers=3,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=False,
            ),
            seed=26000,
        ),
        # Qwen3-MoE: 7 experts, 3 a token not renormalised, decoder_sparse_step 2 (layers 1 and 3
        # sparse, 0 and 2 dense), tied LM head, bfloat16 weights.
        Fixture(
            name="qwen3_moe_bf16_tf5",
            model_cls=Qwen3MoeForCausalLM,
            config=Qwen3MoeConfig(
                vocab_size=320,
                hidden_size=64,
                intermediate_size=80,
                moe_intermediate_size=32,
                num_experts=7,
                num_experts_per_tok=3,
                norm_topk_prob=False,
                decoder_sparse_step=2,
                mlp_only_layers=[],
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_hidden_layers=4,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=True,
            ),
            seed=27000,
            save_dtype=torch.bfloat16,
        ),
        # Mixtral: 3 experts, 2 a token (always renormalised) in every layer, each expert
        # intermediate_size 32 wide, under block_sparse_moe's names (w1, w3, w2), float32.
        Fixture(
            name="mixtral_tf5",
            model_cls=MixtralForCausalLM,
            config=MixtralConfig(
                vocab_size=288,
                hidden_size=48,
                intermediate_size=32,
                num_local_experts=3,
                num_experts_per_tok=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_hidden_layers=2,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=False,
            ),
            seed=28000,
        ),
        # Mixtral with 5 experts, 3 a token, 3 layers, bfloat16 weights.
        Fixture(
            name="mixtral_bf16_tf5",
            model_cls=MixtralForCausalLM,
            config=MixtralConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=32,
                num_local_experts=5,
                num_experts_per_tok=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_hidden_layers=3,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=False,
            ),
            seed=29000,
            save_dtype=torch.bfloat16,
        ),
        # Qwen2-MoE: 5 experts of 32, 2 a token not renormalised, a shared expert of 32 gated per token,
        # layer 2 dense (mlp_only_layers), no q/k/v biases (qkv_bias false), float32.
        Fixture(
            name="qwen2_moe_tf5",
            model_cls=Qwen2MoeForCausalLM,
            config=Qwen2MoeConfig(
                vocab_size=256,
                hidden_size=48,
                intermediate_size=48,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                num_experts=5,
                num_experts_per_tok=2,
                norm_topk_prob=False,
                decoder_sparse_step=1,
                mlp_only_layers=[2],
                qkv_bias=False,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_hidden_layers=3,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=False,
            ),
            seed=30000,
        ),
        # Qwen2-MoE: 7 experts, 3 a token renormalised, shared expert of 48, decoder_sparse_step 2
        # (layers 1 and 3 sparse), q/k/v biases (qkv_bias's default), tied LM head, bfloat16 weights.
        Fixture(
            name="qwen2_moe_bf16_tf5",
            model_cls=Qwen2MoeForCausalLM,
            config=Qwen2MoeConfig(
                vocab_size=288,
                hidden_size=64,
                intermediate_size=80,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                num_experts=7,
                num_experts_per_tok=3,
                norm_topk_prob=True,
                decoder_sparse_step=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_hidden_layers=4,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=True,
            ),
            seed=31000,
            save_dtype=torch.bfloat16,
        ),
        # Gemma 3 as google/gemma-3-*-it publish it: Gemma3ForConditionalGeneration, the text model
        # in text_config (LM head tied to the embedding, five sliding layers to one global, the
        # global RoPE linear 8 as the 27B's), a one-layer vision tower and projector that text-only
        # serving leaves unread. Saved by transformers 5: tensors under language_model.model.
        Fixture(
            name="gemma3_cg_tf5",
            model_cls=Gemma3ForConditionalGeneration,
            config=Gemma3Config(
                text_config=dict(
                    vocab_size=432,
                    hidden_size=72,
                    intermediate_size=112,
                    num_attention_heads=6,
                    num_key_value_heads=2,
                    head_dim=24,
                    num_hidden_layers=6,
                    max_position_embeddings=1024,
                    query_pre_attn_scalar=24,
                    sliding_window=32,
                    rope_parameters=GEMMA3_27B_ROPE,
                    tie_word_embeddings=True,
                ),
                vision_config=TINY_VISION,
                mm_tokens_per_image=4,
            ),
            seed=19000,
            prompt_len=48,
        ),
        # The same architecture with its tensors under model.language_model. and config.json in the
        # 4.x format (rope_theta, rope_local_base_freq, sliding_window_pattern 2, torch_dtype), as
        # transformers 4.52-4.57 saved it; bf16 weights, 4 query heads to 1 KV head.
        RelayoutFixture(
            name="gemma3_cg_tf4",
            model_cls=Gemma3ForConditionalGeneration,
            config=Gemma3Config(
                text_config=dict(
                    vocab_size=368,
                    hidden_size=64,
                    intermediate_size=240,
                    num_attention_heads=4,
                    num_key_value_heads=1,
                    head_dim=16,
                    num_hidden_layers=4,
                    max_position_embeddings=1024,
                    query_pre_attn_scalar=16,
                    sliding_window=32,
                    sliding_window_pattern=2,
                    rope_parameters={
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    },
                    tie_word_embeddings=True,
                ),
                vision_config=TINY_VISION,
                mm_tokens_per_image=4,
            ),
            seed=20000,
            prompt_len=48,
            save_dtype=torch.bfloat16,
            legacy_fields={"sliding_window_pattern": 2},
        ),
    ]


# A SigLIP tower of one layer on 28 x 28 images (4 patches): present in the checkpoint, never read.
TINY_VISION = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)


def longrope_factors(n: int, low: float, high: float) -> list[float]:
    """LongRoPE factors rising from `low` to `high` over the n frequencies, as published ones do
    (small for the fast-turning pairs, large for the slow ones), rounded to 4 places."""
    return [round(low * (high / low) ** (i / (n - 1)), 4) for i in range(n)]


@dataclasses.dataclass
class LegacyConfigFixture(Fixture):
    """A fixture whose config.json is rewritten after the build as transformers 4.x wrote it:
    "rope_theta" and "rope_scaling" for "rope_parameters", "torch_dtype" for "dtype", no
    "layer_types" (Gemma 3: rope_theta, rope_local_base_freq and rope_scaling from its RoPE per layer
    type, and legacy_fields added). transformers must read the rewritten file back as the same config."""

    legacy_fields: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RelayoutFixture(LegacyConfigFixture):
    """A Gemma3ForConditionalGeneration fixture rewritten after the build as transformers 4.52-4.57
    saved it: tensors under model.language_model. / model.vision_tower. / model.multi_modal_projector.
    for transformers 5's language_model.model. / vision_tower. / multi_modal_projector., config.json
    (its text_config) in the 4.x format. transformers 5 must read the rewrite back to the same greedy
    tokens and logits."""


RELAYOUT = [("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector.")]


def relayout(out: pathlib.Path, fixture: Fixture) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        new = next((new + name[len(old):] for old, new in RELAYOUT if name.startswith(old)), None)
        if new is None:
            raise SystemExit(f"{out.name}: tensor {name} has none of the prefixes {[old for old, _ in RELAYOUT]}")
        renamed[new] = tensor
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    write_legacy_config(out, fixture.legacy_fields, text_config=True)
    golden = json.loads((out / "golden.json").read_text())
    model = fixture.model_cls.from_pretrained(out, attn_implementation="eager", **make_parity_fixtures.FLOAT32).eval()
    again = make_parity_fixtures.greedy(model, golden["prompt_ids"])
    for key in ("greedy_ids", "prompt_last_logits", "final_logits"):
        if again[key] != golden[key]:
            raise SystemExit(f"{out.name}: transformers reads the 4.x layout back with other {key}")
    print(f"    tensors renamed to model.language_model. ({len(renamed)}), read back to the same goldens")


def write_legacy_config(out: pathlib.Path, legacy_fields: dict, text_config: bool = False) -> None:
    path = out / "config.json"
    top = json.loads(path.read_text())
    config = top["text_config"] if text_config else top
    rope = config.pop("rope_parameters")
    if "full_attention" in rope:  # Gemma 3: the sliding layers' base in rope_local_base_freq
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = None if rope["rope_type"] == "default" else {
        k: v for k, v in rope.items() if k != "rope_theta"
    }
    config.update(legacy_fields)
    top["torch_dtype"] = top.pop("dtype")
    for sub in ("text_config", "vision_config"):  # the 4.x files give the dtype at the top only
        top.get(sub, {}).pop("dtype", None)
    config.pop("layer_types", None)
    if text_config:  # transformers 5's private copy of the pattern, in no 4.x file
        config.pop("_sliding_window_pattern", None)
    text = (lambda c: c.get_text_config().to_dict()) if text_config else (lambda c: c.to_dict())
    before = text(AutoConfig.from_pretrained(out))
    path.write_text(json.dumps(top, indent=2, sort_keys=True) + "\n")
    after = text(AutoConfig.from_pretrained(out))
    # A text_config's dtype is gone from the 4.x file (the top level's is the checkpoint's).
    for field in ("rope_parameters", "layer_types", "head_dim", "attention_bias") + (() if text_config else ("dtype",)):
        if before.get(field) != after.get(field):
            raise SystemExit(f"{out.name}: the 4.x config.json reads back with {field} "
                             f"{after.get(field)!r}, not {before.get(field)!r}")
    print(f"    config.json rewritten in the 4.x format, read back the same")


def router_margin(model, ids: list[int]) -> float:
    """The smallest gap between the k-th and (k+1)-th largest router logit of any token in any
    sparse layer, over one forward pass of `ids` (softmax keeps the order, so this is what top-k
    decides on)."""
    config = model.config
    k = config.num_experts_per_tok
    gaps = []

    def hook(module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        top = torch.topk(logits.float(), k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())

    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate") or name.endswith("block_sparse_moe.gate")]
    handles = [r.register_forward_hook(hook) for r in routers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return min(gaps)


def build(fixture: Fixture, out_root: pathlib.Path) -> None:
    make_parity_fixtures.build(fixture, out_root)
    if getattr(fixture.config, "num_experts_per_tok", 0):
        model = fixture.model_cls.from_pretrained(
            out_root / fixture.name, attn_implementation="eager", **make_parity_fixtures.FLOAT32
        ).eval()
        golden = json.loads((out_root / fixture.name / "golden.json").read_text())
        margin = router_margin(model, golden["prompt_ids"] + golden["greedy_ids"][:-1])
        # Float32 engines route as transformers does down to gaps far below this (their logits
        # differ by ~1e-6); lower-precision ones move router logits by ~1e-2 and may pick another
        # expert below that, so tests/llama_parity_test.cc holds MoE fixtures to float32 only.
        print(f"    router: min gap between the k-th and (k+1)-th expert's logit {margin:.4g}")
    if fixture.cached_decode:
        # What the cached decode changes: full recompute's tokens (all positions long once the
        # sequence passes the original context) against the golden's.
        model = fixture.model_cls.from_pretrained(
            out_root / fixture.name, attn_implementation="eager", **make_parity_fixtures.FLOAT32
        ).eval()
        golden = json.loads((out_root / fixture.name / "golden.json").read_text())
        recompute = make_parity_fixtures.greedy(model, golden["prompt_ids"])["greedy_ids"]
        same = next((i for i, (a, b) in enumerate(zip(recompute, golden["greedy_ids"])) if a != b), len(recompute))
        print(f"    full recompute agrees with the cached decode on the first {same} of 32 greedy tokens")
    if isinstance(fixture, RelayoutFixture):
        relayout(out_root / fixture.name, fixture)
    elif isinstance(fixture, LegacyConfigFixture):
        write_legacy_config(out_root / fixture.name, fixture.legacy_fields)


if __name__ == "__main__":
    if not make_parity_fixtures.TRANSFORMERS_5:
        raise SystemExit(f"transformers {transformers.__version__}: these fixtures need 5 (tools/fixtures5-env.sh)")
    make_parity_fixtures.main(fixtures, __doc__, build)
