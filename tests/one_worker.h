// One CPU worker holding a whole model alone, for the tests that drive a StepExecutor directly
// (sampler_test, and through tests/speculation_driver.h the proposers' tests).
#ifndef SHARDSERVE_TESTS_ONE_WORKER_H_
#define SHARDSERVE_TESTS_ONE_WORKER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "model/step_limits.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/comm/rendezvous.h"
#include "worker/step_executor.h"

namespace shardserve {

// The assignment of a CPU worker holding the whole model at `model` (its `layers` layers) alone.
inline v1::Assignment WholeModelAssignment(const std::string& model, int64_t layers, const StepLimits& limits) {
  v1::Assignment a;
  a.set_worker_id("w0");
  a.set_model_path(model);
  a.set_stage(0);
  a.set_num_stages(1);
  a.set_tp_rank(0);
  a.set_tp_size(1);
  a.set_first_layer(0);
  a.set_end_layer(layers);
  ToProto(limits, a.mutable_limits());
  a.set_collective_timeout_seconds(10);
  return a;
}

// That worker, its products as `matmul` says (float32 unless told).
inline absl::StatusOr<std::unique_ptr<StepExecutor>> CpuWorker(const v1::Assignment& a,
                                                               std::optional<CpuMatMul> matmul = CpuMatMul::kF32) {
  InMemoryRendezvousStore store;  // unused: every group has one rank
  return StepExecutor::Create(a, "cpu", &store, "127.0.0.1", {.cpu_matmul = matmul});
}

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_ONE_WORKER_H_
