// One worker's part of every step. Built from the coordinator's Assignment, it holds the worker's
// shard of the model (ModelShard), the collective groups the shard needs (its stage's TP group,
// and the pipeline pairs with the previous and the next stage), and executes StepPlans:
//
//   stage > 0:       Recv the previous stage's hidden state [n, hidden] into the shard's input
//   every stage:     Forward (embedding on stage 0, the stage's layers, TP all-reduces inside)
//   stage < last:    Send the hidden state [n, hidden] to the next stage's worker of the same
//                    TP rank
//   last, rank 0:    sample one id per logit row, and logprobs where asked (worker/sampler.h:
//                    argmax or Sample on the device; rows with min_p, penalties or logprobs on
//                    the host); with a draft model (Assignment.draft_model_path), its guesses for
//                    the sampled sequences' next step (worker/draft_runner.h); with the model's
//                    multi-token-prediction layer (Assignment.speculative_mtp), that layer over
//                    every step's hidden states and its guesses (worker/head_runner.h)
//   one stage, TP>1: with StepPlan.share_samples, rank 0's sampled ids all-reduced to every rank
//                    (asynchronous scheduling: each rank feeds them in the next step)
//
// Pipeline pairs are 2-rank groups: in `send_group` this worker is rank 0 and the next stage's
// worker rank 1; in `recv_group` the previous stage's worker is rank 0 and this one rank 1.
//
// Plans are stateful (worker.proto StepPlan): the executor holds the running batch by sequence id
// (worker/step_state.h, over worker/persistent_batch.h) and expands each plan into the StepBatch
// the shard runs and the RowSampling rows the sampler draws with.
//
// Ownership: owns the backend, the communicators, the shard, the sampler, the persistent batch and
// every step buffer. Nothing is allocated per step: the host vectors are reserved for the largest
// step (max_tokens_per_step tokens, max_seqs_per_step sequences and logit rows) at creation.
// Threading: not thread-safe; one step at a time, on one thread.
#ifndef SHARDSERVE_WORKER_STEP_EXECUTOR_H_
#define SHARDSERVE_WORKER_STEP_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/comm/rendezvous.h"
#include "worker/shard/model_shard.h"
#include "worker/draft_runner.h"
#include "worker/head_runner.h"
#include "worker/persistent_batch.h"
#include "worker/sampler.h"
#include "worker/step_state.h"
#include "worker/timed_communicator.h"

namespace shardserve {

// "cpu" -> -1; "cuda" -> 0; "cuda:K" -> K. InvalidArgument for anything else.
absl::StatusOr<int> ParseDevice(const std::string& device);

// The library of a worker's collective groups (worker --collectives): kAuto is Gloo on the CPU,
// with the collectives and hand-offs of a group whose ranks share a host through shared memory
// (worker/comm/shared_memory_communicator.h), and NCCL on CUDA; kGloo is Gloo's TCP alone, and on
// CUDA stages each device tensor through host memory (worker/comm/staged_communicator.h), so that
// several ranks can share one GPU, which NCCL refuses; kNccl on the CPU is refused.
enum class Collectives { kAuto, kGloo, kNccl };

// "auto", "gloo" or "nccl"; InvalidArgument naming the value otherwise.
absl::StatusOr<Collectives> ParseCollectives(const std::string& name);

// How one of a worker's groups moves tensors, as it was joined: nothing for a group of one; Gloo's
// TCP alone (--collectives gloo on the CPU, or kAuto where the ranks share no memory:
// kGlooTcpNoSharedMemory); shared memory (kAuto, the ranks on one host); Gloo staged through host
// memory (kGloo on CUDA); or NCCL.
enum class CollectiveTransport { kNone, kGlooTcp, kGlooTcpNoSharedMemory, kSharedMemory, kGlooStaged, kNccl };

// How a worker runs besides its assignment (worker flags).
struct StepExecutorOptions {
  int cpu_threads = 0;                  // --threads: the CPU backend's math threads (0: OpenMP's default)
  std::optional<CpuMatMul> cpu_matmul;  // --matmul-dtype: none: StepExecutor::ChooseCpuMatMul's
  Collectives collectives = Collectives::kAuto;  // --collectives
  bool dummy_weights_on_device = true;           // --dummy-weights device (default; DummyWeights on_device)
  // --activation-quantization (kernels/backend.h CpuActivationQuant; ignored on CUDA).
  CpuActivationQuant cpu_activation_quant = CpuActivationQuant::kNone;
  // The CUDA backend's options (ignored on the CPU): the worker turns each on but those its
  // --no-cuda-... switches name (kernels/cuda/cuda_switches.h; cuda_backend.h says what each does).
  // Here, all off unless set.
  CudaBackendOptions cuda = {};
};

class StepExecutor {
 public:
  // Checks the assignment, creates the backend for `device` ("cpu" or "cuda:K"), joins the
  // collective groups the assignment names through `store` (used only during this call; Gloo
  // listens on `collective_host`), then loads the shard from the checkpoint at
  // assignment.model_path. Every rank of every group must call this at about the same time: a
  // group whose ranks do not all join within the collective timeout is DeadlineExceeded.
  //
  // The groups: Gloo on CPU; on CUDA NCCL (Unimplemented in a build without it), or with
  // worker_options.collectives kGloo, Gloo on host copies of the device tensors
  // (StagedCommunicator: several ranks on one GPU). worker_options.cpu_threads and cpu_matmul set
  // the CPU backend (ignored on CUDA); dummy_weights_on_device makes --load-format dummy weights in
  // device memory (CUDA).
  static absl::StatusOr<std::unique_ptr<StepExecutor>> Create(const v1::Assignment& assignment,
                                                              const std::string& device, RendezvousStore* store,
                                                              const std::string& collective_host,
                                                              const StepExecutorOptions& worker_options = {});

  // The CPU products' precision for a checkpoint of `checkpoint_dtype` (config.json's
  // torch_dtype) when the worker is not told one (--matmul-dtype auto): as on a GPU, the
  // checkpoint's own dtype where this CPU has it in hardware, so bf16 when the checkpoint is bf16
  // and CpuHasNativeBf16MatMul(); float32 otherwise (f32 and f16 checkpoints, older CPUs).
  static CpuMatMul ChooseCpuMatMul(DType checkpoint_dtype);
  // What a CPU worker of --matmul-dtype `flag` (none: auto) tells the coordinator it stores its
  // products' weights in (Register.cpu_matmul), ChooseCpuMatMul's choice for any checkpoint.
  static v1::CpuMatMulDtype RegisteredCpuMatMul(std::optional<CpuMatMul> flag);

  // Runs this worker's part of `plan` and fills `result` (cleared first): the step id, the timings
  // and, on the last stage's TP rank 0, one sampled id per logit row (and the logprobs, when a row
  // asks). Every worker checks the plan, sampling parameters included, before its first
  // collective, so a bad plan fails on all of them alike. After an error the communicators are
  // unusable (see Communicator): run no further steps.
  absl::Status Execute(const v1::StepPlan& plan, v1::StepResult* result);

  // The group re-formed under `regroup.epoch` (worker.proto Regroup; after the epoch of the
  // assignment or the last Regroup): drops the running batch, closes the old communicators (the
  // peers see them drop) and joins the new groups through `store`, in Create's order; the weights
  // stay. Every rank of every new group must call this (or Create, for a replacement) at about the
  // same time: DeadlineExceeded when one does not join within the collective timeout. After an
  // error the communicators are unusable: run no steps until a later Regroup succeeds.
  absl::Status Regroup(const v1::Regroup& regroup, RendezvousStore* store);

  // Closes this epoch's communicators after a failed step, so that a peer blocked in a collective
  // with this worker sees the connection drop at once and fails its step too, instead of waiting
  // out the collective timeout: every rank of a broken group then settles within milliseconds and
  // the coordinator re-forms the group without waiting (tools/bench/chaos_bench.py measured ~5 s per heal
  // before). Steps fail until the next Regroup, which joins new groups as usual.
  void LeaveGroups() {
    for (TimedCommunicator* c : {tp_.get(), recv_.get(), send_.get()}) {
      if (c != nullptr) c->Replace(nullptr);
    }
  }

  // The coordinator went away (docs/healing.md "The coordinator restarts"): drops the running batch
  // and leaves the groups (LeaveGroups); the weights stay. Run no steps until Adopt or a Regroup
  // succeeds.
  void LeaveCoordinator();

  // A new coordinator adopts this worker: `assignment` must be for the shard it holds (SameShard,
  // model/shard_identity.h: FailedPrecondition naming the difference otherwise) under a later
  // epoch. Takes the new assignment (worker id, groups, collective timeout) and joins its groups as
  // Regroup does, keeping the weights.
  absl::Status Adopt(const v1::Assignment& assignment, RendezvousStore* store);

  // The group's epoch: the assignment's, then the last Regroup's. Execute refuses a plan of another.
  uint64_t epoch() const { return steps_->epoch(); }

  // Reports every collective call of later steps to `observer` (borrowed, must outlive this; null:
  // nowhere).
  void SetCollectiveObserver(CollectiveObserver* observer) {
    for (TimedCommunicator* c : {tp_.get(), recv_.get(), send_.get()}) {
      if (c != nullptr) c->set_observer(observer);
    }
  }

  // Kernel launches of the last step Execute ran (Backend::kernel_launches: on CUDA each of our
  // launches and each cuBLAS call; 0 on the CPU): the kernels-per-step figure of docs/gpu.md.
  uint64_t last_step_kernel_launches() const { return last_step_kernel_launches_; }
  // The shard's step graphs (ModelShard; CudaBackendOptions::step_graphs): how many are recorded, and why they were
  // turned off ("" while on, or never on).
  int step_graphs_recorded() const { return shard_->step_graphs_recorded(); }
  const std::string& step_graphs_off() const { return shard_->step_graphs_off(); }

  uint64_t weight_bytes() const { return shard_->weight_bytes(); }
  absl::StatusOr<std::vector<uint64_t>> ExpertRowsTotal() { return shard_->ExpertRowsTotal(); }
  // How the linear weights are held (ModelShard::QuantizationSummary), for the worker log.
  std::string quantization_summary() const { return shard_->QuantizationSummary(); }
  std::string gpu_paths_not_yet_run() const { return shard_->GpuPathsNotYetRun(); }
  int64_t kv_blocks() const { return shard_->limits().num_kv_blocks; }
  std::string backend_name() const { return backend_->Describe(); }
  // How the groups of more than one rank exchange tensors, for the worker log: "collectives: TP
  // group: shared memory; to the next stage: Gloo TCP (the ranks share no memory)"; "" where every
  // group is of one rank.
  std::string collectives_summary() const;
  // Where the TP group's ranks share a host and its CPUs, and their threads outnumber those CPUs:
  // a warning for the worker log naming each worker's share (HostCpuShare); "" otherwise.
  const std::string& host_cpus_warning() const { return host_cpus_warning_; }
  // Speculative decoding's draft model, for the worker log: what it holds; "" without one.
  const std::string& draft_summary() const { return draft_summary_; }
  // For tests: the multi-token-prediction layer's runner; null without one.
  const HeadRunner* head_runner() const { return head_.get(); }
  // The device's memory beside the plan's, one line per item of Assignment.planned_memory, in its
  // order ("weights: planned 123 B (0.00 MiB), measured 123 B (0.00 MiB), the shard's own count"),
  // then the lines that only measure. Measured: the shard's own counts of its weights, KV cache
  // and step buffers, the backend's of its dequantize scratch; on CUDA also cudaMemGetInfo's free bytes before the backend, after it, after
  // the collective groups and after the shard and sampler (docs/gpu.md says how to read them). An
  // item that cannot be measured here says so instead of a number.
  std::vector<std::string> MemoryReport() const;
  // On CUDA, what the device has taken since loading beside what the plan leaves for it, in the
  // report's form ("after_steps: planned N B (..), measured M B (..), how"): planned, the items
  // that come after loading (cublas_workspace, cuda_graph_pools, runtime_slack); measured,
  // cudaMemGetInfo's free bytes after loading less those now (cuBLAS's workspace, the kernel modules
  // loaded at their first launch, the step graphs). "" on a CPU worker.
  std::string MemoryAfterSteps() const;
  // On a CPU worker, its own anonymous memory beside its buffers now, what the memory report's
  // `process` line measures (RssAnon less the weights, KV cache, step buffers, a draft model's and a
  // head's); nullopt on CUDA or where /proc/self/status has no RssAnon.
  std::optional<int64_t> ProcessMemoryBytes() const;

 private:
  StepExecutor() = default;
  // The bytes of the buffers this worker allocated itself: the shard's weights, KV cache and step
  // buffers, a draft model's, a head's, the backend's dequantize scratch.
  int64_t OwnBufferBytes() const;
  // Closes the communicators and joins the groups `regroup` names (Create: the assignment's), TP
  // group first, recording how each moves tensors (transports_).
  absl::Status JoinGroups(const v1::Regroup& regroup, RendezvousStore* store);
  // StepPlan.share_samples: TP rank 0's `rows` sampled ids (in its `result`) to every rank of the
  // group, each of which keeps them for the rows that feed them (StepState::RecordSamples).
  absl::Status ShareSamples(uint64_t step_id, int64_t rows, const v1::StepResult& result);

  // ---- Constant after Create ----
  v1::Assignment assignment_;
  int cuda_ordinal_ = -1;
  Collectives collectives_ = Collectives::kAuto;
  std::string collective_host_;
  std::unique_ptr<Backend> backend_;
  // The communicators: the objects are constant after Create, their inner communicators are
  // replaced by Regroup.
  std::unique_ptr<TimedCommunicator> tp_;    // the stage's TP group (a LocalCommunicator for TP = 1)
  std::unique_ptr<TimedCommunicator> recv_;  // from the previous stage; null on the first stage
  std::unique_ptr<TimedCommunicator> send_;  // to the next stage; null on the last stage
  CollectiveTransport transports_[3] = {};   // how tp_, recv_ and send_ move tensors (MakeCommunicator)
  std::string host_cpus_warning_;            // host_cpus_warning(), from the last JoinGroups
  std::unique_ptr<ModelShard> shard_;
  // Last stage, TP rank 0 only (null elsewhere): for max_seqs_per_step rows. Declared after
  // backend_, so destroyed before it.
  std::unique_ptr<Sampler> sampler_;
  std::vector<const uint32_t*> token_masks_;  // per logit row of the step: its mask in the plan, or null
  // A TP group of one stage: max_seqs_per_step int32 on the device, and their host copy, for
  // ShareSamples (empty elsewhere).
  Buffer shared_ids_;
  google::protobuf::RepeatedField<int32_t> shared_;
  // Last stage, TP rank 0, with Assignment.draft_model_path: speculative decoding's draft model.
  std::unique_ptr<DraftRunner> draft_;
  // Last stage, TP rank 0, with Assignment.speculative_mtp: the model's multi-token-prediction layer.
  std::unique_ptr<HeadRunner> head_;
  std::string draft_summary_;
  int64_t draft_bytes_ = 0;  // its weights, KV cache and step buffers

  uint64_t last_step_kernel_launches_ = 0;
  // cudaMemGetInfo during Create (-1: CPU, or not read): the device's total and its free bytes at
  // the start, after the backend, after the groups and after the shard and the sampler.
  struct DeviceMemory {
    int64_t total = -1, free_start = -1, free_backend = -1, free_groups = -1, free_loaded = -1;
  };
  DeviceMemory device_memory_;

  // ---- The epoch, the running batch and the step buffers sized at Create ----
  std::unique_ptr<StepState> steps_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_STEP_EXECUTOR_H_
