#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json.h"
#include "base/status_macros.h"
#include "model/checkpoint.h"
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

// What parsing a RoPE object needs from the rest of config.json.
struct RopeContext {
  int64_t max_position_embeddings = 0;  // 0 when absent
  // The top-level original_max_position_embeddings, which transformers puts in place of the RoPE
  // object's (standardize_rope_params); Phi3Config's default 4096 when absent there. 0: none.
  int64_t top_original_max = 0;
  bool phi3 = false;  // FamilyDeclaration::phi3_rope
};

// A list of positive finite numbers (longrope's short_factor / long_factor).
absl::Status GetFactors(const json& r, const std::string& source, const std::string& field, const char* key,
                        std::vector<double>* out) {
  auto it = r.find(key);
  if (it == r.end() || !it->is_array() || it->empty()) {
    return FieldError(source, field, absl::StrCat("has rope_type \"longrope\" but no \"", key, "\" list"));
  }
  for (const json& v : *it) {
    if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>())) {
      return FieldError(source, field, absl::StrCat("has \"", key, "\" with ", v.dump(), "; want numbers > 0"));
    }
    out->push_back(v.get<double>());
  }
  return absl::OkStatus();
}

// The scaling of a RoPE object: transformers 4.x's "rope_scaling" or 5.x's "rope_parameters"
// (`field` names it); "rope_type" (or 4.x's "type") default, linear, dynamic, llama3, yarn or
// longrope, each type's fields resolved as modeling_rope_utils.py's _compute_*_parameters resolve them.
//
// dynamic (NTK): transformers raises the base for a forward call whose longest position reaches L >
// max_position_embeddings, to base x (factor x L / max_position_embeddings - (factor - 1))^(d / (d - 2)),
// and otherwise (L taken as max_position_embeddings: the factor of the base is 1) keeps the default
// frequencies. A shard serves no position at or past max_position_embeddings (step_checks.cc refuses
// them; the planner keeps max_model_len within it), so every rotation it makes is the default one,
// exactly what transformers computes there: dynamic loads as default.
absl::Status ParseRopeScaling(const json& r, const std::string& source, const std::string& field,
                              const RopeContext& ctx, RopeScaling* out) {
  using Type = RopeScaling::Type;
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (r.contains(key) && r[key].is_string()) {
      type = r[key].get<std::string>();
      break;
    }
  }
  // Phi3Config reads "su" and "yarn" as longrope and takes no other scaling.
  if (ctx.phi3 && (type == "su" || type == "yarn")) type = "longrope";
  if (ctx.phi3 && type != "default" && type != "longrope") {
    return FieldError(source, field,
                      absl::StrCat("has rope_type \"", type, "\"; Phi3ForCausalLM takes default and longrope"));
  }
  if (type == "dynamic") {
    if (ctx.max_position_embeddings <= 0) {
      return FieldError(source, field,
                        "has rope_type \"dynamic\", which needs max_position_embeddings > 0 (the context it "
                        "leaves unscaled, and the most this server serves)");
    }
    if (!Present(r, "factor")) return FieldError(source, field, "has rope_type \"dynamic\" but no \"factor\"");
    double factor = 0;
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, absl::StrCat(source, " ", field), "factor", &factor));
    if (!(factor > 0)) return FieldError(source, field, "needs factor > 0");
    out->type = Type::kNone;
    return absl::OkStatus();
  }
  const std::pair<const char*, Type> kTypes[] = {{"default", Type::kNone},
                                                 {"linear", Type::kLinear},
                                                 {"llama3", Type::kLlama3},
                                                 {"yarn", Type::kYarn},
                                                 {"longrope", Type::kLongRope}};
  bool known = false;
  for (const auto& [name, t] : kTypes) {
    if (type == name) {
      out->type = t;
      known = true;
    }
  }
  if (!known) {
    return FieldError(source, field,
                      absl::StrCat("has rope_type \"", type,
                                   "\", which is not supported (supported: default, linear, dynamic, llama3, yarn, longrope)"));
  }
  if (out->type == Type::kNone) return absl::OkStatus();
  const std::string where = absl::StrCat(source, " ", field);
  const bool factor_required = out->type != Type::kLongRope;
  if (factor_required && !Present(r, "factor") && !(out->type == Type::kYarn && r.contains("factor"))) {
    return FieldError(source, field, absl::StrCat("has rope_type \"", type, "\" but no \"factor\""));
  }
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, where, "factor", &out->factor));
  if (out->type == Type::kLinear) {
    if (!(out->factor > 0)) return FieldError(source, field, "needs factor > 0");
    return absl::OkStatus();
  }
  // original_max_position_embeddings: the top level's when there is one, else the object's, else
  // max_position_embeddings (standardize_rope_params).
  out->original_max_position_embeddings = ctx.max_position_embeddings;
  SHARDSERVE_RETURN_IF_ERROR(GetInt(r, where, "original_max_position_embeddings", false,
                                    &out->original_max_position_embeddings));
  if (ctx.top_original_max > 0) out->original_max_position_embeddings = ctx.top_original_max;
  if (out->original_max_position_embeddings <= 0) {
    return FieldError(source, field, absl::StrCat("has rope_type \"", type,
                                                  "\", which needs original_max_position_embeddings > 0"));
  }
  const double original = static_cast<double>(out->original_max_position_embeddings);
  if (out->type == Type::kLlama3) {
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, where, "low_freq_factor", &out->low_freq_factor));
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, where, "high_freq_factor", &out->high_freq_factor));
    if (out->factor <= 0 || out->low_freq_factor <= 0 || out->high_freq_factor <= out->low_freq_factor) {
      return FieldError(source, field, "needs factor > 0 and 0 < low_freq_factor < high_freq_factor");
    }
    return absl::OkStatus();
  }
  // yarn and longrope: a null factor is max_position_embeddings / original_max_position_embeddings.
  if (!Present(r, "factor")) {
    if (ctx.max_position_embeddings <= 0) {
      return FieldError(source, field, "has no \"factor\" and the file no max_position_embeddings to infer it from");
    }
    out->factor = static_cast<double>(ctx.max_position_embeddings) / original;
  }
  if (!(out->factor > 0)) return FieldError(source, field, "needs factor > 0");
  const bool given_attention = Present(r, "attention_factor");
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, where, "attention_factor", &out->attention_factor));
  if (given_attention && !(out->attention_factor > 0)) return FieldError(source, field, "needs attention_factor > 0");
  if (out->type == Type::kLongRope) {
    SHARDSERVE_RETURN_IF_ERROR(GetFactors(r, source, field, "short_factor", &out->short_factor));
    SHARDSERVE_RETURN_IF_ERROR(GetFactors(r, source, field, "long_factor", &out->long_factor));
    if (!given_attention) {
      out->attention_factor =
          out->factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(out->factor) / std::log(original));
    }
    return absl::OkStatus();
  }
  // yarn. beta_fast / beta_slow: null or 0 is the paper's 32 / 1, as transformers' `or`.
  for (auto [key, value, fallback] : {std::tuple{"beta_fast", &out->beta_fast, 32.0},
                                      std::tuple{"beta_slow", &out->beta_slow, 1.0}}) {
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, where, key, value));
    if (*value == 0) *value = fallback;
  }
  SHARDSERVE_RETURN_IF_ERROR(GetBool(r, where, "truncate", &out->truncate));
  if (!given_attention) {
    double mscale = 0, mscale_all_dim = 0;
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, where, "mscale", &mscale));
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(r, where, "mscale_all_dim", &mscale_all_dim));
    const auto get_mscale = [&](double m) { return out->factor <= 1 ? 1.0 : 0.1 * m * std::log(out->factor) + 1.0; };
    out->attention_factor =
        mscale != 0 && mscale_all_dim != 0 ? get_mscale(mscale) / get_mscale(mscale_all_dim) : get_mscale(1.0);
    if (!(out->attention_factor > 0) || !std::isfinite(out->attention_factor)) {
      return FieldError(source, field, "gives an attention factor (from factor, mscale and mscale_all_dim) that is not > 0");
    }
  }
  return absl::OkStatus();
}

// A RoPE object of transformers 5.x ({"rope_theta", "rope_type", and the type's fields}); a missing
// rope_theta is `default_theta`.
absl::Status ParseRopeObject(const json& p, const std::string& source, const std::string& field,
                             const RopeContext& ctx, double default_theta, LayerRope* out) {
  if (!p.is_object()) return FieldError(source, field, "must be an object");
  out->theta = default_theta;
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(p, absl::StrCat(source, " ", field), "rope_theta", &out->theta));
  return ParseRopeScaling(p, source, field, ctx, &out->scaling);
}

// Gemma 3's RoPE, a base per kind of layer: 4.x's "rope_theta" (full attention, default 1e6),
// "rope_local_base_freq" (sliding, default 1e4) and "rope_scaling" (full attention only), or 5.x's
// "rope_parameters" keyed by layer type; a file with both must have them agree.
absl::Status ParseRopePerLayerType(const json& j, const std::string& source, const RopeContext& ctx,
                                   LayerRope* full, LayerRope* sliding) {
  full->theta = 1e6;
  sliding->theta = 1e4;
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, "rope_theta", &full->theta));
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, "rope_local_base_freq", &sliding->theta));
  if (Present(j, "rope_scaling")) {
    if (!j["rope_scaling"].is_object()) return FieldError(source, "rope_scaling", "must be an object or null");
    SHARDSERVE_RETURN_IF_ERROR(ParseRopeScaling(j["rope_scaling"], source, "rope_scaling", ctx, &full->scaling));
  }
  if (!Present(j, "rope_parameters")) return absl::OkStatus();
  const json& p = j["rope_parameters"];
  if (!p.is_object()) return FieldError(source, "rope_parameters", "must be an object or null");
  for (const auto& [key, value] : p.items()) {
    if (key != "full_attention" && key != "sliding_attention") {
      return FieldError(source, "rope_parameters",
                        absl::StrCat("has \"", key, "\"; ", "this architecture's is keyed by layer type "
                                     "(\"full_attention\", \"sliding_attention\")"));
    }
  }
  for (auto [key, layer] : {std::pair{"full_attention", full}, std::pair{"sliding_attention", sliding}}) {
    if (!Present(p, key)) continue;
    const std::string field = absl::StrCat("rope_parameters.", key);
    LayerRope v5;
    SHARDSERVE_RETURN_IF_ERROR(ParseRopeObject(p[key], source, field, ctx, layer->theta, &v5));
    const char* v4_theta = layer == full ? "rope_theta" : "rope_local_base_freq";
    if (Present(j, v4_theta) && v5.theta != layer->theta) {
      return FieldError(source, field, absl::StrCat("has rope_theta ", v5.theta, " but the file's \"", v4_theta,
                                                    "\" is ", layer->theta));
    }
    if (layer == full && Present(j, "rope_scaling") && !(v5.scaling == full->scaling)) {
      return FieldError(source, field, "and \"rope_scaling\" describe different RoPE scalings");
    }
    *layer = v5;
  }
  return absl::OkStatus();
}

// RoPE as either version of transformers writes config.json: 4.x's "rope_theta" and "rope_scaling",
// or 5.x's "rope_parameters" ({"rope_theta", "rope_type", and the type's fields}); a file with
// both must have them agree. rope_parameters keyed by layer type ({"full_attention": {...},
// "sliding_attention": {...}}) is refused here: these architectures have one kind of layer.
absl::Status ParseRope(const json& j, const std::string& source, const RopeContext& ctx, double* theta,
                       RopeScaling* scaling) {
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, "rope_theta", theta));
  if (Present(j, "rope_scaling")) {
    if (!j["rope_scaling"].is_object()) return FieldError(source, "rope_scaling", "must be an object or null");
    SHARDSERVE_RETURN_IF_ERROR(ParseRopeScaling(j["rope_scaling"], source, "rope_scaling", ctx, scaling));
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
  LayerRope v5;
  SHARDSERVE_RETURN_IF_ERROR(ParseRopeObject(p, source, "rope_parameters", ctx, 0, &v5));
  if (Present(j, "rope_theta") && *theta != v5.theta) {
    return FieldError(source, "rope_parameters",
                      absl::StrCat("has rope_theta ", v5.theta, " but the file's \"rope_theta\" is ", *theta));
  }
  if (Present(j, "rope_scaling") && !(*scaling == v5.scaling)) {
    return FieldError(source, "rope_parameters", "and \"rope_scaling\" describe different RoPE scalings");
  }
  *theta = v5.theta;
  *scaling = v5.scaling;
  return absl::OkStatus();
}

// partial_rotary_factor, at the top (4.x) or in each RoPE object (5.x), all the same where several
// give it, else the family's default: head_dim * it (truncated, as transformers' int()) is
// rotary_dim, which must be even.
absl::Status ParsePartialRotary(const json& j, const std::string& source, const FamilyDeclaration& family,
                                ModelConfig* c) {
  std::vector<std::pair<std::string, const json*>> places = {{"partial_rotary_factor", &j}};
  if (Present(j, "rope_parameters") && j["rope_parameters"].is_object()) {
    const json& p = j["rope_parameters"];
    places.push_back({"rope_parameters", &p});
    for (const char* key : {"full_attention", "sliding_attention"}) {
      if (Present(p, key)) places.push_back({absl::StrCat("rope_parameters.", key), &p[key]});
    }
  }
  double factor = family.default_partial_rotary_factor;
  std::string factor_field;
  for (const auto& [field, where] : places) {
    if (!Present(*where, "partial_rotary_factor")) continue;
    double f = 1.0;
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(*where, where == &j ? source : absl::StrCat(source, " ", field),
                                         "partial_rotary_factor", &f));
    if (!factor_field.empty() && f != factor) {
      return FieldError(source, field, absl::StrCat("has partial_rotary_factor ", f, " but \"", factor_field,
                                                    "\" has ", factor));
    }
    factor = f;
    factor_field = field;
  }
  // (absent: the family's default, named as the field)
  const std::string what = factor_field.empty() ? absl::StrCat("is absent, so ", family.architecture, "'s default ")
                           : factor_field == "partial_rotary_factor" ? "is "
                                                                      : "has partial_rotary_factor ";
  if (factor_field.empty()) factor_field = "partial_rotary_factor";
  if (factor != 1.0 && !family.partial_rotary) {
    return FieldError(source, factor_field,
                      absl::StrCat(what, factor, "; ", family.architecture,
                                   " rotates the whole head (only 1 is supported)"));
  }
  if (!(factor > 0 && factor <= 1)) {
    return FieldError(source, factor_field, absl::StrCat(what, factor, "; want a value in (0, 1]"));
  }
  c->rotary_dim = static_cast<int64_t>(static_cast<double>(c->head_dim) * factor);
  if (c->rotary_dim < 2 || c->rotary_dim % 2 != 0) {
    return FieldError(source, factor_field,
                      absl::StrCat(what, factor, ", which rotates ", c->rotary_dim, " of head_dim ", c->head_dim,
                                   " dimensions; want an even number >= 2"));
  }
  return absl::OkStatus();
}

// The most experts a layer may have (DeepSeek-V3 and Kimi K2 have 256 and 384).
constexpr int64_t kMaxExperts = 4096;
// The most experts all layers may have together. A family declares each expert of each layer as
// its own weights (model/families), which ParameterCount, every plan and every load walk: at the
// two bounds above (1024 layers of 4096 experts) that is 12.6 million declarations, 7 GB and a
// minute for `shardserve plan` alone. Kimi K2 has 61 x 384 = 23,424, DeepSeek-V3 62 x 256 = 15,872.
constexpr int64_t kMaxLayerExperts = 65536;

// DeepseekV3Config's and Glm4MoeConfig's router and layer fields, with the config class's defaults
// where config.json leaves one out (FamilyDeclaration::group_router; DeepseekV3Config's in
// parentheses; c's expert count, k and moe_intermediate_size already read): norm_topk_prob (true), n_group (8)
// and topk_group (4) (the experts in n_group equal groups of at least 2, k of at most topk_group
// groups' experts), routed_scaling_factor (2.5), n_shared_experts (1) plain shared experts of
// moe_intermediate_size each, one SwiGLU together; layer i sparse from first_k_dense_replace (3)
// on. DeepseekV3Model reads neither moe_layer_freq nor scoring_func / topk_method (the published
// files' 1, "sigmoid", "noaux_tc"): every later layer is sparse, the scores sigmoids.
absl::Status ParseDeepseekExperts(const json& j, const std::string& source, ModelConfig* c) {
  c->norm_topk_prob = true;
  SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "norm_topk_prob", &c->norm_topk_prob));
  const FamilyDeclaration::GroupRouterDefaults& defaults = c->family->group_router;
  c->n_group = defaults.n_group;
  c->topk_group = defaults.topk_group;
  c->routed_scaling_factor = defaults.routed_scaling_factor;
  int64_t shared = 1, first_dense = defaults.first_k_dense_replace;
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "n_group", false, &c->n_group));
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "topk_group", false, &c->topk_group));
  SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, "routed_scaling_factor", &c->routed_scaling_factor));
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "n_shared_experts", false, &shared));
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "first_k_dense_replace", false, &first_dense));
  const int64_t E = c->num_experts, k = c->num_experts_per_tok;
  if (c->n_group < 1 || c->n_group > 64 || E % c->n_group != 0 || E / c->n_group < 2) {
    return FieldError(source, "n_group", absl::StrCat("must divide n_routed_experts (", E, ") into at most 64 groups of ",
                                                      "at least 2 experts, got ", c->n_group));
  }
  if (c->topk_group < 1 || c->topk_group > c->n_group || k > c->topk_group * (E / c->n_group)) {
    return FieldError(source, "topk_group", absl::StrCat("must be in [1, n_group = ", c->n_group, "] and keep at least ",
                                                         "num_experts_per_tok (", k, ") experts, got ", c->topk_group));
  }
  if (shared < 0 || shared > 64) return FieldError(source, "n_shared_experts", absl::StrCat("must be in [0, 64], got ", shared));
  c->shared_expert_intermediate_size = shared * c->moe_intermediate_size;
  if (first_dense < 0) return FieldError(source, "first_k_dense_replace", absl::StrCat("must be >= 0, got ", first_dense));
  // (the multi-token-prediction layers after them by the same rule)
  c->sparse_layers.resize(c->num_hidden_layers + c->num_nextn_predict_layers);
  for (size_t i = 0; i < c->sparse_layers.size(); ++i) c->sparse_layers[i] = static_cast<int64_t>(i) >= first_dense;
  return absl::OkStatus();
}

// GptOssConfig's experts (c's expert count and k already read): every layer sparse, each expert
// intermediate_size wide, the clamped SwiGLU's swiglu_limit (7.0) and swiglu_alpha (1.702;
// transformers 4.x has no field and always 1.702), both finite and > 0.
absl::Status ParseGptOssExperts(const json& j, const std::string& source, ModelConfig* c) {
  c->moe_intermediate_size = c->intermediate_size;
  c->sparse_layers.assign(c->num_hidden_layers, true);
  c->swiglu_limit = 7.0;
  c->swiglu_alpha = 1.702;
  for (auto [field, value] : {std::pair{"swiglu_limit", &c->swiglu_limit}, std::pair{"swiglu_alpha", &c->swiglu_alpha}}) {
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, field, value));
    if (!(*value > 0)) return FieldError(source, field, absl::StrCat("must be > 0, got ", *value));
  }
  return absl::OkStatus();
}

// gpt-oss's quantization_config: quant_method "mxfp4" (ModelConfig::mxfp4_experts), which
// transformers applies to the experts alone (replace_with_mxfp4_linear converts only GptOssExperts);
// modules_to_not_convert may name any module but the experts. Any other method is refused by name.
absl::Status ParseMxfp4Experts(const json& q, const std::string& source, ModelConfig* c) {
  if (!q.is_object() || !q.contains("quant_method") || q["quant_method"] != "mxfp4") {
    return FieldError(source, "quantization_config",
                      absl::StrCat("has quant_method ", q.is_object() && q.contains("quant_method") ? q["quant_method"].dump() : "null",
                                   "; ", c->architecture_name, " checkpoints are read plain or with \"mxfp4\" experts"));
  }
  if (auto m = q.find("modules_to_not_convert"); m != q.end() && !m->is_null()) {
    if (!m->is_array()) return FieldError(source, "quantization_config.modules_to_not_convert", "must be a list of names");
    for (const json& name : *m) {
      if (!name.is_string() || name.get<std::string>().find("experts") != std::string::npos) {
        return FieldError(source, "quantization_config.modules_to_not_convert",
                          absl::StrCat("has ", name.dump(), "; the experts of an mxfp4 checkpoint are all MXFP4"));
      }
    }
  }
  bool dequantize = false;  // Mxfp4Config's dequantize only changes how transformers holds them
  SHARDSERVE_RETURN_IF_ERROR(GetBool(q, absl::StrCat(source, " quantization_config"), "dequantize", &dequantize));
  c->mxfp4_experts = true;
  return absl::OkStatus();
}

// Multi-head latent attention's fields (ModelConfig::kv_lora_rank and the rest), as
// DeepseekV3Attention reads them: head_dim becomes qk_rope_head_dim, and the softmax scale
// qk_head_dim^-0.5, times mscale^2 for a RoPE scaling with mscale_all_dim (yarn_apply_mscale:
// mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for factor > 1).
absl::Status ParseMla(const json& j, const std::string& source, ModelConfig* c) {
  bool attention_bias = false;
  SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "attention_bias", &attention_bias));
  if (attention_bias) return FieldError(source, "attention_bias", "is true; latent attention with biases is not supported");
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "q_lora_rank", false, &c->q_lora_rank));  // null: q_proj
  for (auto [field, out] : {std::pair{"kv_lora_rank", &c->kv_lora_rank}, {"qk_nope_head_dim", &c->qk_nope_head_dim},
                            {"qk_rope_head_dim", &c->qk_rope_head_dim}, {"v_head_dim", &c->v_head_dim}}) {
    SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, field, true, out));
    if (*out < 1 || *out > 4096) return FieldError(source, field, absl::StrCat("must be in [1, 4096], got ", *out));
  }
  if (Present(j, "q_lora_rank") && (c->q_lora_rank < 1 || c->q_lora_rank > 65536)) {
    return FieldError(source, "q_lora_rank", absl::StrCat("must be null or in [1, 65536], got ", c->q_lora_rank));
  }
  if (c->qk_rope_head_dim % 2 != 0) {
    return FieldError(source, "qk_rope_head_dim", absl::StrCat("must be even, got ", c->qk_rope_head_dim));
  }
  c->rope_interleave = true;  // DeepseekV3Config's default
  SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "rope_interleave", &c->rope_interleave));
  c->head_dim = c->qk_rope_head_dim;
  double scale = 1.0 / std::sqrt(static_cast<double>(c->qk_nope_head_dim + c->qk_rope_head_dim));
  const char* rope_field = Present(j, "rope_parameters") ? "rope_parameters" : "rope_scaling";
  if (c->rope_scaling.type != RopeScaling::Type::kNone && Present(j, rope_field) && j[rope_field].is_object()) {
    double mscale_all_dim = 0;
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(j[rope_field], absl::StrCat(source, " ", rope_field), "mscale_all_dim",
                                         &mscale_all_dim));
    if (mscale_all_dim != 0) {
      const double factor = c->rope_scaling.factor;
      const double mscale = factor <= 1 ? 1.0 : 0.1 * mscale_all_dim * std::log(factor) + 1.0;
      scale *= mscale * mscale;
    }
  }
  c->attention_scale = scale;
  return absl::OkStatus();
}

// The mixture-of-experts fields of config.json, as the family's config class reads them
// (FamilyDeclaration::Experts); c's layer count and intermediate_size are already read.
absl::Status ParseExperts(const json& j, const std::string& source, ModelConfig* c) {
  using Experts = FamilyDeclaration::Experts;
  const Experts kind = c->family->experts;
  c->sparse_layers.assign(c->num_hidden_layers, false);
  if (kind == Experts::kNone) return absl::OkStatus();
  // The expert count: Mixtral's num_local_experts; Qwen-MoE's num_experts, which transformers 5
  // saves as num_local_experts (Qwen3MoeConfig's attribute_map): both must agree where both are.
  const char* count_field = kind == Experts::kDeepseek ? "n_routed_experts" : "num_local_experts";
  if (kind == Experts::kQwen) {
    const bool hub = Present(j, "num_experts"), saved = Present(j, "num_local_experts");
    if (hub && saved && j["num_experts"] != j["num_local_experts"]) {
      return FieldError(source, "num_local_experts", absl::StrCat("is ", j["num_local_experts"].dump(),
                                                                  " but \"num_experts\" is ", j["num_experts"].dump()));
    }
    if (hub || !saved) count_field = "num_experts";
  }
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, count_field, true, &c->num_experts));
  if (c->num_experts < 0 || c->num_experts > kMaxExperts) {
    return FieldError(source, count_field, absl::StrCat("must be in [0, ", kMaxExperts, "], got ", c->num_experts));
  }
  const int64_t layers = c->num_hidden_layers + c->num_nextn_predict_layers;
  if (layers * c->num_experts > kMaxLayerExperts) {
    return FieldError(source, count_field,
                      absl::StrCat("is ", c->num_experts, " experts a layer, ", layers * c->num_experts, " in its ",
                                   layers, " layers (num_hidden_layers and num_nextn_predict_layers); this server "
                                   "takes at most ", kMaxLayerExperts, " in all"));
  }
  if ((kind == Experts::kMixtral || kind == Experts::kGptOss) && c->num_experts == 0) {
    return FieldError(source, count_field, absl::StrCat("is 0; ", c->architecture_name,
                                                        "'s layers are all mixtures of experts"));
  }
  if (c->num_experts == 0) return absl::OkStatus();  // Qwen-MoE with no experts: every MLP dense
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "num_experts_per_tok", true, &c->num_experts_per_tok));
  if (c->num_experts_per_tok < 1 || c->num_experts_per_tok > c->num_experts) {
    return FieldError(source, "num_experts_per_tok", absl::StrCat("must be in [1, ", c->num_experts, "] (",
                                                                  count_field, "), got ", c->num_experts_per_tok));
  }
  if (kind == Experts::kGptOss) return ParseGptOssExperts(j, source, c);
  if (kind == Experts::kMixtral) {
    // MixtralSparseMoeBlock: every layer; experts of intermediate_size; the top k renormalised.
    c->moe_intermediate_size = c->intermediate_size;
    c->norm_topk_prob = true;
    c->sparse_layers.assign(c->num_hidden_layers, true);
    return absl::OkStatus();
  }
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "moe_intermediate_size", true, &c->moe_intermediate_size));
  if (c->moe_intermediate_size <= 0 || c->moe_intermediate_size > kMaxIntermediateSize) {
    return FieldError(source, "moe_intermediate_size",
                      absl::StrCat("must be in [1, 2^20], got ", c->moe_intermediate_size));
  }
  if (kind == Experts::kDeepseek) return ParseDeepseekExperts(j, source, c);
  SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "norm_topk_prob", &c->norm_topk_prob));
  if (c->family->shared_expert) {
    SHARDSERVE_RETURN_IF_ERROR(
        GetInt(j, source, "shared_expert_intermediate_size", true, &c->shared_expert_intermediate_size));
    if (c->shared_expert_intermediate_size <= 0 || c->shared_expert_intermediate_size > kMaxIntermediateSize) {
      return FieldError(source, "shared_expert_intermediate_size",
                        absl::StrCat("must be in [1, 2^20], got ", c->shared_expert_intermediate_size));
    }
  }
  int64_t step = 1;  // Qwen3MoeConfig's default
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "decoder_sparse_step", false, &step));
  if (step < 1) return FieldError(source, "decoder_sparse_step", absl::StrCat("must be >= 1, got ", step));
  std::vector<bool> dense_only(c->num_hidden_layers, false);
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return FieldError(source, "mlp_only_layers", "must be a list of layer indices");
    for (const json& layer : *it) {
      if (!layer.is_number_integer() || layer.get<int64_t>() < 0 || layer.get<int64_t>() >= c->num_hidden_layers) {
        return FieldError(source, "mlp_only_layers", absl::StrCat("has ", layer.dump(), "; want layer indices in [0, ",
                                                                  c->num_hidden_layers, ") (num_hidden_layers)"));
      }
      dense_only[layer.get<int64_t>()] = true;
    }
  }
  // Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers, and where (i + 1) % step == 0.
  for (int64_t i = 0; i < c->num_hidden_layers; ++i) c->sparse_layers[i] = !dense_only[i] && (i + 1) % step == 0;
  return absl::OkStatus();
}

// The text model's config.json of a multimodal architecture served as text
// (FamilyDeclaration::text_config_defaults): "text_config" over the family's defaults, with the
// top level's dtype / torch_dtype, eos_token_id and quantization_config, which transformers reads
// there; tie_word_embeddings at either level, the same where both give it.
absl::StatusOr<json> TextConfig(const json& j, const std::string& source, const FamilyDeclaration& family) {
  if (!Present(j, "text_config") || !j["text_config"].is_object()) {
    return FieldError(source, "text_config",
                      absl::StrCat("must be an object: ", family.architecture, " keeps its text model's fields there"));
  }
  const json& given = j["text_config"];
  json text = json::parse(family.text_config_defaults);
  for (const auto& [key, value] : given.items()) text[key] = value;
  // The top level's dtype is the checkpoint's (transformers 5 may write another in text_config, the
  // dtype the model was built in before it was cast and saved).
  if (Present(j, "dtype") || Present(j, "torch_dtype")) {
    text.erase("dtype");
    text.erase("torch_dtype");
  }
  for (const char* key : {"dtype", "torch_dtype", "eos_token_id", "quantization_config"}) {
    if (Present(j, key)) text[key] = j[key];
  }
  if (Present(j, "tie_word_embeddings")) {
    if (Present(given, "tie_word_embeddings") && given["tie_word_embeddings"] != j["tie_word_embeddings"]) {
      return FieldError(source, "tie_word_embeddings",
                        absl::StrCat("is ", j["tie_word_embeddings"].dump(), " but text_config's is ",
                                     given["tie_word_embeddings"].dump()));
    }
    text["tie_word_embeddings"] = j["tie_word_embeddings"];
  }
  text["architectures"] = j["architectures"];
  return text;
}

// An EAGLE-3 head's fields (ModelConfig::Eagle3): draft_vocab_size (vocab_size when absent: no
// reduced vocabulary), target_hidden_size (hidden_size when absent), eagle_config's
// use_aux_hidden_state (true; false is EAGLE-1/2's head, not this one) and
// eagle_aux_hidden_state_layer_ids, norm_before_residual; one decoder layer.
absl::Status ParseEagle3(const json& j, const std::string& source, ModelConfig* c) {
  ModelConfig::Eagle3 e;
  e.embedding_vocab_size = c->vocab_size;
  int64_t draft_vocab = c->vocab_size;
  if (Present(j, "draft_vocab_size")) SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "draft_vocab_size", false, &draft_vocab));
  if (draft_vocab < 1 || draft_vocab > c->vocab_size) {
    return FieldError(source, "draft_vocab_size",
                      absl::StrCat("must be in [1, vocab_size ", c->vocab_size, "], got ", draft_vocab));
  }
  e.target_hidden_size = c->hidden_size;
  if (Present(j, "target_hidden_size")) SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "target_hidden_size", false, &e.target_hidden_size));
  if (e.target_hidden_size < 1 || e.target_hidden_size > kMaxHiddenSize) {
    return FieldError(source, "target_hidden_size", absl::StrCat("must be in [1, 2^18], got ", e.target_hidden_size));
  }
  if (c->num_hidden_layers != 1) {
    return FieldError(source, "num_hidden_layers",
                      absl::StrCat("is ", c->num_hidden_layers, "; an EAGLE-3 head of one decoder layer is supported"));
  }
  if (auto eagle = j.find("eagle_config"); eagle != j.end() && !eagle->is_null()) {
    if (!eagle->is_object()) return FieldError(source, "eagle_config", "must be an object");
    if (auto use = eagle->find("use_aux_hidden_state"); use != eagle->end() && !(use->is_boolean() && use->get<bool>())) {
      return FieldError(source, "eagle_config.use_aux_hidden_state",
                        absl::StrCat("is ", use->dump(), "; a head over one hidden state (EAGLE-1/2) is not supported"));
    }
    if (auto ids = eagle->find("eagle_aux_hidden_state_layer_ids"); ids != eagle->end() && !ids->is_null()) {
      if (!ids->is_array() || ids->empty() || ids->size() > 16) {
        return FieldError(source, "eagle_config.eagle_aux_hidden_state_layer_ids", "must be a list of 1 to 16 layers");
      }
      for (const json& id : *ids) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= kMaxLayers) {
          return FieldError(source, "eagle_config.eagle_aux_hidden_state_layer_ids",
                            absl::StrCat("has ", id.dump(), "; want layer indices in [0, 1024)"));
        }
        e.aux_layers.push_back(id.get<int64_t>());
      }
    }
  }
  SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "norm_before_residual", &e.norm_before_residual));
  c->vocab_size = draft_vocab;
  c->eagle3 = std::move(e);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> Eagle3AuxLayers(const ModelConfig& head, const ModelConfig& target) {
  if (!head.eagle3.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(head.architecture_name, " is not an EAGLE-3 head"));
  }
  const ModelConfig::Eagle3& e = *head.eagle3;
  const int64_t L = target.num_hidden_layers;
  std::vector<int64_t> layers = e.aux_layers;
  if (layers.empty()) layers = {2, L / 2, L - 3};
  std::vector<int64_t> sorted = layers;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (sorted[i] < 0 || sorted[i] >= L || (i > 0 && sorted[i] == sorted[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the EAGLE-3 head reads the served model's hidden states at layers ", absl::StrJoin(layers, ", "),
          e.aux_layers.empty() ? " (2, L / 2, L - 3: its config.json's eagle_config names none)" : "",
          ", which are not distinct layers of the model's ", L));
    }
  }
  if (e.target_hidden_size != target.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("the EAGLE-3 head reads hidden states of ", e.target_hidden_size,
                                                   " (target_hidden_size) but the served model's hidden_size is ",
                                                   target.hidden_size));
  }
  if (head.hidden_size != target.hidden_size) {
    // (its embedding, its own or the model's, is the head's width; the published heads are the model's)
    return absl::InvalidArgumentError(absl::StrCat("the EAGLE-3 head's hidden_size ", head.hidden_size,
                                                   " is not the served model's ", target.hidden_size));
  }
  if (e.embedding_vocab_size != target.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("the EAGLE-3 head's vocabulary is ", e.embedding_vocab_size,
                                                   " ids (vocab_size) but the served model's is ", target.vocab_size));
  }
  return sorted;
}

bool Eagle3SharesEmbedding(const ModelConfig& head, bool whole_table) {
  return whole_table && head.eagle3.has_value() && !head.eagle3->embedding_in_checkpoint && !head.tie_word_embeddings;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& text, std::string source) {
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
  c.weight_prefix = c.family->layouts.front().decoder;
  c.lm_head_weight = c.family->layouts.front().lm_head;
  if (c.family->text_config_defaults != nullptr) {
    SHARDSERVE_ASSIGN_OR_RETURN(j, TextConfig(j, source, *c.family));
    source = absl::StrCat(source, " text_config");
  }
  using AttentionBias = FamilyDeclaration::AttentionBias;
  c.qkv_bias = c.family->attention_bias == AttentionBias::kQkv;
  c.qk_norm = c.family->qk_norm;
  if (c.family->qk_norm_flag != nullptr) {
    SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, c.family->qk_norm_flag, &c.qk_norm));
  }

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
  if (c.family->attention_bias == AttentionBias::kQkvConfigured) {  // Qwen2MoeConfig: qkv_bias, default true
    c.qkv_bias = true;
    SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "qkv_bias", &c.qkv_bias));
  }
  if (c.family->attention_bias == AttentionBias::kConfigured ||
      c.family->attention_bias == AttentionBias::kConfiguredOn ||
      c.family->attention_bias == AttentionBias::kQkvByAttentionBias) {
    c.qkv_bias = c.family->attention_bias == AttentionBias::kConfiguredOn;  // GptOssConfig's default: true
    SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "attention_bias", &c.qkv_bias));
    c.o_bias = c.qkv_bias && c.family->attention_bias != AttentionBias::kQkvByAttentionBias;  // (GLM-4.5: never o)
  }
  c.attention_sinks = c.family->attention_sinks;
  SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "mlp_bias", &c.mlp_bias));
  RopeContext rope_context{.max_position_embeddings = c.max_position_embeddings, .phi3 = c.family->phi3_rope};
  // The top level's original_max_position_embeddings replaces the RoPE object's (not one keyed by
  // layer type), as transformers' standardize_rope_params does when the model is built.
  if (c.family->phi3_rope) rope_context.top_original_max = 4096;  // Phi3Config's default
  if (!c.family->rope_per_layer_type) {
    SHARDSERVE_RETURN_IF_ERROR(
        GetInt(j, source, "original_max_position_embeddings", false, &rope_context.top_original_max));
  }
  if (c.family->rope_per_layer_type) {
    LayerRope full, sliding;
    SHARDSERVE_RETURN_IF_ERROR(ParseRopePerLayerType(j, source, rope_context, &full, &sliding));
    c.rope_theta = full.theta;
    c.rope_scaling = full.scaling;
    c.sliding_rope = sliding;
  } else {
    // The config class's RoPE where the file leaves it out (GptOssConfig: base 150000, yarn).
    if (c.family->default_rope_theta > 0) c.rope_theta = c.family->default_rope_theta;
    if (c.family->default_rope_scaling != nullptr && !Present(j, "rope_scaling") && !Present(j, "rope_parameters")) {
      json rope = json::parse(c.family->default_rope_scaling);
      SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, "rope_theta", &c.rope_theta));
      rope["rope_theta"] = c.rope_theta;
      j["rope_parameters"] = rope;
    }
    SHARDSERVE_RETURN_IF_ERROR(ParseRope(j, source, rope_context, &c.rope_theta, &c.rope_scaling));
  }
  if (auto q = j.find("quantization_config"); q != j.end() && !q->is_null()) {
    if (c.family->experts == FamilyDeclaration::Experts::kGptOss) {
      SHARDSERVE_RETURN_IF_ERROR(ParseMxfp4Experts(*q, source, &c));
    } else {
      SHARDSERVE_ASSIGN_OR_RETURN(c.checkpoint_quant, ParseCheckpointQuant(q->dump(), source));
    }
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
  if (c.family->mtp_weights != nullptr) {
    // DeepseekV3Config's num_nextn_predict_layers (1 in the published files, 0 in transformers'
    // default): the layers --speculative mtp runs; the model's forward pass never reads them.
    SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "num_nextn_predict_layers", false, &c.num_nextn_predict_layers));
    if (c.num_nextn_predict_layers < 0 || c.num_nextn_predict_layers > 8) {
      return FieldError(source, "num_nextn_predict_layers",
                        absl::StrCat("must be in [0, 8], got ", c.num_nextn_predict_layers));
    }
  }
  if (c.family->eagle3) SHARDSERVE_RETURN_IF_ERROR(ParseEagle3(j, source, &c));
  SHARDSERVE_RETURN_IF_ERROR(ParseExperts(j, source, &c));
  if (c.mxfp4_experts && (c.hidden_size % 32 != 0 || c.moe_intermediate_size % 32 != 0)) {
    return FieldError(source, "quantization_config",
                      absl::StrCat("is mxfp4, whose blocks hold 32 inputs, but hidden_size ", c.hidden_size,
                                   " or intermediate_size ", c.moe_intermediate_size, " is not a multiple of 32"));
  }
  c.head_dim = c.hidden_size / c.num_attention_heads;
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "head_dim", false, &c.head_dim));
  if (c.head_dim <= 0 || c.head_dim % 2 != 0 || c.head_dim > 1024) {
    return FieldError(source, "head_dim", absl::StrCat("must be even and in [2, 1024], got ", c.head_dim));
  }
  if (c.family->mla) SHARDSERVE_RETURN_IF_ERROR(ParseMla(j, source, &c));
  // Every size is bounded above, so these products cannot overflow; together they must describe
  // a model of at most kMaxParameters.
  const double params = static_cast<double>(c.num_hidden_layers) *
                            (2.0 * c.hidden_size * c.q_dim() + 2.0 * c.hidden_size * c.kv_dim() +
                             3.0 * c.hidden_size * c.intermediate_size +
                             (1.0 + 3.0 * c.moe_intermediate_size) * c.hidden_size * c.num_experts +
                             (1.0 + 3.0 * c.shared_expert_intermediate_size) * c.hidden_size) +
                        2.0 * c.vocab_size * c.hidden_size;
  if (params > kMaxParameters) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": the sizes describe ", params, " parameters, above the ", kMaxParameters, " this server takes (",
        "num_hidden_layers ", c.num_hidden_layers, ", hidden_size ", c.hidden_size, ", intermediate_size ",
        c.intermediate_size, ", experts ", c.num_experts, " x ", c.moe_intermediate_size, ", q/kv heads ", c.num_attention_heads, "/", c.num_key_value_heads, " x head_dim ",
        c.head_dim, ", vocab_size ", c.vocab_size, ")"));
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return FieldError(source, "num_key_value_heads",
                      absl::StrCat("(", c.num_key_value_heads, ") must divide num_attention_heads (",
                                   c.num_attention_heads, ")"));
  }
  if (c.rms_norm_eps <= 0) return FieldError(source, "rms_norm_eps", "must be > 0");
  if (c.rope_theta <= 0) return FieldError(source, "rope_theta", "must be > 0");
  if (c.sliding_rope.has_value() && c.sliding_rope->theta <= 0) {
    return FieldError(source, "rope_local_base_freq", "must be > 0");
  }
  SHARDSERVE_RETURN_IF_ERROR(ParsePartialRotary(j, source, *c.family, &c));
  for (const RopeScaling* r : {&c.rope_scaling, c.sliding_rope ? &c.sliding_rope->scaling : nullptr}) {
    if (r == nullptr || r->type != RopeScaling::Type::kLongRope) continue;
    const size_t half = static_cast<size_t>(c.rotary_dim / 2);
    if (r->short_factor.size() != half || r->long_factor.size() != half) {
      return FieldError(source, Present(j, "rope_parameters") ? "rope_parameters" : "rope_scaling",
                        absl::StrCat("has longrope short_factor / long_factor of ", r->short_factor.size(), " / ",
                                     r->long_factor.size(), " entries; want rotary_dim / 2 = ", half));
    }
  }
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
  if (c.family->query_pre_attn_scalar) {
    double scalar = 256;  // Gemma2Config's and Gemma3TextConfig's default
    SHARDSERVE_RETURN_IF_ERROR(GetDouble(j, source, "query_pre_attn_scalar", &scalar));
    if (!(scalar > 0) || !std::isfinite(scalar)) return FieldError(source, "query_pre_attn_scalar", "must be > 0");
    c.attention_scale = std::pow(scalar, -0.5);
  }
  using SlidingWindow = FamilyDeclaration::SlidingWindow;
  c.layer_window.assign(c.num_hidden_layers, 0);
  if (c.family->sliding_window == SlidingWindow::kLayerTypes) {
    // Gemma's layers by "layer_types"; without it layer i slides unless (i + 1) is a multiple of the
    // pattern (Gemma2Config: the even layers; Gemma3TextConfig: sliding_window_pattern, default 6).
    int64_t pattern = c.family->sliding_window_pattern;
    if (c.family->rope_per_layer_type) {
      SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "sliding_window_pattern", false, &pattern));
      if (pattern < 1) return FieldError(source, "sliding_window_pattern", absl::StrCat("must be >= 1, got ", pattern));
    }
    c.sliding_layers.assign(c.num_hidden_layers, false);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      c.sliding_layers[i] = (i + 1) % pattern != 0;
      if (Present(j, "layer_types") && j["layer_types"].is_array() &&
          j["layer_types"].size() == static_cast<size_t>(c.num_hidden_layers)) {
        c.sliding_layers[i] = j["layer_types"][i] == "sliding_attention";
      }
    }
  }
  if ((c.family->sliding_window == SlidingWindow::kEveryLayer ||
       c.family->sliding_window == SlidingWindow::kLayerTypes) &&
      (Present(j, "sliding_window") || (c.family->sliding_window == SlidingWindow::kLayerTypes &&
                                        !j.contains("sliding_window")))) {
    // Gemma2Config's and Gemma3TextConfig's default (4096), GptOssConfig's (128), when the field is absent
    int64_t window = c.family->default_sliding_window;
    SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "sliding_window", false, &window));
    if (window < kMinPositionEmbeddings || window > kMaxPositionEmbeddings) {
      return FieldError(source, "sliding_window",
                        absl::StrCat("must be null or in [", kMinPositionEmbeddings, ", 2^31], got ", window));
    }
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const bool sliding = c.family->sliding_window == SlidingWindow::kEveryLayer || c.sliding_layers[i];
      c.layer_window[i] = sliding ? window : 0;
    }
  }
  bool bidirectional = false;
  if (c.family->rope_per_layer_type) {
    SHARDSERVE_RETURN_IF_ERROR(GetBool(j, source, "use_bidirectional_attention", &bidirectional));
  }
  if (bidirectional) {
    return FieldError(source, "use_bidirectional_attention",
                      "is true (an encoder's attention, as EmbeddingGemma has); only causal attention is supported");
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
  // (an EAGLE-3 head's token ids are the served model's: config.json's vocab_size, not its LM head's)
  const int64_t ids = c.eagle3.has_value() ? c.eagle3->embedding_vocab_size : c.vocab_size;
  for (int64_t id : c.eos_token_ids) {
    if (id < 0 || id >= ids) {
      return FieldError(source, "eos_token_id",
                        absl::StrCat("has ", id, ", outside the vocabulary [0, ", ids, ") (vocab_size)"));
    }
  }
  SHARDSERVE_RETURN_IF_ERROR(GetInt(j, source, "bos_token_id", false, &c.bos_token_id));
  if (c.bos_token_id != -1 && (c.bos_token_id < 0 || c.bos_token_id >= ids)) {
    return FieldError(source, "bos_token_id",
                      absl::StrCat("is ", c.bos_token_id, ", outside the vocabulary [0, ", ids, ") (vocab_size)"));
  }
  // The worker computes RoPE in float32: a rope_theta or llama3 scaling that is positive in double
  // can still give inf or NaN there (rope_theta 1e-50 rounds to 0).
  for (const RopeTable& table : RopeTables(c)) {
    for (const std::vector<float>* freqs : {&table.inv_freq, &table.long_inv_freq}) {
      for (float f : *freqs) {
        if (!std::isfinite(f)) {
          return FieldError(source, c.rope_scaling.type == RopeScaling::Type::kNone ? "rope_theta" : "rope_scaling",
                            "gives RoPE frequencies that are not finite in float32");
        }
      }
    }
    if (!std::isfinite(table.attention_factor)) {
      return FieldError(source, "rope_scaling", "gives an attention factor that is not finite in float32");
    }
  }
  if (c.checkpoint_quant.has_value()) {
    // MLA's rows picked per head from q_b_proj and kv_a_proj_with_mqa are read dequantized
    // (worker/shard/loader.cc); tensors that fuse several products otherwise (Phi-3's qkv_proj,
    // stacked experts) are not read in a quantized format.
    for (const WeightDecl& w : ModelWeights(c)) {
      if (!w.fused_shape.empty() && w.pick.period == 0 && IsCheckpointQuantized(c, w)) {
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
  SHARDSERVE_ASSIGN_OR_RETURN(ModelConfig c, ParseModelConfig(ss.str(), file.string()));
  if (c.family->layouts.size() > 1 && std::filesystem::is_directory(path)) {
    // Which of the family's layouts the checkpoint is in: the one whose embedding it holds. A
    // directory without safetensors (dummy weights) keeps the default; one whose files do not open
    // is left to the loader, which reports them.
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(path);
    if (ckpt.ok()) {
      std::vector<std::string> embeddings;
      for (const CheckpointLayout& layout : c.family->layouts) {
        embeddings.push_back(absl::StrCat("\"", layout.decoder, "embed_tokens.weight\""));
        if ((*ckpt)->tensors().contains(absl::StrCat(layout.decoder, "embed_tokens.weight"))) {
          c.weight_prefix = layout.decoder;
          c.lm_head_weight = layout.lm_head;
          return c;
        }
      }
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", path.string(), " has none of ",
                                                        absl::StrJoin(embeddings, ", "), ", where ",
                                                        c.architecture_name, " keeps its text model's embedding"));
    }
  }
  return c;
}

namespace {

// 1 / theta^(2i / dim) for i < dim / 2, in float32 from an int64 arange as transformers'
// _compute_default_rope_parameters.
std::vector<float> DefaultInvFreq(double theta, int64_t dim) {
  std::vector<float> inv(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    inv[i] = 1.0f / std::pow(static_cast<float>(theta), exponent);
  }
  return inv;
}

// _compute_llama3_parameters' rescaling of the default frequencies.
void Llama3Scale(const RopeScaling& r, std::vector<float>* inv) {
  const double old_ctx = static_cast<double>(r.original_max_position_embeddings);
  const double low_freq_wavelen = old_ctx / r.low_freq_factor;
  const double high_freq_wavelen = old_ctx / r.high_freq_factor;
  for (float& f : *inv) {
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

// _compute_yarn_parameters: per frequency, a blend of the interpolated (inv / factor) and the
// extrapolated (inv) frequency along a linear ramp over the correction range of dimensions.
void YarnScale(const RopeScaling& r, double theta, int64_t dim, std::vector<float>* inv) {
  const double original = static_cast<double>(r.original_max_position_embeddings);
  const auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) * std::log(original / (rotations * 2 * M_PI))) / (2 * std::log(theta));
  };
  double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // prevent singularity
  const float factor = static_cast<float>(r.factor);
  for (size_t i = 0; i < inv->size(); ++i) {
    // (arange - min) / (max - min) in float32, clamped to [0, 1]; extrapolation weight 1 - ramp
    const float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low),
                                  0.0f, 1.0f);
    const float extrapolation = 1.0f - ramp;
    const float pos_freq = std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(dim));
    const float interpolated = 1.0f / (factor * pos_freq);
    (*inv)[i] = interpolated * (1.0f - extrapolation) + (1.0f / pos_freq) * extrapolation;
  }
}

// _compute_longrope_parameters: 1 / (factor[i] * theta^(2i / dim)).
std::vector<float> LongRopeInvFreq(double theta, int64_t dim, const std::vector<double>& factors) {
  std::vector<float> inv(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    inv[i] = 1.0f / (static_cast<float>(factors[i]) * std::pow(static_cast<float>(theta), exponent));
  }
  return inv;
}

RopeTable TableFor(const LayerRope& rope, int64_t rotary_dim) {
  using Type = RopeScaling::Type;
  const RopeScaling& r = rope.scaling;
  RopeTable t;
  t.attention_factor = static_cast<float>(r.attention_factor);
  switch (r.type) {
    case Type::kNone:
      t.inv_freq = DefaultInvFreq(rope.theta, rotary_dim);
      break;
    case Type::kLinear:
      t.inv_freq = DefaultInvFreq(rope.theta, rotary_dim);
      for (float& f : t.inv_freq) f /= static_cast<float>(r.factor);
      break;
    case Type::kLlama3:
      t.inv_freq = DefaultInvFreq(rope.theta, rotary_dim);
      Llama3Scale(r, &t.inv_freq);
      break;
    case Type::kYarn:
      t.inv_freq = DefaultInvFreq(rope.theta, rotary_dim);
      YarnScale(r, rope.theta, rotary_dim, &t.inv_freq);
      break;
    case Type::kLongRope:
      // transformers chooses the long factors for a whole forward call when its longest position
      // reaches original_max_position_embeddings; here each position chooses for itself, which is
      // what transformers computes for a sequence decoded token by token (each key rotated once,
      // when its token was the call's last). It differs where transformers takes one call over a
      // sequence crossing that length (a long prompt prefilled at once, or recomputed without a
      // cache): its earlier positions then use the long factors too.
      t.inv_freq = LongRopeInvFreq(rope.theta, rotary_dim, r.short_factor);
      t.long_inv_freq = LongRopeInvFreq(rope.theta, rotary_dim, r.long_factor);
      t.long_from = r.original_max_position_embeddings;
      break;
  }
  return t;
}

}  // namespace

std::vector<RopeTable> RopeTables(const ModelConfig& c) {
  const int64_t rotary_dim = c.RotaryDim();
  std::vector<RopeTable> tables = {TableFor(LayerRope{c.rope_theta, c.rope_scaling}, rotary_dim)};
  if (c.sliding_rope.has_value()) tables.push_back(TableFor(*c.sliding_rope, rotary_dim));
  return tables;
}

std::vector<float> RopeInvFreq(const ModelConfig& c) { return RopeTables(c)[0].inv_freq; }

}  // namespace shardserve
