#!/usr/bin/env python3
"""Writes tests/fixtures/moe/routing.json: router logits tables and the experts and weights that
transformers' own router modules choose for them (MixtralTopKRouter, Qwen3MoeTopKRouter,
GptOssTopKRouter, DeepseekV3TopkRouter), for tests/kernels_moe_test.cc's comparison with
Backend::MoeRoute.

Each router is built with hidden_size = E and an identity weight, so its logits are the table
itself (x @ I^T is exact in float32) and its own forward() does the rest. The tables are random
float32 values without ties, so torch.topk's choice is unique; the ids are compared exactly, as
sets per token where transformers asks torch.topk for sorted=False (DeepSeek-V3).

Run with a Python that has torch and transformers (5.x): python tools/make_moe_routing_fixture.py
"""
import json
import os

import torch
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "moe", "routing.json")


def table(n, e, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, e, generator=g) * scale).float()


def identity(router, e):
    with torch.no_grad():
        router.weight.copy_(torch.eye(e))
    return router


def run(router, logits):
    with torch.no_grad():
        out = router(logits)
    _, weights, ids = out
    return ids.tolist(), weights.float().tolist()


def main():
    cases = []
    # (name, router, E, k, norm_topk_prob, n_group, topk_group, routed_scaling_factor, n, seed)
    for name, kind, e, k, norm, n, seed in [
        ("mixtral_e8_k2", "mixtral", 8, 2, True, 33, 1),
        ("qwen3_e60_k4", "qwen3", 60, 4, False, 17, 2),
        ("qwen3_e60_k4_norm", "qwen3", 60, 4, True, 17, 3),
        ("qwen3_e7_k7", "qwen3", 7, 7, False, 5, 4),
        ("qwen3_e5_k1", "qwen3", 5, 1, True, 9, 5),
        ("gptoss_e32_k4", "gptoss", 32, 4, None, 21, 6),
        ("gptoss_e6_k1", "gptoss", 6, 1, None, 4, 7),
    ]:
        logits = table(n, e, seed)
        if kind == "mixtral":
            r = MixtralTopKRouter(MixtralConfig(hidden_size=e, num_local_experts=e, num_experts_per_tok=k))
            router = "softmax_topk"
        elif kind == "qwen3":
            r = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=e, num_experts=e, num_experts_per_tok=k,
                                                  norm_topk_prob=norm))
            router = "softmax_topk"
        else:
            r = GptOssTopKRouter(GptOssConfig(hidden_size=e, num_local_experts=e, num_experts_per_tok=k))
            router = "topk_softmax"
        ids, weights = run(identity(r.float(), e), logits)
        cases.append(dict(name=name, router=router, experts=e, k=k, norm_topk_prob=bool(norm), n_group=1,
                          topk_group=1, routed_scaling_factor=1.0, logits=logits.tolist(), selection_bias=None,
                          ids=ids, weights=weights, sorted=True))
    for name, e, k, norm, ng, tg, scale, n, seed in [
        ("deepseek_e64_k6_g8_t3", 64, 6, True, 8, 3, 2.5, 19, 8),
        ("deepseek_e24_k4_g4_t2_nonorm", 24, 4, False, 4, 2, 1.0, 11, 9),
        ("deepseek_e16_k3_g1_t1", 16, 3, True, 1, 1, 2.827, 7, 10),
    ]:
        logits = table(n, e, seed, scale=1.5)
        cfg = DeepseekV3Config(hidden_size=e, n_routed_experts=e, num_experts_per_tok=k, n_group=ng, topk_group=tg,
                               norm_topk_prob=norm, routed_scaling_factor=scale)
        cfg.num_local_experts = e
        r = DeepseekV3TopkRouter(cfg)
        bias = table(1, e, seed + 100, scale=0.5)[0]
        with torch.no_grad():
            r.e_score_correction_bias.copy_(bias)
        ids, weights = run(identity(r, e), logits)
        cases.append(dict(name=name, router="sigmoid_group_topk", experts=e, k=k, norm_topk_prob=norm, n_group=ng,
                          topk_group=tg, routed_scaling_factor=scale, logits=logits.tolist(),
                          selection_bias=bias.tolist(), ids=ids, weights=weights, sorted=False))
    with open(OUT, "w") as f:
        json.dump(dict(generator="tools/make_moe_routing_fixture.py", torch=torch.__version__, cases=cases), f)
        f.write("\n")


if __name__ == "__main__":
    main()
