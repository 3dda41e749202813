// shardserve generate-ids: greedy generation in one process from token ids, no tokenizer, no
// network. The smallest end-to-end check of a checkpoint and a backend.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/backend.h"
#include "model/weight_source.h"
#include "model/config.h"
#include "tools/cli/command.h"
#include "base/flags.h"
#include "kernels/cuda/cuda_switches.h"
#include "worker/shard/greedy.h"
#include "worker/shard/model_shard.h"

namespace shardserve::cli {
namespace {

constexpr char kUsage[] =
    "usage: shardserve generate-ids --model DIR [--max-new-tokens N] [--device cpu|cuda:K]\n"
    "                               [--quantization none|int8|int4|fp8] [--load-format auto|dummy] [--dummy-seed N]\n"
    "                               [--activation-quantization auto|none|int8|int16] [--no-cuda-quantized-kernels]\n"
    "                               [--no-cuda-graphs] [--no-cuda-split-attention] [--no-cuda-fused-kernels]\n"
    "                               [--no-cuda-dense-gemv] [--cuda-int4-mma] [--cuda-pdl] [--cuda-fp8-gemm]\n"
    "                               [--cuda-int4-folded] [--cuda-moe-grouped]\n"
    "                               ID [ID ...]\n"
    "  Loads the Hugging Face checkpoint in DIR and greedily generates N (default 16) token ids after\n"
    "  the prompt ids, printing them space-separated. Ids may also be given comma-separated.\n"
    "  --quantization int8 stores the linear layers' weights in int8 (one scale per output channel),\n"
    "  int4 in 4 bits (a scale and zero point per group of 128 inputs), fp8 in e4m3 (one scale per\n"
    "  output channel), quantized at load, as the coordinator's --quantization does.\n"
    "  --no-cuda-... turn the CUDA paths off and --cuda-int4-mma, --cuda-pdl, --cuda-fp8-gemm,\n"
    "  --cuda-int4-folded, --cuda-moe-grouped turn their own on, as the worker's do (shardserve-worker\n"
    "  --help).\n"
    "  --activation-quantization int8 rounds the inputs of the int8/int4 products to int8 (AVX-512 VNNI\n"
    "  or AVX2), int16 those of the int4 products to int16 (AVX-512 VNNI), none neither; auto (default)\n"
    "  is int16 on a CPU with AVX-512 VNNI, else none: as the worker's --activation-quantization.\n"
    "  --load-format dummy makes the weights from config.json and --dummy-seed (default 0) instead of\n"
    "  reading safetensors, as the coordinator's --load-format dummy does: DIR may hold only config.json.\n";

int Fail(const std::string& msg) {
  std::fprintf(stderr, "shardserve generate-ids: %s\n", msg.c_str());
  return 1;
}

int Run(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags =
      Flags::Parse(args,
                   {"model", "max-new-tokens", "device", "quantization", "load-format", "dummy-seed",
                    "activation-quantization"},
                   WithCudaSwitches({"help"}));
  if (!flags.ok()) {
    std::fprintf(stderr, "shardserve generate-ids: %s\n%s", std::string(flags.status().message()).c_str(), kUsage);
    return 2;
  }
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!flags->Has("model")) {
    std::fprintf(stderr, "shardserve generate-ids: --model is required\n%s", kUsage);
    return 2;
  }
  std::vector<int32_t> prompt;
  for (const std::string& arg : flags->positional()) {
    for (absl::string_view piece : absl::StrSplit(arg, ',', absl::SkipEmpty())) {
      int32_t id;
      if (!absl::SimpleAtoi(piece, &id)) {
        std::fprintf(stderr, "shardserve generate-ids: '%s' is not a token id\n", std::string(piece).c_str());
        return 2;
      }
      prompt.push_back(id);
    }
  }
  if (prompt.empty()) {
    std::fprintf(stderr, "shardserve generate-ids: give at least one prompt token id\n%s", kUsage);
    return 2;
  }
  const absl::StatusOr<WeightQuant> quant = ParseWeightQuant(flags->Get("quantization", "none"));
  if (!quant.ok()) {
    std::fprintf(stderr, "shardserve generate-ids: --%s\n", std::string(quant.status().message()).c_str());
    return 2;
  }
  const absl::StatusOr<CpuActivationQuant> act = ParseCpuActivationQuant(flags->Get("activation-quantization", "auto"));
  if (!act.ok()) {
    std::fprintf(stderr, "shardserve generate-ids: --%s\n", std::string(act.status().message()).c_str());
    return 2;
  }
  const absl::StatusOr<LoadFormat> load_format = ParseLoadFormat(flags->Get("load-format", "auto"));
  if (!load_format.ok()) {
    std::fprintf(stderr, "shardserve generate-ids: --%s\n", std::string(load_format.status().message()).c_str());
    return 2;
  }
  uint64_t dummy_seed = 0;
  if (flags->Has("dummy-seed") && *load_format != LoadFormat::kDummy) {
    std::fprintf(stderr, "shardserve generate-ids: flag --dummy-seed needs --load-format dummy\n");
    return 2;
  }
  if (absl::Status s = flags->Int("dummy-seed", 0, INT64_MAX, &dummy_seed); !s.ok()) {
    std::fprintf(stderr, "shardserve generate-ids: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  absl::StatusOr<int64_t> max_new = flags->GetInt("max-new-tokens", 16);
  if (!max_new.ok() || *max_new < 1) {
    std::fprintf(stderr, "shardserve generate-ids: --max-new-tokens must be a positive integer\n");
    return 2;
  }

  const std::string dir = flags->Get("model");
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return Fail(std::string(config.status().message()));
  absl::StatusOr<std::unique_ptr<WeightSource>> weights = OpenWeightSource(dir, *config, *load_format, dummy_seed);
  if (!weights.ok()) return Fail(std::string(weights.status().message()));

  const std::string device = flags->Get("device", "cpu");
  std::unique_ptr<Backend> backend;
  if (device == "cpu") {
    absl::StatusOr<std::unique_ptr<Backend>> cpu = MakeCpuBackend(0, CpuMatMul::kF32, *act);
    if (!cpu.ok()) return Fail(std::string(cpu.status().message()));
    backend = std::move(*cpu);
  } else if (device.rfind("cuda", 0) == 0) {
    // (auto, the default, means nothing there)
    if (const std::string asked = flags->Get("activation-quantization", "auto"); asked != "auto" && asked != "none") {
      std::fprintf(stderr, "shardserve generate-ids: --activation-quantization applies to --device cpu only\n");
      return 2;
    }
    int ordinal = 0;
    if (device.size() > 5 && !absl::SimpleAtoi(device.substr(5), &ordinal)) return Fail("bad --device " + device);
    // On GPU the activations keep the checkpoint's dtype.
    absl::StatusOr<std::unique_ptr<Backend>> cuda =
        MakeCudaBackend(ordinal, config->dtype, CudaOptionsFromSwitches(*flags));
    if (!cuda.ok()) return Fail(std::string(cuda.status().message()));
    backend = std::move(*cuda);
  } else {
    std::fprintf(stderr, "shardserve generate-ids: --device must be cpu or cuda:K, got '%s'\n", device.c_str());
    return 2;
  }

  // One sequence, prompt chunks of 256 tokens, a KV cache that holds it whole.
  StepLimits opt{.max_tokens_per_step = 256, .max_seqs_per_step = 1, .block_size = 16, .num_kv_blocks = 0,
                 .max_model_len = static_cast<int64_t>(prompt.size()) + *max_new};
  opt.num_kv_blocks = opt.max_blocks_per_seq();
  LocalCommunicator tp(backend.get());
  ShardSpec spec;
  spec.weight_quant = *quant;
  absl::StatusOr<std::unique_ptr<ModelShard>> model = ModelShard::Load(**weights, *config, spec, opt, backend.get(), &tp);
  if (!model.ok()) return Fail(std::string(model.status().message()));
  absl::StatusOr<std::vector<int32_t>> ids = GreedyGenerate(model->get(), prompt, *max_new);
  if (!ids.ok()) return Fail(std::string(ids.status().message()));
  for (size_t i = 0; i < ids->size(); ++i) std::printf("%s%d", i ? " " : "", (*ids)[i]);
  std::printf("\n");
  return 0;
}

const CommandRegistration kRegistration({"generate-ids", "greedy token ids from a checkpoint in one process", Run});

}  // namespace
}  // namespace shardserve::cli
