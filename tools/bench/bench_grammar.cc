// bench_grammar: the grammar engine's speed (grammar/): compile time per schema and mask time per
// token, p50 and p99, over a Qwen-sized vocabulary. docs/structured-outputs.md has the figures.
//
// The vocabulary is a tokenizer's raw token bytes (--tokenizer DIR, default the qwen2 fixture;
// Tokenizer::TokenBytes, as the server reads them) grown to --vocab tokens (default 151,643,
// Qwen2's count) when the tokenizer has fewer: first the tokens of the other real tokenizer
// fixtures (GPT-2, Llama 3, Llama 2, Mistral), then made-up ones from the words of those
// tokenizers and of their test texts: words and word pieces with and without a leading space,
// numbers, runs of JSON punctuation, and CJK characters, so that the mix of short and long, ASCII
// and multi-byte tokens is like a real one. Only committed fixtures feed it, so the vocabulary is
// the same on every checkout. Each case is compiled --compiles times; then --walks random walks
// of up to --steps tokens each sample from the mask (leaning to closing tokens, so that walks
// finish) and time every FillNextTokenBitmask. The whole case is run --runs times, each from a
// fresh compile and with the same walks, and each mask's time is the median over the runs (a
// loaded machine's outliers are not the engine's).
//
// --write-walks FILE writes the vocabulary (each token's bytes in hex, "" for a special token), the
// end-of-sequence ids and each case's walks (the tokens accepted), so that
// tools/bench/bench_xgrammar.py times xgrammar along the same walks over the same vocabulary.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <time.h>
#include <string>
#include <vector>

#include "base/flags.h"
#include "base/json.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "coordinator/model/structured_output.h"

namespace {

using shardserve::grammar::CompiledGrammar;
using shardserve::grammar::Grammar;
using shardserve::grammar::GrammarMatcher;
using shardserve::grammar::TokenizerInfo;
using Clock = std::chrono::steady_clock;

constexpr char kUsage[] =
    "usage: bench_grammar [--tokenizer DIR] [--vocab N] [--cases FILE] [--compiles N] [--walks N] [--steps N] "
    "[--runs N] [--write-walks FILE]\n";

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Made-up tokens until the vocabulary has `size` (see the header comment).
std::shared_ptr<const TokenizerInfo> Grow(const TokenizerInfo& base, int32_t size) {
  std::vector<std::string> bytes;
  std::vector<bool> special;
  std::set<std::string> seen;
  for (int32_t id = 0; id < base.vocab_size(); ++id) {
    const bool ok = base.allowed_ever(id);
    const bool eos = std::find(base.eos_ids().begin(), base.eos_ids().end(), id) != base.eos_ids().end();
    bytes.push_back(ok ? base.token_bytes(id) : std::string());
    special.push_back(!ok && !eos);
    seen.insert(bytes.back());
  }
  auto add = [&](const std::string& t) {
    if (static_cast<int32_t>(bytes.size()) >= size || t.empty() || !seen.insert(t).second) return;
    bytes.push_back(t);
    special.push_back(false);
  };
  std::string text;
  for (const char* kind : {"gpt2", "llama3", "qwen2", "llama2", "mistral"}) {
    const std::string dir = std::string(SHARDSERVE_SOURCE_DIR) + "/tests/fixtures/tokenizers/" + kind;
    auto other = shardserve::Tokenizer::FromDirectory(dir);
    if (!other.ok()) continue;
    for (int32_t id = 0; id < (*other)->vocab_size(); ++id) {
      std::optional<std::string> t = (*other)->TokenBytes(id);
      if (!t.has_value() || (*other)->IsSpecial(id)) continue;
      add(*t);
      text += *t + " ";
    }
    auto cases = shardserve::ParseJson<nlohmann::json>(ReadFile(dir + "/cases.json"), dir);
    if (!cases.ok() || !cases->contains("encode")) continue;
    for (const auto& c : (*cases)["encode"]) {
      if (c.contains("text") && c["text"].is_string()) text += c["text"].get<std::string>() + " ";
    }
  }
  std::vector<std::string> words;
  std::string word;
  for (char c : text + " ") {
    if (isalnum(static_cast<unsigned char>(c)) || c == '_') {
      word += c;
    } else if (!word.empty()) {
      words.push_back(word);
      word.clear();
    }
  }
  for (const std::string& w : words) {
    for (size_t n = 2; n <= w.size(); ++n) {
      add(w.substr(0, n));
      add(" " + w.substr(0, n));
      add(w.substr(w.size() - n));
    }
  }
  const std::string punct = "{}[]\",:.- _()/'\n";
  std::mt19937 rng(1);
  for (int i = 0; i < 100000 && static_cast<int32_t>(bytes.size()) < size; ++i) {
    add(std::to_string(i));
    std::string p;
    for (int k = 0, n = 2 + static_cast<int>(rng() % 3); k < n; ++k) p += punct[rng() % punct.size()];
    add(p);
    add(words[rng() % words.size()] + words[rng() % words.size()]);
    std::string cjk;
    for (int k = 0, n = 1 + static_cast<int>(rng() % 3); k < n; ++k) {
      const uint32_t cp = 0x4E00 + rng() % 0x5000;
      cjk += static_cast<char>(0xE0 | (cp >> 12));
      cjk += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      cjk += static_cast<char>(0x80 | (cp & 0x3F));
    }
    add(cjk);
  }
  return std::make_shared<const TokenizerInfo>(std::move(bytes), special, base.eos_ids(), size);
}

// This thread's CPU time in microseconds: on a loaded machine the wall time of a mask includes
// the time the thread waited for a core; its CPU time does not.
double ThreadCpuMicros() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e6 + static_cast<double>(t.tv_nsec) / 1e3;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace

int main(int argc, char** argv) {
  auto flags = shardserve::Flags::Parse(std::vector<std::string>(argv + 1, argv + argc),
                                        {"tokenizer", "vocab", "cases", "compiles", "walks", "steps", "runs", "write-walks"});
  int64_t vocab_size = 151643, compiles = 3, walks = 5, steps = 200, runs = 3;
  absl::Status st = flags.ok() ? flags->Int("vocab", 1, 1 << 22, &vocab_size) : flags.status();
  if (st.ok()) st = flags->Int("compiles", 1, 1000, &compiles);
  if (st.ok()) st = flags->Int("walks", 1, 10000, &walks);
  if (st.ok()) st = flags->Int("steps", 1, 100000, &steps);
  if (st.ok()) st = flags->Int("runs", 1, 100, &runs);
  if (!st.ok()) {
    std::fprintf(stderr, "bench_grammar: %s\n%s", std::string(st.message()).c_str(), kUsage);
    return 2;
  }
  const std::string dir = flags->Get("tokenizer", SHARDSERVE_SOURCE_DIR "/tests/fixtures/tokenizers/qwen2");
  auto tokenizer = shardserve::Tokenizer::FromDirectory(dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "bench_grammar: %s\n", std::string(tokenizer.status().message()).c_str());
    return 1;
  }
  auto base = shardserve::GrammarVocab(**tokenizer, (*tokenizer)->eos_ids(), 0);
  auto vocab = base->vocab_size() >= vocab_size ? base : Grow(*base, static_cast<int32_t>(vocab_size));
  const std::string cases_path = flags->Get("cases", SHARDSERVE_SOURCE_DIR "/tests/fixtures/grammar/cases.json");
  auto cases = shardserve::ParseJson<nlohmann::ordered_json>(ReadFile(cases_path), cases_path);
  if (!cases.ok()) {
    std::fprintf(stderr, "bench_grammar: %s\n", std::string(cases.status().message()).c_str());
    return 1;
  }
  std::printf("vocabulary: %d tokens (%zu distinct byte strings), tokenizer %s\n", vocab->vocab_size(),
              vocab->sorted().size(), dir.c_str());
  std::printf("%-30s %10s %12s %6s %10s %10s %10s %10s %10s\n", "case", "compile_ms", "ctx_dep_tok", "masks",
              "p50_us", "p99_us", "max_us", "cpu_p50_us", "cpu_p99_us");
  std::vector<double> all, all_cpu, case_compile_ms;
  nlohmann::json walks_out = {{"vocab", nlohmann::json::array()}, {"eos", vocab->eos_ids()}, {"cases", nlohmann::json::array()}};
  if (flags->Has("write-walks")) {
    static constexpr char kHex[] = "0123456789abcdef";
    for (int32_t id = 0; id < vocab->vocab_size(); ++id) {
      std::string hex;
      if (vocab->allowed_ever(id)) {
        for (unsigned char b : vocab->token_bytes(id)) hex += {kHex[b >> 4], kHex[b & 15]};
      }
      walks_out["vocab"].push_back(hex);
    }
  }
  int case_index = 0;
  for (const auto& c : *cases) {
    const std::string kind = c["kind"];
    absl::StatusOr<Grammar> g = kind == "json_schema" ? shardserve::grammar::GrammarFromJsonSchema(c["source"].dump())
                                : kind == "regex"     ? shardserve::grammar::GrammarFromRegex(c["source"].get<std::string>())
                                : kind == "choices"
                                    ? shardserve::grammar::GrammarFromChoices(c["source"].get<std::vector<std::string>>())
                                    : shardserve::grammar::ParseGbnf(c["source"].get<std::string>());
    if (!g.ok()) {
      std::fprintf(stderr, "bench_grammar: %s: %s\n", c["name"].get<std::string>().c_str(), std::string(g.status().message()).c_str());
      return 1;
    }
    std::vector<double> compile_ms;
    std::shared_ptr<const CompiledGrammar> compiled;
    // runs x masks: each run repeats the same walks (the same seeds, and the same masks).
    std::vector<std::vector<double>> run_us, run_cpu_us;
    for (int64_t r = 0; r < runs; ++r) {
      for (int64_t i = 0; i < compiles; ++i) {
        const auto t0 = Clock::now();
        compiled = *CompiledGrammar::Compile(*g, vocab);
        compile_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
      std::vector<double>& us = run_us.emplace_back();
      std::vector<double>& cpu_us = run_cpu_us.emplace_back();
      std::vector<uint32_t> mask((vocab->vocab_size() + 31) / 32);
      nlohmann::json case_walks = nlohmann::json::array();
      for (int64_t w = 0; w < walks; ++w) {
        std::mt19937 rng(static_cast<uint32_t>(case_index * 10007 + w));
        GrammarMatcher m(compiled);
        nlohmann::json& walk = case_walks.emplace_back(nlohmann::json::array());
        for (int64_t s = 0; s < steps && !m.IsTerminated(); ++s) {
          const double c0 = ThreadCpuMicros();
          const auto t0 = Clock::now();
          m.FillNextTokenBitmask(mask.data());
          us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
          cpu_us.push_back(ThreadCpuMicros() - c0);
          std::vector<int32_t> ids, closing;
          for (int32_t id = 0; id < vocab->vocab_size(); ++id) {
            if (!((mask[id >> 5] >> (id & 31)) & 1)) continue;
            ids.push_back(id);
            if (!vocab->allowed_ever(id) || vocab->token_bytes(id).find_first_of("\"]},:") != std::string::npos) {
              closing.push_back(id);
            }
          }
          if (ids.empty()) break;
          const std::vector<int32_t>& from = !closing.empty() && rng() % 2 == 0 ? closing : ids;
          const int32_t token = from[rng() % from.size()];
          m.AcceptToken(token);
          walk.push_back(token);
        }
      }
      if (r == 0) walks_out["cases"].push_back({{"name", c["name"]}, {"walks", std::move(case_walks)}});
      if (us.size() != run_us[0].size()) {
        std::fprintf(stderr, "bench_grammar: %s: run %lld walked differently from run 0\n",
                     c["name"].get<std::string>().c_str(), static_cast<long long>(r));
        return 1;
      }
    }
    std::vector<double> mask_us(run_us[0].size()), mask_cpu_us(run_us[0].size());
    for (size_t k = 0; k < mask_us.size(); ++k) {
      std::vector<double> a, b;
      for (int64_t r = 0; r < runs; ++r) {
        a.push_back(run_us[r][k]);
        b.push_back(run_cpu_us[r][k]);
      }
      mask_us[k] = Percentile(a, 0.5);
      mask_cpu_us[k] = Percentile(b, 0.5);
    }
    ++case_index;
    case_compile_ms.push_back(Percentile(compile_ms, 0.5));
    all.insert(all.end(), mask_us.begin(), mask_us.end());
    all_cpu.insert(all_cpu.end(), mask_cpu_us.begin(), mask_cpu_us.end());
    std::printf("%-30s %10.1f %12lld %6zu %10.1f %10.1f %10.1f %10.1f %10.1f\n", c["name"].get<std::string>().c_str(),
                Percentile(compile_ms, 0.5), static_cast<long long>(compiled->context_dependent_tokens()), mask_us.size(),
                Percentile(mask_us, 0.5), Percentile(mask_us, 0.99), Percentile(mask_us, 1.0),
                Percentile(mask_cpu_us, 0.5), Percentile(mask_cpu_us, 0.99));
    std::fflush(stdout);
  }
  std::printf("%-30s %10.1f %12s %6zu %10.1f %10.1f %10.1f %10.1f %10.1f\n", "all", Percentile(case_compile_ms, 0.5), "",
              all.size(), Percentile(all, 0.5), Percentile(all, 0.99), Percentile(all, 1.0), Percentile(all_cpu, 0.5),
              Percentile(all_cpu, 0.99));
  if (flags->Has("write-walks")) {
    std::ofstream out(flags->Get("write-walks", ""));
    out << walks_out.dump() << "\n";
    if (!out.good()) {
      std::fprintf(stderr, "bench_grammar: cannot write %s\n", flags->Get("write-walks", "").c_str());
      return 1;
    }
  }
  std::printf("compile: median of the cases' medians %.1f ms, largest %.1f ms; %lld runs, masks the median over runs\n",
              Percentile(case_compile_ms, 0.5), Percentile(case_compile_ms, 1.0), static_cast<long long>(runs));
  return 0;
}
