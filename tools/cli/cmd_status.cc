// shardserve status: the plan and every worker's state, as the coordinator sees them.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tools/cli/client.h"
#include "tools/cli/command.h"
#include "base/flags.h"

namespace shardserve::cli {
namespace {

constexpr char kUsage[] =
    "usage: shardserve status [--address HOST:PORT] [--tls-ca FILE] [--tls-cert FILE --tls-key FILE]\n"
    "                         [--api-key KEY] [--insecure]\n"
    "  Prints the coordinator's health, the model, the plan and each worker's state.\n";

const std::string kFullUsage = std::string(kUsage) + kClientFlagsUsage;

int Run(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(args, ClientFlagNames(), {"help", kInsecureFlag});
  if (!flags.ok()) {
    std::fprintf(stderr, "shardserve status: %s\n%s", std::string(flags.status().message()).c_str(), kUsage);
    return 2;
  }
  if (flags->Has("help")) {
    std::printf("%s", kFullUsage.c_str());
    return 0;
  }
  const absl::StatusOr<ClientOptions> client = ClientOptionsFromFlags(*flags);
  if (!client.ok()) {
    std::fprintf(stderr, "shardserve status: %s\n", std::string(client.status().message()).c_str());
    return 2;
  }
  const std::string& address = client->address;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> connected = ConnectToCoordinator(*client);
  if (!connected.ok()) {
    std::fprintf(stderr, "shardserve status: %s\n", std::string(connected.status().message()).c_str());
    return 1;
  }
  std::shared_ptr<grpc::Channel> channel = *connected;
  auto deadline = [] { return std::chrono::system_clock::now() + std::chrono::seconds(5); };

  grpc::ClientContext hctx;
  hctx.set_deadline(deadline());
  grpc::health::v1::HealthCheckRequest hreq;
  grpc::health::v1::HealthCheckResponse hresp;
  grpc::Status hs = grpc::health::v1::Health::NewStub(channel)->Check(&hctx, hreq, &hresp);
  if (!hs.ok()) {
    std::fprintf(stderr, "shardserve status: cannot reach the coordinator at %s: %s%s\n", address.c_str(),
                 hs.error_message().c_str(),
                 client->tls.any() ? "" : "; if it serves TLS, give --tls-ca (docs/security.md)");
    return 1;
  }
  std::printf("coordinator %s: %s\n", address.c_str(),
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(hresp.status()).c_str());

  grpc::ClientContext ctx;
  ctx.set_deadline(deadline());
  v1::ClusterStatus cs;
  grpc::Status s = v1::InferenceService::NewStub(channel)->GetClusterStatus(&ctx, v1::GetClusterStatusRequest(), &cs);
  if (!s.ok()) {
    std::fprintf(stderr, "shardserve status: GetClusterStatus: %s\n", s.error_message().c_str());
    return 1;
  }
  const v1::ModelInfo& m = cs.model();
  std::printf("model %s (%s, %lld layers, vocab %lld, checkpoint %s, max length %lld)\n", m.name().c_str(), m.architecture().c_str(),
              static_cast<long long>(m.num_layers()), static_cast<long long>(m.vocab_size()), m.dtype().c_str(),
              static_cast<long long>(m.max_model_len()));
  // state: starting, serving, healing (a lost worker is being replaced: docs/healing.md) or
  // degraded; an older coordinator sends none.
  std::printf("layout TP=%d x PP=%d, %s, state %s, epoch %llu\n", cs.tp(), cs.pp(),
              cs.serving() ? "serving" : "NOT serving", cs.state().empty() ? "unknown" : cs.state().c_str(),
              static_cast<unsigned long long>(cs.epoch()));
  const v1::SchedulerStatus& q = cs.scheduler();
  std::printf("scheduler: %d running (max %d), %d waiting (max %d), KV blocks %lld free of %lld (%lld tokens each), "
              "%lld preemptions, %d micro-batch(es), %lld tokens per step\n",
              q.running(), q.max_running(), q.waiting(), q.max_waiting(), static_cast<long long>(q.kv_blocks_free()),
              static_cast<long long>(q.kv_blocks_total()), static_cast<long long>(q.block_size()),
              static_cast<long long>(q.preemptions()), q.micro_batches(), static_cast<long long>(q.max_tokens_per_step()));
  if (!q.speculative().empty()) {
    const long long proposed = q.spec_proposed_tokens(), accepted = q.spec_accepted_tokens(),
                    rows = q.spec_verifications();
    std::printf("speculative decoding: %s, %lld of %lld guessed tokens accepted (%.1f%%), %.2f tokens per verification\n",
                q.speculative().c_str(), accepted, proposed, proposed > 0 ? 100.0 * accepted / proposed : 0.0,
                rows > 0 ? static_cast<double>(accepted + rows) / rows : 0.0);
  }
  if (q.prefix_caching()) {
    std::printf("prefix cache: %lld free blocks cached, %lld of %lld prompt tokens looked up found (%.1f%%)\n\n",
                static_cast<long long>(q.kv_blocks_cached()), static_cast<long long>(q.prefix_cache_hit_tokens()),
                static_cast<long long>(q.prefix_cache_query_tokens()),
                q.prefix_cache_query_tokens() > 0
                    ? 100.0 * static_cast<double>(q.prefix_cache_hit_tokens()) / q.prefix_cache_query_tokens()
                    : 0.0);
  } else {
    std::printf("prefix cache: off (--no-prefix-caching)\n\n");
  }
  if (!cs.plan_text().empty()) std::printf("%s\n", cs.plan_text().c_str());
  std::printf("%-10s %-8s %-7s %-6s %-4s %-9s %-11s %-22s %-22s %s\n", "worker", "node", "device", "stage", "tp",
              "layers", "state", "address", "metrics", "detail");
  for (const v1::WorkerStatus& w : cs.workers()) {
    // A spare (stage -1) holds no layers.
    std::string layers =
        w.stage() < 0 ? "-" : std::to_string(w.first_layer()) + "-" + std::to_string(w.last_layer());
    std::string state = v1::WorkerState_Name(w.state());
    state = state.substr(state.rfind('_') + 1);
    std::printf("%-10s %-8s %-7s %-6d %-4d %-9s %-11s %-22s %-22s %s\n", w.worker_id().c_str(), w.node().c_str(),
                w.device().c_str(), w.stage(), w.tp_rank(), layers.c_str(), state.c_str(), w.address().c_str(),
                w.metrics_address().empty() ? "-" : w.metrics_address().c_str(), w.detail().c_str());
  }
  return cs.serving() ? 0 : 1;
}

const CommandRegistration kRegistration({"status", "the plan and each worker's health", Run});

}  // namespace
}  // namespace shardserve::cli
