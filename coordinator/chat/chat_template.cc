#include "coordinator/chat/chat_template.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/json.h"
#include "coordinator/chat/parser.h"
#include "coordinator/chat/py_str.h"
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
  t.templates_["default"] = Named{*std::move(parsed), source};
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
    t.templates_["default"] = Named{*std::move(parsed), jinja_override};
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
    t.templates_["default"] = Named{*std::move(parsed), it->get<std::string>()};
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
    t.templates_[name] = Named{*std::move(parsed), entry["template"].get<std::string>()};
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

absl::StatusOr<const ChatTemplate::Named*> ChatTemplate::Pick(const nlohmann::ordered_json& messages,
                                                              const nlohmann::ordered_json& tools,
                                                              const nlohmann::ordered_json& extra) const {
  if (!messages.is_array()) return absl::InvalidArgumentError("messages must be a JSON array");
  if (!tools.is_null() && !tools.is_array()) return absl::InvalidArgumentError("tools must be a JSON array or null");
  if (!extra.is_null() && !extra.is_object()) return absl::InvalidArgumentError("extra arguments must be a JSON object");
  for (size_t i = 0; i < tools.size() && tools.is_array(); ++i) {
    if (!tools[i].is_object()) return absl::InvalidArgumentError(absl::StrCat("tools[", i, "] must be a JSON object"));
  }
  // transformers' get_chat_template: "tool_use" when tools are given and the model has one.
  if (templates_.size() == 1) return &templates_.begin()->second;
  if (!tools.is_null() && templates_.count("tool_use")) return &templates_.at("tool_use");
  if (templates_.count("default")) return &templates_.at("default");
  return absl::InvalidArgumentError("the model has several chat templates and none named \"default\"");
}

absl::StatusOr<std::string> ChatTemplate::RenderWith(const Named& tmpl, const nlohmann::ordered_json& messages,
                                                     bool add_generation_prompt, const nlohmann::ordered_json& tools,
                                                     const nlohmann::ordered_json& extra,
                                                     const RenderBudget& budget) const {
  Dict context;
  context.items.emplace_back(Value("messages"), Value::FromJson(messages));
  context.items.emplace_back(Value("tools"), Value::FromJson(tools));  // None when absent, as transformers
  context.items.emplace_back(Value("documents"), Value::None());
  context.items.emplace_back(Value("add_generation_prompt"), Value(add_generation_prompt));
  for (const auto& [k, v] : special_tokens_.items()) context.Set(Value(k), Value::FromJson(v));
  if (extra.is_object()) {
    for (const auto& [k, v] : extra.items()) context.Set(Value(k), Value::FromJson(v));
  }
  return chat::Render(*tmpl.parsed, Value::MakeDict(std::move(context)), budget);
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                                 const nlohmann::ordered_json& tools,
                                                 const nlohmann::ordered_json& extra,
                                                 const RenderBudget& budget) const {
  absl::StatusOr<const Named*> tmpl = Pick(messages, tools, extra);
  if (!tmpl.ok()) return tmpl.status();
  return RenderWith(**tmpl, messages, add_generation_prompt, tools, extra, budget);
}

absl::StatusOr<std::string> ChatTemplate::RenderContinuing(const nlohmann::ordered_json& messages,
                                                           const nlohmann::ordered_json& tools,
                                                           const nlohmann::ordered_json& extra,
                                                           const RenderBudget& budget) const {
  absl::StatusOr<const Named*> tmpl = Pick(messages, tools, extra);
  if (!tmpl.ok()) return tmpl.status();
  // transformers' errors, word for word up to their first sentence's end.
  if (messages.empty()) return absl::InvalidArgumentError("continue_final_message is set but the conversation is empty!");
  if (!messages.back().is_object()) return absl::InvalidArgumentError("the final message must be a JSON object");
  auto content = messages.back().find("content");
  if (content == messages.back().end() || content->is_null()) {
    return absl::InvalidArgumentError("continue_final_message is set but the final message has no \"content\" to continue!");
  }
  if ((*tmpl)->source.find("content") == std::string::npos) {
    return absl::InvalidArgumentError(
        "continue_final_message is set to \"content\" but this is not an accepted field in the chat_template");
  }
  // The final message's text (a list's last part with text) marked at its end; the render is cut
  // where the mark lands.
  nlohmann::ordered_json marked = messages;
  nlohmann::ordered_json& last = marked.back()["content"];
  std::string final_text;
  if (last.is_array()) {
    auto part = std::find_if(last.rbegin(), last.rend(), [](const nlohmann::ordered_json& p) {
      return p.is_object() && p.contains("text") && p["text"].is_string();
    });
    if (part == last.rend()) {
      return absl::InvalidArgumentError(
          "continue_final_message is set but we could not find any text to continue in the final message!");
    }
    final_text = (*part)["text"].get<std::string>();
    (*part)["text"] = final_text + kContinueMark;
  } else if (last.is_string()) {
    final_text = last.get<std::string>();
    last = final_text + kContinueMark;
  } else {
    return absl::InvalidArgumentError("continue_final_message is set but the final message's content is not text");
  }
  absl::StatusOr<std::string> out = RenderWith(**tmpl, marked, /*add_generation_prompt=*/false, tools, extra, budget);
  if (!out.ok()) return out;
  const std::string mark = Strip(kContinueMark, nullptr, true, true);
  const size_t at = out->rfind(mark);
  if (out->find(Strip(final_text, nullptr, true, true)) == std::string::npos || at == std::string::npos) {
    return absl::InvalidArgumentError(
        "continue_final_message is set but the final message does not appear in the chat after applying the chat "
        "template! The template drops or rewrites part of the final message.");
  }
  // The template kept the text as it was: the prompt ends where the mark began; else (it trimmed the
  // message) the prompt ends at the text's last non-space.
  if (absl::string_view(*out).substr(at, std::strlen(kContinueMark)) == kContinueMark) {
    out->resize(at);
  } else {
    *out = Strip(out->substr(0, at), nullptr, false, true);
  }
  return out;
}

}  // namespace shardserve::chat
