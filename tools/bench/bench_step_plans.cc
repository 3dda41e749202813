// bench_step_plans: bytes of the step plans the coordinator sends every worker (StepPlan
// ByteSizeLong, what goes on the wire once per worker), from the Scheduler alone: deterministic
// and cheap, no model. `--seqs` sequences of `--prompt` tokens each generate `--generate` tokens;
// every step is completed at once with a fixed sampled id. Reports the mean bytes of decode steps
// (every row feeds one token), of steps that prefill, and of all steps, and the decode steps'
// bytes at the shortest and the longest context.
//
// Uses only the Scheduler's API (Add, Schedule, Complete, Remove), so that the same file builds
// against any version of the plan format and the two can be compared.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/scheduler/scheduler.h"
#include "tools/bench/bench_util.h"

namespace {

constexpr char kUsage[] =
    "usage: bench_step_plans [--seqs N] [--prompt N] [--generate N] [--penalty 1|2]\n"
    "                        [--max-tokens-per-step N] [--block-size N] [--max-model-len N]\n"
    "  --penalty 2  every request has repetition_penalty 1.1 (1, the default: no penalty)\n";

}  // namespace

int main(int argc, char** argv) {
  using shardserve::MicroBatch;
  const std::optional<std::map<std::string, int64_t>> flags = shardserve::bench::PositiveIntFlagsOrUsage(
      "bench_step_plans", kUsage, argc, argv,
      {{"seqs", 64}, {"prompt", 3584}, {"generate", 512}, {"penalty", 1}, {"max-tokens-per-step", 512},
       {"block-size", 16}, {"max-model-len", 4096}});
  if (!flags) return 2;
  const int64_t seqs = flags->at("seqs"), prompt = flags->at("prompt"), generate = flags->at("generate");
  const bool penalty = flags->at("penalty") == 2;

  shardserve::SchedulerOptions o;
  o.limits.max_seqs_per_step = seqs;
  o.limits.max_tokens_per_step = std::max(flags->at("max-tokens-per-step"), seqs);
  o.limits.block_size = flags->at("block-size");
  o.limits.max_model_len = flags->at("max-model-len");
  if (prompt + generate > o.limits.max_model_len) {
    std::fprintf(stderr, "bench_step_plans: --prompt + --generate exceeds --max-model-len\n");
    return 2;
  }
  // Room for every sequence at full length: no preemption.
  o.limits.num_kv_blocks = seqs * o.limits.max_blocks_per_seq();
  o.lanes = 1;
  shardserve::Scheduler sched(o);
  shardserve::v1::RowSampling sampling;
  sampling.set_seed(1);
  if (penalty) sampling.set_repetition_penalty(1.1f);
  for (int64_t id = 1; id <= seqs; ++id) {
    std::vector<int32_t> tokens(static_cast<size_t>(prompt));
    for (int64_t i = 0; i < prompt; ++i) tokens[i] = static_cast<int32_t>((id * 131 + i * 7) % 4096);
    sched.Add(static_cast<uint64_t>(id), std::move(tokens), sampling);
  }

  std::map<uint64_t, int64_t> generated;
  shardserve::v1::StepPlan plan;
  int64_t steps = 0, decode_steps = 0, decode_rows = 0, full_steps = 0, prefill_steps = 0;
  double bytes = 0, decode_bytes = 0, full_bytes = 0, prefill_bytes = 0;
  int64_t first_full = -1, last_full = -1;
  while (sched.num_running() + sched.num_waiting() > 0) {
    const MicroBatch* b = sched.Schedule(0, static_cast<uint64_t>(steps), &plan);
    if (b == nullptr) {
      std::fprintf(stderr, "bench_step_plans: nothing scheduled with sequences left\n");
      return 1;
    }
    ++steps;
    const int64_t size = static_cast<int64_t>(plan.ByteSizeLong());
    bytes += static_cast<double>(size);
    std::vector<int32_t> sampled;
    for (const MicroBatch::Entry& e : b->entries) {
      if (e.logit_row >= 0) sampled.push_back(static_cast<int32_t>((e.seq * 17 + steps) % 4096));
    }
    if (b->prefill_tokens == 0) {
      ++decode_steps;
      decode_rows += static_cast<int64_t>(b->entries.size());
      decode_bytes += static_cast<double>(size);
      if (static_cast<int64_t>(b->entries.size()) == seqs) {
        ++full_steps;
        full_bytes += static_cast<double>(size);
        if (first_full < 0) first_full = size;
        last_full = size;
      }
    } else {
      ++prefill_steps;
      prefill_bytes += static_cast<double>(size);
    }
    for (const shardserve::SampledToken& t : sched.Complete(0, sampled)) {
      if (++generated[t.seq] == generate) sched.Remove(t.seq);
    }
  }
  std::printf("seqs %lld, prompt %lld + generate %lld tokens (context up to %lld), block_size %lld, "
              "max_model_len %lld, repetition_penalty %s\n",
              static_cast<long long>(seqs), static_cast<long long>(prompt), static_cast<long long>(generate),
              static_cast<long long>(prompt + generate), static_cast<long long>(o.limits.block_size),
              static_cast<long long>(o.limits.max_model_len), penalty ? "1.1" : "off");
  std::printf("steps %lld, mean plan bytes %.0f, total %.0f bytes\n", static_cast<long long>(steps),
              steps ? bytes / steps : 0.0, bytes);
  std::printf("  with prefill: %lld steps, mean %.0f bytes\n", static_cast<long long>(prefill_steps),
              prefill_steps ? prefill_bytes / prefill_steps : 0.0);
  std::printf("  decode only:  %lld steps, mean %.1f rows, mean %.0f bytes, %.1f bytes per row\n",
              static_cast<long long>(decode_steps), decode_steps ? static_cast<double>(decode_rows) / decode_steps : 0.0,
              decode_steps ? decode_bytes / decode_steps : 0.0,
              decode_rows ? decode_bytes / static_cast<double>(decode_rows) : 0.0);
  std::printf("  decode of all %lld sequences: %lld steps, mean %.0f bytes (first %lld, last %lld)\n",
              static_cast<long long>(seqs), static_cast<long long>(full_steps),
              full_steps ? full_bytes / full_steps : 0.0, static_cast<long long>(first_full),
              static_cast<long long>(last_full));
  return 0;
}
