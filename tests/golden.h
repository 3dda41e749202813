// Hugging Face's answers for a fixture (golden.json, written by tools/fixtures/make_parity_fixtures.py and
// tools/fixtures/make_quantized_fixtures.py): the prompt, transformers' greedy continuation, and its logits
// after the prompt and at the last greedy step; and the one measure the parity tests compare logits
// by. Header-only, for the test programs.
#ifndef SHARDSERVE_TESTS_GOLDEN_H_
#define SHARDSERVE_TESTS_GOLDEN_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <vector>

#include "nlohmann/json.hpp"

namespace shardserve {

struct Golden {
  std::vector<int32_t> prompt, greedy;
  std::vector<float> prompt_last_logits, final_logits;
};

// `dir`/golden.json; a missing file or field throws (the test fails, naming it).
inline Golden ReadGolden(const std::filesystem::path& dir) {
  std::ifstream in(dir / "golden.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  Golden g;
  g.prompt = j.at("prompt_ids").get<std::vector<int32_t>>();
  g.greedy = j.at("greedy_ids").get<std::vector<int32_t>>();
  g.prompt_last_logits = j.at("prompt_last_logits").get<std::vector<float>>();
  g.final_logits = j.at("final_logits").get<std::vector<float>>();
  return g;
}

// max|a - b| / max|b|: the error relative to the logits' scale, so one number bounds every entry.
// Infinite where the two differ in length or are empty (callers check the lengths first, to say so),
// or where a holds NaN or Inf.
inline double NormalizedError(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() || b.empty()) return INFINITY;
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

// Pearson's correlation of a and b: 1 when one is an increasing affine function of the other, 0 when
// either is constant (a model whose logits collapsed to one value, all zeros included) or they are
// unrelated. NaN or Inf in a gives -1.
inline double Correlation(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() || b.empty()) return -1;
  double ma = 0, mb = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return -1;
    ma += a[i];
    mb += b[i];
  }
  ma /= static_cast<double>(a.size());
  mb /= static_cast<double>(b.size());
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    sab += (a[i] - ma) * (b[i] - mb);
    saa += (a[i] - ma) * (a[i] - ma);
    sbb += (b[i] - mb) * (b[i] - mb);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : 0;
}

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_GOLDEN_H_
