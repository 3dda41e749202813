// What the coordinator checks in the messages a worker sends it (worker.proto WorkerMessage)
// before it keeps or acts on anything in them: the Register that opens a Connect stream, and each
// StepResult. A worker is a peer over the network: a malformed message is refused (Register) or
// makes the pool mark the worker lost (a malformed StepResult), never an out-of-range index or a
// figure the planner cannot take. Loaded, Heartbeat and Failure carry nothing to check beyond
// their epoch and the group's state (Membership::OnMessage); a Failure's text is cut to
// kMaxFailureLength before it is kept.
//
// Pure functions of their arguments, so that fuzz/worker_message_fuzzer.cc runs exactly what the
// coordinator runs (Membership::Register, StepDispatcher::OnResult). Threading: none keep state;
// call them from any thread.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_WORKER_MESSAGES_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_WORKER_MESSAGES_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {

// The version of worker.proto this coordinator speaks (one home for the number: the enum).
inline constexpr int kWorkerProtocolVersion = v1::PROTOCOL_VERSION_CURRENT;
// Lengths of the strings a worker sends that are kept and shown.
inline constexpr size_t kMaxNameLength = 256;
inline constexpr size_t kMaxFailureLength = 4096;
// The highest K of a "cuda:K" device a worker may report: far above the GPUs of any host.
inline constexpr int kMaxDeviceOrdinal = 4095;
// The most memory a worker may report: the planner's bound on one device's (cluster.cc).
inline constexpr int64_t kMaxWorkerMemory = int64_t{1} << 50;

// A Register on its own: this coordinator's protocol version (FailedPrecondition otherwise);
// node, device, address and collective_host of 1 to kMaxNameLength printable characters without
// spaces, metrics_address at most that; device "cpu", "cuda" or "cuda:K" with K in
// [0, kMaxDeviceOrdinal]; memory_bytes in [1, 2^50]; memory_bytes_per_s 0 (not reported) or a
// bandwidth the planner takes (coordinator/planner/cluster.h). InvalidArgument naming the field.
// (Whether the worker fits the group, its node or a slot is the pool's to decide.)
absl::Status CheckRegister(const v1::Register& hello);

// A StepResult for a step that samples `sampled_rows` ids from this worker (0 unless it is the
// last stage's TP rank 0) with `logprob_rows` logprob rows (0 unless some row asked), over a
// vocabulary of `vocab_size`: that many ids in the vocabulary, logprob rows with as many top ids as
// top logprobs (at most kMaxTopLogprobs), ids in the vocabulary and no NaN logprob, non-finite rows
// ascending inside [0, sampled_rows), `draft_ids` draft ids in the vocabulary (a draft model's
// guesses; 0 unless the plan asked), timings finite and >= 0. InvalidArgument naming the step and
// what is wrong.
absl::Status CheckStepResult(const v1::StepResult& r, int sampled_rows, int logprob_rows, int64_t vocab_size,
                             int draft_ids = 0);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_WORKER_MESSAGES_H_
