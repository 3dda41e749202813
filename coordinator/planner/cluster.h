// The machines a model is planned onto: nodes of alike GPUs, the links between them, and presets
// for common machines ("2x1xA100-80GB": 2 nodes x 1 GPU per node x A100-80GB).
//
// Units: memory in bytes (presets carry the total nvidia-smi reports, e.g. 81920 MiB for an
// A100-80GB); bandwidths in bytes per second, one direction; latencies in seconds.
// Plain value types; thread-compatible.
#ifndef SHARDSERVE_COORDINATOR_PLANNER_CLUSTER_H_
#define SHARDSERVE_COORDINATOR_PLANNER_CLUSTER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

// One kind of GPU (or, for CPU workers, one worker's share of a host).
struct GpuSpec {
  std::string name;            // "A100-80GB"; "cpu" for CPU workers (the coordinator's name for them)
  uint64_t memory_bytes = 0;   // total device memory
  double hbm_bytes_per_s = 0;  // device memory bandwidth

  // How the plan names one device and its memory: "GPU" and "HBM", or "CPU worker" and "memory"
  // for CPU workers, whose share of a host is planned as if it were a GPU.
  bool is_cpu() const { return name == "cpu"; }
  const char* device_noun() const { return is_cpu() ? "CPU worker" : "GPU"; }
  const char* memory_noun() const { return is_cpu() ? "memory" : "HBM"; }
  // "1 GPU", "4 GPUs", "4 CPU workers".
  std::string Count(int64_t n) const;
};

struct ClusterSpec {
  GpuSpec gpu;                     // every GPU is alike; pass the smallest when they are not
  std::vector<int> gpus_per_node;  // one entry per node, each >= 1
  // GPU to GPU inside a node (NVLink, or PCIe without it), per direction, and the fixed cost of
  // one collective or message on it.
  double intra_node_bytes_per_s = 0;
  double intra_node_latency_s = 0;
  // Node to node (the NIC), per direction, and the fixed cost of one message on it.
  double inter_node_bytes_per_s = 0;
  double inter_node_latency_s = 0;

  int nodes() const { return static_cast<int>(gpus_per_node.size()); }
  int total_gpus() const;
  int max_gpus_per_node() const;
  // "2 nodes x 1 x A100-80GB" or "nodes of 8+4 x H100-80GB" when they differ.
  std::string Describe() const;
};

// A preset GPU by name, case-insensitive ("a100-80gb"), or by the part before its '-' where only
// one preset has it ("h200"), with its link defaults filled into a one-node, one-GPU cluster.
// NotFound lists the known names, or the presets an ambiguous name ("A100") could mean.
absl::StatusOr<ClusterSpec> GpuPreset(const std::string& gpu_name);

// "NxGxGPU": N nodes of G GPUs of preset GPU, e.g. "2x1xA100-80GB", "1x8xH100-80GB".
// InvalidArgument naming the problem for anything else.
absl::StatusOr<ClusterSpec> ParseClusterPreset(const std::string& spec);

// The known preset GPU names, for help texts.
std::vector<std::string> GpuPresetNames();

// The bandwidths the planner takes, in bytes per second: 1 MB/s to 1 PB/s. Below that range its
// estimates run to hundreds of digits; no link or memory comes near either end.
inline constexpr double kMinBandwidthBytesPerS = 1e6;
inline constexpr double kMaxBandwidthBytesPerS = 1e15;

// InvalidArgument naming the field when a spec cannot be planned on (no nodes, zero memory, a
// bandwidth outside [kMinBandwidthBytesPerS, kMaxBandwidthBytesPerS], negative latency).
absl::Status ValidateCluster(const ClusterSpec& cluster);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_PLANNER_CLUSTER_H_
