// The worker process's life on its control stream with the coordinator (worker.proto Connect):
//
//   worker                                   coordinator
//   Register {node, device, memory, ...}  ->
//                                         <-  Assignment {stage, tp rank, layers, groups, sizes}
//   (joins its groups through RendezvousSet/Get, loads its shard)
//   Loaded {weight bytes, kv blocks}      ->
//                                         <-  StepPlan           (one per step, to every worker)
//   StepResult {sampled ids, timings}     ->  (every worker answers every step)
//   ...
//                                         <-  Regroup {epoch, groups}  (a peer was lost and replaced)
//   (closes its old groups, drops its running batch, keeps its weights, joins the new groups)
//   Loaded {epoch}                        ->
//   ...
//   Heartbeat, every second, from a thread of its own, whatever the main thread is doing.
//
// The coordinator going away (the stream ends with UNAVAILABLE: its process died, the connection
// dropped; not a Shutdown, a refusal or the coordinator ending this worker's stream on purpose)
// does not end the worker: it drops its running batch, leaves its collective groups, keeps its
// shard and registers again (backoff 0.25 s doubling to 2 s) with the same address, presenting the
// shard it holds (Register.held). A new coordinator adopts it (Assignment.adopt: it only joins the
// new groups, then answers Loaded) or gives it another shard to load (it drops its own first).
// After --coordinator-grace-seconds without a coordinator taking it back, Run() returns an error
// (the process exits 1). docs/healing.md "The coordinator restarts".
//
// The coordinator ending the stream without a Shutdown (CANCELLED: it marked this worker lost, for
// example after it was frozen past the heartbeat timeout) does not end the worker either: it leaves
// its collective groups, keeps its shard and registers again at once; the coordinator gives it its
// slot back if that is still open, makes it a spare of its node if the slot was taken, or refuses
// it (Run() then returns the reason: exit 1). At most 3 times in a row without a load or a step
// completing in between. A Shutdown that lets this worker go (Shutdown.let_go: a replacement whose
// load failed) is an error too; a Shutdown otherwise (the coordinator stops) ends Run() with OK.
//
// A load error, a step error or a collective timeout is sent as a Failure naming this worker
// (node, stage, TP rank), the cause, its epoch and the step; the worker then marks itself
// NOT_SERVING in its health service, answers every later step with that Failure, and stays
// connected (the other workers and the coordinator keep running) until the coordinator sends a
// Regroup (a successful one clears the failure: the group heals, docs/healing.md) or Shutdown, or
// ends the stream, or Stop() is called.
//
// Ownership: borrows the health service, which must outlive this. Threading: Run() is called
// once, on one thread; Stop() may be called from any thread (a signal handler's thread), at any
// time, any number of times.
#ifndef SHARDSERVE_WORKER_WORKER_SERVICE_H_
#define SHARDSERVE_WORKER_WORKER_SERVICE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <grpcpp/client_context.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/credentials.h>
#include <prometheus/registry.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "telemetry/log.h"
#include "shardserve/v1/worker.grpc.pb.h"
#include "worker/control_dispatch.h"
#include "worker/step_executor.h"
#include "worker/worker_metrics.h"

namespace shardserve {

struct WorkerOptions {
  std::string coordinator;      // host:port of the coordinator
  // How to reach it (security/tls.h MakeChannelCredentials); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> channel_credentials;
  std::string node;             // node name: the workers of one node form a TP group
  std::string device;           // "cpu" or "cuda:K"
  int64_t memory_bytes = 0;     // memory for weights and KV cache, reported to the planner
  double memory_bytes_per_s = 0;  // that memory's peak bandwidth, reported to the planner; 0: unknown
  std::string address;          // this worker's own gRPC server (health), host:port
  std::string collective_host;  // address this worker's collectives listen on
  int cpu_threads = 0;          // --device cpu: math threads (MakeCpuBackend); 0: OpenMP's default
  // --device cpu: the products' precision (MakeCpuBackend); none: the checkpoint's where the CPU
  // has it (StepExecutor::ChooseCpuMatMul).
  std::optional<CpuMatMul> cpu_matmul;
  Collectives collectives = Collectives::kAuto;  // --collectives (StepExecutor::Options)
  bool dummy_weights_on_device = true;           // --dummy-weights device (default)
  // --activation-quantization: kInt8 rounds the CPU products' inputs by int8/int4 weights to int8, kInt16
  // those by int4 weights to int16 (the worker's default where the CPU has AVX-512 VNNI).
  CpuActivationQuant cpu_activation_quant = CpuActivationQuant::kNone;
  // The CUDA backend's paths, each on but those a --no-cuda-... switch turns off
  // (kernels/cuda/cuda_switches.h; StepExecutorOptions::cuda).
  CudaBackendOptions cuda = {};
  // The Prometheus /metrics endpoint this process serves (host:port, reported in Register; empty:
  // none) and its registry, where the worker's metrics are created once it is assigned (borrowed,
  // must outlive the service; null: no metrics).
  std::string metrics_address;
  prometheus::Registry* metrics_registry = nullptr;
  // How long to wait for the coordinator to accept a connection.
  absl::Duration connect_timeout = absl::Seconds(60);
  // Test-only: sleep this long before each step, so that a test can act in the middle of a
  // generation. Zero in production.
  absl::Duration debug_step_delay = absl::ZeroDuration();
  // TEST-ONLY (--debug-load-delay-ms): after loading an assigned shard, wait this long before
  // answering Loaded, so that a test can kill a worker that is still loading (tests/heal_test.cc).
  absl::Duration debug_load_delay = absl::ZeroDuration();
  // Register as a spare (worker.proto Register.spare): no shard until a slot of this node is lost.
  bool spare = false;
  // How long to outlive a coordinator that went away, re-registering (--coordinator-grace-seconds);
  // zero: stop with it, as before protocol version 4.
  absl::Duration coordinator_grace = absl::Seconds(60);
};

class WorkerService {
 public:
  // `health` (not owned; may be null) is this process's gRPC health service: NOT_SERVING until the
  // shard is loaded, SERVING while steps run, NOT_SERVING after a failure.
  WorkerService(WorkerOptions options, grpc::HealthCheckServiceInterface* health);
  WorkerService(const WorkerService&) = delete;
  WorkerService& operator=(const WorkerService&) = delete;

  // Connects, registers and serves until the coordinator sends Shutdown or Stop() is called: then
  // OK (an error for a Shutdown that lets it go). A coordinator that goes away is waited for, and a
  // stream the coordinator ends is followed by a new registration (see above). An error when the
  // coordinator cannot be reached within connect_timeout, refuses this worker (a node with too many
  // workers, a node not in the group, too little memory), or none takes it back within
  // coordinator_grace.
  absl::Status Run();

  // Makes Run() return soon: the control stream is cancelled at once; a step or a load in progress
  // finishes first (each collective is bounded by the collective timeout).
  void Stop();

 private:
  using Stream = grpc::ClientReaderWriterInterface<v1::WorkerMessage, v1::CoordinatorMessage>;

  // Waits until the channel to the coordinator is up or Stop() is called (OK), or connect_timeout
  // passes (Unavailable), or the coordinator's port turns out to speak TLS when this worker does
  // not, or the reverse (CheckTlsMatches: FailedPrecondition).
  absl::Status WaitForCoordinator(grpc::Channel* channel);
  // Dials the coordinator's port: FailedPrecondition "TLS mismatch: ..." naming the flags when it
  // speaks TLS and this worker plaintext, or the reverse; OK otherwise (also when it cannot tell).
  absl::Status CheckTlsMatches() const;
  // How a control stream ended, for Run().
  enum class SessionEnd {
    kDone,                // a Shutdown, a refusal, Stop(), or an error: Run() returns
    kCoordinatorGone,     // the coordinator went away (UNAVAILABLE): re-register within the grace
    kEndedByCoordinator,  // the coordinator ended it without a Shutdown (it lost this worker): rejoin
  };
  // One control stream: registers (with the shard it holds, if any) and serves until the stream
  // ends; *end says how.
  absl::Status Session(v1::WorkerControl::Stub* stub, SessionEnd* end);
  // Sleeps `d` unless Stop() is called first (then true, at once).
  bool SleepUnlessStopped(absl::Duration d);
  // The protocol after Register, until the stream ends or Shutdown: each message handled as
  // NextControlAction (worker/control_dispatch.h) says. FailedPrecondition when the coordinator
  // refuses this worker (a Shutdown before any assignment) or lets it go.
  absl::Status Serve(Stream* stream, v1::WorkerControl::StubInterface* stub);
  // Loads the assigned shard (dropping one it holds first).
  void Load(Stream* stream, v1::WorkerControl::StubInterface* stub);
  // Handles an Assignment with adopt (a shard held): keeps the shard, joins the new groups.
  void Adopt(Stream* stream, v1::WorkerControl::StubInterface* stub);
  // Handles a Regroup (a shard held): re-forms the collective groups under the new epoch, keeping
  // the weights.
  void Regroup(Stream* stream, v1::WorkerControl::StubInterface* stub);
  // Executes a step (a shard held, no failure) and answers its StepResult, or the failure.
  void RunStep(Stream* stream);
  // Sets the process-memory metric (a CPU worker's own memory beside its buffers) when `now`, or when
  // the last setting is a second old or more.
  void SampleProcessMemory(bool now);
  // Sends heartbeats every second until the stream is done.
  void HeartbeatLoop(Stream* stream);
  // Writes one message; serialized with the heartbeat thread's writes.
  bool Write(Stream* stream, const v1::WorkerMessage& message);
  // Records the first failure, reports it to the coordinator (with the epoch and `step_id`, 0 for
  // none) and marks this worker NOT_SERVING.
  void Fail(Stream* stream, const std::string& message, uint64_t step_id = 0);
  // Loaded {epoch} for the shard executor_ holds, ready after `seconds` of loading or joining.
  v1::WorkerMessage LoadedMessage(uint64_t epoch, double seconds) const;
  // The group's epoch this worker is in: its assignment's, then its last Regroup's.
  uint64_t epoch() const;
  void SetServing(bool serving);
  // "worker w3 (node n1, stage 1, tp rank 0)", or "worker (node n1)" before the assignment: who
  // speaks, in the log and in Failure messages.
  std::string Who() const;
  // The ids of this worker for a log line: node, and worker id, stage and rank once assigned.
  LogIds Ids(const char* level = "info") const;

  // ---- Constant after construction ----
  const WorkerOptions options_;
  grpc::HealthCheckServiceInterface* const health_;

  // ---- Shared with Stop() and the heartbeat thread ----
  absl::Mutex mu_;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;  // the Connect call's, while it runs
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool stream_done_ ABSL_GUARDED_BY(mu_) = false;  // the heartbeat thread stops

  // Serializes writes to the control stream (gRPC allows one writer at a time).
  absl::Mutex write_mu_;

  // ---- Used only by the thread in Run() ----
  bool assigned_ = false;               // has had an assignment (from any coordinator)
  bool assigned_this_stream_ = false;   // the current control stream brought an Assignment
  bool accepted_this_stream_ = false;   // ... or a Regroup: this coordinator had taken the worker in
  bool told_to_stop_ = false;           // the current stream brought a Shutdown
  bool peer_ended_ = false;             // the coordinator's side ended the current stream
  int rejoins_ = 0;                     // registrations after an ended stream since the last load or step
  v1::Assignment assignment_;           // the last one, updated by Regroup and Adopt
  std::string model_fingerprint_;       // ModelFingerprint of assignment_.model_path at load; "" unknown
  std::unique_ptr<WorkerMetrics> metrics_;  // once assigned, when options_.metrics_registry is set
  std::unique_ptr<StepExecutor> executor_;  // declared after metrics_: destroyed first
  std::string failure_;         // the first failure; not empty: no more steps run
  uint64_t logged_decode_kernels_ = 0;  // kernels per decode step in the last such log line
  int logged_step_graphs_ = 0;          // step graphs recorded, in the last such log line
  bool logged_graphs_off_ = false;      // the line saying why step graphs were turned off was written
  std::chrono::steady_clock::time_point process_memory_at_;  // the last SetProcessMemory
  v1::CoordinatorMessage in_;   // the message being handled
  v1::WorkerMessage reply_;     // holds a step_result, reused step after step
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_WORKER_SERVICE_H_
