// config.json text (model/config.h): ParseModelConfig, as LoadModelConfig calls it on the file's
// contents, then what every parsed config meets in production: ParameterCount (planner,
// ModelInfo), RopeTables (the worker's forward pass) and a quantized checkpoint's quantization_config bounds.
// Errors must be a Status; a config that parses must keep these free of overflow (UBSan) and
// their results finite.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<shardserve::ModelConfig> config = shardserve::ParseModelConfig(text, "config.json");
  if (!config.ok()) return 0;
  if (config->ParameterCount() <= 0) std::abort();
  if (config->q_dim() <= 0 || config->kv_dim() <= 0 || config->num_attention_heads % config->num_key_value_heads != 0) {
    std::abort();
  }
  if (config->checkpoint_quant.has_value()) {  // quantization_config (model/quantized_checkpoint.h): only what loads parses
    const shardserve::CheckpointQuant& q = *config->checkpoint_quant;
    if ((q.bits != 4 && q.bits != 8) || q.groups(config->hidden_size) < 1) std::abort();
    if (q.output_multiple() < 1 || q.input_multiple(/*split=*/true) < 1) std::abort();
    if (q.method == shardserve::QuantMethod::kFp8 && (q.block_out < 1 || q.block_in < 1)) std::abort();
    (void)q.Quantizes("model.layers.0.mlp.down_proj");  // the ignore list's patterns compiled at parse time
  }
  for (const shardserve::RopeTable& table : shardserve::RopeTables(*config)) {
    if (static_cast<int64_t>(table.inv_freq.size()) * 2 != config->RotaryDim()) std::abort();
    if (!table.long_inv_freq.empty() && table.long_inv_freq.size() != table.inv_freq.size()) std::abort();
    if (!(table.attention_factor > 0) || !std::isfinite(table.attention_factor)) std::abort();
    for (const std::vector<float>* freqs : {&table.inv_freq, &table.long_inv_freq}) {
      for (float f : *freqs) {
        if (!std::isfinite(f)) std::abort();
      }
    }
  }
  return 0;
}
