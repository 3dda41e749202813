// shardserve plan: how a model would be split over a cluster (TP inside nodes, PP across them),
// with every GPU's memory and a roofline estimate of a decode step. Reads only config.json and
// the safetensors headers; no GPU needed. See docs/planner.md.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "coordinator/planner/cluster.h"
#include "coordinator/planner/planner.h"
#include "coordinator/planner/render.h"
#include "model/weight_source.h"
#include "tools/cli/command.h"
#include "base/flags.h"

namespace shardserve::cli {
namespace {

constexpr char kUsage[] =
    "usage: shardserve plan (--model DIR | --config FILE) [--dtype bf16|fp16|fp32] [--quantization none|int8|int4|fp8]\n"
    "                       (--cluster NODESxGPUSxGPU | --gpu-memory-gb G --hbm-gbps B) [cluster flags]\n"
    "                       [--gpu-memory-utilization F] [--max-model-len N] [--tp T] [--pp P]\n"
    "                       [--expert-parallel] [--decode-batch B] [--speculative ngram|draft|mtp|eagle3]\n"
    "                       [--draft-model DIR] [--json]\n"
    "\n"
    "  Chooses tensor parallelism (TP, inside a node) and pipeline parallelism (PP, across nodes)\n"
    "  for a model on a cluster, and prints each stage's layers and each GPU's weights, KV cache\n"
    "  capacity and a roofline estimate of a decode step. Exit code 0 when the plan fits, 1 when it\n"
    "  does not (or the model cannot be planned), 2 for bad flags.\n"
    "\n"
    "model:\n"
    "  --model DIR                 checkpoint directory: config.json (+ safetensors, checked, not read)\n"
    "  --config FILE               a config.json alone; weights are counted from it\n"
    "  --dtype D                   weights and KV cache dtype on the GPU (default: torch_dtype)\n"
    "  --quantization Q            linear layers' weights as the workers' --quantization stores them:\n"
    "                              none (default), int8, int4 or fp8; the plan then also says what the\n"
    "                              model needs without it\n"
    "cluster:\n"
    "  --cluster NxGxGPU           N nodes of G GPUs, e.g. 2x1xA100-80GB, 1x8xH100-80GB; GPUs: %s\n"
    "  --nodes N                   nodes (overrides the preset; default 1)\n"
    "  --gpus-per-node G           GPUs in each node (overrides the preset; default 1)\n"
    "  --gpu-memory-gb G           memory per GPU in GiB, as sold (\"80GB\" = 80 GiB)\n"
    "  --hbm-gbps B                GPU memory bandwidth, GB/s\n"
    "  --intra-node-gbps B         GPU-to-GPU bandwidth in a node per direction, GB/s (default 32, PCIe)\n"
    "  --inter-node-gbps B         node-to-node bandwidth per direction, GB/s (default 25)\n"
    "serving:\n"
    "  --gpu-memory-utilization F  fraction of GPU memory to use (default 0.9)\n"
    "  --max-model-len N           longest sequence (default: the model's, lowered to fit if needed)\n"
    "  --max-tokens-per-step N     tokens per step the buffers are sized for (default 2048)\n"
    "  --max-seqs-per-step N       sequences per step (default 256)\n"
    "  --runtime-reserve-gb G      GiB per GPU for the CUDA context, cuBLAS and NCCL (default 1)\n"
    "  --tp T, --pp P              force a layout\n"
    "  --expert-parallel           a mixture of experts' experts held whole, a block a TP rank, as the\n"
    "                              coordinator's --expert-parallel serves them (default: cut over TP)\n"
    "  --decode-batch B            sequences in the decode step estimated and ranked by (default 1): a\n"
    "                              mixture of experts reads more distinct experts the larger B is\n"
    "  --speculative S             speculative decoding as the coordinator's --speculative runs it, counted\n"
    "                              on the last stage's TP rank 0 (the worker that samples): mtp, the\n"
    "                              model's multi-token-prediction layer (weights, KV cache, buffers);\n"
    "                              draft, with --draft-model; eagle3, with --draft-model the EAGLE-3\n"
    "                              head (and on every GPU the hidden states kept for it); ngram\n"
    "                              (nothing on the GPUs)\n"
    "  --draft-model DIR           speculative decoding's draft model or EAGLE-3 head (its config.json):\n"
    "                              counted on the last stage's TP rank 0, as the coordinator's\n"
    "                              --draft-model runs it\n"
    "  --json                      print one JSON object instead of the table\n";

// Defaults for a cluster given by explicit flags only: PCIe between GPUs, one 200 Gb/s NIC.
constexpr double kDefaultIntraGbps = 32, kDefaultInterGbps = 25;
constexpr double kPcieLatency = 20e-6, kNicLatency = 30e-6;

int Usage(const std::string& msg) {
  std::fprintf(stderr, "shardserve plan: %s (see shardserve plan --help)\n", msg.c_str());
  return 2;
}

// The cluster from --cluster and the explicit flags, which override the preset's fields.
absl::StatusOr<ClusterSpec> ClusterFromFlags(const Flags& f) {
  ClusterSpec c;
  if (f.Has("cluster")) {
    absl::StatusOr<ClusterSpec> preset = ParseClusterPreset(f.Get("cluster"));
    if (!preset.ok()) return preset.status();
    c = *preset;
  } else {
    if (!f.Has("gpu-memory-gb") || !f.Has("hbm-gbps")) {
      return absl::InvalidArgumentError("give --cluster NODESxGPUSxGPU, or --gpu-memory-gb and --hbm-gbps");
    }
    c.gpus_per_node = {1};
    c.intra_node_bytes_per_s = kDefaultIntraGbps * 1e9;
    c.intra_node_latency_s = kPcieLatency;
    c.inter_node_bytes_per_s = kDefaultInterGbps * 1e9;
    c.inter_node_latency_s = kNicLatency;
  }
  int nodes = c.nodes(), gpus = c.gpus_per_node.front();
  SHARDSERVE_RETURN_IF_ERROR(f.Int("nodes", 1, 4096, &nodes));
  SHARDSERVE_RETURN_IF_ERROR(f.Int("gpus-per-node", 1, 4096, &gpus));
  c.gpus_per_node.assign(nodes, gpus);

  double memory_gib = static_cast<double>(c.gpu.memory_bytes) / (1 << 30);
  SHARDSERVE_RETURN_IF_ERROR(f.Positive("gpu-memory-gb", &memory_gib));
  if (memory_gib > 1e6) return absl::InvalidArgumentError("flag --gpu-memory-gb is above a million GiB");
  double hbm = c.gpu.hbm_bytes_per_s / 1e9, intra = c.intra_node_bytes_per_s / 1e9,
         inter = c.inter_node_bytes_per_s / 1e9;
  for (auto [name, gbps] : {std::pair{"hbm-gbps", &hbm}, {"intra-node-gbps", &intra}, {"inter-node-gbps", &inter}}) {
    SHARDSERVE_RETURN_IF_ERROR(f.Positive(name, gbps));
    // The planner's range (cluster.h), said here in the flags' unit.
    if (!(*gbps * 1e9 >= kMinBandwidthBytesPerS && *gbps * 1e9 <= kMaxBandwidthBytesPerS)) {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --", name, " must be in [0.001, 1e6] GB/s, got ", f.Get(name)));
    }
  }
  if (f.Has("gpu-memory-gb")) {
    c.gpu.memory_bytes = static_cast<uint64_t>(memory_gib * (1 << 30));
    c.gpu.name = f.Has("cluster") ? absl::StrFormat("%s with %g GiB", c.gpu.name, memory_gib)
                                  : absl::StrFormat("%g GiB GPU", memory_gib);
  }
  c.gpu.hbm_bytes_per_s = hbm * 1e9;
  c.intra_node_bytes_per_s = intra * 1e9;
  c.inter_node_bytes_per_s = inter * 1e9;
  return c;
}

absl::StatusOr<PlanOptions> OptionsFromFlags(const Flags& f) {
  PlanOptions o;
  double util = o.gpu_memory_utilization;
  SHARDSERVE_RETURN_IF_ERROR(f.Positive("gpu-memory-utilization", &util));
  if (util > 1) return absl::InvalidArgumentError("flag --gpu-memory-utilization must be in (0, 1]");
  o.gpu_memory_utilization = util;
  SHARDSERVE_RETURN_IF_ERROR(f.Int("max-model-len", 1, int64_t{1} << 31, &o.limits.max_model_len));
  SHARDSERVE_RETURN_IF_ERROR(f.Int("max-tokens-per-step", 1, int64_t{1} << 20, &o.limits.max_tokens_per_step));
  SHARDSERVE_RETURN_IF_ERROR(f.Int("max-seqs-per-step", 1, int64_t{1} << 20, &o.limits.max_seqs_per_step));
  double reserve_gib = static_cast<double>(o.runtime_reserve_bytes) / (1 << 30);
  SHARDSERVE_RETURN_IF_ERROR(f.Double("runtime-reserve-gb", 0, 1e6, &reserve_gib));
  o.runtime_reserve_bytes = static_cast<uint64_t>(reserve_gib * (1 << 30));
  SHARDSERVE_RETURN_IF_ERROR(f.Int("tp", 1, 4096, &o.tp));
  SHARDSERVE_RETURN_IF_ERROR(f.Int("pp", 1, 1 << 20, &o.pp));
  SHARDSERVE_RETURN_IF_ERROR(f.Int("decode-batch", 1, 4096, &o.decode_batch));
  o.expert_parallel = f.Has("expert-parallel");
  // As the coordinator takes them (coordinator/engine/engine.cc): a draft model with --speculative
  // draft, an EAGLE-3 head with --speculative eagle3; --draft-model alone plans a draft too.
  std::string speculative;
  SHARDSERVE_RETURN_IF_ERROR(f.OneOf("speculative", {"ngram", "draft", "mtp", "eagle3"}, &speculative));
  if ((speculative == "draft" || speculative == "eagle3") && !f.Has("draft-model")) {
    return absl::InvalidArgumentError(absl::StrCat("--speculative ", speculative, " needs --draft-model DIR (the ",
                                                   speculative == "draft" ? "draft model's" : "EAGLE-3 head's",
                                                   " config.json)"));
  }
  if (!speculative.empty() && speculative != "draft" && speculative != "eagle3" && f.Has("draft-model")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--draft-model is speculative decoding's draft model, not --speculative ", speculative, "'s"));
  }
  o.mtp = speculative == "mtp";
  if (f.Has("dtype")) {
    absl::StatusOr<DType> d = ParsePlanDType(f.Get("dtype"));
    if (!d.ok()) return d.status();
    o.dtype = *d;
  }
  if (f.Has("quantization")) {
    absl::StatusOr<WeightQuant> q = ParseWeightQuant(f.Get("quantization"));
    if (!q.ok()) return q.status();
    o.weight_quant = *q;
  }
  return o;
}

int Run(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags =
      Flags::Parse(args,
                   {"model", "config", "dtype", "cluster", "nodes", "gpus-per-node", "gpu-memory-gb", "hbm-gbps",
                    "intra-node-gbps", "inter-node-gbps", "gpu-memory-utilization", "max-model-len",
                    "max-tokens-per-step", "max-seqs-per-step", "runtime-reserve-gb", "tp", "pp", "quantization",
                    "decode-batch", "draft-model", "speculative"},
                   {"json", "help", "expert-parallel"});
  if (!flags.ok()) return Usage(std::string(flags.status().message()));
  if (flags->Has("help")) {
    std::printf(kUsage, absl::StrJoin(GpuPresetNames(), ", ").c_str());
    return 0;
  }
  if (!flags->positional().empty()) return Usage(absl::StrCat("unexpected argument '", flags->positional()[0], "'"));
  if (flags->Has("model") == flags->Has("config")) return Usage("give exactly one of --model DIR and --config FILE");
  absl::StatusOr<ClusterSpec> cluster = ClusterFromFlags(*flags);
  if (!cluster.ok()) return Usage(std::string(cluster.status().message()));
  absl::StatusOr<PlanOptions> options = OptionsFromFlags(*flags);
  if (!options.ok()) return Usage(std::string(options.status().message()));

  absl::StatusOr<PlannerModel> model = OpenPlannerModel(flags->Get(flags->Has("model") ? "model" : "config"));
  if (!model.ok()) {
    std::fprintf(stderr, "shardserve plan: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  if (flags->Has("draft-model")) {
    // (a head's checkpoint, where the directory has one, says whether it has an embedding of its own)
    absl::StatusOr<PlannerModel> draft_model = OpenPlannerModel(flags->Get("draft-model"));
    if (!draft_model.ok()) {
      std::fprintf(stderr, "shardserve plan: --draft-model: %s\n", std::string(draft_model.status().message()).c_str());
      return 1;
    }
    ModelConfig& draft = draft_model->config;
    if (draft_model->checkpoint != nullptr) NoteEagle3Embedding(*draft_model->checkpoint, &draft);
    // (as the coordinator: a head with --speculative eagle3 only, a model with draft only)
    const bool eagle3 = flags->Get("speculative") == "eagle3";
    if (draft.eagle3.has_value() != eagle3) {
      std::fprintf(stderr, "shardserve plan: --draft-model %s is %s (%s): plan it with --speculative %s\n",
                   flags->Get("draft-model").c_str(), eagle3 ? "not an EAGLE-3 head" : "an EAGLE-3 head",
                   draft.architecture_name.c_str(), eagle3 ? "draft" : "eagle3");
      return 1;
    }
    (eagle3 ? options->eagle3 : options->draft) = std::move(draft);
  }
  absl::StatusOr<Plan> plan = MakePlan(model->config, model->checkpoint.get(), *cluster, *options);
  if (!plan.ok()) {
    std::fprintf(stderr, "shardserve plan: %s\n", std::string(plan.status().message()).c_str());
    return 1;
  }
  const std::string text = flags->Has("json") ? PlanJson(*plan) + "\n" : PlanTable(*plan);
  std::fputs(text.c_str(), stdout);
  return plan->fits ? 0 : 1;
}

const CommandRegistration kRegistration({"plan", "choose TP/PP for a model on a cluster and show the memory math",
                                         Run});

}  // namespace
}  // namespace shardserve::cli
