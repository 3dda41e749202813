#include "worker/worker_service.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>
#include <utility>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "model/shard_identity.h"
#include "security/transport_probe.h"
#include "worker/grpc_rendezvous.h"
#include "worker/worker_log.h"

namespace shardserve {
namespace {

constexpr absl::Duration kHeartbeatInterval = absl::Seconds(1);
// How often WaitForCoordinator checks for Stop() while the coordinator is not up.
constexpr absl::Duration kConnectPoll = absl::Milliseconds(250);
// Waits between tries to re-register after the coordinator went away: doubling, bounded.
constexpr absl::Duration kReconnectBackoffMin = absl::Milliseconds(250);
constexpr absl::Duration kReconnectBackoffMax = absl::Seconds(2);
// How many times in a row the worker registers again after the coordinator ended its stream without
// a load or a step completing in between (Run()).
constexpr int kMaxRejoins = 3;
// While the channel fails to connect, how often WaitForCoordinator dials the coordinator's port to
// see whether it speaks TLS when this worker does not, or the reverse (security/transport_probe.h),
// and how long one such dial may take.
constexpr absl::Duration kProbeInterval = absl::Seconds(2);
constexpr absl::Duration kProbeTimeout = absl::Seconds(2);

}  // namespace

WorkerService::WorkerService(WorkerOptions options, grpc::HealthCheckServiceInterface* health)
    : options_(std::move(options)), health_(health) {
  SetServing(false);
}

void WorkerService::Stop() {
  absl::MutexLock lock(&mu_);
  stop_requested_ = true;
  if (context_ != nullptr) context_->TryCancel();
}

void WorkerService::SetServing(bool serving) {
  if (health_ != nullptr) health_->SetServingStatus(serving);
}

std::string WorkerService::Who() const {
  if (!assigned_) return absl::StrCat("worker (node ", options_.node, ")");
  return absl::StrCat("worker ", assignment_.worker_id(), " (node ", options_.node, ", stage ", assignment_.stage(),
                      ", tp rank ", assignment_.tp_rank(), ")");
}

LogIds WorkerService::Ids(const char* level) const {
  LogIds ids;
  ids.node = options_.node;
  ids.level = level;
  if (assigned_) {
    ids.worker = assignment_.worker_id();
    ids.stage = assignment_.stage();
    ids.rank = assignment_.tp_rank();
  }
  return ids;
}

absl::Status WorkerService::WaitForCoordinator(grpc::Channel* channel) {
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  absl::Time next_probe = absl::InfinitePast();
  while (!channel->WaitForConnected(absl::ToChronoTime(std::min(deadline, absl::Now() + kConnectPoll)))) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_requested_) return absl::OkStatus();  // Run() sees the request and returns
    }
    // A failed connection may be a TLS mismatch, which no retry mends: name it and stop.
    const bool late = absl::Now() >= deadline;
    if (late || (channel->GetState(false) == GRPC_CHANNEL_TRANSIENT_FAILURE && absl::Now() >= next_probe)) {
      next_probe = absl::Now() + kProbeInterval;
      SHARDSERVE_RETURN_IF_ERROR(CheckTlsMatches());
    }
    if (late) {
      return absl::UnavailableError(absl::StrCat(
          "cannot reach the coordinator at ", options_.coordinator, " within ",
          absl::FormatDuration(options_.connect_timeout),
          options_.channel_credentials ? " (or the TLS handshake failed: is the coordinator's certificate from "
                                         "--tls-ca, and this worker's from the coordinator's --tls-ca?)"
                                       : ""));
    }
  }
  return absl::OkStatus();
}

absl::Status WorkerService::CheckTlsMatches() const {
  const bool tls = options_.channel_credentials != nullptr;
  const PortSpeaks speaks = ProbePort(options_.coordinator, kProbeTimeout);
  if (!tls && speaks == PortSpeaks::kTls) {
    return absl::FailedPreconditionError(absl::StrCat(
        "TLS mismatch: the coordinator at ", options_.coordinator,
        " speaks TLS and this worker plaintext: give the worker --tls-ca (the CA of the coordinator's certificate), "
        "--tls-cert and --tls-key (a certificate from the coordinator's --tls-ca)"));
  }
  if (tls && speaks == PortSpeaks::kPlaintext) {
    return absl::FailedPreconditionError(absl::StrCat(
        "TLS mismatch: the coordinator at ", options_.coordinator,
        " speaks plaintext (no TLS) and this worker TLS (--tls-cert/--tls-ca): give the coordinator --tls-cert, "
        "--tls-key and --tls-ca, or this worker none of them"));
  }
  return absl::OkStatus();
}

bool WorkerService::SleepUnlessStopped(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&stop_requested_), d);
}

absl::Status WorkerService::Run() {
  WorkerLog(Who(), absl::StrCat("connecting to the coordinator at ", options_.coordinator), Ids());
  // Reconnect backoff held to at most a second, so that a restarted coordinator is found soon
  // (gRPC's default grows to 120 s).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
      options_.coordinator, options_.channel_credentials ? options_.channel_credentials : grpc::InsecureChannelCredentials(),
      args);
  SHARDSERVE_RETURN_IF_ERROR(WaitForCoordinator(channel.get()));
  std::unique_ptr<v1::WorkerControl::Stub> stub = v1::WorkerControl::NewStub(channel);

  // Since when no coordinator has given this worker a shard (or taken it in as a spare); none while
  // one has.
  std::optional<absl::Time> orphaned_since;
  absl::Duration backoff = kReconnectBackoffMin;
  absl::Status result;
  for (;;) {
    SessionEnd end = SessionEnd::kDone;
    result = Session(stub.get(), &end);
    {
      absl::MutexLock lock(&mu_);
      if (stop_requested_) break;
    }
    if (end == SessionEnd::kEndedByCoordinator) {
      // The coordinator let this worker go without a Shutdown: it was lost to the group (frozen past
      // the heartbeat timeout, a step deadline missed, a malformed message) while this process went
      // on. Register again: the coordinator gives it its slot back if that is still open (adopting
      // the shard it holds), makes it a spare of its node if the slot was taken, or refuses it
      // (a Shutdown: Run() then returns the reason). Bounded, so that a worker the coordinator keeps
      // letting go does not register forever.
      if (++rejoins_ > kMaxRejoins) {
        result = absl::FailedPreconditionError(absl::StrCat(
            "the coordinator at ", options_.coordinator, " ended this worker's control stream ", rejoins_,
            " times in a row without it loading or completing a step in between; exiting"));
        WorkerLog(Who(), std::string(result.message()), Ids("error"));
        break;
      }
      if (executor_ != nullptr) executor_->LeaveCoordinator();
      failure_.clear();
      SetServing(false);
      WorkerLog(Who(),
                absl::StrCat("the coordinator at ", options_.coordinator,
                             " ended this worker's control stream without a shutdown (it lost this worker: frozen, "
                             "too slow or silent); registering again",
                             executor_ != nullptr ? ", holding its shard (left the collective groups)" : "",
                             ": it takes its slot back if that is still open, else it waits as a spare of node ",
                             options_.node),
                Ids("warn"));
      if (SleepUnlessStopped(kReconnectBackoffMin)) break;
      continue;
    }
    if (end != SessionEnd::kCoordinatorGone || options_.coordinator_grace <= absl::ZeroDuration()) break;
    if (accepted_this_stream_ || !orphaned_since.has_value()) {
      // The coordinator that had this worker is gone: outlive it, holding the shard.
      orphaned_since = absl::Now();
      backoff = kReconnectBackoffMin;
      if (executor_ != nullptr) executor_->LeaveCoordinator();
      failure_.clear();  // the old group's failure went with it
      SetServing(false);
      WorkerLog(Who(),
                absl::StrCat("the coordinator at ", options_.coordinator, " is gone; ",
                             executor_ != nullptr ? "keeping the shard (dropped the running batch, left the "
                                                    "collective groups), "
                                                  : "",
                             "re-registering for up to ", absl::FormatDuration(options_.coordinator_grace),
                             " (--coordinator-grace-seconds)"),
                Ids("warn"));
    }
    const absl::Duration left = options_.coordinator_grace - (absl::Now() - *orphaned_since);
    if (left <= absl::ZeroDuration()) {
      result = absl::UnavailableError(absl::StrCat(
          "no coordinator at ", options_.coordinator, " took this worker back within ",
          absl::FormatDuration(options_.coordinator_grace), " (--coordinator-grace-seconds); exiting"));
      WorkerLog(Who(), std::string(result.message()), Ids("error"));
      break;
    }
    if (SleepUnlessStopped(std::min(backoff, left))) break;
    backoff = std::min(backoff * 2, kReconnectBackoffMax);
  }
  executor_.reset();  // closes the collective connections; peers see them drop
  SetServing(false);
  WorkerLog(Who(), "stopped", Ids());
  return result;
}

absl::Status WorkerService::Session(v1::WorkerControl::Stub* stub, SessionEnd* end) {
  grpc::ClientContext context;
  {
    absl::MutexLock lock(&mu_);
    if (stop_requested_) return absl::OkStatus();
    context_ = &context;
    stream_done_ = false;
  }
  accepted_this_stream_ = false;
  assigned_this_stream_ = false;
  told_to_stop_ = false;
  peer_ended_ = false;
  std::unique_ptr<Stream> stream = stub->Connect(&context);

  v1::WorkerMessage hello;
  v1::Register* r = hello.mutable_register_();
  r->set_protocol_version(v1::PROTOCOL_VERSION_CURRENT);
  r->set_node(options_.node);
  r->set_device(options_.device);
  r->set_memory_bytes(options_.memory_bytes);
  r->set_memory_bytes_per_s(options_.memory_bytes_per_s);
  r->set_address(options_.address);
  r->set_collective_host(options_.collective_host);
  r->set_metrics_address(options_.metrics_address);
  if (options_.device == "cpu") r->set_cpu_matmul(StepExecutor::RegisteredCpuMatMul(options_.cpu_matmul));
  // A spare that took a slot holds a shard now: it comes back as that slot's worker.
  r->set_spare(options_.spare && executor_ == nullptr);
  if (executor_ != nullptr) {
    *r->mutable_held()->mutable_assignment() = assignment_;
    r->mutable_held()->mutable_assignment()->clear_rendezvous_token();  // the old coordinator's secret
    r->mutable_held()->set_model_fingerprint(model_fingerprint_);
  }
  absl::Status result;
  std::thread heartbeat;
  if (!Write(stream.get(), hello)) {
    peer_ended_ = true;
    result = absl::UnavailableError(absl::StrCat("the coordinator at ", options_.coordinator,
                                                 " closed the control stream before registration"));
  } else {
    WorkerLog(Who(),
              absl::StrCat("registered (", options_.device, ", listening on ", options_.address,
                           options_.metrics_address.empty() ? "" : ", metrics on http://", options_.metrics_address,
                           options_.metrics_address.empty() ? "" : "/metrics",
                           executor_ != nullptr ? absl::StrCat(", holding stage ", assignment_.stage(), " tp rank ",
                                                               assignment_.tp_rank(), " of epoch ", assignment_.epoch())
                                                : "",
                           ")"),
              Ids());
    heartbeat = std::thread([this, s = stream.get()] { HeartbeatLoop(s); });
    result = Serve(stream.get(), stub);
  }

  // Unless the coordinator ended the call (its status then tells why: UNAVAILABLE when it went
  // away), end it from this side too, which also makes a heartbeat stuck in a write return; stop
  // the heartbeat thread, drain the call and close it.
  {
    absl::MutexLock lock(&mu_);
    context_ = nullptr;
    stream_done_ = true;
  }
  if (!peer_ended_) context.TryCancel();
  if (heartbeat.joinable()) heartbeat.join();
  while (stream->Read(&in_)) {
  }
  const grpc::Status finish = stream->Finish();
  if (result.ok() && !assigned_ && !told_to_stop_ && !finish.ok() &&
      finish.error_code() != grpc::StatusCode::CANCELLED && finish.error_code() != grpc::StatusCode::UNAVAILABLE) {
    // Refused before any assignment (UNAUTHENTICATED: no certificate from the coordinator's CA).
    result = absl::FailedPreconditionError(
        absl::StrCat("the coordinator at ", options_.coordinator, " refused this worker: ", finish.error_message()));
  }  // else what went wrong, if anything, is known and logged already
  // The coordinator process died or the connection dropped (not a Shutdown, a refusal, or the
  // coordinator ending this worker's stream on purpose, which is CANCELLED).
  const bool coordinator_gone = !told_to_stop_ && finish.error_code() == grpc::StatusCode::UNAVAILABLE &&
                               !absl::IsFailedPrecondition(result);
  // The coordinator ended this stream on purpose (CANCELLED from its side) without a Shutdown: it
  // marked this worker lost.
  const bool ended = peer_ended_ && !told_to_stop_ && result.ok() && finish.error_code() == grpc::StatusCode::CANCELLED;
  *end = coordinator_gone ? SessionEnd::kCoordinatorGone : ended ? SessionEnd::kEndedByCoordinator : SessionEnd::kDone;
  return result;
}

absl::Status WorkerService::Serve(Stream* stream, v1::WorkerControl::StubInterface* stub) {
  while (stream->Read(&in_)) {
    const ControlState state{.assigned_this_stream = assigned_this_stream_,
                             .holds_shard = executor_ != nullptr,
                             .failed = !failure_.empty(),
                             .epoch = epoch()};
    switch (NextControlAction(state, in_)) {
      case ControlAction::kSecondAssignment:
        Fail(stream, absl::StrCat(Who(), ": the coordinator sent a second assignment"));
        break;
      case ControlAction::kLoad:
        Load(stream, stub);
        break;
      case ControlAction::kAdopt:
        Adopt(stream, stub);
        break;
      case ControlAction::kAdoptWithoutShard:
        assignment_ = in_.assignment();
        assigned_ = true;
        assigned_this_stream_ = true;
        accepted_this_stream_ = true;
        Fail(stream, absl::StrCat(Who(), ": asked to keep a shard it does not hold"));
        break;
      case ControlAction::kStep:
        RunStep(stream);
        break;
      case ControlAction::kRefuseStep: {
        // This worker cannot take part; say so rather than leave the coordinator waiting.
        const v1::StepPlan& plan = in_.step();
        v1::WorkerMessage failure;
        failure.mutable_failure()->set_message(
            failure_.empty() ? absl::StrCat(Who(), ": got step ", plan.step_id(), " before an assignment") : failure_);
        failure.mutable_failure()->set_epoch(epoch());
        failure.mutable_failure()->set_step_id(plan.step_id());
        Write(stream, failure);
        break;
      }
      case ControlAction::kRegroup:
        accepted_this_stream_ = true;
        Regroup(stream, stub);
        break;
      case ControlAction::kRegroupWithoutShard:
        accepted_this_stream_ = true;
        Fail(stream, absl::StrCat(Who(), ": got a regroup to epoch ", in_.regroup().epoch(), " without a loaded shard"));
        break;
      case ControlAction::kRefused:
        told_to_stop_ = true;
        return absl::FailedPreconditionError(absl::StrCat("the coordinator at ", options_.coordinator,
                                                          " refused this worker: ", in_.shutdown().reason()));
      case ControlAction::kLetGo:
        // Let go for its own failure (a replacement whose load failed): not a clean stop.
        told_to_stop_ = true;
        return absl::FailedPreconditionError(absl::StrCat("the coordinator at ", options_.coordinator,
                                                          " let this worker go: ", in_.shutdown().reason()));
      case ControlAction::kShutdown:
        told_to_stop_ = true;
        WorkerLog(Who(), absl::StrCat("shutdown requested by the coordinator: ", in_.shutdown().reason()), Ids());
        return absl::OkStatus();
      case ControlAction::kIgnore:
        WorkerLog(Who(), "ignoring an empty message from the coordinator (a newer protocol?)", Ids());
        break;
    }
  }
  peer_ended_ = true;
  WorkerLog(Who(), "the coordinator ended the control stream", Ids());
  return absl::OkStatus();
}

void WorkerService::Load(Stream* stream, v1::WorkerControl::StubInterface* stub) {
  if (executor_ != nullptr) {
    WorkerLog(Who(), absl::StrCat("dropping the shard it holds (stage ", assignment_.stage(), ", tp rank ",
                                  assignment_.tp_rank(), ", layers [", assignment_.first_layer(), ", ",
                                  assignment_.end_layer(), ")): the coordinator assigns another"),
              Ids("warn"));
    executor_.reset();
  }
  assignment_ = in_.assignment();
  assigned_ = true;
  assigned_this_stream_ = true;
  accepted_this_stream_ = true;
  failure_.clear();
  const v1::Assignment& a = assignment_;
  if (a.model_manifest_size() > 0) {
    // The checkpoint at model_path must be the coordinator's own: this machine's copy may differ.
    const absl::StatusOr<std::vector<std::string>> here = ModelManifest(a.model_path());
    const absl::Status same =
        here.ok() ? SameModelFiles(*here, std::vector<std::string>(a.model_manifest().begin(), a.model_manifest().end()))
                  : here.status();
    if (!same.ok()) {
      Fail(stream, absl::StrCat(Who(), ": refusing to load ", a.model_path(),
                                ": this worker's copy is not the coordinator's model: ", same.message()));
      return;
    }
  }
  // What the weights about to be loaded are, for a later coordinator that would adopt this worker.
  absl::StatusOr<std::string> fingerprint = ModelFingerprint(a.model_path());
  model_fingerprint_ = fingerprint.ok() ? *fingerprint : "";
  if (!fingerprint.ok()) {
    WorkerLog(Who(), absl::StrCat("no model fingerprint (a restarted coordinator cannot adopt this worker): ",
                                  fingerprint.status().message()), Ids("warn"));
  }
  WorkerLog(Who(), absl::StrCat("assigned layers [", a.first_layer(), ", ", a.end_layer(), ") of ", a.model_path(),
                                ", stage ", a.stage(), " of ", a.num_stages(), ", tp rank ", a.tp_rank(), " of ",
                                a.tp_size()),
            Ids());
  const auto start = std::chrono::steady_clock::now();
  GrpcRendezvousStore store(stub, a.rendezvous_token());
  absl::StatusOr<std::unique_ptr<StepExecutor>> executor =
      StepExecutor::Create(a, options_.device, &store, options_.collective_host,
                           {options_.cpu_threads, options_.cpu_matmul, options_.collectives,
                            options_.dummy_weights_on_device, options_.cpu_activation_quant,
                            options_.cuda});
  if (!executor.ok()) {
    Fail(stream, absl::StrCat(Who(), ": loading failed: ", executor.status().message()));
    return;
  }
  executor_ = std::move(*executor);
  logged_step_graphs_ = 0;
  logged_graphs_off_ = false;
  if (options_.metrics_registry != nullptr && metrics_ == nullptr) {
    // The checkpoint directory's base name, computed as the coordinator's ServedModel::name.
    const std::filesystem::path path = std::filesystem::path(a.model_path()).lexically_normal();
    std::string model = path.filename().string();
    if (model.empty()) model = path.parent_path().filename().string();
    metrics_ = std::make_unique<WorkerMetrics>(options_.metrics_registry, model, options_.node, a.stage(), a.tp_rank());
    metrics_->SetWeightBytes(executor_->weight_bytes());
    executor_->SetCollectiveObserver(metrics_.get());
  }
  if (options_.debug_load_delay > absl::ZeroDuration()) {
    WorkerLog(Who(), absl::StrCat("TEST-ONLY: holding the load for ", absl::FormatDuration(options_.debug_load_delay),
                                  " (--debug-load-delay-ms)"),
              Ids());
    absl::SleepFor(options_.debug_load_delay);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const v1::WorkerMessage loaded = LoadedMessage(a.epoch(), seconds);
  SetServing(true);
  WorkerLog(Who(), absl::StrFormat("loaded in %.2f s: %.1f MiB of weights (linear layers: %s), %d KV blocks, %s",
                                   seconds, static_cast<double>(executor_->weight_bytes()) / (1 << 20),
                                   executor_->quantization_summary(), executor_->kv_blocks(),
                                   executor_->backend_name()), Ids());
  if (!executor_->draft_summary().empty()) WorkerLog(Who(), executor_->draft_summary(), Ids());
  if (const std::string c = executor_->collectives_summary(); !c.empty()) WorkerLog(Who(), c, Ids());
  if (!executor_->host_cpus_warning().empty()) WorkerLog(Who(), executor_->host_cpus_warning(), Ids("warn"));
  if (const std::string untried = executor_->gpu_paths_not_yet_run(); !untried.empty()) {
    WorkerLog(Who(), absl::StrCat("this model runs CUDA kernels that have not yet passed on a GPU (docs/gpu.md): ",
                                  untried), Ids("warn"));
  }
  // The plan's memory beside what this worker allocated and measured, item by item (docs/gpu.md).
  for (const std::string& line : executor_->MemoryReport()) WorkerLog(Who(), "memory " + line, Ids());
  if (metrics_ != nullptr) {
    std::vector<std::pair<std::string, int64_t>> planned;
    for (const v1::MemoryItem& item : a.planned_memory()) planned.emplace_back(item.name(), item.bytes());
    metrics_->SetPlannedMemory(planned);
    SampleProcessMemory(/*now=*/true);
  }
  rejoins_ = 0;
  Write(stream, loaded);
}

void WorkerService::Adopt(Stream* stream, v1::WorkerControl::StubInterface* stub) {
  const v1::Assignment& a = in_.assignment();
  assigned_this_stream_ = true;
  accepted_this_stream_ = true;
  const uint64_t old_epoch = executor_->epoch();
  const std::string old_id = assignment_.worker_id();
  const auto start = std::chrono::steady_clock::now();
  GrpcRendezvousStore store(stub, a.rendezvous_token());
  const absl::Status s = executor_->Adopt(a, &store);
  assignment_ = a;
  failure_.clear();
  if (!s.ok()) {
    executor_.reset();  // no shard it can serve: the Failure carries the new epoch, and it holds nothing
    Fail(stream, absl::StrCat(Who(), ": adoption under epoch ", a.epoch(), " failed: ", s.message()));
    return;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const v1::WorkerMessage loaded = LoadedMessage(a.epoch(), seconds);
  SetServing(true);
  WorkerLog(Who(), absl::StrFormat("adopted by the coordinator at %s (was %s under epoch %d): kept its weights "
                                   "(%.1f MiB, no reload), joined the groups of epoch %d in %.2f s",
                                   options_.coordinator, old_id, old_epoch,
                                   static_cast<double>(executor_->weight_bytes()) / (1 << 20), a.epoch(), seconds),
            Ids());
  rejoins_ = 0;
  Write(stream, loaded);
}

v1::WorkerMessage WorkerService::LoadedMessage(uint64_t epoch, double seconds) const {
  v1::WorkerMessage loaded;
  v1::Loaded* l = loaded.mutable_loaded();
  l->set_weight_bytes(static_cast<int64_t>(executor_->weight_bytes()));
  l->set_kv_blocks(executor_->kv_blocks());
  l->set_load_seconds(seconds);
  l->set_epoch(epoch);
  return loaded;
}

uint64_t WorkerService::epoch() const {
  return executor_ != nullptr ? executor_->epoch() : assignment_.epoch();
}

void WorkerService::Regroup(Stream* stream, v1::WorkerControl::StubInterface* stub) {
  const v1::Regroup& r = in_.regroup();
  const uint64_t old_epoch = executor_->epoch();
  WorkerLog(Who(), absl::StrCat("regrouping: epoch ", old_epoch, " -> ", r.epoch(),
                                ": leaving the old collective groups, dropping the running batch, keeping the weights"),
            Ids("warn"));
  SetServing(false);
  const auto start = std::chrono::steady_clock::now();
  GrpcRendezvousStore store(stub, r.rendezvous_token());
  const absl::Status s = executor_->Regroup(r, &store);
  failure_.clear();  // the old epoch's failure is over; a new one is this regroup's
  if (!s.ok()) {
    Fail(stream, absl::StrCat(Who(), ": regrouping to epoch ", r.epoch(), " failed: ", s.message()));
    return;
  }
  assignment_.set_epoch(r.epoch());
  assignment_.set_tp_group(r.tp_group());
  assignment_.set_send_group(r.send_group());
  assignment_.set_recv_group(r.recv_group());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const v1::WorkerMessage loaded = LoadedMessage(r.epoch(), seconds);
  SetServing(true);
  WorkerLog(Who(), absl::StrFormat("regrouped under epoch %d in %.2f s", r.epoch(), seconds), Ids());
  if (const std::string c = executor_->collectives_summary(); !c.empty()) WorkerLog(Who(), c, Ids());
  if (!executor_->host_cpus_warning().empty()) WorkerLog(Who(), executor_->host_cpus_warning(), Ids("warn"));
  rejoins_ = 0;
  Write(stream, loaded);
}

void WorkerService::SampleProcessMemory(bool now) {
  if (metrics_ == nullptr || executor_ == nullptr) return;
  const auto t = std::chrono::steady_clock::now();
  if (!now && t - process_memory_at_ < std::chrono::seconds(1)) return;  // a read of /proc a second at most
  process_memory_at_ = t;
  if (const std::optional<int64_t> bytes = executor_->ProcessMemoryBytes()) metrics_->SetProcessMemory(*bytes);
}

void WorkerService::RunStep(Stream* stream) {
  const v1::StepPlan& plan = in_.step();
  if (options_.debug_step_delay > absl::ZeroDuration()) absl::SleepFor(options_.debug_step_delay);
  const auto start = std::chrono::steady_clock::now();
  if (absl::Status s = executor_->Execute(plan, reply_.mutable_step_result()); !s.ok()) {
    executor_->LeaveGroups();  // peers stuck in a collective with this worker fail now, not after the timeout
    Fail(stream, absl::StrCat(Who(), ": step ", plan.step_id(), " failed: ", s.message()), plan.step_id());
    return;
  }
  // More tokens than rows: some row feeds a prompt chunk. A step that mixes prefill chunks and
  // decodes counts as prefill (its cost is the prefill's).
  const bool prefill = plan.token_ids_size() > plan.row_seq_ids_size();
  const uint64_t kernels = executor_->last_step_kernel_launches();
  if (metrics_ != nullptr) {
    metrics_->StepDone(prefill, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                       kernels);
  }
  SampleProcessMemory(/*now=*/false);
  // read every step, so that the device's 32-bit counts stay small
  if (absl::StatusOr<std::vector<uint64_t>> rows = executor_->ExpertRowsTotal(); !rows.ok()) {
    WorkerLog(Who(), absl::StrCat("reading the experts' row counts failed: ", rows.status().message()), Ids());
  } else if (metrics_ != nullptr) {
    metrics_->ExpertRowsDone(*rows);
  }
  bool memory_line = false;  // the device memory taken since loading, beside these (on CUDA)
  if (!prefill && kernels != logged_decode_kernels_) {  // on CUDA; tools/gpu/gpu-bench.sh reads this line
    WorkerLog(Who(), absl::StrCat("kernels per decode step: ", kernels, " (", plan.row_seq_ids_size(), " rows)"), Ids());
    logged_decode_kernels_ = kernels;
    memory_line = true;
  }
  if (executor_->step_graphs_recorded() != logged_step_graphs_) {  // CudaBackendOptions::step_graphs
    logged_step_graphs_ = executor_->step_graphs_recorded();
    WorkerLog(Who(),
              absl::StrCat("step graphs recorded: ", logged_step_graphs_, " (replayed for decode steps of their shape)"),
              Ids());
    memory_line = true;
  }
  if (memory_line) {
    if (const std::string line = executor_->MemoryAfterSteps(); !line.empty()) WorkerLog(Who(), "memory " + line, Ids());
  }
  if (!logged_graphs_off_ && !executor_->step_graphs_off().empty()) {
    logged_graphs_off_ = true;
    WorkerLog(Who(), absl::StrCat("step graphs turned off: ", executor_->step_graphs_off()), Ids());
  }
  rejoins_ = 0;
  Write(stream, reply_);
}

void WorkerService::Fail(Stream* stream, const std::string& message, uint64_t step_id) {
  if (failure_.empty()) failure_ = message;
  SetServing(false);
  WorkerLog(Who(),
            absl::StrCat("FAILED (epoch ", epoch(), "), now NOT_SERVING until the coordinator regroups or stops it: ",
                         message),
            Ids("error"));
  v1::WorkerMessage failure;
  failure.mutable_failure()->set_message(message);
  failure.mutable_failure()->set_epoch(epoch());
  failure.mutable_failure()->set_step_id(step_id);
  Write(stream, failure);
}

bool WorkerService::Write(Stream* stream, const v1::WorkerMessage& message) {
  absl::MutexLock lock(&write_mu_);
  return stream->Write(message);
}

void WorkerService::HeartbeatLoop(Stream* stream) {
  const v1::WorkerMessage heartbeat = [] {
    v1::WorkerMessage m;
    m.mutable_heartbeat();
    return m;
  }();
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stream_done_), kHeartbeatInterval)) return;
    }
    if (!Write(stream, heartbeat)) return;  // the stream is broken; Run() notices on its next Read
  }
}

}  // namespace shardserve
