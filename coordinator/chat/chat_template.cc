#include "coordinator/chat/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/json.h"
#include "coordinator/chat/parser.h"
#include "coordinator/chat/render.h"
#include "coordinator/chat/value.h"

namespace shardserve::chat {
namespace {

constexpr size_t kMaxFileBytes = 64 << 20;  // tokenizer configs are kilobytes; refuse anything huge

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(path.string(), ": ", ec.message()));
  if (size > kMaxFileBytes) return absl::InvalidArgumentError(absl::StrCat(path.string(), ": ", size, " bytes is too large"));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The special tokens transformers passes to the template: tokenizer.special_tokens_map, the ones set.
nlohmann::ordered_json SpecialTokens(const nlohmann::ordered_json& config) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    auto it = config.find(key);
    if (it == config.end()) continue;
    if (it->is_string()) {
      out[key] = *it;
    } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
      out[key] = (*it)["content"];
    }
  }
  auto extra = config.find("additional_special_tokens");
  if (extra != config.end() && extra->is_array() && !extra->empty()) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const auto& t : *extra) {
      if (t.is_string()) list.push_back(t);
      else if (t.is_object() && t.contains("content") && t["content"].is_string()) list.push_back(t["content"]);
    }
    out["additional_special_tokens"] = list;
  }
  return out;
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::FromString(const std::string& source,
                                                      const nlohmann::ordered_json& special_tokens) {
  absl::StatusOr<std::shared_ptr<const Template>> parsed = Parse(source);
  if (!parsed.ok()) return parsed.status();
  ChatTemplate t;
  t.templates_["default"] = *std::move(parsed);
  t.source_ = source;
  if (special_tokens.is_object()) t.special_tokens_ = special_tokens;
  return t;
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromTokenizerConfig(const std::string& config_json,
                                                               const std::string& jinja_override) {
  absl::StatusOr<nlohmann::ordered_json> parsed = ParseJson<nlohmann::ordered_json>(config_json, "tokenizer_config.json");
  if (!parsed.ok()) return parsed.status();
  const nlohmann::ordered_json config = *std::move(parsed);
  if (!config.is_object()) {
    return absl::InvalidArgumentError("tokenizer_config.json: not a JSON object");
  }
  ChatTemplate t;
  t.special_tokens_ = SpecialTokens(config);
  if (!jinja_override.empty()) {
    absl::StatusOr<std::shared_ptr<const Template>> parsed = Parse(jinja_override);
    if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat("chat_template.jinja: ", parsed.status().message()));
    t.templates_["default"] = *std::move(parsed);
    t.source_ = jinja_override;
    return t;
  }
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) {
    return absl::NotFoundError("tokenizer_config.json has no chat_template");
  }
  if (it->is_string()) {
    absl::StatusOr<std::shared_ptr<const Template>> parsed = Parse(it->get<std::string>());
    if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat("chat_template: ", parsed.status().message()));
    t.templates_["default"] = *std::move(parsed);
    t.source_ = it->get<std::string>();
    return t;
  }
  if (!it->is_array()) return absl::InvalidArgumentError("tokenizer_config.json: chat_template must be a string or a list");
  for (size_t i = 0; i < it->size(); ++i) {
    const auto& entry = (*it)[i];
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() || !entry.contains("template") ||
        !entry["template"].is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer_config.json: chat_template[", i, "] must be {\"name\": string, \"template\": string}"));
    }
    const std::string name = entry["name"].get<std::string>();
    absl::StatusOr<std::shared_ptr<const Template>> parsed = Parse(entry["template"].get<std::string>());
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("chat_template '", name, "': ", parsed.status().message()));
    }
    t.templates_[name] = *std::move(parsed);
    t.source_ += entry["template"].get<std::string>();
  }
  if (t.templates_.empty()) return absl::NotFoundError("tokenizer_config.json: chat_template is an empty list");
  return t;
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromDirectory(const std::string& dir) {
  const std::filesystem::path root(dir);
  std::string jinja;
  std::error_code ec;
  if (std::filesystem::exists(root / "chat_template.jinja", ec)) {
    absl::StatusOr<std::string> text = ReadFile(root / "chat_template.jinja");
    if (!text.ok()) return text.status();
    jinja = *std::move(text);
    if (jinja.empty()) return absl::InvalidArgumentError(absl::StrCat(dir, "/chat_template.jinja is empty"));
  }
  std::string config = "{}";
  if (std::filesystem::exists(root / "tokenizer_config.json", ec)) {
    absl::StatusOr<std::string> text = ReadFile(root / "tokenizer_config.json");
    if (!text.ok()) return text.status();
    config = *std::move(text);
  } else if (jinja.empty()) {
    return absl::NotFoundError(absl::StrCat(dir, " has neither chat_template.jinja nor tokenizer_config.json"));
  }
  absl::StatusOr<ChatTemplate> t = FromTokenizerConfig(config, jinja);
  if (!t.ok()) return absl::Status(t.status().code(), absl::StrCat(dir, ": ", t.status().message()));
  return t;
}

std::vector<std::string> ChatTemplate::names() const {
  std::vector<std::string> out;
  for (const auto& [name, unused] : templates_) out.push_back(name);
  return out;
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                                 const nlohmann::ordered_json& tools,
                                                 const nlohmann::ordered_json& extra,
                                                 const RenderBudget& budget) const {
  if (!messages.is_array()) return absl::InvalidArgumentError("messages must be a JSON array");
  if (!tools.is_null() && !tools.is_array()) return absl::InvalidArgumentError("tools must be a JSON array or null");
  if (!extra.is_null() && !extra.is_object()) return absl::InvalidArgumentError("extra arguments must be a JSON object");
  for (size_t i = 0; i < tools.size() && tools.is_array(); ++i) {
    if (!tools[i].is_object()) return absl::InvalidArgumentError(absl::StrCat("tools[", i, "] must be a JSON object"));
  }
  // transformers' get_chat_template: "tool_use" when tools are given and the model has one.
  const Template* tmpl = nullptr;
  if (templates_.size() == 1) {
    tmpl = templates_.begin()->second.get();
  } else if (!tools.is_null() && templates_.count("tool_use")) {
    tmpl = templates_.at("tool_use").get();
  } else if (templates_.count("default")) {
    tmpl = templates_.at("default").get();
  } else {
    return absl::InvalidArgumentError("the model has several chat templates and none named \"default\"");
  }
  Dict context;
  context.items.emplace_back(Value("messages"), Value::FromJson(messages));
  context.items.emplace_back(Value("tools"), Value::FromJson(tools));  // None when absent, as transformers
  context.items.emplace_back(Value("documents"), Value::None());
  context.items.emplace_back(Value("add_generation_prompt"), Value(add_generation_prompt));
  for (const auto& [k, v] : special_tokens_.items()) context.Set(Value(k), Value::FromJson(v));
  if (extra.is_object()) {
    for (const auto& [k, v] : extra.items()) context.Set(Value(k), Value::FromJson(v));
  }
  return chat::Render(*tmpl, Value::MakeDict(std::move(context)), budget);
}

}  // namespace shardserve::chat
