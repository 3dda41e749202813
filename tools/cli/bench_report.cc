// shardserve bench's output: the table and JSON of one run, and the side-by-side table and JSON of
// --compare's runs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tools/cli/bench.h"
#include "tools/cli/bench_stats.h"

namespace shardserve::cli::bench {
namespace {

json RateJson(const LoadConfig& c) {
  if (!c.open_loop) return nullptr;
  if (!std::isfinite(c.request_rate)) return "inf";
  return c.request_rate;
}

std::string Ms(double s) { return std::isnan(s) ? "-" : absl::StrFormat("%.2f", s * 1e3); }

void PrintErrors(const LoadResult& r) {
  if (r.errors.empty()) return;
  std::printf("errors (each distinct message once):\n");
  for (const auto& [message, count] : r.errors)
    std::printf("  %lld x %s\n", static_cast<long long>(count), message.c_str());
}

std::string MiB(int64_t bytes) {
  return bytes < 0 ? "-" : absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
}

int64_t MaxOf(const std::vector<int64_t>& v) { return v.empty() ? -1 : *std::max_element(v.begin(), v.end()); }

}  // namespace

double PerSecond(double n, double s) { return s > 0 ? n / s : 0; }

// The keys every run has (single run, and each of --compare's runs).
json ResultJson(const LoadConfig& c, const LoadResult& r) {
  json j;
  j["backend"] = c.backend == Backend::kOpenAI ? "openai" : "grpc";
  j["mode"] = c.open_loop ? "open" : "closed";
  j["concurrency"] = c.open_loop ? json(nullptr) : json(c.concurrency);
  j["request_rate"] = RateJson(c);
  j["num_requests"] = c.num_requests;
  j["input_len"] = c.input_len;
  j["output_len"] = c.output_len;
  j["range_ratio"] = c.range_ratio;
  j["seed"] = c.seed;
  j["temperature"] = c.temperature;
  j["warmup"] = c.warmup;
  j["chat_turns"] = c.chat_turns;
  j["system_prompt_len"] = c.system_prompt_len;
  j["json_schema"] = c.json_schema_file.empty() ? json(nullptr) : json(c.json_schema_file);
  j["interrupted"] = r.interrupted;
  j["duration_s"] = r.duration_s;
  j["completed"] = r.completed;
  j["failed"] = r.failed;
  j["resent_on_new_connection"] = r.resent;
  j["total_input_tokens"] = r.total_input_tokens;
  j["total_output_tokens"] = r.total_output_tokens;
  j["total_cached_prompt_tokens"] = r.total_cached_tokens;
  j["requests_per_s"] = PerSecond(static_cast<double>(r.completed), r.duration_s);
  j["output_tokens_per_s"] = PerSecond(static_cast<double>(r.total_output_tokens), r.duration_s);
  j["total_tokens_per_s"] = PerSecond(static_cast<double>(r.total_input_tokens + r.total_output_tokens), r.duration_s);
  for (const auto& [name, s] :
       {std::pair<const char*, const LatencySummary&>{"ttft", r.ttft}, {"itl", r.itl}, {"e2e", r.e2e}}) {
    j[absl::StrCat(name, "_mean_s")] = s.mean;  // NaN (no samples) is written as null
    j[absl::StrCat(name, "_p50_s")] = s.p50;
    j[absl::StrCat(name, "_p90_s")] = s.p90;
    j[absl::StrCat(name, "_p99_s")] = s.p99;
  }
  json errors = json::array();
  for (const auto& [message, count] : r.errors) errors.push_back({{"message", message}, {"count", count}});
  j["errors"] = errors;
  return j;
}

std::string LoadLine(const LoadConfig& c) {
  std::string load = c.open_loop
                         ? (std::isfinite(c.request_rate)
                                ? absl::StrFormat("open loop, Poisson arrivals at %g requests/s", c.request_rate)
                                : std::string("open loop, all requests at once"))
                         : absl::StrCat("closed loop, concurrency ", c.concurrency);
  if (c.chat_turns > 0 && c.backend == Backend::kOpenAI) {
    load = absl::StrFormat("%s; chat over /chat/completions: %d conversations of %d turns after a shared %d-word "
                           "system prompt (input: each turn's new message, in words)",
                           load, c.num_requests / c.chat_turns, c.chat_turns, c.system_prompt_len);
  } else if (c.chat_turns > 0) {
    load = absl::StrFormat("%s; chat: %d conversations of %d turns after a shared %d-token system prompt (input: "
                           "each turn's new message)",
                           load, c.num_requests / c.chat_turns, c.chat_turns, c.system_prompt_len);
  }
  std::string line = absl::StrFormat(
      "%s; %d requests (+%d warm-up), input %d, output %d tokens (range ratio %g), temperature %g, seed %d", load,
      c.num_requests, c.warmup, c.input_len, c.output_len, c.range_ratio, c.temperature, c.seed);
  if (!c.json_schema.empty()) absl::StrAppend(&line, "; outputs constrained to the JSON Schema of ", c.json_schema_file);
  return line;
}

void PrintTable(const LoadConfig& c, const BenchRun& run) {
  const LoadResult& r = run.load;
  std::printf("shardserve bench: %s, model %s (vocab %lld)\n", c.address.c_str(), run.model.name.c_str(),
              static_cast<long long>(run.model.vocab_size));
  std::printf("load: %s%s\n\n", LoadLine(c).c_str(), r.interrupted ? " (INTERRUPTED)" : "");
  std::printf("%-22s %12lld\n", "completed", static_cast<long long>(r.completed));
  std::printf("%-22s %12lld\n", "failed", static_cast<long long>(r.failed));
  if (r.resent > 0) {
    std::printf("%-22s %12lld   (the server had closed their keep-alive connection)\n", "resent",
                static_cast<long long>(r.resent));
  }
  std::printf("%-22s %12.2f s\n", "duration", r.duration_s);
  std::printf("%-22s %12.3f\n", "requests/s", PerSecond(static_cast<double>(r.completed), r.duration_s));
  std::printf("%-22s %12.1f\n", "output tokens/s", PerSecond(static_cast<double>(r.total_output_tokens), r.duration_s));
  std::printf("%-22s %12.1f\n", "total tokens/s",
              PerSecond(static_cast<double>(r.total_input_tokens + r.total_output_tokens), r.duration_s));
  std::printf("%-22s %12.1f %%\n", "prompt tokens cached",
              r.total_input_tokens > 0 ? 100.0 * r.total_cached_tokens / r.total_input_tokens : 0.0);
  std::printf("\n%-22s %10s %10s %10s %10s\n", "latency (ms)", "mean", "p50", "p90", "p99");
  for (const auto& [name, s] : {std::pair<const char*, const LatencySummary&>{"time to first token", r.ttft},
                                {"inter-token", r.itl},
                                {"end-to-end", r.e2e}}) {
    std::printf("%-22s %10s %10s %10s %10s\n", name, Ms(s.mean).c_str(), Ms(s.p50).c_str(), Ms(s.p90).c_str(),
                Ms(s.p99).c_str());
  }
  PrintErrors(r);
}

void PrintCompareTable(const LoadConfig& c, const std::vector<CompareRun>& runs) {
  std::printf("shardserve bench --compare: %s\n\n", LoadLine(c).c_str());
  std::vector<std::pair<std::string, std::vector<std::string>>> rows;
  auto row = [&](const std::string& label, auto cell) {
    std::vector<std::string> cells;
    for (const CompareRun& r : runs)
      cells.push_back(r.error.empty() || label == "layout" || label == "workers" ? cell(r) : "-");
    rows.emplace_back(label, cells);
  };
  auto rate = [](double n, double s) { return absl::StrFormat("%.1f", PerSecond(n, s)); };
  row("layout", [](const CompareRun& r) { return r.layout.name; });
  row("workers", [](const CompareRun& r) { return absl::StrCat(r.layout.tp * r.layout.pp); });
  row("micro-batches", [](const CompareRun& r) {
    return r.scheduler ? absl::StrCat(r.scheduler->micro_batches()) : std::string("-");
  });
  row("preemptions", [](const CompareRun& r) {
    return r.scheduler ? absl::StrCat(r.scheduler->preemptions()) : std::string("-");
  });
  row("prefix caching", [](const CompareRun& r) {
    return r.scheduler ? std::string(r.scheduler->prefix_caching() ? "on" : "off") : std::string("-");
  });
  row("JSON Schema", [](const CompareRun& r) {
    return r.json_schema_file.empty() ? std::string("off") : std::filesystem::path(r.json_schema_file).filename().string();
  });
  row("speculative", [](const CompareRun& r) { return r.scheduler ? SpeculationSummary(*r.scheduler) : std::string("-"); });
  row("prompt tok cached", [](const CompareRun& r) {
    const LoadResult& l = r.run.load;
    return absl::StrFormat("%.1f%%", l.total_input_tokens > 0 ? 100.0 * l.total_cached_tokens / l.total_input_tokens : 0.0);
  });
  row("completed / failed",
      [](const CompareRun& r) { return absl::StrCat(r.run.load.completed, " / ", r.run.load.failed); });
  row("output tok/s", [&](const CompareRun& r) {
    return rate(static_cast<double>(r.run.load.total_output_tokens), r.run.load.duration_s);
  });
  row("req/s", [](const CompareRun& r) {
    return absl::StrFormat("%.3f", PerSecond(static_cast<double>(r.run.load.completed), r.run.load.duration_s));
  });
  row("TTFT p50 (ms)", [](const CompareRun& r) { return Ms(r.run.load.ttft.p50); });
  row("TTFT p99 (ms)", [](const CompareRun& r) { return Ms(r.run.load.ttft.p99); });
  row("ITL p50 (ms)", [](const CompareRun& r) { return Ms(r.run.load.itl.p50); });
  row("ITL p99 (ms)", [](const CompareRun& r) { return Ms(r.run.load.itl.p99); });
  row("peak RSS/worker (max)", [](const CompareRun& r) { return MiB(MaxOf(r.worker_peak_rss_bytes)); });
  row("weights/worker (max)", [](const CompareRun& r) { return MiB(MaxOf(r.worker_weight_bytes)); });
  size_t width = 10;
  for (const auto& [label, cells] : rows) {
    for (const std::string& cell : cells) width = std::max(width, cell.size());
  }
  for (const auto& [label, cells] : rows) {
    std::printf("%-22s", label.c_str());
    for (const std::string& cell : cells) std::printf("  %*s", static_cast<int>(width), cell.c_str());
    std::printf("\n");
  }
  for (const CompareRun& r : runs) {
    if (!r.error.empty()) {
      std::printf("\n%s: FAILED: %s\n", r.layout.name.c_str(), r.error.c_str());
    } else if (!r.run.load.errors.empty()) {
      std::printf("\n%s: ", r.layout.name.c_str());
      PrintErrors(r.run.load);
    }
  }
}

std::string SpeculationSummary(const v1::SchedulerStatus& s) {
  if (s.speculative().empty()) return "off";
  const double proposed = static_cast<double>(s.spec_proposed_tokens());
  const double rows = static_cast<double>(s.spec_verifications());
  return absl::StrFormat("%s: %.0f%% of %lld accepted, %.2f tok/verify", s.speculative(),
                         proposed > 0 ? 100.0 * static_cast<double>(s.spec_accepted_tokens()) / proposed : 0.0,
                         static_cast<long long>(s.spec_proposed_tokens()),
                         rows > 0 ? (static_cast<double>(s.spec_accepted_tokens()) + rows) / rows : 0.0);
}

json SpeculationJson(const v1::SchedulerStatus& s) {
  if (s.speculative().empty()) return json(nullptr);
  json j;
  j["proposer"] = s.speculative();
  j["proposed_tokens"] = s.spec_proposed_tokens();
  j["accepted_tokens"] = s.spec_accepted_tokens();
  j["rejected_tokens"] = s.spec_proposed_tokens() - s.spec_accepted_tokens();
  j["verifications"] = s.spec_verifications();
  j["accepted_by_position"] = std::vector<int64_t>(s.spec_accepted_by_position().begin(), s.spec_accepted_by_position().end());
  j["mean_accepted_length"] =
      s.spec_verifications() > 0
          ? json(static_cast<double>(s.spec_accepted_tokens() + s.spec_verifications()) / s.spec_verifications())
          : json(nullptr);
  return j;
}

json CompareJson(const LoadConfig& c, const std::vector<CompareRun>& runs) {
  json out = {{"runs", json::array()}};
  for (const CompareRun& r : runs) {
    json j;
    j["layout"] = r.layout.name;
    j["tp"] = r.layout.tp;
    j["pp"] = r.layout.pp;
    j["serial"] = r.layout.serial;
    j["prefix_caching"] = r.scheduler ? json(r.scheduler->prefix_caching()) : json(nullptr);
    j["speculative"] = r.scheduler ? SpeculationJson(*r.scheduler) : json(nullptr);
    j["workers"] = r.layout.tp * r.layout.pp;
    j["error"] = r.error.empty() ? json(nullptr) : json(r.error);
    j["model"] = r.run.model.name;
    j["address"] = r.address;
    j["cluster_start_s"] = r.start_s;
    j.update(ResultJson(c, r.run.load));
    j["json_schema"] = r.json_schema_file.empty() ? json(nullptr) : json(r.json_schema_file);  // /json layouts only
    j["backend"] = r.layout.http ? "openai" : "grpc";  // /http: the OpenAI API, whatever c says
    j["worker_names"] = r.worker_names;
    j["worker_peak_rss_bytes"] = r.worker_peak_rss_bytes;
    j["worker_weight_bytes"] = r.worker_weight_bytes;
    if (r.scheduler) {
      j["micro_batches"] = r.scheduler->micro_batches();
      j["max_num_seqs"] = r.scheduler->max_running();
      j["kv_blocks_total"] = r.scheduler->kv_blocks_total();
      j["block_size"] = r.scheduler->block_size();
      j["preemptions"] = r.scheduler->preemptions();
    } else {
      for (const char* k : {"micro_batches", "max_num_seqs", "kv_blocks_total", "block_size", "preemptions"}) {
        j[k] = nullptr;
      }
    }
    out["runs"].push_back(j);
  }
  return out;
}

// Writes `j` to `path` (nothing when it is empty); false, with a message, when it cannot.
bool WriteJsonOut(const std::string& path, const json& j) {
  if (path.empty()) return true;
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) {
    std::fprintf(stderr, "shardserve bench: cannot write --json-out %s\n", path.c_str());
    return false;
  }
  return true;
}

}  // namespace shardserve::cli::bench
