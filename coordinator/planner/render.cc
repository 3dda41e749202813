#include "coordinator/planner/render.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "coordinator/planner/format.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

namespace fmt = planner_format;
using json = nlohmann::json;

constexpr size_t kMaxLayoutRows = 10;

constexpr size_t kWidth = 100;

std::string GBps(double bytes_per_s) { return absl::StrFormat("%.0f GB/s", bytes_per_s / 1e9); }

// `text` broken at spaces into lines of at most kWidth columns, each starting with `indent`.
std::string Wrap(const std::string& text, const std::string& indent) {
  std::string out, line = indent;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (line.size() > indent.size() && line.size() + 1 + word.size() > kWidth) {
      absl::StrAppend(&out, line, "\n");
      line = indent;
    }
    absl::StrAppend(&line, line.size() > indent.size() ? " " : "", word);
  }
  return absl::StrCat(out, line, "\n");
}

// The itemised memory's column heading for a memory.h item name.
std::string MemoryHeading(const std::string& name) {
  constexpr std::pair<const char*, const char*> kHeadings[] = {
      {kMemWeights, "weights"},           {kMemKvCache, "KV cache"},          {kMemStepBuffers, "step bufs"},
      {kMemDraftModel, "draft"},           {kMemMtpLayer, "MTP layer"},        {kMemEagle3Head, "EAGLE-3 head"},
      {kMemCublasWorkspace, "cuBLAS ws"}, {kMemDequantScratch, "dequant"},    {kMemCudaGraphPools, "graphs"},
      {kMemNcclBuffers, "NCCL"},          {kMemCudaContext, "context"},       {kMemRuntimeSlack, "slack"},
      {kMemProcess, "process"},
      {kMemFree, "free"},                 {kMemHeldBack, "held back"}};
  for (const auto& [item, heading] : kHeadings) {
    if (name == item) return heading;
  }
  return name;
}

}  // namespace

std::string PlanTable(const Plan& p) {
  const ClusterSpec& c = p.cluster;
  std::string out;
  const std::string checkpoint_dtype =
      p.checkpoint_dtype == p.dtype ? "" : absl::StrCat("; the checkpoint is ", PlanDTypeName(p.checkpoint_dtype));
  const std::string quant = !p.checkpoint_quant.empty() ? absl::StrCat(", linear layers ", p.checkpoint_quant)
                            : p.options.weight_quant == WeightQuant::kNone
                                ? ""
                                : absl::StrCat(", linear layers ", WeightQuantName(p.options.weight_quant));
  const std::string active = p.active_parameters == p.parameters
                                 ? ""
                                 : absl::StrCat(" (", fmt::Parameters(p.active_parameters), " active a token)");
  absl::StrAppendFormat(&out, "model    %s: %d layers, %s parameters%s, %s %s%s (weights from %s%s)\n",
                        p.architecture, p.num_layers, fmt::Parameters(p.parameters), active, fmt::Size(p.model_weight_bytes),
                        fmt::HeldIn(WeightsDTypeName(p.dtype, p.options), p.experts_format), quant, p.weights_from,
                        checkpoint_dtype);
  if (p.unserved_checkpoint_bytes > 0) {
    absl::StrAppendFormat(&out, "         not served: %s of the checkpoint's tensors outside the text model (vision "
                          "tower, projector), neither loaded nor counted\n", fmt::Size(p.unserved_checkpoint_bytes));
  }
  if (p.unserved_layer_bytes > 0) {
    absl::StrAppendFormat(&out, "         not served: %s of the checkpoint's layers after its %d (a multi-token-prediction "
                          "layer, which --speculative mtp loads), neither loaded nor counted\n",
                          fmt::Size(p.unserved_layer_bytes), p.num_layers);
  }
  absl::StrAppendFormat(&out, "cluster  %s: %s, %s %s; intra-node %s, inter-node %s\n", c.Describe(),
                        fmt::Size(c.gpu.memory_bytes), c.gpu.memory_noun(), GBps(c.gpu.hbm_bytes_per_s),
                        GBps(c.intra_node_bytes_per_s), GBps(c.inter_node_bytes_per_s));
  absl::StrAppendFormat(&out, "usable   %.2f x %s = %s per %s\n\n", p.options.gpu_memory_utilization,
                        fmt::Size(c.gpu.memory_bytes), fmt::Size(p.usable_bytes_per_gpu), c.gpu.device_noun());

  if (p.fits) {
    absl::StrAppendFormat(&out, "plan     %s on %s, max_model_len %s, KV cache %s tokens (%s blocks of %d)%s\n",
                          fmt::Layout(p.tp, p.pp), c.gpu.Count(p.tp * p.pp),
                          fmt::Count(p.max_model_len), fmt::Count(p.kv_cache_tokens),
                          fmt::Count(p.limits.num_kv_blocks), p.limits.block_size,
                          p.limits.num_sliding_kv_blocks > 0
                              ? absl::StrCat(", the sliding layers' own ", fmt::Count(p.limits.num_sliding_kv_blocks),
                                             " blocks")
                              : "");
  } else {
    absl::StrAppendFormat(&out, "plan     DOES NOT FIT (closest layout shown: %s)\n", fmt::Layout(p.tp, p.pp));
  }
  absl::StrAppend(&out, Wrap(p.reason, "         "), "\n");
  if (p.unquantized) {
    const Plan::Unquantized& u = *p.unquantized;
    const std::string q = WeightQuantName(p.options.weight_quant), plain = PlanDTypeName(p.dtype);
    const std::string without =
        u.fits ? absl::StrCat(c.gpu.Count(u.tp * u.pp), " (", fmt::Layout(u.tp, u.pp), ") with KV cache for ",
                              fmt::Count(u.kv_cache_tokens), " tokens")
               : "does not fit on this cluster";
    const std::string with = p.fits ? absl::StrCat(c.gpu.Count(p.tp * p.pp), " (", fmt::Layout(p.tp, p.pp),
                                                   ") with KV cache for ", fmt::Count(p.kv_cache_tokens), " tokens")
                                    : "does not fit either";
    std::string text = Wrap(absl::StrCat(q, " against ", plain, ": weights ", fmt::Size(p.model_weight_bytes),
                                         " instead of ", fmt::Size(u.model_weight_bytes), "; in ", plain, " ", without,
                                         ", in ", q, " ", with),
                            "         ");
    text.replace(0, 9, "quant    ");  // the first line's label
    absl::StrAppend(&out, text, "\n");
  }

  // Columns named for the devices: GPUs, or CPU workers.
  const bool cpu = c.gpu.is_cpu();
  const std::string devices = cpu ? "workers" : "GPUs", device = cpu ? "worker" : "GPU";
  const int devices_w = static_cast<int>(devices.size()) > 6 ? static_cast<int>(devices.size()) : 6;
  const int device_w = static_cast<int>(device.size());
  absl::StrAppendFormat(&out, "%5s  %-15s  %4s  %-*s  %s\n", "stage", "layers", "node", devices_w, devices,
                        "also holds");
  for (size_t s = 0; s < p.stages.size(); ++s) {
    const StagePlan& st = p.stages[s];
    std::vector<std::string> extras;
    if (st.embedding) extras.push_back("embedding");
    if (st.lm_head) extras.push_back("final norm + LM head");
    const std::string gpus =
        p.tp == 1 ? absl::StrCat(st.first_gpu) : absl::StrCat(st.first_gpu, "-", st.first_gpu + p.tp - 1);
    absl::StrAppendFormat(&out, "%5d  %-15s  %4d  %-*s  %s\n", s,
                          absl::StrFormat("%d-%d (%d)", st.first_layer, st.last_layer, st.num_layers()), st.node,
                          devices_w, gpus, extras.empty() ? "-" : absl::StrJoin(extras, ", "));
  }
  absl::StrAppend(&out, "\n");

  absl::StrAppendFormat(&out, "%4s  %*s  %5s  %7s  %11s  %12s  %10s  %10s  %15s\n", "node", device_w, device, "stage",
                        "TP rank",
                        "weights", "step buffers", "reserve", "KV/token", "KV cache tokens");
  for (const GpuPlan& g : p.per_gpu) {
    absl::StrAppendFormat(&out, "%4d  %*d  %5d  %7d  %11s  %12s  %10s  %10s  %15s\n", g.node, device_w, g.gpu, g.stage,
                          g.tp_rank,
                          fmt::Size(g.weight_bytes), fmt::Size(g.activation_bytes), fmt::Size(g.reserve_bytes),
                          absl::StrFormat("%.1f KiB", g.kv_bytes_per_token / 1024.0), fmt::Count(g.kv_cache_tokens));
  }
  absl::StrAppend(&out, "\n");

  // Each device's memory item by item (memory.h); they add up to the device's memory.
  absl::StrAppendFormat(&out, "memory per %s, itemised (adds up to %s):\n", device, fmt::Size(c.gpu.memory_bytes));
  // The columns are the items of the first device (every device of a plan lists the same ones).
  absl::StrAppendFormat(&out, "%4s  %*s", "node", device_w, device);
  if (!p.per_gpu.empty()) {
    for (const MemoryItem& item : p.per_gpu[0].memory) absl::StrAppendFormat(&out, "  %10s", MemoryHeading(item.name));
  }
  absl::StrAppend(&out, "\n");
  for (const GpuPlan& g : p.per_gpu) {
    absl::StrAppendFormat(&out, "%4d  %*d", g.node, device_w, g.gpu);
    for (const MemoryItem& item : g.memory) absl::StrAppendFormat(&out, "  %10s", fmt::Size(item.bytes));
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(&out, "\n");

  const DecodeEstimate& d = p.decode;
  if (d.batch == 1) {
    absl::StrAppendFormat(&out, "decode   %s per token at batch 1 (%.1f tokens/s), by roofline:\n", fmt::Ms(d.total_s()),
                          1.0 / d.total_s());
  } else {
    absl::StrAppendFormat(&out, "decode   %s per step of %d sequences (%.1f tokens/s), by roofline (KV reads not counted):\n",
                          fmt::Ms(d.total_s()), d.batch, d.batch / d.total_s());
  }
  absl::StrAppendFormat(&out, "         %s weights from %s + %s TP collectives + %s stage hops\n",
                        fmt::Ms(d.weights_s), c.gpu.memory_noun(), fmt::Ms(d.collectives_s), fmt::Ms(d.transfers_s));
  if (d.experts > 0) {
    // The experts' share of a sparse layer that a step reads (planner.h DecodeEstimate).
    absl::StrAppendFormat(&out, "         experts read a sparse layer: %.1f of %d on average%s\n", d.experts_read,
                          d.experts, p.options.expert_parallel ? " (expert parallel: tokens exchanged by all-to-all)" : "");
  }
  absl::StrAppend(&out, "\n");

  absl::StrAppend(&out, "layouts weighed, best first:\n");
  const std::string weights_per = absl::StrCat("weights/", device);
  const int weights_w = std::max<int>(11, static_cast<int>(weights_per.size()));
  absl::StrAppendFormat(&out, "   %3s  %3s  %4s  %*s  %10s  %11s  %s\n", "TP", "PP", cpu ? "wkrs" : "GPUs", weights_w,
                        weights_per, "KV tokens", "decode step", "verdict");
  for (size_t i = 0; i < p.layouts.size() && i < kMaxLayoutRows; ++i) {
    const LayoutOption& l = p.layouts[i];
    absl::StrAppendFormat(&out, " %s %3d  %3d  %4d  %*s  %10s  %11s  %s\n", i == 0 ? "*" : " ", l.tp, l.pp,
                          l.tp * l.pp, weights_w, fmt::Size(l.max_weight_bytes), l.fits ? fmt::Count(l.kv_cache_tokens) : "-",
                          l.fits ? fmt::Ms(l.decode_step_s) : "-", l.note);
  }
  if (p.layouts.size() > kMaxLayoutRows) {
    absl::StrAppendFormat(&out, "   (%d more; --json lists them all)\n", p.layouts.size() - kMaxLayoutRows);
  }
  return out;
}

std::string PlanJson(const Plan& p) {
  const ClusterSpec& c = p.cluster;
  json j;
  j["model"] = {{"architecture", p.architecture},  {"weights_from", p.weights_from},
                {"num_layers", p.num_layers},      {"parameters", p.parameters},
                {"active_parameters", p.active_parameters},
                {"dtype", PlanDTypeName(p.dtype)}, {"experts_format", p.experts_format},
                {"weight_bytes", p.model_weight_bytes},
                {"unserved_checkpoint_bytes", p.unserved_checkpoint_bytes},
                {"unserved_layer_bytes", p.unserved_layer_bytes}};
  j["cluster"] = {{"gpu", c.gpu.name},
                  {"gpus_per_node", c.gpus_per_node},
                  {"gpu_memory_bytes", c.gpu.memory_bytes},
                  {"hbm_bytes_per_s", c.gpu.hbm_bytes_per_s},
                  {"intra_node_bytes_per_s", c.intra_node_bytes_per_s},
                  {"intra_node_latency_s", c.intra_node_latency_s},
                  {"inter_node_bytes_per_s", c.inter_node_bytes_per_s},
                  {"inter_node_latency_s", c.inter_node_latency_s}};
  j["options"] = {{"gpu_memory_utilization", p.options.gpu_memory_utilization},
                  {"usable_bytes_per_gpu", p.usable_bytes_per_gpu},
                  {"runtime_reserve_bytes", p.options.runtime_reserve_bytes},
                  {"target_max_model_len", p.target_max_model_len}};
  j["tp"] = p.tp;
  j["pp"] = p.pp;
  j["quantization"] = WeightQuantName(p.options.weight_quant);
  if (p.unquantized) {
    j["unquantized"] = {{"fits", p.unquantized->fits},
                        {"tp", p.unquantized->tp},
                        {"pp", p.unquantized->pp},
                        {"kv_cache_tokens", p.unquantized->kv_cache_tokens},
                        {"weight_bytes", p.unquantized->model_weight_bytes}};
  }
  j["stages"] = json::array();
  for (size_t s = 0; s < p.stages.size(); ++s) {
    const StagePlan& st = p.stages[s];
    j["stages"].push_back({{"stage", s},
                           {"first_layer", st.first_layer},
                           {"last_layer", st.last_layer},
                           {"node", st.node},
                           {"first_gpu", st.first_gpu},
                           {"embedding", st.embedding},
                           {"lm_head", st.lm_head}});
  }
  j["per_gpu"] = json::array();
  for (const GpuPlan& g : p.per_gpu) {
    j["per_gpu"].push_back({{"stage", g.stage},
                            {"tp_rank", g.tp_rank},
                            {"node", g.node},
                            {"gpu", g.gpu},
                            {"weight_bytes", g.weight_bytes},
                            {"expert_weight_bytes", g.expert_weight_bytes},
                            {"activation_bytes", g.activation_bytes},
                            {"reserve_bytes", g.reserve_bytes},
                            {"kv_bytes_per_token", g.kv_bytes_per_token},
                            {"sliding_kv_bytes_per_token", g.sliding_kv_bytes_per_token},
                            {"kv_cache_tokens", g.kv_cache_tokens},
                            {"shortfall_bytes", std::max<int64_t>(g.shortfall_bytes, 0)}});
    json memory = json::object();  // item name -> bytes (nlohmann::json sorts an object's keys)
    for (const MemoryItem& item : g.memory) memory[item.name] = item.bytes;
    j["per_gpu"].back()["memory"] = memory;
  }
  j["max_model_len"] = p.max_model_len;
  j["kv_cache_tokens"] = p.kv_cache_tokens;
  j["worker_sizing"] = {{"max_tokens_per_step", p.limits.max_tokens_per_step},
                        {"max_seqs_per_step", p.limits.max_seqs_per_step},
                        {"block_size", p.limits.block_size},
                        {"num_kv_blocks", p.limits.num_kv_blocks},
                        {"num_sliding_kv_blocks", p.limits.num_sliding_kv_blocks},
                        {"max_blocks_per_seq", p.limits.max_blocks_per_seq()}};
  j["decode_step"] = {{"batch", p.decode.batch},
                      {"experts_read", p.decode.experts_read},
                      {"weights_s", p.decode.weights_s},
                      {"collectives_s", p.decode.collectives_s},
                      {"transfers_s", p.decode.transfers_s},
                      {"total_s", p.decode.total_s()},
                      {"tokens_per_s", 1.0 / p.decode.total_s()}};
  j["layouts"] = json::array();
  for (const LayoutOption& l : p.layouts) {
    j["layouts"].push_back({{"tp", l.tp},
                            {"pp", l.pp},
                            {"fits", l.fits},
                            {"max_model_len", l.max_model_len},
                            {"kv_cache_tokens", l.kv_cache_tokens},
                            {"max_weight_bytes", l.max_weight_bytes},
                            {"shortfall_bytes", l.shortfall_bytes},
                            {"decode_step_s", l.decode_step_s},
                            {"note", l.note}});
  }
  j["fits"] = p.fits;
  j["reason"] = p.reason;
  return j.dump(2);
}

}  // namespace shardserve
