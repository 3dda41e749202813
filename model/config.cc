#include "model/config.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "base/json.h"
#include "base/status_macros.h"
#include "model/families/registry.h"
#include "nlohmann/json.hpp"

namespace shardserve {

// The parser bounds every size and their total (kMaxParameters below), so no sum overflows.
int64_t ModelConfig::ParameterCount() const {
  int64_t n = 0;
  for (const WeightDecl& w : ModelWeights(*this)) {
    int64_t elements = 1;
    for (int64_t d : w.shape) elements *= d;
    n += elements;
  }
  return n;
}

namespace {

using json = nlohmann::json;

// Upper bounds on config.json's sizes: far above any published model (Llama 3.1 405B has hidden
// 16384, intermediate 53248, 126 layers and 128 heads; the largest vocabularies hold ~256k tokens,
// the longest contexts ~10M), low enough that every product of them used to size a tensor fits
// in int64 with room to spare (hidden x q_dim <= 2^18 x 2^24; vocab x hidden <= 2^42), so that
// a typo is an error naming the field before anything is sized from it.
constexpr int64_t kMaxVocabSize = int64_t{1} << 24;
constexpr int64_t kMaxHiddenSize = int64_t{1} << 18;
constexpr int64_t kMaxIntermediateSize = int64_t{1} << 20;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = int64_t{1} << 14;
constexpr int64_t kMaxPositionEmbeddings = int64_t{1} << 31;  // kMaxKvCacheTokens
// The shortest context served: a default request alone asks for 16 new tokens after its prompt.
constexpr int64_t kMinPositionEmbeddings = 32;
// The most parameters the sizes may describe together (the planner's bound, planner.cc).
constexpr double kMaxParameters = 1e15;
// The most ids eos_token_id may list.
constexpr size_t kMaxEosIds = 1024;

absl::Status FieldError(const std::string& source, const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": field \"", field, "\" ", what));
}

// Whether `field` is in `j` and not null (what transformers writes for an unset field).
bool Present(const json& j, const char* field) { return j.contains(field) && !j[field].is_null(); }

// Reads an integer field; `required` fields must be present.
absl::Status GetInt(const json& j, const std::string& source, const char* field, bool required, int64_t* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    return required ? FieldError(source, field, "is missing") : absl::OkStatus();
  }
  if (!it->is_number_integer()) return FieldError(source, field, absl::StrCat("must be an integer, got ", it->dump()));
  *out = it->get<int64_t>();
  return absl::OkStatus();
}

absl::Status GetDouble(const json& j, const std::string& source, const char* field, double* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return FieldError(source, field, absl::StrCat("must be a number, got ", it->dump()));
  *out = it->get<double>();
  if (!std::isfinite(*out)) return FieldError(source, field, "must be finite");
  return absl::OkStatus();
}

absl::Status GetBool(const json& j, const std::string& source, const char* field, bool* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) return FieldError(source, field, absl::StrCat("must be true or false, got ", it->dump()));
  *out = it->get<bool>();
  return absl::OkStatus();
}

// The scaling of a RoPE object: transformers 4.x's "rope_scaling" or 5.x's "rope_parameters"
// (`field` names it); "rope_type" (or 4.x's "type") default or llama3. Other types change the
// math and are refused, naming them.
absl::Status ParseRopeScaling(const json& r, const std::string& source, const std::string& field, RopeScaling* out) {
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (r.contains(key) && r[key].is_string()) {
      type = r[key].get<std::string>();
      break;
    }
  }
  if (type == "default") return absl::OkStatus();
  if (type != "llama3") {
    return FieldError(source, field,
                      absl::StrCat("has rope_type \"", type, "\", which is not supported (supported: llama3, default)"));
  }
  const std::string where = absl::StrCat(source, " ", field);
  out->type = RopeScaling::Type::kLlama3;
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, where, "factor", &out->factor));
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, where, "low_freq_factor", &out->low_freq_factor));
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, where, "high_freq_factor", &out->high_freq_factor));
  SHARDSERVE_RETURN_IF_ERROR(GetInt(r, where, "original_max_position_embeddings", false,
                                    &out->original_max_position_embeddings));
  if (out->factor <= 0 || out->low_freq_factor <= 0 || out->high_freq_factor <= out->low_freq_factor ||
      out->original_max_position_embeddings <= 0) {
    return FieldError(source, field,
                      "needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0");
  }
  return absl::OkStatus();
}

// RoPE as either version of transformers writes config.json: 4.x's "rope_theta" and "rope_scaling",
// or 5.x's "rope_parameters" ({"rope_theta", "rope_type", and the type's fields}); a file with
// both must have them agree. rope_parameters keyed by layer type ({"full_attention": {...},
// "sliding_attention": {...}}, as Gemma 3 writes it) is refused: these architectures have one kind
// of layer.
absl::Status ParseRope(const json& j, const std::string& source, double* theta, RopeScaling* scaling) {
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, "rope_theta", theta));
  if (Present(j, "rope_scaling")) {
    if (!j["rope_scaling"].is_object()) return FieldError(source, "rope_scaling", "must be an object or null");
    SHARDSERVE_RETURN_IF_ERROR(ParseRopeScaling(j["rope_scaling"], source, "rope_scaling", scaling));
  }
  if (!Present(j, "rope_parameters")) return absl::OkStatus();
  const json& p = j["rope_parameters"];
  if (!p.is_object()) return FieldError(source, "rope_parameters", "must be an object or null");
  if (!p.contains("rope_theta")) {
    for (const auto& [key, value] : p.items()) {
      if (value.is_object()) {
        return FieldError(source, "rope_parameters",
                          absl::StrCat("is given per layer type (\"", key,
                                       "\", ...), which this architecture does not have"));
      }
    }
    return FieldError(source, "rope_parameters", "has no \"rope_theta\"");
  }
  double v5_theta = 0;
  RopeScaling v5_scaling;
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(p, absl::StrCat(source, " rope_parameters"), "rope_theta", &v5_theta));
  SHARDSERVE_RETURN_IF_ERROR(ParseRopeScaling(p, source, "rope_parameters", &v5_scaling));
  if (Present(j, "rope_theta") && *theta != v5_theta) {
    return FieldError(source, "rope_parameters",
                      absl::StrCat("has rope_theta ", v5_theta, " but the file's \"rope_theta\" is ", *theta));
  }
  if (Present(j, "rope_scaling") && !(*scaling == v5_scaling)) {
    return FieldError(source, "rope_parameters", "and \"rope_scaling\" describe different RoPE scalings");
  }
  *theta = v5_theta;
  *scaling = v5_scaling;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& text, const std::string& source) {
  SHARDSERVE_ASSIGN_OR_RETURN(json j, ParseJson<json>(text, source));
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(source, ": expected a JSON object"));

  ModelConfig c;
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    return FieldError(source, "architectures", "is missing or not a list of names");
  }
  c.architecture_name = (*arch)[0].get<std::string>();
  c.family = FindFamily(c.architecture_name);
  if (c.family == nullptr) {
    return absl::UnimplementedError(absl::StrCat(source, ": architecture \"", c.architecture_name,
                                                 "\" is not supported (supported: ", SupportedArchitectures(), ")"));
  }
  using AttentionBias = FamilyDeclaration::AttentionBias;
  c.qkv_bias = c.family->attention_bias == AttentionBias::kQkv;
  c.qk_norm = c.family->qk_norm;

  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "vocab_size", true, &c.vocab_size));
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "hidden_size", true, &c.hidden_size));
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "intermediate_size", true, &c.intermediate_size));
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "num_hidden_layers", true, &c.num_hidden_layers));
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "num_attention_heads", true, &c.num_attention_heads));
  c.num_key_value_heads = c.num_attention_heads;
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "num_key_value_heads", false, &c.num_key_value_heads));
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "max_position_embeddings", false, &c.max_position_embeddings));
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, "rms_norm_eps", &c.rms_norm_eps));
  SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "tie_word_embeddings", &c.tie_word_embeddings));
  if (c.family->attention_bias == AttentionBias::kConfigured) {
    SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "attention_bias", &c.qkv_bias));
    c.o_bias = c.qkv_bias;
  }
  SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "mlp_bias", &c.mlp_bias));
  SHARDSERVE_RETURN_IF_ERROR(ParseRope(j, source, &c.rope_theta, &c.rope_scaling));
  if (auto q = j.find("quantization_config"); q != j.end() && !q->is_null()) {
    SHARDSERVE_ASSIGN_OR_RETURN(c.checkpoint_quant, ParseCheckpointQuant(q->dump(), source));
  }

  for (auto [field, value, max, max_text] :
       {std::tuple{"vocab_size", c.vocab_size, kMaxVocabSize, "2^24"},
        {"hidden_size", c.hidden_size, kMaxHiddenSize, "2^18"},
        {"intermediate_size", c.intermediate_size, kMaxIntermediateSize, "2^20"},
        {"num_hidden_layers", c.num_hidden_layers, kMaxLayers, "1024"},
        {"num_attention_heads", c.num_attention_heads, kMaxHeads, "2^14"},
        {"num_key_value_heads", c.num_key_value_heads, kMaxHeads, "2^14"}}) {
    if (value <= 0 || value > max) {
      return FieldError(source, field, absl::StrCat("must be in [1, ", max_text, "], got ", value));
    }
  }
  // 0 when absent (the server then needs --max-model-len); when present, a context to serve.
  if (Present(j, "max_position_embeddings") &&
      (c.max_position_embeddings < kMinPositionEmbeddings || c.max_position_embeddings > kMaxPositionEmbeddings)) {
    return FieldError(source, "max_position_embeddings",
                      absl::StrCat("must be in [", kMinPositionEmbeddings, ", 2^31], got ", c.max_position_embeddings));
  }
  c.head_dim = c.hidden_size / c.num_attention_heads;
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "head_dim", false, &c.head_dim));
  if (c.head_dim <= 0 || c.head_dim % 2 != 0 || c.head_dim > 1024) {
    return FieldError(source, "head_dim", absl::StrCat("must be even and in [2, 1024], got ", c.head_dim));
  }
  // Every size is bounded above, so these products cannot overflow; together they must describe
  // a model of at most kMaxParameters.
  const double params = static_cast<double>(c.num_hidden_layers) *
                            (2.0 * c.hidden_size * c.q_dim() + 2.0 * c.hidden_size * c.kv_dim() +
                             3.0 * c.hidden_size * c.intermediate_size) +
                        2.0 * c.vocab_size * c.hidden_size;
  if (params > kMaxParameters) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": the sizes describe ", params, " parameters, above the ", kMaxParameters, " this server takes (",
        "num_hidden_layers ", c.num_hidden_layers, ", hidden_size ", c.hidden_size, ", intermediate_size ",
        c.intermediate_size, ", q/kv heads ", c.num_attention_heads, "/", c.num_key_value_heads, " x head_dim ",
        c.head_dim, ", vocab_size ", c.vocab_size, ")"));
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return FieldError(source, "num_key_value_heads",
                      absl::StrCat("(", c.num_key_value_heads, ") must divide num_attention_heads (",
                                   c.num_attention_heads, ")"));
  }
  if (c.rms_norm_eps <= 0) return FieldError(source, "rms_norm_eps", "must be > 0");
  if (c.rope_theta <= 0) return FieldError(source, "rope_theta", "must be > 0");
  if (c.mlp_bias) return FieldError(source, "mlp_bias", "true is not supported");
  // The MLP's activation: "hidden_act", or Gemma's "hidden_activation" (which wins where both are).
  const std::string activation = c.family->activation;
  for (const char* act_field : {"hidden_act", "hidden_activation"}) {
    if (Present(j, act_field) && j[act_field] != activation &&
        !(act_field == std::string("hidden_act") && Present(j, "hidden_activation"))) {
      return FieldError(source, act_field,
                        absl::StrCat("is ", j[act_field].dump(), "; ", c.architecture_name, " takes \"", activation, "\""));
    }
  }
  c.activation = activation == "silu" ? ModelConfig::Activation::kSilu : ModelConfig::Activation::kGeluTanh;
  c.norm_plus_one = c.family->norm_plus_one;
  if (c.family->scale_embeddings) c.embedding_scale = std::sqrt(static_cast<double>(c.hidden_size));
  if (c.family->query_pre_attn_scalar && Present(j, "query_pre_attn_scalar")) {
    double scalar = 0;
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, "query_pre_attn_scalar", &scalar));
    if (!(scalar > 0) || !std::isfinite(scalar)) return FieldError(source, "query_pre_attn_scalar", "must be > 0");
    c.attention_scale = std::pow(scalar, -0.5);
  }
  using SlidingWindow = FamilyDeclaration::SlidingWindow;
  c.layer_window.assign(c.num_hidden_layers, 0);
  if ((c.family->sliding_window == SlidingWindow::kEveryLayer ||
       c.family->sliding_window == SlidingWindow::kLayerTypes) &&
      Present(j, "sliding_window")) {
    int64_t window = 0;
    SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "sliding_window", false, &window));
    if (window < kMinPositionEmbeddings || window > kMaxPositionEmbeddings) {
      return FieldError(source, "sliding_window",
                        absl::StrCat("must be null or in [", kMinPositionEmbeddings, ", 2^31], got ", window));
    }
    c.layer_window.assign(c.num_hidden_layers, window);
    if (c.family->sliding_window == SlidingWindow::kLayerTypes) {
      // Gemma 2's layers by "layer_types"; without it the even layers slide (Gemma2Config's default).
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        bool sliding = i % 2 == 0;
        if (Present(j, "layer_types") && j["layer_types"].is_array() &&
            j["layer_types"].size() == static_cast<size_t>(c.num_hidden_layers)) {
          sliding = j["layer_types"][i] == "sliding_attention";
        }
        if (!sliding) c.layer_window[i] = 0;
      }
    }
  }

  // The weights' type: "dtype" as transformers 5.x writes it, "torch_dtype" as 4.x did.
  std::string dtype = "float32";
  const char* dtype_field = "torch_dtype";
  for (const char* field : {"torch_dtype", "dtype"}) {
    if (!Present(j, field)) continue;
    if (!j[field].is_string()) return FieldError(source, field, "must be a string");
    if (field == std::string("dtype") && Present(j, "torch_dtype") && j["torch_dtype"] != j["dtype"]) {
      return FieldError(source, "dtype", absl::StrCat("is ", j["dtype"].dump(), " but \"torch_dtype\" is ",
                                                      j["torch_dtype"].dump()));
    }
    dtype = j[field].get<std::string>();
    dtype_field = field;
  }
  if (dtype == "float32") {
    c.dtype = DType::kF32;
  } else if (dtype == "float16") {
    c.dtype = DType::kF16;
  } else if (dtype == "bfloat16") {
    c.dtype = DType::kBF16;
  } else {
    return FieldError(source, dtype_field, absl::StrCat("is \"", dtype, "\"; supported: float32, float16, bfloat16"));
  }
  // Fields of newer configs that would change the math of these architectures: understood as the
  // value that changes nothing, refused by name otherwise (never silently ignored).
  // partial_rotary_factor: at the top (4.x) or inside rope_parameters (5.x).
  for (const json* where : {&j, Present(j, "rope_parameters") ? &j["rope_parameters"] : nullptr}) {
    if (where == nullptr) continue;
    double partial_rotary = 1.0;
    const std::string field = where == &j ? "partial_rotary_factor" : "rope_parameters";
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(*where, where == &j ? source : absl::StrCat(source, " rope_parameters"),
                                         "partial_rotary_factor", &partial_rotary));
    if (partial_rotary != 1.0) {
      return FieldError(source, field,
                        absl::StrCat(where == &j ? "is " : "has partial_rotary_factor ", partial_rotary,
                                     "; only 1 (RoPE on the whole head) is supported"));
    }
  }
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return FieldError(source, "layer_types", "must be a list of names");
    const bool typed = c.family->sliding_window == SlidingWindow::kLayerTypes;
    if (typed && it->size() != static_cast<size_t>(c.num_hidden_layers)) {
      return FieldError(source, "layer_types", absl::StrCat("has ", it->size(), " entries for ", c.num_hidden_layers,
                                                            " layers (num_hidden_layers)"));
    }
    for (const json& type : *it) {
      if (type != "full_attention" && !(typed && type == "sliding_attention")) {
        return FieldError(source, "layer_types",
                          absl::StrCat("has ", type.dump(), "; ", c.architecture_name, " takes \"full_attention\"",
                                       typed ? " and \"sliding_attention\"" : "", " layers"));
      }
    }
  }
  for (auto [field, value] : {std::pair{"attn_logit_softcapping", &c.attn_logit_softcap},
                              std::pair{"final_logit_softcapping", &c.final_logit_softcap}}) {
    if (!Present(j, field)) continue;
    if (!c.family->softcapping) {
      return FieldError(source, field, absl::StrCat("is ", j[field].dump(), "; soft-capping is not supported for ",
                                                    c.architecture_name));
    }
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, field, value));
    if (!(*value > 0) || !std::isfinite(*value)) return FieldError(source, field, "must be null or > 0");
  }
  bool use_sliding_window = false;
  SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "use_sliding_window", &use_sliding_window));
  if (c.family->sliding_window == SlidingWindow::kOffUnlessUsed && use_sliding_window) {
    return FieldError(source, "use_sliding_window",
                      absl::StrCat("is true; sliding-window attention is not supported for ", c.architecture_name));
  }

  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    if (it->is_number_integer()) {
      c.eos_token_ids.push_back(it->get<int64_t>());
    } else if (it->is_array() && it->size() <= kMaxEosIds) {
      for (const auto& e : *it) {
        if (!e.is_number_integer()) return FieldError(source, "eos_token_id", "must be an integer or a list of integers");
        c.eos_token_ids.push_back(e.get<int64_t>());
      }
    } else {
      return FieldError(source, "eos_token_id",
                        absl::StrCat("must be an integer or a list of at most ", kMaxEosIds, " integers"));
    }
  }
  for (int64_t id : c.eos_token_ids) {
    if (id < 0 || id >= c.vocab_size) {
      return FieldError(source, "eos_token_id",
                        absl::StrCat("has ", id, ", outside the vocabulary [0, ", c.vocab_size, ") (vocab_size)"));
    }
  }
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "bos_token_id", false, &c.bos_token_id));
  if (c.bos_token_id != -1 && (c.bos_token_id < 0 || c.bos_token_id >= c.vocab_size)) {
    return FieldError(source, "bos_token_id",
                      absl::StrCat("is ", c.bos_token_id, ", outside the vocabulary [0, ", c.vocab_size, ") (vocab_size)"));
  }
  // The worker computes RoPE in float32: a rope_theta or llama3 scaling that is positive in double
  // can still give inf or NaN there (rope_theta 1e-50 rounds to 0).
  for (float f : RopeInvFreq(c)) {
    if (!std::isfinite(f)) {
      return FieldError(source, c.rope_scaling.type == RopeScaling::Type::kNone ? "rope_theta" : "rope_scaling",
                        "gives RoPE frequencies that are not finite in float32");
    }
  }
  if (c.checkpoint_quant.has_value()) {
    for (const WeightDecl& w : ModelWeights(c)) {
      if (!w.fused_shape.empty()) {
        return FieldError(source, "quantization_config",
                          absl::StrCat("describes a quantized checkpoint of ", c.architecture_name, ", whose tensor \"",
                                       w.name, "\" fuses several products; quantized checkpoints of fused products are "
                                       "not supported (load the unquantized checkpoint, with --quantization if need be)"));
      }
    }
  }
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& path) {
  std::filesystem::path file = std::filesystem::is_directory(path) ? path / "config.json" : path;
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(file.string(), ": cannot open (does the file exist?)"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseModelConfig(ss.str(), file.string());
}

std::vector<float> RopeInvFreq(const ModelConfig& c) {
  // As transformers' _compute_default_rope_parameters: 1 / theta^(2i / d), computed in float32
  // from an int64 arange, then (llama3) _compute_llama3_parameters.
  const int64_t half = c.head_dim / 2;
  std::vector<float> inv(half);
  for (int64_t i = 0; i < half; ++i) {
    float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    inv[i] = 1.0f / std::pow(static_cast<float>(c.rope_theta), exponent);
  }
  if (c.rope_scaling.type == RopeScaling::Type::kLlama3) {
    const RopeScaling& r = c.rope_scaling;
    const double old_ctx = static_cast<double>(r.original_max_position_embeddings);
    const double low_freq_wavelen = old_ctx / r.low_freq_factor;
    const double high_freq_wavelen = old_ctx / r.high_freq_factor;
    for (float& f : inv) {
      const float wavelen = 2.0f * static_cast<float>(M_PI) / f;
      if (wavelen > low_freq_wavelen) {
        f = f / static_cast<float>(r.factor);  // long wavelengths: fully scaled
      } else if (wavelen >= high_freq_wavelen) {
        // medium wavelengths: smooth interpolation between scaled and unscaled
        const float smooth = static_cast<float>((old_ctx / wavelen - r.low_freq_factor) /
                                                (r.high_freq_factor - r.low_freq_factor));
        f = (1.0f - smooth) * f / static_cast<float>(r.factor) + smooth * f;
      }  // short wavelengths: unchanged
    }
  }
  return inv;
}

}  // namespace shardserve
