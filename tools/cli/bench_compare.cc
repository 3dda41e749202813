// shardserve bench --compare: parses the layouts and, for each, starts a local cluster
// (local_cluster.h), runs the load against it, reads its workers' memory and stops it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tools/cli/bench.h"
#include "tools/cli/client.h"
#include "tools/cli/local_cluster.h"

namespace shardserve::cli::bench {
namespace {

namespace fs = std::filesystem;

// The coordinator's view of a cluster, read after the load: weights per worker (by stage, then TP
// rank) and its scheduler (micro-batches in flight, KV blocks, preemptions). Empty on an error.
struct ClusterFacts {
  std::vector<int64_t> weight_bytes;
  std::optional<v1::SchedulerStatus> scheduler;
};

ClusterFacts GetClusterFacts(const std::string& address) {
  ClientOptions client;  // bench --compare's clusters are plaintext on loopback
  client.address = address;
  ClusterFacts facts;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = ConnectToCoordinator(client);
  if (!channel.ok()) return facts;
  auto stub = v1::InferenceService::NewStub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ClusterStatus cs;
  if (!stub->GetClusterStatus(&ctx, v1::GetClusterStatusRequest(), &cs).ok()) return facts;
  std::vector<v1::WorkerStatus> workers(cs.workers().begin(), cs.workers().end());
  std::sort(workers.begin(), workers.end(), [](const v1::WorkerStatus& a, const v1::WorkerStatus& b) {
    return std::pair(a.stage(), a.tp_rank()) < std::pair(b.stage(), b.tp_rank());
  });
  for (const v1::WorkerStatus& w : workers) facts.weight_bytes.push_back(w.weight_bytes());
  if (cs.has_scheduler()) facts.scheduler = cs.scheduler();
  return facts;
}

}  // namespace

// tpN, ppM, tpNxppM, each optionally followed by /serial, /sync, /no-prefix-caching, /ngram, /draft or
// /mtp, /adaptive, /http, /ep, /gloo and /json (in any order).
absl::StatusOr<Layout> ParseLayout(const std::string& text) {
  Layout l;
  l.name = text;
  std::string body = absl::AsciiStrToLower(text);
  bool more = true;
  // Takes `suffix` off the end of body when it is there.
  auto strip = [&](absl::string_view suffix) {
    if (!absl::EndsWith(body, suffix)) return false;
    body.resize(body.size() - suffix.size());
    return more = true;
  };
  while (more) {
    more = false;
    if (strip("/serial")) l.serial = true;
    if (strip("/sync")) l.sync = true;
    if (strip("/http")) l.http = true;
    if (strip("/json")) l.json = true;
    if (strip("/gloo")) l.gloo = true;
    if (strip("/ep")) {
      l.expert_parallel = true;
    } else if (strip("/ngram")) {
      l.ngram = true;
    } else if (strip("/draft")) {
      l.draft = true;
    } else if (strip("/mtp")) {
      l.mtp = true;
    } else if (strip("/eagle3")) {
      l.eagle3 = true;
    }
    if (strip("/no-prefix-caching")) l.prefix_caching = false;
    if (strip("/adaptive")) l.adaptive = true;
  }
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout '", text,
        "' is not tpN, ppM or tpNxppM (optionally /serial, /sync, /no-prefix-caching, /ngram, /draft, /mtp, /eagle3, /adaptive, "
        "/http, /ep, /gloo, /json), e.g. tp2xpp2/serial"));
  };
  if (int{l.ngram} + int{l.draft} + int{l.mtp} + int{l.eagle3} > 1) return bad();
  if (l.adaptive && !l.ngram && !l.draft && !l.mtp && !l.eagle3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout '", text, "': /adaptive adapts the guesses of /ngram, /draft, /mtp or /eagle3; it needs one of them"));
  }
  const std::vector<std::string> parts = absl::StrSplit(body, 'x');
  if (parts.empty() || parts.size() > 2) return bad();
  bool seen_tp = false, seen_pp = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    int64_t n;
    if (p.size() < 3 || !absl::SimpleAtoi(p.substr(2), &n) || n < 1 || n > 64) return bad();
    if (p.rfind("tp", 0) == 0 && !seen_tp && i == 0) {
      l.tp = n;
      seen_tp = true;
    } else if (p.rfind("pp", 0) == 0 && !seen_pp) {
      l.pp = n;
      seen_pp = true;
    } else {
      return bad();
    }
  }
  if (l.tp * l.pp > 64) return absl::InvalidArgumentError(absl::StrCat("layout '", text, "': at most 64 workers"));
  return l;
}

CompareRun RunLayout(const Layout& layout, int round, const CompareOptions& o, LoadConfig load) {
  CompareRun out;
  out.layout = layout;
  if (layout.json) {
    load.json_schema = o.json_schema;
    load.json_schema_file = out.json_schema_file = o.json_schema_file;
  }
  const int64_t workers = layout.tp * layout.pp;
  LocalClusterOptions co;
  co.bin_dir = fs::read_symlink("/proc/self/exe").parent_path().string();
  co.model = o.cluster.model;
  co.nodes = layout.pp;
  co.gpus_per_node = layout.tp;
  co.device = o.cluster.device;
  co.address = "127.0.0.1:0";  // the coordinator picks a free port: no clash with a cluster on 50051
  std::string dir_name = layout.name;
  std::replace(dir_name.begin(), dir_name.end(), '/', '_');
  if (round > 1) absl::StrAppend(&dir_name, "_", round);
  co.log_dir = (fs::path(o.log_dir) / dir_name).string();
  co.metrics_port_base = 0;
  // /serial layouts run one micro-batch.
  co.coordinator_flags = o.cluster.CoordinatorArgs(layout.serial ? "micro-batches" : "");
  if (layout.serial) co.coordinator_flags.insert(co.coordinator_flags.end(), {"--micro-batches", "1"});
  if (!layout.prefix_caching && o.cluster.prefix_caching) co.coordinator_flags.push_back("--no-prefix-caching");
  if (layout.sync && o.cluster.async_scheduling) co.coordinator_flags.push_back("--no-async-scheduling");
  if (layout.expert_parallel && !o.cluster.expert_parallel) co.coordinator_flags.push_back("--expert-parallel");
  if (layout.adaptive && !o.cluster.adaptive_speculative_tokens) {
    co.coordinator_flags.push_back("--adaptive-speculative-tokens");
  }
  // /ngram, /draft and /mtp layouts speculate with the n-gram proposer, the draft model or the
  // model's multi-token-prediction layer (--num-speculative-tokens as given, else 4).
  const bool speculative_given =
      std::find(co.coordinator_flags.begin(), co.coordinator_flags.end(), "--speculative") != co.coordinator_flags.end();
  // /draft layouts with the draft model, /eagle3 ones with the EAGLE-3 head: bench's --draft-model.
  if ((layout.draft || layout.eagle3) && !speculative_given) {
    if (o.cluster.draft_model.empty()) {
      out.error = absl::StrCat("layout ", layout.name, " needs --draft-model DIR (the ",
                               layout.draft ? "draft's checkpoint" : "EAGLE-3 head's directory", ")");
      return out;
    }
    co.coordinator_flags.insert(co.coordinator_flags.end(), {"--speculative", layout.draft ? "draft" : "eagle3",
                                                             "--draft-model", o.cluster.draft_model});
  }
  if ((layout.ngram || layout.draft || layout.mtp || layout.eagle3) && !speculative_given) {
    if (layout.ngram) co.coordinator_flags.insert(co.coordinator_flags.end(), {"--speculative", "ngram"});
    if (layout.mtp) co.coordinator_flags.insert(co.coordinator_flags.end(), {"--speculative", "mtp"});
    if (std::find(co.coordinator_flags.begin(), co.coordinator_flags.end(), "--num-speculative-tokens") ==
        co.coordinator_flags.end()) {
      co.coordinator_flags.insert(co.coordinator_flags.end(), {"--num-speculative-tokens", "4"});
    }
  }
  co.http_free_port = layout.http;
  co.worker_flags = o.cluster.WorkerArgs(workers);
  if (const std::string note = o.cluster.WorkerThreadsNote(workers); !note.empty()) {
    std::fprintf(stderr, "bench: %s: warning: %s\n", layout.name.c_str(), note.c_str());
  }
  co.worker_flags.insert(co.worker_flags.end(), o.cluster.worker_flags.begin(), o.cluster.worker_flags.end());
  // /gloo layouts: the workers' collectives over Gloo's TCP alone, where --worker-collectives left
  // them to the default (on CPUs: shared memory between the ranks of one host).
  if (layout.gloo) {
    const auto given = std::find(co.worker_flags.begin(), co.worker_flags.end(), "--collectives");
    if (given == co.worker_flags.end()) {
      co.worker_flags.insert(co.worker_flags.end(), {"--collectives", "gloo"});
    } else if (*(given + 1) != "gloo") {  // local_cluster.cc gives the flag with its value
      out.error = absl::StrCat("layout ", layout.name, " runs the workers' collectives over Gloo; --worker-collectives ",
                               *(given + 1), " says otherwise");
      return out;
    }
  }

  std::fprintf(stderr, "bench: %s: starting a coordinator and %lld worker(s) (TP=%lld x PP=%lld%s), logs in %s\n",
               layout.name.c_str(), static_cast<long long>(workers), static_cast<long long>(layout.tp),
               static_cast<long long>(layout.pp), layout.serial ? ", one micro-batch" : "", co.log_dir.c_str());
  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(co);
  if (!cluster.ok()) {
    out.error = std::string(cluster.status().message());
    return out;
  }
  if (absl::Status s = (*cluster)->WaitUntilServing(std::chrono::seconds(o.cluster.ready_timeout_s), &g_stop); !s.ok()) {
    out.error = std::string(s.message());
    return out;  // the destructor stops and reaps every process
  }
  out.start_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::fprintf(stderr, "bench: %s: serving on %s after %.1f s; %s\n", layout.name.c_str(),
               (*cluster)->address().c_str(), out.start_s, LoadLine(load).c_str());
  out.address = (*cluster)->address();
  load.address = (*cluster)->address();
  load.client = ClientOptions();
  load.client.address = load.address;
  if (layout.http) {
    // Over HTTP; the vocabulary and EOS ids (vocab_size 0) still from gRPC, so the prompts are the
    // gRPC layouts' own.
    load.backend = Backend::kOpenAI;
    load.base_url = absl::StrCat("http://127.0.0.1:", (*cluster)->http_port(), "/v1");
    load.vocab_size = 0;
  }
  absl::StatusOr<BenchRun> run = Benchmark(load);
  ClusterFacts facts = GetClusterFacts(out.address);
  out.worker_weight_bytes = facts.weight_bytes;
  out.scheduler = facts.scheduler;
  // Peak RSS of each worker, read while it still runs.
  out.worker_names = (*cluster)->WorkerNames();
  for (pid_t pid : (*cluster)->WorkerPids()) {
    absl::StatusOr<int64_t> rss = pid > 0 ? PeakRssBytes(pid) : absl::NotFoundError("exited");
    out.worker_peak_rss_bytes.push_back(rss.ok() ? *rss : -1);
  }
  if (std::optional<ExitedProcess> dead = (*cluster)->ReapExited()) {
    out.error =
        absl::StrCat(dead->name, " ", dead->how, " during the run; last lines of ", dead->log, ":\n", dead->log_tail);
  }
  (*cluster)->Stop(std::chrono::seconds(10));
  if (!run.ok()) {
    if (out.error.empty()) out.error = std::string(run.status().message());
    return out;
  }
  out.run = *run;
  const LoadResult& r = run->load;
  std::fprintf(stderr, "bench: %s: %lld completed, %lld failed in %.1f s, %.1f output tokens/s; stopped\n",
               layout.name.c_str(), static_cast<long long>(r.completed), static_cast<long long>(r.failed), r.duration_s,
               PerSecond(static_cast<double>(r.total_output_tokens), r.duration_s));
  return out;
}

}  // namespace shardserve::cli::bench
