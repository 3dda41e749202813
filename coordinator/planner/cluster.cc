#include "coordinator/planner/cluster.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace shardserve {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// Bounds that keep products of counts far from overflow and the layouts to weigh few; no real
// cluster is near them.
constexpr int kMaxGpusPerNode = 4096;
constexpr int kMaxGpus = 65536;
constexpr uint64_t kMaxGpuMemory = uint64_t{1} << 50;

// Link defaults. NVLink figures are per direction per GPU (A100: 12 links x 25 GB/s; H100/H200:
// 18 x 25 GB/s; B200: 18 x 50 GB/s); GPUs without NVLink talk over PCIe 4.0 x16 (~32 GB/s).
// Latencies are the fixed cost of one small NCCL collective or send, the part that dominates a
// decode step's traffic. Between nodes: one 200 Gb/s NIC (InfiniBand HDR or RoCE), 25 GB/s.
constexpr double kNvlinkA100 = 300e9, kNvlinkH100 = 450e9, kNvlinkB200 = 900e9, kPcie4 = 32e9;
constexpr double kNvlinkLatency = 10e-6, kPcieLatency = 20e-6;
constexpr double kInterNode = 25e9, kInterNodeLatency = 30e-6;

struct Preset {
  const char* name;
  uint64_t memory_mib;  // as nvidia-smi reports the total
  double hbm_bytes_per_s;
  double intra_bytes_per_s;
  double intra_latency_s;
};

// SXM parts where both exist (the ones multi-GPU servers carry).
constexpr Preset kPresets[] = {
    {"A100-40GB", 40960, 1555e9, kNvlinkA100, kNvlinkLatency},
    {"A100-80GB", 81920, 2039e9, kNvlinkA100, kNvlinkLatency},
    {"H100-80GB", 81559, 3350e9, kNvlinkH100, kNvlinkLatency},
    {"H200-141GB", 143771, 4800e9, kNvlinkH100, kNvlinkLatency},
    // B200: nvidia-smi's total on an HGX B200; 8 TB/s as sold (the memory clock and bus the driver
    // reports give 7.67 TB/s).
    {"B200-180GB", 183359, 8000e9, kNvlinkB200, kNvlinkLatency},
    {"L40S-48GB", 46068, 864e9, kPcie4, kPcieLatency},
    {"L4-24GB", 23034, 300e9, kPcie4, kPcieLatency},
};

}  // namespace

int ClusterSpec::total_gpus() const { return std::accumulate(gpus_per_node.begin(), gpus_per_node.end(), 0); }

int ClusterSpec::max_gpus_per_node() const {
  return gpus_per_node.empty() ? 0 : *std::max_element(gpus_per_node.begin(), gpus_per_node.end());
}

std::string GpuSpec::Count(int64_t n) const { return absl::StrCat(n, " ", device_noun(), n == 1 ? "" : "s"); }

std::string ClusterSpec::Describe() const {
  const bool alike =
      std::all_of(gpus_per_node.begin(), gpus_per_node.end(), [&](int g) { return g == gpus_per_node.front(); });
  if (alike && !gpus_per_node.empty()) {
    return absl::StrCat(nodes(), nodes() == 1 ? " node" : " nodes", " x ", gpus_per_node.front(), " x ", gpu.name);
  }
  return absl::StrCat(nodes(), " nodes of ", absl::StrJoin(gpus_per_node, "+"), " x ", gpu.name);
}

std::vector<std::string> GpuPresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.push_back(p.name);
  return names;
}

absl::StatusOr<ClusterSpec> GpuPreset(const std::string& gpu_name) {
  // The name as listed, or the part before its '-' when only one preset has it ("H200"; not "A100").
  std::vector<const Preset*> matches;
  for (const Preset& p : kPresets) {
    if (absl::EqualsIgnoreCase(gpu_name, p.name)) matches = {&p};
  }
  if (matches.empty() && !gpu_name.empty()) {
    for (const Preset& p : kPresets) {
      if (absl::StartsWithIgnoreCase(p.name, absl::StrCat(gpu_name, "-"))) matches.push_back(&p);
    }
  }
  if (matches.size() > 1) {
    std::vector<std::string> names;
    for (const Preset* p : matches) names.push_back(p->name);
    return absl::NotFoundError(
        absl::StrCat("GPU \"", gpu_name, "\" is ambiguous: say which of ", absl::StrJoin(names, ", ")));
  }
  if (matches.empty()) {
    return absl::NotFoundError(
        absl::StrCat("unknown GPU \"", gpu_name, "\" (known: ", absl::StrJoin(GpuPresetNames(), ", "), ")"));
  }
  const Preset& p = *matches.front();
  ClusterSpec c;
  c.gpu = {p.name, p.memory_mib * kMiB, p.hbm_bytes_per_s};
  c.gpus_per_node = {1};
  c.intra_node_bytes_per_s = p.intra_bytes_per_s;
  c.intra_node_latency_s = p.intra_latency_s;
  c.inter_node_bytes_per_s = kInterNode;
  c.inter_node_latency_s = kInterNodeLatency;
  return c;
}

absl::StatusOr<ClusterSpec> ParseClusterPreset(const std::string& spec) {
  // Split at the first two 'x' only: GPU names may contain more.
  std::vector<std::string> parts = absl::StrSplit(spec, absl::MaxSplits('x', 2));
  int nodes = 0, gpus = 0;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &nodes) || !absl::SimpleAtoi(parts[1], &gpus)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster \"", spec, "\" is not NODESxGPUSxGPU, e.g. 2x1xA100-80GB or 1x8xH100-80GB"));
  }
  if (nodes < 1 || nodes > kMaxGpus || gpus < 1 || gpus > kMaxGpusPerNode) {
    return absl::InvalidArgumentError(absl::StrCat("cluster \"", spec, "\": nodes must be in [1, ", kMaxGpus,
                                                   "] and GPUs per node in [1, ", kMaxGpusPerNode, "]"));
  }
  absl::StatusOr<ClusterSpec> c = GpuPreset(parts[2]);
  if (!c.ok()) return absl::InvalidArgumentError(absl::StrCat("cluster \"", spec, "\": ", c.status().message()));
  c->gpus_per_node.assign(nodes, gpus);
  return c;
}

absl::Status ValidateCluster(const ClusterSpec& c) {
  if (c.gpus_per_node.empty()) return absl::InvalidArgumentError("the cluster has no nodes");
  if (c.nodes() > kMaxGpus) {
    return absl::InvalidArgumentError(
        absl::StrCat("the cluster has ", c.nodes(), " nodes; the planner stops at ", kMaxGpus));
  }
  for (size_t n = 0; n < c.gpus_per_node.size(); ++n) {
    if (c.gpus_per_node[n] < 1 || c.gpus_per_node[n] > kMaxGpusPerNode) {
      return absl::InvalidArgumentError(
          absl::StrCat("node ", n, " has ", c.gpus_per_node[n], " GPUs; need 1 to ", kMaxGpusPerNode));
    }
  }
  if (c.total_gpus() > kMaxGpus) {
    return absl::InvalidArgumentError(
        absl::StrCat("the cluster has ", c.total_gpus(), " GPUs; the planner stops at ", kMaxGpus));
  }
  if (c.gpu.memory_bytes == 0 || c.gpu.memory_bytes > kMaxGpuMemory) {
    return absl::InvalidArgumentError(absl::StrCat("GPU memory must be in [1, 2^50] bytes, got ", c.gpu.memory_bytes));
  }
  for (auto [field, v] : {std::pair{"HBM bandwidth", c.gpu.hbm_bytes_per_s},
                          {"intra-node bandwidth", c.intra_node_bytes_per_s},
                          {"inter-node bandwidth", c.inter_node_bytes_per_s}}) {
    if (!(v >= kMinBandwidthBytesPerS && v <= kMaxBandwidthBytesPerS)) {  // false for NaN
      return absl::InvalidArgumentError(absl::StrCat(field, " must be in [1e6, 1e15] bytes/s, got ", v));
    }
  }
  for (auto [field, v] :
       {std::pair{"intra-node latency", c.intra_node_latency_s}, {"inter-node latency", c.inter_node_latency_s}}) {
    if (!(std::isfinite(v) && v >= 0)) return absl::InvalidArgumentError(absl::StrCat(field, " must be >= 0, got ", v));
  }
  return absl::OkStatus();
}

}  // namespace shardserve
