#include "coordinator/api/openai/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/field_error.h"
#include "base/status_macros.h"
#include "base/version.h"
#include "coordinator/api/openai/connection_pool.h"
#include "coordinator/api/openai/peer_watch.h"
#include "coordinator/api/openai/protocol.h"
#include "coordinator/api/openai/responses.h"
#include "coordinator/api/request_validation.h"
#include "coordinator/telemetry/log.h"
#include "security/https.h"

namespace shardserve::openai {
namespace {

using Json = nlohmann::ordered_json;

constexpr char kJson[] = "application/json";
// How long a handler waits for the next tokens before it looks again (at its other choices, or
// whether a streaming client is still there).
constexpr absl::Duration kPoll = absl::Milliseconds(50);
constexpr absl::Duration kPollSeveral = absl::Milliseconds(10);
// A client that disconnected before its answer was complete, as nginx logs it.
constexpr int kClientClosed = 499;
// Threads that answer, at once, the connections that find every serving thread taken (each holds
// one for at most ConnectionPolicy::hurried_head_deadline while its request arrives).
constexpr int kOverflowThreads = 4;
// Connections the kernel completes before the listening thread accepts them. httplib's is 5: a burst
// of clients connecting at once (a benchmark's streams) overflows it, and the kernel then drops
// their handshakes, to be retried a second or more later.
constexpr int kListenBacklog = SOMAXCONN;
// Requests on one keep-alive connection before the server closes it ("Connection: close" on the
// last). httplib 0.11.4's 5 makes a long-lived client (a benchmark's stream, an SDK's connection
// pool) open a new connection every fifth request: a handshake, and the new connection is admitted
// to the ConnectionPool again, where it may find the threads taken (503) before the connection it
// replaces has given its thread back. 100 is httplib's own default since 0.17 (and llama-server's).
// The 5 s idle timeout stays (ConnectionPolicy's default): an idle connection holds a serving
// thread, so a longer one would turn idle clients into 503s for new ones.
constexpr int kKeepAliveMaxCount = 100;

// A Content-Length httplib would read as something else: it takes "-5" as 2^64 - 5 (and then reads
// and drops that many bytes before its 413), "12abc" as 12. Empty when the header is absent or a
// plain decimal count.
std::string BadContentLength(const httplib::Request& req) {
  if (!req.has_header("Content-Length")) return "";
  const std::string value = req.get_header_value("Content-Length");
  const bool digits = !value.empty() && value.size() <= 18 &&
                      std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
  return digits ? "" : value;
}

// The endpoint label of a path: the routes, or "other" (no unbounded label values).
std::string EndpointLabel(const std::string& path) {
  for (const char* route :
       {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
        "/health", "/version"}) {
    if (path == route) return route;
  }
  if (absl::StartsWith(path, "/v1/models/")) return "/v1/models/{model}";  // one series, whatever is asked
  if (absl::StartsWith(path, "/v1/responses/")) {
    return absl::EndsWith(path, "/input_items") ? "/v1/responses/{id}/input_items" : "/v1/responses/{id}";
  }
  return "other";
}

void SetError(httplib::Response& res, const ApiError& error) {
  res.status = error.http_status;
  res.set_content(ErrorBody(error), kJson);
}

void SetError(httplib::Response& res, const absl::Status& status) { SetError(res, ErrorFromStatus(status)); }

// The answer to a stored response's route whose id is unknown, or another API key's: 404.
absl::Status NoStoredResponse(const std::string& id) {
  return absl::NotFoundError(absl::StrCat("no stored response has the id '", id.substr(0, 128), "'"));
}

// A request refused: logged under its id, answered with the status's error.
void Refuse(const std::string& id, const absl::Status& status, httplib::Response& res) {
  CoordinatorRequestLog(id, absl::StrCat("rejected: ", status.message()), "warn");
  SetError(res, status);
}

std::string RandomHex() {
  absl::BitGen gen;
  return absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen));
}

// The id a client names its request by, and where it came from: the X-Request-Id header, else the
// body's request_id (as vLLM takes them); empty when neither names one.
struct ClientId {
  std::string id;
  const char* field;
};
ClientId ClientNamedId(const httplib::Request& req, std::string body_request_id) {
  if (std::string header = req.get_header_value("X-Request-Id"); !header.empty()) {
    return {std::move(header), "X-Request-Id"};
  }
  return {std::move(body_request_id), "request_id"};
}

// The ids of those of `markers` that the tokenizer has as special tokens.
std::vector<int32_t> SpecialIds(const Tokenizer& tokenizer, const std::vector<absl::string_view>& markers) {
  std::vector<int32_t> ids;
  for (absl::string_view marker : markers) {
    const std::optional<int32_t> id = tokenizer.SpecialTokenId(std::string_view(marker.data(), marker.size()));
    if (id.has_value()) ids.push_back(*id);
  }
  return ids;
}

// One choice of a request: its engine submission and what it has produced.
struct Choice {
  int prompt = 0;  // its prompt in a completions batch (Request::prompts)
  uint64_t engine_id = 0;
  std::shared_ptr<RequestStream> stream;
  bool ended = false;
  std::string text;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t text_offset = 0;  // completions logprobs: bytes streamed so far
  std::vector<v1::TokenLogprobs> logprobs;
  std::vector<v1::TokenLogprobs> prompt_logprobs;  // with sampling.prompt_logprobs: its first response's
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  // Chat with reasoning or tool calls parsed: the output split so far, and each call's id.
  std::unique_ptr<OutputSplitter> splitter;
  OutputSplit whole;
  std::vector<std::string> call_ids;
};

// How a chat request's output is split: reasoning (the prompt may have opened it), tool calls.
struct OutputParsing {
  bool reasoning = false;
  bool reasoning_inside = false;
  ToolCallFormat tools = ToolCallFormat::kNone;
  int max_calls = 0;
  ToolChoice forced = ToolChoice::kAuto;  // kRequired / kNamed: the calls a grammar made
  std::string forced_name;
  bool on() const { return reasoning || tools != ToolCallFormat::kNone || forced != ToolChoice::kAuto; }
};

// A response of one choice, and (chat with parsing on) what its text added, split.
struct Polled {
  int index = 0;
  v1::GenerateResponse response;
  OutputSplit split;
};

// A request's choices in the engine, from submission to their end: n for each prompt (a chat's one,
// a completion's one or a batch), prompt p's choice i at p * n + i. Used by one thread at a time
// (the handler, then httplib's content provider on the same connection).
class Job {
 public:
  // `prompt_tokens`: each prompt's length in tokens; `echoes`: with Request::echo, the text each
  // prompt's choices begin with (else empty).
  // `first_tokens`: each prompt's first token (the one the prompt's log-probabilities leave out).
  Job(Engine* engine, Request request, std::string id, std::vector<int64_t> prompt_tokens, OutputParsing parsing,
      std::vector<std::string> echoes, std::vector<int32_t> first_tokens)
      : engine_(engine), request_(std::move(request)), id_(std::move(id)), prompt_tokens_(std::move(prompt_tokens)),
        echoes_(std::move(echoes)), first_tokens_(std::move(first_tokens)), created_(absl::ToUnixSeconds(absl::Now())),
        parsing_(parsing) {}
  ~Job() { Cancel(absl::CancelledError("the request was dropped")); }

  const Request& request() const { return request_; }
  bool chat() const { return request_.endpoint == Endpoint::kChatCompletions; }

  // Submits every choice of every prompt (`prompts`: each one's checked request, its choice 0);
  // on a refusal cancels those already submitted.
  absl::Status Submit(const std::vector<GenerationParams>& prompts, std::chrono::steady_clock::time_point arrival) {
    absl::BitGen gen;
    const bool several = prompts.size() * request_.n > 1;
    for (size_t p = 0; p < prompts.size(); ++p) {
      for (int i = 0; i < request_.n; ++i) {
        SHARDSERVE_RETURN_IF_ERROR(SubmitChoice(prompts[p], static_cast<int>(p), i, several, gen, arrival));
      }
    }
    return absl::OkStatus();
  }

  // Cancels every choice still running.
  void Cancel(const absl::Status& why) {
    for (Choice& c : choices_) {
      if (!c.ended) {
        engine_->Cancel(c.engine_id, why);
        c.ended = true;
      }
    }
  }

  bool done() const {
    for (const Choice& c : choices_) {
      if (!c.ended) return false;
    }
    return true;
  }
  const absl::Status& error() const { return error_; }

  // Gathers what the choices produced, waiting at most about kPoll when none had anything.
  // Returns the responses in arrival order.
  std::vector<Polled> Poll() {
    std::vector<Polled> out;
    const absl::Duration wait = choices_.size() > 1 ? kPollSeveral : kPoll;
    for (int pass = 0; pass < 2 && out.empty(); ++pass) {
      for (int i = 0; i < static_cast<int>(choices_.size()); ++i) {
        Choice& c = choices_[i];
        v1::GenerateResponse response;
        std::optional<absl::Status> ended;
        // Pass 0 drains what is there; pass 1 waits on the first choice still running.
        while (!c.ended && c.stream->Next(pass == 0 ? absl::ZeroDuration() : wait, &response, &ended)) {
          Polled p;
          p.index = i;
          p.split = Apply(c, response);
          p.response = std::move(response);
          out.push_back(std::move(p));
          if (pass == 1) break;
        }
        if (!c.ended && ended.has_value()) {
          c.ended = true;
          if (!ended->ok() && error_.ok()) error_ = *ended;
        }
        if (pass == 1 && !c.ended) break;
      }
    }
    if (!error_.ok()) Cancel(absl::CancelledError("another choice of the request failed"));
    return out;
  }

  // ---- JSON ----
  // Each prompt counted once (its choices share it), with the most of it any of its choices found
  // cached; every choice's completion tokens.
  Json UsageJson() const {
    int64_t completion = 0;
    std::vector<int64_t> cached(prompt_tokens_.size(), 0);
    for (const Choice& c : choices_) {
      completion += c.completion_tokens;
      cached[c.prompt] = std::max(cached[c.prompt], c.cached_tokens);
    }
    int64_t prompt = 0, cached_sum = 0;
    for (size_t p = 0; p < prompt_tokens_.size(); ++p) {
      prompt += prompt_tokens_[p];
      cached_sum += std::min(cached[p], prompt_tokens_[p]);
    }
    return openai::UsageJson(prompt, completion, cached_sum);
  }

  // The whole answer, once done() without error.
  Json Response(const Tokenizer* tokenizer) const {
    Json choices = Json::array();
    for (size_t i = 0; i < choices_.size(); ++i) {
      const Choice& c = choices_[i];
      Json logprobs = nullptr;
      if (request_.sampling.logprobs()) {
        const bool ids = request_.return_tokens_as_token_ids;
        if (chat()) {
          logprobs = Json{{"content", ChatLogprobsContent(c.logprobs, tokenizer, ids)}};
        } else if (request_.echo) {  // the prompt's tokens first, then the output's
          std::vector<v1::TokenLogprobs> all = c.prompt_logprobs;
          all.insert(all.end(), c.logprobs.begin(), c.logprobs.end());
          logprobs = CompletionLogprobs(all, tokenizer, 0, ids, first_tokens_[c.prompt]);
        } else {
          logprobs = CompletionLogprobs(c.logprobs, tokenizer, 0, ids);
        }
      }
      Json choice = {{"index", i}};
      const std::string& echo = Echo(c);
      if (chat() && c.splitter != nullptr) {
        choice["message"] = ChatMessage(c.whole, c.splitter->reasoning(), c.call_ids);
        if (!echo.empty()) {
          const Json& content = choice["message"]["content"];
          choice["message"]["content"] = echo + (content.is_string() ? content.get<std::string>() : "");
        }
      } else if (chat()) {
        choice["message"] = {{"role", "assistant"}, {"content", echo + c.text}};
      } else {
        choice["text"] = echo + c.text;
      }
      choice["logprobs"] = logprobs;
      choice["finish_reason"] = ChatFinishReason(c.finish, !c.whole.calls.empty());
      if (!chat() && request_.sampling.has_prompt_logprobs()) {
        choice["prompt_logprobs"] = PromptLogprobs(c.prompt_logprobs, tokenizer, request_.return_tokens_as_token_ids);
      }
      choices.push_back(std::move(choice));
    }
    Json answer = {{"id", id_},
                   {"object", chat() ? "chat.completion" : "text_completion"},
                   {"created", created_},
                   {"model", request_.model},
                   {"choices", choices},
                   {"usage", UsageJson()},
                   {"system_fingerprint", nullptr}};
    // A chat's one prompt, whatever its choices: its log-probabilities beside them (vLLM's place).
    if (chat() && request_.sampling.has_prompt_logprobs() && !choices_.empty()) {
      answer["prompt_logprobs"] =
          PromptLogprobs(choices_.front().prompt_logprobs, tokenizer, request_.return_tokens_as_token_ids);
    }
    return answer;
  }

  // A stream chunk of choice `index`: `delta` text (chat: a delta object), logprobs, finish.
  Json Chunk(int index, const Json& delta_or_text, const Json& logprobs, const Json& finish) const {
    Json choice = {{"index", index}};
    choice[chat() ? "delta" : "text"] = delta_or_text;
    choice["logprobs"] = logprobs;
    choice["finish_reason"] = finish;
    Json chunk = {{"id", id_},
                  {"object", chat() ? "chat.completion.chunk" : "text_completion"},
                  {"created", created_},
                  {"model", request_.model},
                  {"choices", Json::array({choice})},
                  {"system_fingerprint", nullptr}};
    if (request_.include_usage) {
      // continuous_usage_stats: the choice's usage so far (its prompt, its tokens).
      const Choice& c = choices_[index];
      chunk["usage"] = request_.continuous_usage_stats
                           ? openai::UsageJson(prompt_tokens_[c.prompt], c.completion_tokens, c.cached_tokens)
                           : Json(nullptr);
    }
    return chunk;
  }

  // The chunks of one response: none when it adds nothing a client sees. With parsing on, a piece
  // may make several (reasoning, content, each call's name and arguments); the first carries the
  // logprobs, the last the finish_reason.
  std::vector<Json> ChunksOf(const Polled& p, const Tokenizer* tokenizer) {
    const v1::GenerateResponse& r = p.response;
    const bool finished = r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED;
    Choice& c = choices_[p.index];
    std::vector<Json> deltas;
    if (!chat()) {
      if (!r.text().empty()) deltas.push_back(r.text());
    } else if (c.splitter != nullptr) {
      deltas = ChatDeltas(p.split, static_cast<int>(c.whole.calls.size() - p.split.calls.size()), c.call_ids);
    } else if (!r.text().empty()) {
      deltas.push_back({{"content", r.text()}});
    }
    if (deltas.empty() && (r.logprobs_size() > 0 || finished)) deltas.push_back(chat() ? Json::object() : Json(""));
    const std::vector<v1::TokenLogprobs> entries(r.logprobs().begin(), r.logprobs().end());
    Json logprobs = nullptr;
    if (request_.sampling.logprobs()) {
      const bool ids = request_.return_tokens_as_token_ids;
      logprobs = chat() ? Json{{"content", ChatLogprobsContent(entries, tokenizer, ids)}}
                        : CompletionLogprobs(entries, tokenizer, c.text_offset, ids);
    }
    c.text_offset += static_cast<int64_t>(r.text().size());
    std::vector<Json> chunks;
    for (size_t i = 0; i < deltas.size(); ++i) {
      const bool last = i + 1 == deltas.size();
      chunks.push_back(Chunk(p.index, deltas[i], i == 0 ? logprobs : Json(nullptr),
                             finished && last ? Json(ChatFinishReason(r.finish_reason(), !c.whole.calls.empty()))
                                              : Json(nullptr)));
    }
    return chunks;
  }

  // The last chunk with include_usage: no choices, the usage.
  Json UsageChunk() const {
    return Json{{"id", id_},
                {"object", chat() ? "chat.completion.chunk" : "text_completion"},
                {"created", created_},
                {"model", request_.model},
                {"choices", Json::array()},
                {"system_fingerprint", nullptr},
                {"usage", UsageJson()}};
  }

  // The chunks that open a stream: chat's role for each choice, then each choice's echo.
  std::vector<Json> OpeningChunks() const {
    std::vector<Json> out;
    if (chat()) {
      for (int i = 0; i < n(); ++i) {
        out.push_back(Chunk(i, Json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr));
      }
    }
    for (int i = 0; i < n(); ++i) {
      const std::string& echo = Echo(choices_[i]);
      if (!echo.empty()) out.push_back(Chunk(i, chat() ? Json{{"content", echo}} : Json(echo), nullptr, nullptr));
    }
    return out;
  }

  int n() const { return static_cast<int>(choices_.size()); }
  const std::string& id() const { return id_; }

 private:
  const std::string& Echo(const Choice& c) const {
    static const std::string kNone;
    return static_cast<size_t>(c.prompt) < echoes_.size() ? echoes_[c.prompt] : kNone;
  }

  // Submits prompt p's choice i (with `several`, its request id numbered as its choice).
  absl::Status SubmitChoice(const GenerationParams& first, int p, int i, bool several, absl::BitGen& gen,
                            std::chrono::steady_clock::time_point arrival) {
    GenerationParams params = first;
    if (several) params.request_id = absl::StrCat(first.request_id, "-", p * request_.n + i);
    if (i > 0) {
      params.seed = request_.sampling.has_seed() ? first.seed + static_cast<uint64_t>(i) : absl::Uniform<uint64_t>(gen);
    }
    absl::StatusOr<Engine::Submitted> submitted = engine_->Submit(std::move(params), arrival);
    if (!submitted.ok()) {
      Cancel(absl::CancelledError("another choice of the request was refused"));
      return submitted.status();
    }
    Choice c;
    c.prompt = p;
    c.engine_id = submitted->id;
    c.stream = std::move(submitted->stream);
    if (parsing_.forced != ToolChoice::kAuto) {
      c.splitter = std::make_unique<OutputSplitter>(parsing_.forced, parsing_.forced_name, request_.stream);
    } else if (parsing_.on()) {
      c.splitter = std::make_unique<OutputSplitter>(parsing_.reasoning, parsing_.reasoning_inside, parsing_.tools,
                                                    parsing_.max_calls, request_.tools, request_.stream);
    }
    choices_.push_back(std::move(c));
    return absl::OkStatus();
  }

  // Adds a response to its choice; returns what its text added, split (chat with parsing on).
  static OutputSplit Apply(Choice& c, const v1::GenerateResponse& r) {
    c.text += r.text();
    c.completion_tokens += r.token_ids_size();
    c.logprobs.insert(c.logprobs.end(), r.logprobs().begin(), r.logprobs().end());
    c.prompt_logprobs.insert(c.prompt_logprobs.end(), r.prompt_logprobs().begin(), r.prompt_logprobs().end());
    const bool finished = r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED;
    if (finished) {
      c.finish = r.finish_reason();
      c.completion_tokens = r.usage().completion_tokens();
      c.cached_tokens = r.usage().cached_prompt_tokens();
    }
    OutputSplit split;
    if (c.splitter != nullptr) {
      split = c.splitter->Add(r.text(), finished);
      c.whole.reasoning += split.reasoning;
      c.whole.content += split.content;
      // Each call's id: the model's own where its format has one (kimi_k2), else a new one.
      for (const ToolCall& call : split.calls) {
        c.whole.calls.push_back(call);
        c.call_ids.push_back(call.id.empty() ? absl::StrCat("call_", RandomHex()) : call.id);
      }
      for (const ToolCallPiece& piece : split.pieces) {
        if (!piece.name.empty()) {
          c.whole.calls.push_back(ToolCall{piece.name, "", piece.id});
          c.call_ids.push_back(piece.id.empty() ? absl::StrCat("call_", RandomHex()) : piece.id);
        }
        if (piece.index >= 0 && static_cast<size_t>(piece.index) < c.whole.calls.size()) {
          c.whole.calls[piece.index].arguments += piece.arguments;
        }
      }
    }
    return split;
  }

  Engine* const engine_;
  const Request request_;
  const std::string id_;
  const std::vector<int64_t> prompt_tokens_;
  const std::vector<std::string> echoes_;
  const std::vector<int32_t> first_tokens_;
  const int64_t created_;
  const OutputParsing parsing_;
  std::vector<Choice> choices_;
  absl::Status error_;
};

std::string Event(const Json& data) {
  return absl::StrCat("data: ", data.dump(-1, ' ', false, Json::error_handler_t::replace), "\n\n");
}

}  // namespace

HttpServer::HttpServer(const ServedModel* model, WorkerPool* pool, Engine* engine, CoordinatorMetrics* metrics,
                       const HttpServerOptions& options)
    : model_(model), pool_(pool), engine_(engine), metrics_(metrics), options_(options),
      created_(absl::ToUnixSeconds(absl::Now())),
      responses_(options.responses_store_bytes > 0 ? std::make_unique<ResponsesStore>(options.responses_store_bytes)
                                                   : nullptr) {}

HttpServer::~HttpServer() { Stop(); }

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const ServedModel* model, WorkerPool* pool,
                                                              Engine* engine, CoordinatorMetrics* metrics,
                                                              const HttpServerOptions& options) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("the HTTP API's TLS needs both a certificate and a key");
  }
  std::unique_ptr<HttpServer> s(new HttpServer(model, pool, engine, metrics, options));
  // The output formats: as named, else recognised in the chat template.
  const std::string template_source = model->chat_template != nullptr ? model->chat_template->source() : "";
  if (options.tool_call_parser.empty()) {
    s->tool_format_ = ToolCallFormatOfTemplate(template_source);
  } else {
    absl::StatusOr<ToolCallFormat> format = ToolCallFormatFromName(options.tool_call_parser);
    if (!format.ok()) return format.status();
    s->tool_format_ = *format;
  }
  if (s->tool_format_ == ToolCallFormat::kHarmony && model->tokenizer != nullptr) {
    s->harmony_markers_ = HarmonyMarkersOf(*model->tokenizer);
  }
  if (options.reasoning_parser.empty()) {
    s->reasoning_format_ = ReasoningFormatOfTemplate(template_source);
  } else {
    absl::StatusOr<ReasoningFormat> format = ReasoningFormatFromName(options.reasoning_parser);
    if (!format.ok()) return format.status();
    s->reasoning_format_ = *format;
  }
  if (model->tokenizer != nullptr) {
    s->reasoning_marker_ids_ = SpecialIds(*model->tokenizer, ReasoningMarkers(s->reasoning_format_));
    s->tool_marker_ids_ = SpecialIds(*model->tokenizer, TextMarkers(s->tool_format_));
  }
  // HTTPS when a certificate is given, re-read when its files change (security/https.h); TCP_NODELAY
  // there: otherwise Nagle holds each small SSE chunk until the client's delayed ACK (up to 40 ms),
  // which shows as time to first token (shardserve bench --backend openai measured it).
  ConnectionPolicy policy;
  policy.max_requests = kKeepAliveMaxCount;
  policy.max_per_peer = options.max_connections_per_peer;
  policy.hurried = &ConnectionPool::OnOverflowThread;
  // Read by the pool's threads only, while the pool (which httplib owns) exists.
  policy.crowded = [pool = s->connections_] {
    ConnectionPool* p = pool->load();
    return p != nullptr && p->Crowded();
  };
  absl::StatusOr<std::unique_ptr<httplib::Server>> http =
      MakeHttpServer(TlsFiles{options.tls_cert, options.tls_key, ""}, policy);
  if (!http.ok()) return http.status();
  s->http_ = *std::move(http);
  const int threads = std::max(1, options.threads);
  s->http_->new_task_queue = [threads, pool = s->connections_] {
    auto* made = new ConnectionPool(threads, kOverflowThreads);
    pool->store(made);
    return made;
  };
  // The listening socket, to widen its backlog once bound (httplib's is fixed at 5 in its library).
  int listen_fd = -1;
  s->http_->set_socket_options([&listen_fd](socket_t sock) {
    ListenSocketOptions(sock);
    listen_fd = sock;  // the last one tried is the one bound
  });
  s->http_->set_payload_max_length(static_cast<size_t>(options.max_body_bytes));
  s->Routes();
  if (options.port == 0) {
    s->port_ = s->http_->bind_to_any_port(options.host);
  } else if (s->http_->bind_to_port(options.host, options.port)) {
    s->port_ = options.port;
  }
  if (s->port_ <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot listen for HTTP on ", options.host, ":", options.port, " (in use, or not this host's)"));
  }
  // Listening already: listen() again only changes the backlog.
  if (listen_fd >= 0 && ::listen(listen_fd, kListenBacklog) != 0) {
    LogIds ids;
    ids.level = "warn";
    CoordinatorLog("http", absl::StrCat("cannot widen the listen backlog to ", kListenBacklog, ": ", std::strerror(errno)),
                   ids);
  }
  s->http_->set_socket_options(ListenSocketOptions);
  HttpServer* raw = s.get();
  s->listener_ = std::thread([raw] { raw->http_->listen_after_bind(); });
  return s;
}

void HttpServer::Stop() {
  if (!listener_.joinable()) return;
  http_->stop();
  listener_.join();
}

absl::Status HttpServer::Authorize(const httplib::Request& req) {
  if (options_.api_keys == nullptr) return absl::OkStatus();
  std::optional<absl::string_view> header;
  if (auto it = req.headers.find("Authorization"); it != req.headers.end()) header = it->second;  // case-insensitive
  const ApiKeys::Verdict verdict = options_.api_keys->Check(header);
  if (verdict == ApiKeys::Verdict::kOk) return absl::OkStatus();
  if (metrics_ != nullptr) metrics_->AuthFailure(verdict == ApiKeys::Verdict::kMissing ? "missing_key" : "invalid_key");
  return absl::UnauthenticatedError(verdict == ApiKeys::Verdict::kMissing
                                        ? "this server needs an API key: send the header 'Authorization: Bearer <key>' "
                                          "(the openai client's api_key, or OPENAI_API_KEY)"
                                        : "the API key is not valid");
}

void HttpServer::Routes() {
  // httplib's own answers (no route, a body too large, a request it cannot parse) in OpenAI's shape.
  const int64_t max_body = options_.max_body_bytes;
  http_->set_error_handler(httplib::Server::HandlerWithResponse(
      [max_body](const httplib::Request& req, httplib::Response& res) -> httplib::Server::HandlerResponse {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    ApiError e{res.status, res.status >= 500 ? "server_error" : "invalid_request_error", "", "", ""};
    if (const std::string late = RequestTimeoutOnThisThread(); !late.empty()) {
      // httplib says 400 for a head cut short; the connection's deadline cut it (http_connection.h).
      e.http_status = res.status = 408;
      e.message = late;
      e.code = "request_timeout";
      res.set_header("Connection", "close");
    } else if (res.status == 404) {
      e.message = absl::StrCat("no route ", req.method, " ", req.path);
      e.code = "not_found";
    } else if (res.status == 413) {
      e.message = absl::StrCat("the request body is larger than ", max_body, " bytes (--http-max-body-bytes)");
      e.code = "request_too_large";
    } else if (res.status == 414) {
      e.message = "the request line is longer than 8192 bytes";
      e.code = "uri_too_long";
      res.set_header("Connection", "close");  // as every unreadable head (security/https.cc)
    } else if (res.status == 400) {
      // httplib parsed neither the request line nor the headers (it says no more).
      e.message =
          "malformed HTTP/1.1 request: the first line must be 'METHOD /path HTTP/1.1' and each header "
          "'Name: value' on a line of its own (at most 8192 bytes), ending with an empty line";
      e.code = "malformed_request";
      res.set_header("Connection", "close");  // where the next request would begin is not known
    } else {
      e.message = absl::StrCat("HTTP ", res.status);
    }
    SetError(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }));
  // Streaming answers are counted when their stream ends, and a non-streaming one whose client went
  // away by its handler (see Generate): httplib logs only what it could write.
  http_->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    if (metrics_ != nullptr && !res.content_provider_resource_releaser_ && res.status != kClientClosed) {
      metrics_->HttpRequest(EndpointLabel(req.path), res.status);
    }
  });

  // After the headers, before the body: a body that no Content-Length frames is refused now (the
  // connection then closes: its body is unread). One over the limit is read and dropped by httplib
  // (within the body's deadline) and answered 413, so that the client, still sending, reads it.
  http_->set_pre_routing_handler(
      [](const httplib::Request& req, httplib::Response& res) -> httplib::Server::HandlerResponse {
        // Every answer is a whole JSON document or an event stream: a Range header is ignored, where
        // httplib would cut the body to its byte ranges and answer 206 (a completion's JSON cut
        // short). `req` is httplib's own request, handed to this handler as const.
        const_cast<httplib::Request&>(req).ranges.clear();
        ApiError e{400, "invalid_request_error", "", "", ""};
        if (req.method == "POST" && !req.has_header("Content-Length") &&
            absl::AsciiStrToLower(req.get_header_value("Transfer-Encoding")) != "chunked") {
          // Else httplib would read the body until the client closes its side.
          e.http_status = 411;
          e.message = "a POST needs a Content-Length header (or Transfer-Encoding: chunked)";
          e.code = "length_required";
        } else if (const std::string bad = BadContentLength(req); !bad.empty()) {
          e.message = absl::StrCat("Content-Length: '", bad, "' is not a number of bytes");
          e.code = "malformed_request";
        } else {
          return httplib::Server::HandlerResponse::Unhandled;
        }
        SetError(res, e);
        res.set_header("Connection", "close");
        return httplib::Server::HandlerResponse::Handled;
      });

  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (absl::Status s = pool_->CheckServing(); !s.ok()) return SetError(res, s);
    res.set_content(R"({"status":"ok"})", kJson);
  });
  // Every route but /health (open for probes): the key checked first. In the handler, after
  // httplib has read the body: a refusal from a pre-routing handler would leave a POST's body
  // unread on a kept-alive connection, to be parsed as the next request.
  auto refuse_key = [this](const httplib::Request& req, httplib::Response& res) {
    absl::Status s = Authorize(req);
    if (s.ok()) return false;
    // OpenAI's own answer to a bad key: 401, invalid_request_error, invalid_api_key.
    SetError(res, ApiError{401, "invalid_request_error", std::string(s.message()), "", "invalid_api_key"});
    res.set_header("WWW-Authenticate", "Bearer");
    return true;
  };
  auto guarded = [refuse_key](httplib::Server::Handler handler) {
    return [refuse_key, handler = std::move(handler)](const httplib::Request& req, httplib::Response& res) {
      if (!refuse_key(req, res)) handler(req, res);
    };
  };
  // A POST's body read here, not by httplib, whose own reading refuses a form-encoded body over
  // 8 KB (what `curl -d` sends) with 413; the body is parsed as JSON whatever its Content-Type.
  // A POST on an overflow thread is refused before its body is read (the connection closes).
  using BodyHandler = std::function<void(const httplib::Request&, const std::string&, httplib::Response&)>;
  auto with_body = [this, refuse_key](BodyHandler handler) {
    return [this, refuse_key, handler](const httplib::Request& req, httplib::Response& res,
                                       const httplib::ContentReader& reader) {
      if (ConnectionPool::OnOverflowThread()) return Busy(res);
      std::string body;
      if (!reader([&body](const char* data, size_t n) {
            body.append(data, n);
            return true;
          })) {
        // httplib set 413 (too large: the error handler says so) or nothing: the body came too late,
        // ended early, or its chunks were malformed.
        res.set_header("Connection", "close");
        if (res.status == 413) return;
        if (const std::string late = RequestTimeoutOnThisThread(); !late.empty()) {
          return SetError(res, ApiError{408, "invalid_request_error", late, "", "request_timeout"});
        }
        return SetError(res, ApiError{400, "invalid_request_error",
                                      "the request body could not be read: it ended before its Content-Length, "
                                      "or its chunked encoding is malformed",
                                      "", "malformed_request"});
      }
      if (!refuse_key(req, res)) handler(req, body, res);
    };
  };
  // The served model as OpenAI's model object.
  auto model_object = [this] {
    return Json{{"id", model_->name},
                {"object", "model"},
                {"created", created_},
                {"owned_by", "shardserve"},
                {"max_model_len", pool_->max_model_len()}};
  };
  // The release, as vLLM's GET /version says it.
  http_->Get("/version", guarded([](const httplib::Request&, httplib::Response& res) {
    res.set_content(Json{{"version", kVersion}}.dump(), kJson);
  }));
  http_->Get("/v1/models", guarded([model_object](const httplib::Request&, httplib::Response& res) {
    const Json body = {{"object", "list"}, {"data", Json::array({model_object()})}};
    res.set_content(body.dump(-1, ' ', false, Json::error_handler_t::replace), kJson);
  }));
  // Retrieve a model (the openai client's models.retrieve): the served one, else 404 as a completion for
  // another model gets.
  http_->Get("/v1/models/(.+)", guarded([this, model_object](const httplib::Request& req, httplib::Response& res) {
    const std::string asked = req.matches[1];
    if (absl::Status s = CheckModelName(asked); !s.ok()) return SetError(res, s);
    res.set_content(model_object().dump(-1, ' ', false, Json::error_handler_t::replace), kJson);
  }));
  using std::placeholders::_1, std::placeholders::_2, std::placeholders::_3;
  http_->Post("/v1/chat/completions", with_body(std::bind(&HttpServer::Generate, this, true, _1, _2, _3, nullptr)));
  http_->Post("/v1/completions", with_body(std::bind(&HttpServer::Generate, this, false, _1, _2, _3, nullptr)));
  http_->Post("/v1/responses", with_body(std::bind(&HttpServer::Respond, this, _1, _2, _3)));
  // The stored responses: another key's, or one never stored, is 404 (as an unknown id).
  auto stored = [this](const httplib::Request& req) -> absl::StatusOr<std::string> {
    const std::string id = req.matches[1];
    if (responses_ == nullptr) {
      return absl::NotFoundError(absl::StrCat("no response '", id.substr(0, 128),
                                              "': this server stores none (--http-responses-store-bytes 0)"));
    }
    return id;
  };
  http_->Get(R"(/v1/responses/([^/]+))", guarded([this, stored](const httplib::Request& req, httplib::Response& res) {
    absl::StatusOr<std::string> id = stored(req);
    if (!id.ok()) return SetError(res, id.status());
    std::optional<Json> response = responses_->Get(*id, Owner(req));
    if (!response.has_value()) return SetError(res, NoStoredResponse(*id));
    res.set_content(response->dump(-1, ' ', false, Json::error_handler_t::replace), kJson);
  }));
  http_->Delete(R"(/v1/responses/([^/]+))", guarded([this, stored](const httplib::Request& req,
                                                                   httplib::Response& res) {
    absl::StatusOr<std::string> id = stored(req);
    if (!id.ok()) return SetError(res, id.status());
    if (!responses_->Delete(*id, Owner(req))) return SetError(res, NoStoredResponse(*id));
    StoreMetrics();
    const Json answer = {{"id", *id}, {"object", "response"}, {"deleted", true}};
    res.set_content(answer.dump(-1, ' ', false, Json::error_handler_t::replace), kJson);
  }));
  http_->Get(R"(/v1/responses/([^/]+)/input_items)", guarded([this, stored](const httplib::Request& req,
                                                                            httplib::Response& res) {
    if (absl::StatusOr<std::string> id = stored(req); !id.ok()) return SetError(res, id.status());
    ListInputItems(req, res);
  }));
  http_->Post("/tokenize", with_body(std::bind(&HttpServer::Tokenize, this, _1, _2, _3)));
  http_->Post("/detokenize", with_body(std::bind(&HttpServer::Detokenize, this, _1, _2, _3)));
}

void HttpServer::StoreMetrics() {
  if (metrics_ == nullptr) return;
  metrics_->responses_stored.Set(static_cast<double>(responses_->size()));
  metrics_->responses_stored_bytes.Set(static_cast<double>(responses_->bytes()));
}

std::string HttpServer::Owner(const httplib::Request& req) const {
  if (options_.api_keys == nullptr) return "";
  std::optional<absl::string_view> header;
  if (auto it = req.headers.find("Authorization"); it != req.headers.end()) header = it->second;
  return ApiKeys::Fingerprint(header);
}

void HttpServer::Respond(const httplib::Request& req, const std::string& body, httplib::Response& res) {
  const std::string refused_id = absl::StrCat("resp_", RandomHex());
  absl::StatusOr<Json> request = ParseBody(body);
  if (!request.ok()) return Refuse(refused_id, request.status(), res);
  const std::string owner = Owner(req);
  // previous_response_id: the stored conversation it ends, read before this input.
  std::optional<Json> earlier;
  std::string previous;
  if (responses_ != nullptr && request->contains("previous_response_id") &&
      !(*request)["previous_response_id"].is_null()) {
    if (!(*request)["previous_response_id"].is_string()) {
      return Refuse(refused_id, InvalidField("previous_response_id", "must be a string"), res);
    }
    previous = (*request)["previous_response_id"].get<std::string>();
    absl::StatusOr<Json> conversation = responses_->Conversation(previous, owner);
    if (!conversation.ok()) {
      return Refuse(refused_id, InvalidField("previous_response_id", conversation.status().message()), res);
    }
    earlier = *std::move(conversation);
  }
  // Stored unless it says store: false (OpenAI's default is to store).
  if (request->contains("store") && !(*request)["store"].is_boolean() && !(*request)["store"].is_null()) {
    return Refuse(refused_id, InvalidField("store", "must be true or false"), res);
  }
  const bool store = responses_ != nullptr && request->value("store", Json(true)) != false;
  (*request)["store"] = store;
  absl::StatusOr<Json> chat = ResponsesToChat(*request, earlier.has_value() ? &*earlier : nullptr);
  if (!chat.ok()) return Refuse(refused_id, chat.status(), res);
  auto view = std::make_shared<ResponsesView>(*request);
  if (store) {
    // A client-named id (X-Request-Id, request_id) that names another key's stored response is
    // refused before anything runs: stored ids are unique.
    const auto [named, named_field] = ClientNamedId(
        req, request->contains("request_id") && (*request)["request_id"].is_string()
                 ? (*request)["request_id"].get<std::string>()
                 : "");
    if (!named.empty() && responses_->Taken(absl::StrCat("resp_", named), owner)) {
      return Refuse(refused_id,
                    InvalidField(named_field, absl::StrCat("'", named, "' names a stored response of another API key: "
                                                           "a stored response's id is unique; name this request "
                                                           "otherwise")),
                    res);
    }
    // Stored under the id of a response it continues, the conversation would loop (a tracing id
    // sent with every turn of one).
    if (!named.empty() && !previous.empty() && responses_->InChain(absl::StrCat("resp_", named), previous, owner)) {
      return Refuse(refused_id,
                    InvalidField(named_field, absl::StrCat("'", named, "' names a response that this one continues "
                                                           "(previous_response_id ", previous, "): name each "
                                                           "response of a conversation otherwise")),
                    res);
    }
    view->OnFinished([this, owner, previous, input = (*request)["input"]](const Json& response) {
      const std::string id = response.value("id", "");
      StoredResponse entry{owner, previous, NormalizedInputItems(input, id), response};
      if (!responses_->Put(std::move(entry))) {
        CoordinatorRequestLog(id, absl::StrCat("not stored: larger than --http-responses-store-bytes (",
                                               responses_->max_bytes(), "), or its id is another API key's"),
                              "warn");
      }
      StoreMetrics();
    });
  }
  Generate(/*chat=*/true, req, chat->dump(), res, std::move(view));
  // The server's own id names the Response (ChatToResponse's "resp_" + what follows "chatcmpl-").
  if (const std::string id = res.get_header_value("X-Request-Id"); absl::StartsWith(id, "chatcmpl-")) {
    res.headers.erase("X-Request-Id");
    res.set_header("X-Request-Id", absl::StrCat("resp_", id.substr(9)));
  }
  if (res.status < 400) return;
  // An error's param as this API names it.
  absl::StatusOr<Json> answer = ParseBody(res.body);
  if (!answer.ok()) return;
  if (Json& error = (*answer)["error"]; error.is_object() && error.contains("param") && error["param"].is_string()) {
    const std::string param = error["param"].get<std::string>(), renamed = ResponsesParam(param);
    std::string message = error.value("message", "");
    if (absl::StartsWith(message, param + ":")) message = renamed + message.substr(param.size());
    error["param"] = renamed;
    error["message"] = message;
    res.set_content(answer->dump(-1, ' ', false, Json::error_handler_t::replace), kJson);
  }
}

void HttpServer::ListInputItems(const httplib::Request& req, httplib::Response& res) {
  const std::string id = req.matches[1];
  int64_t limit = 20;
  if (req.has_param("limit")) {
    const std::string value = req.get_param_value("limit");
    if (!absl::SimpleAtoi(value, &limit) || limit < 1 || limit > 100) {
      return SetError(res, InvalidField("limit", absl::StrCat("'", value.substr(0, 32), "' is not 1 to 100")));
    }
  }
  const std::string order = req.has_param("order") ? req.get_param_value("order") : "desc";
  if (order != "asc" && order != "desc") {
    return SetError(res, InvalidField("order", absl::StrCat("'", order.substr(0, 32), "' is not asc or desc")));
  }
  std::optional<Json> items = responses_->InputItems(id, Owner(req));
  if (!items.has_value()) {
    return SetError(res, NoStoredResponse(id));
  }
  std::vector<const Json*> ordered;
  for (const Json& item : *items) ordered.push_back(&item);
  if (order == "desc") std::reverse(ordered.begin(), ordered.end());
  size_t from = 0;
  if (req.has_param("after")) {
    const std::string after = req.get_param_value("after");
    auto at = std::find_if(ordered.begin(), ordered.end(), [&](const Json* item) { return (*item)["id"] == after; });
    if (at == ordered.end()) {
      return SetError(res, InvalidField("after", absl::StrCat("no input item of '", id.substr(0, 128),
                                                              "' has the id '", after.substr(0, 128), "'")));
    }
    from = static_cast<size_t>(at - ordered.begin()) + 1;
  }
  const size_t to = std::min(ordered.size(), from + static_cast<size_t>(limit));
  Json data = Json::array();
  for (size_t i = from; i < to; ++i) data.push_back(*ordered[i]);
  const Json answer = {{"object", "list"},
                       {"data", data},
                       {"first_id", data.empty() ? Json(nullptr) : data.front()["id"]},
                       {"last_id", data.empty() ? Json(nullptr) : data.back()["id"]},
                       {"has_more", to < ordered.size()}};
  res.set_content(answer.dump(-1, ' ', false, Json::error_handler_t::replace), kJson);
}

void HttpServer::Tokenize(const httplib::Request& req, const std::string& body, httplib::Response& res) {
  const std::string id = absl::StrCat("tokenize-", RandomHex());
  auto reject = [&](const absl::Status& status) { Refuse(id, status, res); };
  absl::StatusOr<TokenizeRequest> request = ParseTokenizeRequest(body);
  if (!request.ok()) return reject(request.status());
  if (absl::Status s = CheckModelName(request->model); !s.ok()) return reject(s);
  std::string text = request->prompt;
  if (request->chat) {
    std::optional<std::string> prompt = RenderChat(id, request->messages, req, res);
    if (!prompt.has_value()) return;
    text = *std::move(prompt);
  } else if (model_->tokenizer == nullptr) {
    return reject(InvalidField("prompt", model_->NoTokenizer()));
  }
  absl::StatusOr<std::vector<int32_t>> ids = model_->tokenizer->Encode(text, request->add_special_tokens);
  if (!ids.ok()) return reject(InvalidField(request->chat ? "messages" : "prompt", ids.status().message()));
  Json out = {{"count", ids->size()}, {"max_model_len", pool_->max_model_len()}, {"tokens", *ids},
              {"token_strs", nullptr}};
  if (request->return_token_strs) {
    Json strs = Json::array();
    for (int32_t t : *ids) strs.push_back(std::string(model_->tokenizer->IdToToken(t).value_or("")));
    out["token_strs"] = std::move(strs);
  }
  res.set_content(out.dump(-1, ' ', false, Json::error_handler_t::replace), kJson);
}

void HttpServer::Detokenize(const httplib::Request&, const std::string& body, httplib::Response& res) {
  const std::string id = absl::StrCat("detokenize-", RandomHex());
  auto reject = [&](const absl::Status& status) { Refuse(id, status, res); };
  absl::StatusOr<DetokenizeRequest> request = ParseDetokenizeRequest(body);
  if (!request.ok()) return reject(request.status());
  if (absl::Status s = CheckModelName(request->model); !s.ok()) return reject(s);
  const Tokenizer* tokenizer = model_->tokenizer.get();
  if (tokenizer == nullptr) {
    return reject(InvalidField("tokens", model_->NoTokenizer()));
  }
  for (size_t i = 0; i < request->tokens.size(); ++i) {
    if (request->tokens[i] >= tokenizer->vocab_size()) {
      return reject(InvalidField(absl::StrCat("tokens[", i, "]"),
                                 absl::StrCat(request->tokens[i], " is not in the vocabulary (ids 0 to ",
                                              tokenizer->vocab_size() - 1, ")")));
    }
  }
  // As transformers' decode: special tokens kept; bytes that end mid-character become U+FFFD.
  const Json out = {{"prompt", tokenizer->Decode(request->tokens, /*skip_special_tokens=*/false)}};
  res.set_content(out.dump(-1, ' ', false, Json::error_handler_t::replace), kJson);
}

absl::Status HttpServer::CheckModelName(const std::string& model) const {
  if (model.empty() || model == model_->name) return absl::OkStatus();
  return FieldErrorStatus(
      "model", absl::StrCat("'", model, "' is not served here; this server serves '", model_->name, "'"),
      absl::StatusCode::kNotFound);
}

void HttpServer::Busy(httplib::Response& res) {
  // Every serving thread holds a connection: a clear refusal now, not a wait in a queue.
  LogIds ids;
  ids.level = "warn";
  CoordinatorLog("http", "refused a completion: every HTTP connection thread is taken", ids);
  SetError(res, ApiError{503, "service_unavailable_error",
                         absl::StrCat("the server is serving as many HTTP connections as it has threads (",
                                      options_.threads, "; from --max-num-seqs and --max-waiting-requests): ",
                                      "retry shortly"),
                         "", "server_busy"});
  res.set_header("Retry-After", "1");
  res.set_header("Connection", "close");
}

std::optional<std::string> HttpServer::RenderChat(const std::string& id, const Request& request,
                                                  const httplib::Request& req, httplib::Response& res) {
  auto reject = [&](const absl::Status& status) {
    Refuse(id, status, res);
    return std::nullopt;
  };
  if (model_->chat_template == nullptr) {
    return reject(InvalidField(
        "messages", model_->chat_template_status.code() == absl::StatusCode::kNotFound
                        ? absl::StrCat("the model ", model_->name,
                                       " has no chat template (tokenizer_config.json chat_template, or "
                                       "chat_template.jinja): use /v1/completions")
                        : absl::StrCat("the model's chat template cannot be used: ",
                                       model_->chat_template_status.message())));
  }
  if (model_->tokenizer == nullptr) {
    return reject(InvalidField("messages", model_->NoTokenizer()));
  }
  // The template comes with the checkpoint: it renders within the default budget (a deadline, caps
  // on memory and depth) and stops when the client goes away. Its socket is looked up only once a
  // render has run 10 ms (real ones take far less), then polled at most every 10 ms.
  chat::RenderBudget budget;
  std::optional<PeerWatch> render_peer;
  auto next_probe = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
  budget.cancelled = [&]() {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_probe) return false;
    next_probe = now + std::chrono::milliseconds(10);
    if (!render_peer.has_value()) {
      render_peer = PeerWatch::Find(req.local_addr, req.local_port, req.remote_addr, req.remote_port);
    }
    return render_peer.has_value() && render_peer->Closed();
  };
  auto render = [&](const nlohmann::ordered_json& messages) {
    return request.continue_final_message
               ? model_->chat_template->RenderContinuing(messages, request.tools, request.chat_template_kwargs, budget)
               : model_->chat_template->Render(messages, request.add_generation_prompt, request.tools,
                                               request.chat_template_kwargs, budget);
  };
  absl::StatusOr<std::string> prompt = render(request.messages);
  if (prompt.status().code() == absl::StatusCode::kInvalidArgument && !request.messages_with_argument_text.is_null()) {
    // A template that writes the tool-call arguments' text (not the object) as it is.
    absl::StatusOr<std::string> as_text = render(request.messages_with_argument_text);
    if (as_text.ok()) prompt = std::move(as_text);
  }
  if (prompt.status().code() == absl::StatusCode::kCancelled) {
    CoordinatorRequestLog(id, "client disconnected while the chat template rendered: cancelled", "warn");
    res.status = kClientClosed;  // nobody reads it; the logger leaves it to this count
    if (metrics_ != nullptr) metrics_->HttpRequest(EndpointLabel(req.path), kClientClosed);
    return std::nullopt;
  }
  if (prompt.status().code() == absl::StatusCode::kResourceExhausted ||
      prompt.status().code() == absl::StatusCode::kDeadlineExceeded) {
    // The model's template failed, not the request: a server error (500), not invalid_request_error,
    // and not ErrorFromStatus's 429 for RESOURCE_EXHAUSTED, which means a full queue to retry.
    CoordinatorRequestLog(id, absl::StrCat("chat template failed: ", prompt.status().message()), "error");
    SetError(res, ApiError{500, "server_error", std::string(prompt.status().message()), "",
                           "chat_template_budget_exceeded"});
    return std::nullopt;
  }
  if (!prompt.ok()) {
    // A continuation that cannot be made names its field; anything else the template raised, messages.
    const absl::string_view why = prompt.status().message();
    return reject(request.continue_final_message && absl::StartsWith(why, "continue_final_message")
                      ? InvalidField("continue_final_message", why)
                      : absl::InvalidArgumentError(why));
  }
  return *std::move(prompt);
}

void HttpServer::Generate(bool chat, const httplib::Request& req, const std::string& body, httplib::Response& res,
                          std::shared_ptr<ResponsesView> view) {
  const auto arrival = std::chrono::steady_clock::now();
  const Endpoint endpoint = chat ? Endpoint::kChatCompletions : Endpoint::kCompletions;
  // The request's id, in the log and the answer: the client's (an X-Request-Id header, else the
  // body's request_id, as vLLM takes them) after the endpoint's prefix, else a random one. The
  // answer's X-Request-Id header says which.
  const char* prefix = chat ? "chatcmpl-" : "cmpl-";
  std::string id = absl::StrCat(prefix, RandomHex());
  auto reject = [&](const absl::Status& status) { Refuse(id, status, res); };
  if (absl::Status s = CheckRequestId("X-Request-Id", req.get_header_value("X-Request-Id")); !s.ok()) {
    return reject(s);
  }

  absl::StatusOr<Request> request = ParseRequest(endpoint, body);
  if (!request.ok()) return reject(request.status());
  const std::string client_id = ClientNamedId(req, request->request_id).id;
  if (!client_id.empty()) id = absl::StrCat(prefix, client_id);
  res.set_header("X-Request-Id", client_id.empty() ? id : client_id);
  if (absl::Status s = CheckModelName(request->model); !s.ok()) return reject(s);

  // A chat prompt's token ids (this handler renders and encodes it); a completion's come with it
  // or PrepareGeneration makes them.
  std::optional<std::vector<int32_t>> ids;
  OutputParsing parsing;
  if (chat) {
    // The template writes the special tokens (BOS) itself: none are added again (as vLLM). Under
    // /v1/responses' truncation "auto", the oldest turns are dropped until the prompt leaves room for
    // max_tokens (or one token), each time rendered again.
    std::optional<std::string> prompt;
    const bool truncates = view != nullptr && view->truncates();
    for (;;) {
      prompt = RenderChat(id, *request, req, res);
      if (!prompt.has_value()) return;
      absl::StatusOr<std::vector<int32_t>> encoded = model_->tokenizer->Encode(*prompt, /*add_special_tokens=*/false);
      if (!encoded.ok()) return reject(InvalidField("messages", encoded.status().message()));
      if (absl::Status s = CheckTokenizedPrompt("messages", *encoded, *model_); !s.ok()) return reject(s);
      ids = std::move(*encoded);
      const int64_t room = request->max_tokens.value_or(1);
      if (!truncates || static_cast<int64_t>(ids->size()) + room <= pool_->max_model_len() ||
          !DropOldestTurn(&request->messages, &request->messages_with_argument_text)) {
        break;
      }
    }
    parsing.reasoning = reasoning_format_ != ReasoningFormat::kNone;
    parsing.reasoning_inside = parsing.reasoning && PromptOpensReasoning(*prompt);
    const bool forced = request->tool_choice == ToolChoice::kRequired || request->tool_choice == ToolChoice::kNamed;
    // A forced call under harmony is written as harmony writes calls (HarmonyForcedToolConstraint)
    // and parsed as harmony: one call, since gpt-oss's <|call|> ends the generation.
    const bool harmony_forced = forced && tool_format_ == ToolCallFormat::kHarmony && harmony_markers_.has_value();
    if (harmony_forced) {
      if (absl::Status s = HarmonyForcedToolConstraint(&*request, *harmony_markers_); !s.ok()) return reject(s);
    }
    const bool calls = request->tools.is_array() && !request->tools.empty() &&
                       (request->tool_choice == ToolChoice::kAuto || harmony_forced);
    if (calls) {
      parsing.tools = tool_format_;
      parsing.max_calls = request->parallel_tool_calls && !harmony_forced ? kMaxToolCallsPerMessage : 1;
    }
    if (tool_format_ == ToolCallFormat::kHarmony || reasoning_format_ == ReasoningFormat::kHarmony) {
      // Harmony is parsed whole (harmony.h), with or without tools; its calls only under the
      // tool parser openai.
      parsing.tools = ToolCallFormat::kHarmony;
      parsing.reasoning = true;
      parsing.reasoning_inside = false;
      if (!calls || tool_format_ != ToolCallFormat::kHarmony) parsing.max_calls = 0;
    }
    if (forced && !harmony_forced) {
      parsing.reasoning = false;  // the grammar makes the calls' JSON from the first token
      parsing.forced = request->tool_choice;
      parsing.forced_name = request->named_tool;
    }
  }

  // Each prompt checked (a chat's one, a completion's one or each of a batch, whose errors name
  // it), before any is submitted. Unset max_tokens: 16 for completions, what the context leaves for
  // chat (a prompt that fills it is PrepareGeneration's error).
  const int64_t max_model_len = pool_->max_model_len();
  const int prompts = chat ? 1 : static_cast<int>(request->prompts.size());
  const bool batch = !chat && prompts > 1;
  std::vector<GenerationParams> prepared;
  std::vector<int64_t> prompt_tokens;
  for (int p = 0; p < prompts; ++p) {
    const std::vector<int32_t>* prompt_ids = chat                         ? &*ids
                                             : request->prompts[p].is_ids ? &request->prompts[p].ids
                                                                          : nullptr;
    int64_t max_tokens = request->max_tokens.value_or(16);
    if (chat && !request->max_tokens.has_value()) {
      int64_t prompt_len = static_cast<int64_t>(prompt_ids->size());
      if (const int32_t keep = request->sampling.truncate_prompt_tokens(); keep > 0) {
        prompt_len = std::min<int64_t>(prompt_len, keep);
      }
      max_tokens = std::max<int64_t>(1, max_model_len - prompt_len);
    }
    absl::StatusOr<GenerationParams> params = PrepareGeneration(
        ToGenerateRequest(*request, p, 0, static_cast<int32_t>(std::min<int64_t>(max_tokens, INT32_MAX)), prompt_ids),
        *model_, max_model_len, id);
    if (!params.ok()) {
      return reject(RenameGenerationError(params.status(), endpoint, request->constraint_field, batch ? p : -1));
    }
    // A format whose markers are special tokens needs them in the text.
    if (KeepsSpecialTokens(parsing.tools)) params->skip_special_tokens = false;
    // So does a text marker that this checkpoint makes a special token (kept alone).
    if (params->skip_special_tokens) {
      std::vector<int32_t>& kept = params->kept_special_ids;
      if (parsing.reasoning) kept.insert(kept.end(), reasoning_marker_ids_.begin(), reasoning_marker_ids_.end());
      if (parsing.tools != ToolCallFormat::kNone) kept.insert(kept.end(), tool_marker_ids_.begin(), tool_marker_ids_.end());
      std::sort(kept.begin(), kept.end());
    }
    prompt_tokens.push_back(static_cast<int64_t>(params->prompt.size()));
    prepared.push_back(*std::move(params));
  }

  // echo: the text each prompt's choices begin with (vLLM's: a chat's final message when it is the
  // role answering; a completion's prompt, token ids decoded as the output is, and of a prompt that
  // truncate_prompt_tokens cut, the tokens kept).
  std::vector<std::string> echoes;
  if (request->echo && chat) {
    const Json& last = request->messages.back();
    const bool answering = !request->add_generation_prompt || last.value("role", "") == "assistant";
    auto content = last.find("content");
    echoes.push_back(answering && content != last.end() && content->is_string() ? content->get<std::string>() : "");
  } else if (request->echo) {
    const int32_t keep = request->sampling.truncate_prompt_tokens();
    for (int p = 0; p < prompts; ++p) {
      const Request::Prompt& prompt = request->prompts[p];
      // A prompt truncate_prompt_tokens may have cut echoes the tokens kept.
      const bool decoded = prompt.is_ids || (keep > 0 && prepared[p].prompt.size() == static_cast<size_t>(keep));
      if (decoded && model_->tokenizer == nullptr) {
        return reject(InvalidField("echo", absl::StrCat(model_->NoTokenizer(), " to write the prompt's text")));
      }
      echoes.push_back(decoded ? model_->tokenizer->Decode(prepared[p].prompt, prepared[p].skip_special_tokens)
                               : prompt.text);
    }
  }

  std::vector<int32_t> first_tokens;
  for (const GenerationParams& params : prepared) first_tokens.push_back(params.prompt.front());
  auto job = std::make_shared<Job>(engine_, *std::move(request), id, std::move(prompt_tokens), parsing,
                                   std::move(echoes), std::move(first_tokens));
  if (absl::Status s = job->Submit(prepared, arrival); !s.ok()) {
    CoordinatorRequestLog(id, absl::StrCat("refused: ", s.message()), "warn");
    return SetError(res, s);
  }
  const Tokenizer* tokenizer = model_->tokenizer.get();

  if (!job->request().stream) {
    // httplib notices a closed connection only when it writes: watch the socket while waiting, so
    // that a client that gives up frees its KV blocks now, not when its answer is complete.
    const std::optional<PeerWatch> peer = PeerWatch::Find(req.local_addr, req.local_port, req.remote_addr, req.remote_port);
    while (!job->done()) {
      job->Poll();
      if (peer.has_value() && !job->done() && peer->Closed()) {
        CoordinatorRequestLog(id, "client disconnected: cancelled", "warn");
        job->Cancel(absl::CancelledError("the HTTP client disconnected"));
        res.status = kClientClosed;  // nobody reads it; the logger leaves it to this count
        if (metrics_ != nullptr) metrics_->HttpRequest(EndpointLabel(req.path), kClientClosed);
        return;
      }
    }
    if (!job->error().ok()) return SetError(res, job->error());
    const Json answer = view != nullptr ? view->Answer(job->Response(tokenizer)) : job->Response(tokenizer);
    res.set_content(answer.dump(-1, ' ', false, Json::error_handler_t::replace), kJson);
    return;
  }

  // Streaming: the provider runs after this handler returns, on the same thread, once per batch of
  // tokens, until it calls sink.done() or a write fails (the client went away).
  auto first = std::make_shared<bool>(true);
  auto counted = std::make_shared<std::atomic<bool>>(false);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [job, first, tokenizer, view](size_t, httplib::DataSink& sink) {
        // A chunk as the client reads it: a chat or completion chunk, or /v1/responses' events.
        auto write = [&view](const Json& chunk) { return view != nullptr ? view->Chunk(chunk) : Event(chunk); };
        std::string out;
        if (*first) {
          *first = false;
          for (const Json& chunk : job->OpeningChunks()) out += write(chunk);
        }
        for (const Polled& p : job->Poll()) {
          for (const Json& chunk : job->ChunksOf(p, tokenizer)) out += write(chunk);
        }
        if (job->done()) {
          if (!job->error().ok()) {
            // The 200 is sent: the error travels as an event, as OpenAI-compatible servers do.
            const Json error = Json::parse(ErrorBody(ErrorFromStatus(job->error())));
            out += view != nullptr ? view->End(&error) : Event(error);
          } else if (job->request().include_usage) {
            out += write(job->UsageChunk());
          }
          if (view == nullptr) {
            out += "data: [DONE]\n\n";
          } else if (job->error().ok()) {
            out += view->End();
          }
        }
        if (!out.empty() && !sink.write(out.data(), out.size())) return false;
        if (job->done()) sink.done();
        return true;
      },
      [this, job, counted, responses = view != nullptr](bool success) {
        // The stream ended: written to the end, or its client went away (cancel what runs).
        if (counted->exchange(true)) return;
        const bool gone = !success && !job->done();
        if (gone) {
          CoordinatorRequestLog(job->id(), "client disconnected: cancelled", "warn");
          job->Cancel(absl::CancelledError("the HTTP client disconnected"));
        }
        if (metrics_ != nullptr) {
          metrics_->HttpRequest(responses ? "/v1/responses" : job->chat() ? "/v1/chat/completions" : "/v1/completions",
                                success || !gone ? 200 : kClientClosed);
        }
      });
}

}  // namespace shardserve::openai
