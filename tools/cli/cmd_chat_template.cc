// shardserve chat-template: a model's chat template (coordinator/chat) rendered from the command
// line, to see byte for byte the prompt the server would build from a conversation.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "base/flags.h"
#include "base/json.h"
#include "coordinator/chat/chat_template.h"
#include "nlohmann/json.hpp"
#include "tools/cli/command.h"

namespace shardserve::cli {
namespace {

constexpr char kUsage[] =
    "usage: shardserve chat-template --model DIR --messages FILE.json\n"
    "                                [--no-generation-prompt | --continue-final-message]\n"
    "                                [--tools FILE.json] [--extra FILE.json]\n"
    "  Renders the chat template of checkpoint DIR (chat_template.jinja or tokenizer_config.json) as\n"
    "  transformers' apply_chat_template(tokenize=False) does and prints the prompt, byte for byte.\n"
    "  --messages              a JSON array of messages ({\"role\": ..., \"content\": ...})\n"
    "  --no-generation-prompt  add_generation_prompt=False (default True)\n"
    "  --continue-final-message  the prompt ends inside the final message, for the model to continue\n"
    "                          it (continue_final_message=True; no generation prompt)\n"
    "  --tools                 a JSON array of tool definitions\n"
    "  --extra                 a JSON object of further template variables (date_string, ...)\n";

// Reads and parses a JSON file; on failure prints why and returns false.
bool ReadJson(const std::string& flag, const std::string& path, nlohmann::ordered_json* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "shardserve chat-template: --%s %s: cannot open\n", flag.c_str(), path.c_str());
    return false;
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<nlohmann::ordered_json> json = ParseJson<nlohmann::ordered_json>(ss.str(), path);
  if (!json.ok()) {
    std::fprintf(stderr, "shardserve chat-template: --%s %s\n", flag.c_str(), std::string(json.status().message()).c_str());
    return false;
  }
  *out = *std::move(json);
  return true;
}

int RunChatTemplate(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags = Flags::Parse(args, {"model", "messages", "tools", "extra"},
                                             {"help", "no-generation-prompt", "continue-final-message"});
  if (!flags.ok()) {
    std::fprintf(stderr, "shardserve chat-template: %s\n%s", std::string(flags.status().message()).c_str(), kUsage);
    return 2;
  }
  if (flags->Has("help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!flags->Has("model") || !flags->Has("messages") || !flags->positional().empty()) {
    std::fprintf(stderr, "shardserve chat-template: --model and --messages are required\n%s", kUsage);
    return 2;
  }
  nlohmann::ordered_json messages, tools = nullptr, extra = nullptr;
  if (!ReadJson("messages", flags->Get("messages"), &messages)) return 1;
  if (flags->Has("tools") && !ReadJson("tools", flags->Get("tools"), &tools)) return 1;
  if (flags->Has("extra") && !ReadJson("extra", flags->Get("extra"), &extra)) return 1;

  absl::StatusOr<chat::ChatTemplate> tmpl = chat::ChatTemplate::FromDirectory(flags->Get("model"));
  if (!tmpl.ok()) {
    std::fprintf(stderr, "shardserve chat-template: %s\n", tmpl.status().ToString().c_str());
    return 1;
  }
  // The server's default budget (coordinator/chat/budget.h): a hostile template ends in an
  // error that names the budget, not in minutes of CPU or gigabytes of memory.
  absl::StatusOr<std::string> prompt =
      flags->Has("continue-final-message")
          ? tmpl->RenderContinuing(messages, tools, extra, chat::RenderBudget())
          : tmpl->Render(messages, !flags->Has("no-generation-prompt"), tools, extra, chat::RenderBudget());
  if (!prompt.ok()) {
    std::fprintf(stderr, "shardserve chat-template: %s\n", prompt.status().ToString().c_str());
    return 1;
  }
  std::fwrite(prompt->data(), 1, prompt->size(), stdout);
  return std::fflush(stdout) == 0 ? 0 : 1;
}

const CommandRegistration kRegistration({"chat-template", "render a model's chat template for a conversation",
                                         RunChatTemplate});

}  // namespace
}  // namespace shardserve::cli
