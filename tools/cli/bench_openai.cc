// shardserve bench --backend openai: the load's requests over an OpenAI-compatible HTTP API, by
// cpp-httplib's client (a Debian package). Each request is POST /completions with the prompt as a
// list of token ids (shardserve, vLLM and llama.cpp's server take them) or, for the multi-turn chat
// load, POST /chat/completions with the conversation's messages as text; max_tokens = its output
// length, ignore_eos (with a JSON Schema, response_format json_schema instead), stream with
// stream_options.include_usage. The stream's server-sent events are parsed as they arrive: the
// first chunk with text (chat: delta.content) is the first token (TTFT); the gaps between chunks
// with text are the inter-token latencies, one per chunk (a chunk may carry several tokens, which
// then count as one gap); the tokens are counted from the final usage.completion_tokens.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tools/cli/bench.h"

namespace shardserve::cli::bench {
namespace {

struct BaseUrl {
  std::string host;
  int port = 80;
  std::string prefix;  // "/v1"
};

absl::StatusOr<BaseUrl> ParseBaseUrl(const std::string& url) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--base-url '", url, "' ", why, " (expected http://HOST:PORT/v1, e.g. http://127.0.0.1:8000/v1)"));
  };
  absl::string_view rest = url;
  if (absl::StartsWith(rest, "https://")) return bad("is https, which bench does not speak");
  if (!absl::ConsumePrefix(&rest, "http://")) return bad("does not start with http://");
  BaseUrl b;
  const size_t slash = rest.find('/');
  absl::string_view authority = rest.substr(0, slash);
  b.prefix = slash == absl::string_view::npos ? "" : std::string(rest.substr(slash));
  while (!b.prefix.empty() && b.prefix.back() == '/') b.prefix.pop_back();
  const size_t colon = authority.rfind(':');
  if (colon != absl::string_view::npos && authority.find(']', colon) == absl::string_view::npos) {
    if (!absl::SimpleAtoi(authority.substr(colon + 1), &b.port) || b.port < 1 || b.port > 65535) {
      return bad("has no valid port");
    }
    authority = authority.substr(0, colon);
  }
  if (absl::ConsumePrefix(&authority, "[")) absl::ConsumeSuffix(&authority, "]");
  if (authority.empty()) return bad("has no host");
  b.host = std::string(authority);
  return b;
}

// "connection refused" and friends, for messages.
std::string HttpErrorText(httplib::Error e) {
  switch (e) {
    case httplib::Error::Connection:
      return "cannot connect (connection refused or host unreachable)";
    case httplib::Error::Read:
      return "the connection failed or timed out while reading the response";
    case httplib::Error::Write:
      return "the connection failed while sending the request";
    case httplib::Error::ConnectionTimeout:
      return "the connection timed out";
    case httplib::Error::Canceled:
      return "cancelled";
    default:
      return httplib::to_string(e);
  }
}

// The message of an OpenAI error body ({"error": {"message": ...}}), else the body's start.
std::string ErrorBody(const std::string& body) {
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_object() && j.contains("error") && j["error"].is_object() && j["error"].contains("message") &&
      j["error"]["message"].is_string()) {
    return j["error"]["message"].get<std::string>();
  }
  return body.substr(0, 200);
}

}  // namespace

absl::Status CheckBaseUrl(const std::string& base_url) { return ParseBaseUrl(base_url).status(); }

struct OpenAIConnection::Impl {
  BaseUrl url;
  std::unique_ptr<httplib::Client> client;
  httplib::Headers headers;
  std::string url_error;  // set when the URL does not parse
  nlohmann::json json_schema;  // LoadConfig::json_schema parsed; null without one
};

OpenAIConnection::OpenAIConnection(const LoadConfig& c) : impl_(std::make_unique<Impl>()), c_(c) {
  absl::StatusOr<BaseUrl> url = ParseBaseUrl(c.base_url);
  if (!url.ok()) {
    impl_->url_error = std::string(url.status().message());
    return;
  }
  impl_->url = *url;
  if (!c.json_schema.empty()) impl_->json_schema = nlohmann::json::parse(c.json_schema, nullptr, false);
  impl_->client = std::make_unique<httplib::Client>(url->host, url->port);
  impl_->client->set_keep_alive(true);
  // Without it, Nagle and delayed ACKs hold a request body back by up to 40 ms (a TTFT artefact).
  impl_->client->set_tcp_nodelay(true);
  impl_->client->set_connection_timeout(std::chrono::seconds(10));
  // A stalled server: every read waits at most the request's deadline.
  const auto timeout = std::chrono::microseconds(static_cast<int64_t>(c.timeout_s * 1e6));
  impl_->client->set_read_timeout(timeout);
  impl_->client->set_write_timeout(timeout);
  if (!c.client.api_key.empty()) impl_->headers.emplace("Authorization", "Bearer " + c.client.api_key);
}

OpenAIConnection::~OpenAIConnection() = default;

void OpenAIConnection::Stop() {
  if (impl_->client != nullptr) impl_->client->stop();
}

absl::StatusOr<ServedModel> OpenAIConnection::GetModel() {
  if (!impl_->url_error.empty()) return absl::InvalidArgumentError(impl_->url_error);
  const std::string where = absl::StrCat(c_.base_url, "/models");
  httplib::Result res = impl_->client->Get(impl_->url.prefix + "/models", impl_->headers);
  if (!res) return absl::UnavailableError(absl::StrCat("cannot reach ", where, ": ", HttpErrorText(res.error())));
  if (res->status != 200) {
    return absl::UnavailableError(absl::StrCat("GET ", where, ": HTTP ", res->status, ": ", ErrorBody(res->body)));
  }
  const nlohmann::json j = nlohmann::json::parse(res->body, nullptr, false);
  if (!j.is_object() || !j.contains("data") || !j["data"].is_array()) {
    return absl::UnavailableError(absl::StrCat("GET ", where, ": not a model list: ", res->body.substr(0, 200)));
  }
  ServedModel m;
  std::vector<std::string> names;
  for (const nlohmann::json& e : j["data"]) {
    if (!e.is_object() || !e.contains("id") || !e["id"].is_string()) continue;
    const std::string id = e["id"].get<std::string>();
    names.push_back(id);
    if (m.name.empty() && (c_.model_name.empty() || c_.model_name == id)) {
      m.name = id;
      if (e.contains("max_model_len") && e["max_model_len"].is_number_integer()) {
        m.max_model_len = e["max_model_len"].get<int64_t>();
      }
    }
  }
  if (m.name.empty()) {
    std::string listed;
    for (const std::string& n : names) absl::StrAppend(&listed, listed.empty() ? "" : ", ", n);
    return absl::InvalidArgumentError(
        c_.model_name.empty() ? absl::StrCat("GET ", where, " lists no model")
                              : absl::StrCat("--model '", c_.model_name, "' is not served at ", c_.base_url,
                                             " (it serves: ", listed, ")"));
  }
  m.vocab_size = c_.vocab_size;
  return m;
}

RequestResult OpenAIConnection::Send(const RequestSpec& spec) {
  RequestResult r;
  r.done = true;
  r.input_tokens = static_cast<int64_t>(spec.prompt.size());
  if (!impl_->url_error.empty()) {
    r.error = impl_->url_error;
    return r;
  }
  const bool chat = !spec.messages.empty();
  const std::string path = chat ? "/chat/completions" : "/completions";
  nlohmann::json body;
  if (chat) {
    nlohmann::json messages = nlohmann::json::array();
    for (const ChatMessage& m : spec.messages) messages.push_back({{"role", m.role}, {"content", m.content}});
    body["messages"] = std::move(messages);
  } else {
    body["prompt"] = spec.prompt;
  }
  body["max_tokens"] = spec.output_len;
  body["temperature"] = c_.temperature;
  if (impl_->json_schema.is_null()) {
    body["ignore_eos"] = true;
  } else {
    // OpenAI's structured output; ignore_eos would be refused with it (bench.h, LoadConfig::json_schema).
    body["response_format"] = {{"type", "json_schema"},
                               {"json_schema", {{"name", "bench"}, {"schema", impl_->json_schema}}}};
  }
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  if (!c_.model_name.empty()) body["model"] = c_.model_name;
  if (spec.sampling_seed) body["seed"] = *spec.sampling_seed;

  // The stream, parsed as it arrives: events end at a blank line; "data: {json}" or "data: [DONE]".
  std::string pending, error_body;
  int status = 0;
  bool done = false;
  int64_t usage_tokens = -1;
  int64_t usage_prompt_tokens = -1;
  std::string finish;
  std::string parse_error;
  std::vector<double> arrivals;
  const Clock::time_point t0 = Clock::now();
  auto on_event = [&](absl::string_view event) {
    for (absl::string_view line : absl::StrSplit(event, '\n')) {
      absl::ConsumeSuffix(&line, "\r");
      if (!absl::ConsumePrefix(&line, "data:")) continue;  // comments, "event:", ...
      line = absl::StripLeadingAsciiWhitespace(line);
      if (line == "[DONE]") {
        done = true;
        continue;
      }
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_object()) {
        if (parse_error.empty()) parse_error = absl::StrCat("malformed SSE data (not JSON): ", line.substr(0, 120));
        continue;
      }
      if (j.contains("error")) {
        if (parse_error.empty()) parse_error = absl::StrCat("error in the stream: ", ErrorBody(std::string(line)));
        continue;
      }
      if (j.contains("choices") && j["choices"].is_array()) {
        for (const nlohmann::json& ch : j["choices"]) {
          if (!ch.is_object()) continue;
          // Completions: "text"; chat: "delta": {"content": ...} (the first delta may be the role alone).
          const nlohmann::json* text = nullptr;
          if (!chat && ch.contains("text")) {
            text = &ch["text"];
          } else if (chat && ch.contains("delta") && ch["delta"].is_object() && ch["delta"].contains("content")) {
            text = &ch["delta"]["content"];
          }
          if (text != nullptr && text->is_string() && !text->get_ref<const std::string&>().empty()) {
            arrivals.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
            if (chat || !c_.json_schema.empty()) r.output_text += text->get_ref<const std::string&>();
          }
          if (ch.contains("finish_reason") && ch["finish_reason"].is_string()) finish = ch["finish_reason"];
        }
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        const nlohmann::json& u = j["usage"];
        if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer()) {
          usage_tokens = u["completion_tokens"].get<int64_t>();
        }
        if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer()) {
          usage_prompt_tokens = u["prompt_tokens"].get<int64_t>();
        }
        if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object() &&
            u["prompt_tokens_details"].contains("cached_tokens") &&
            u["prompt_tokens_details"]["cached_tokens"].is_number_integer()) {
          r.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
        }
      }
    }
  };

  httplib::Request req;
  req.method = "POST";
  req.path = impl_->url.prefix + path;
  req.headers = impl_->headers;
  req.headers.emplace("Accept", "text/event-stream");
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    return !g_stop;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (status != 200) {
      if (error_body.size() < 4096) error_body.append(data, n);
      return !g_stop;
    }
    pending.append(data, n);
    for (size_t end; (end = pending.find("\n\n")) != std::string::npos;) {
      on_event(absl::string_view(pending).substr(0, end));
      pending.erase(0, end + 2);
    }
    const bool late = std::chrono::duration<double>(Clock::now() - t0).count() > c_.timeout_s;
    return !g_stop && !late;
  };
  // A keep-alive connection may be closed by the server as this request goes out on it (RFC 9112
  // 9.3): cpp-httplib servers close one after 5 idle seconds, llama-server after every streamed
  // response, without "Connection: close". httplib checks the socket before reusing it, but a close
  // that arrives after that check leaves the request unanswered: no response byte, Error::Read or
  // Error::Write. Such a request is sent once more on a new connection (httplib closed the failed
  // one), as the openai clients do for a connection error. Safe for these POSTs: nothing came back, so
  // nothing is measured twice, and a completion changes no server state (had the server read it, it
  // only computed it once more). Not on a connection opened for this request, nor once a response
  // began, nor past the deadline: those are the server's failures and are reported.
  const bool reused = impl_->client->is_socket_open() != 0;
  httplib::Result res = impl_->client->send(req);
  if (!res && reused && status == 0 && (res.error() == httplib::Error::Read || res.error() == httplib::Error::Write) &&
      !g_stop && std::chrono::duration<double>(Clock::now() - t0).count() < c_.timeout_s) {
    r.resent = true;
    res = impl_->client->send(req);
  }
  r.e2e_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!pending.empty() && status == 200) on_event(pending);  // a last event without its blank line

  const std::string what = absl::StrCat("POST ", c_.base_url, path);
  if (g_stop) {
    r.error = "interrupted";
  } else if (r.e2e_s > c_.timeout_s) {
    r.error = absl::StrCat(what, ": no complete answer within --timeout-seconds ", c_.timeout_s);
  } else if (!res) {
    r.error = absl::StrCat(what, ": ", HttpErrorText(res.error()));
  } else if (status != 200) {
    r.error = absl::StrCat(what, ": HTTP ", status, ": ", ErrorBody(error_body));
  } else if (!parse_error.empty()) {
    r.error = absl::StrCat(what, ": ", parse_error);
  } else if (!done) {
    r.error = absl::StrCat(what, ": the stream ended without data: [DONE]");
  } else if (usage_tokens < 0 || (chat && usage_prompt_tokens < 0)) {
    r.error = absl::StrCat(what, ": the stream has no usage.", usage_tokens < 0 ? "completion_tokens" : "prompt_tokens",
                           " (stream_options.include_usage unsupported?)");
  } else if (usage_tokens != spec.output_len) {
    r.error = ShortOutputError(c_, spec.output_len, usage_tokens, finish.empty() ? "none" : finish);
  } else if (arrivals.empty()) {
    r.error = absl::StrCat(what, ": ", usage_tokens, " tokens in usage but no chunk with text");
  } else if (std::string why = c_.json_schema.empty() ? "" : JsonPrefixError(r.output_text); !why.empty()) {
    r.error = NotJsonError(why);
  } else {
    r.ok = true;
    r.output_tokens = usage_tokens;
    if (chat) r.input_tokens = usage_prompt_tokens;
    r.ttft_s = arrivals.front();
    for (size_t i = 1; i < arrivals.size(); ++i) r.itl_s.push_back(arrivals[i] - arrivals[i - 1]);
  }
  return r;
}

}  // namespace shardserve::cli::bench
