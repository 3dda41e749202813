// The budget of one chat-template render: a template comes with a downloaded checkpoint
// (tokenizer_config.json, chat_template.jinja), so it is outside input, and a hostile or broken one
// must end in a clear error, quickly and in bounded memory, never in minutes of CPU, gigabytes of
// memory or a stack overflow.
//
// RenderBudget is what the caller chooses (the defaults suit every real template with a wide
// margin). BudgetTracker is the runtime's side: Render (render.h) installs one for the calling
// thread for the duration of the render, and the value operations (value.cc, filters.cc,
// methods.cc, py_str.cc) charge it where they create lists, dicts and strings, checking sizes
// BEFORE allocating wherever the size is known (list + list, str * n, range(n), join, replace,
// indent), so that memory stays within the budget.
// Outside a render (no tracker installed) nothing is charged.
//
// A budget exceeded throws BudgetError inside the runtime; Render turns it into an absl::Status:
//   RESOURCE_EXHAUSTED  elements, iterations, bytes or nesting depth
//   DEADLINE_EXCEEDED   the deadline
//   CANCELLED           the caller's `cancelled` returned true
// with a message that names the budget and its limit, e.g. "the chat template exceeded its budget
// of 1000000 list and dict elements (line 3, column 18)".
//
// Threading: a RenderBudget is copied into the tracker; `cancelled` is called on the rendering
// thread only. A BudgetTracker belongs to the thread that created it.
#ifndef SHARDSERVE_COORDINATOR_CHAT_BUDGET_H_
#define SHARDSERVE_COORDINATOR_CHAT_BUDGET_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/chat/lexer.h"

namespace shardserve::chat {

class Value;

struct RenderBudget {
  // Wall time of one render. Real templates render in well under a millisecond per message (the
  // fixture conversations take microseconds); one second leaves three orders of magnitude for a
  // long conversation on a loaded machine and still answers a hostile template promptly.
  std::chrono::milliseconds deadline{1000};
  // Lists, dicts and their items, and range() entries created by one render, counted as created
  // (so also the most it can hold: about 150 bytes each, some 150 MB at most). Real templates
  // build a few small lists per message (items(), a slice of the messages, a split); a million is
  // a hundred times what a thousand-message conversation needs.
  int64_t max_elements = 1'000'000;
  // Loop iterations and macro calls. Real templates take O(messages^2) at worst (a loop over the
  // messages inside a loop over them): ten million covers a three-thousand-message conversation.
  int64_t max_iterations = 10'000'000;
  // Bytes of the strings one render builds (concatenations, filters, macro output, captures) and of
  // its output, counted as created, so also the most memory they can hold. A render copies each
  // message a handful of times; 128 MiB is more than ten times the text of the longest context
  // window of any model, and sixteen times the largest request body the server takes by default.
  int64_t max_bytes = int64_t{128} << 20;
  // Macro calls inside one another, plus the levels of lists and dicts inside one another that
  // printing, tojson and comparisons walk: each is a level of C++ recursion, so this keeps the
  // stack bounded (a macro calling itself without end is an error, never a stack overflow). Real
  // templates nest a few macros and JSON tool schemas a few dozen levels.
  int max_depth = 200;
  // Polled during the render, at most every kPollEvery evaluation steps (so a cheap call is
  // enough; a costly check should limit its own rate): true stops the render with CANCELLED.
  std::function<bool()> cancelled;
};

// Thrown by the runtime and the value operations when a budget is exceeded; Render catches it.
class BudgetError {
 public:
  BudgetError(absl::StatusCode code, std::string message, Location where)
      : code_(code), message_(std::move(message)), where_(where) {}
  absl::StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  Location where() const { return where_; }

 private:
  absl::StatusCode code_;
  std::string message_;
  Location where_;
};

class BudgetTracker {
 public:
  // The deadline and `cancelled` are checked every kPollEvery steps (loop iterations, macro
  // calls, expression evaluations, nodes walked by comparisons and printing): some microseconds.
  static constexpr int64_t kPollEvery = 256;

  // Installs this tracker as the current thread's until it is destroyed.
  explicit BudgetTracker(const RenderBudget& budget);
  // Uninstalls it, then empties every list and dict the render created (see Register).
  ~BudgetTracker();
  BudgetTracker(const BudgetTracker&) = delete;
  BudgetTracker& operator=(const BudgetTracker&) = delete;

  // The tracker of the render running on this thread, or nullptr.
  static BudgetTracker* Current();

  // The node the renderer is evaluating: the location of errors raised where none is known.
  void At(Location where) { where_ = where; }
  Location where() const { return where_; }

  // Throws unless `n` more elements fit (checks before allocating; the container charges).
  void CheckElements(int64_t n, Location where) const;
  // Counts a new list or dict of `items` items (1 + items elements) and keeps it until the render
  // ends: a template can build reference cycles (a namespace holding itself) and arbitrarily deep
  // chains of lists; emptying every container one by one at the end frees them all, without a
  // recursion as deep as the chain.
  void Register(const Value& container, size_t items);
  // Throws unless `n` more bytes fit (checks before allocating).
  void CheckBytes(int64_t n, Location where) const;
  void ChargeBytes(int64_t n, Location where);
  // A loop iteration or a macro call.
  void Iteration(Location where);
  // One step of evaluation; polls the deadline and `cancelled` every kPollEvery steps.
  void Tick() {
    if (++ticks_ % kPollEvery == 0) Poll(where_);
  }
  // One level deeper (macro call, nested value walked); throws past max_depth.
  void Enter(Location where);
  void Leave() { --depth_; }

 private:
  void Poll(Location where);
  [[noreturn]] void Exceeded(absl::StatusCode code, const std::string& what, Location where) const;

  const RenderBudget budget_;
  const std::chrono::steady_clock::time_point deadline_;
  BudgetTracker* const previous_;
  int64_t elements_ = 0;
  int64_t bytes_ = 0;
  int64_t iterations_ = 0;
  int64_t ticks_ = 0;
  int depth_ = 0;
  Location where_;
  std::vector<Value>* containers_;  // owned; a pointer because Value is incomplete here
};

// One level of nesting (and one step) for the current render's tracker, if any, for the scope of
// this object: the recursive walks over values (printing, JSON, comparisons) hold one per level.
class DepthGuard {
 public:
  DepthGuard() : tracker_(BudgetTracker::Current()) {
    if (tracker_ != nullptr) {
      tracker_->Tick();
      tracker_->Enter(tracker_->where());
    }
  }
  ~DepthGuard() {
    if (tracker_ != nullptr) tracker_->Leave();
  }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;

 private:
  BudgetTracker* tracker_;
};

// The value operations' budget checks (value.cc, py_str.cc, filters.cc, methods.cc), before an
// allocation of known size; no-ops outside a render. `where` defaults to
// the node the renderer is evaluating.
inline void CheckBytes(int64_t size, const Location* where = nullptr) {
  if (BudgetTracker* t = BudgetTracker::Current()) t->CheckBytes(size, where ? *where : t->where());
}
// Also a step of the render (see BudgetTracker::Tick): the loops that grow a string one piece at a
// time (printing, JSON, join, replace, indent) poll the deadline through it.
inline void CheckGrowth(const std::string& out, size_t more, const Location* where = nullptr) {
  if (BudgetTracker* t = BudgetTracker::Current()) {
    t->CheckBytes(static_cast<int64_t>(out.size() + more), where ? *where : t->where());
    t->Tick();
  }
}
inline void CheckElements(int64_t n, const Location* where = nullptr) {
  if (BudgetTracker* t = BudgetTracker::Current()) t->CheckElements(n, where ? *where : t->where());
}

}  // namespace shardserve::chat

#endif  // SHARDSERVE_COORDINATOR_CHAT_BUDGET_H_
