#include "coordinator/chat/budget.h"

#include "absl/strings/str_cat.h"
#include "coordinator/chat/value.h"

namespace shardserve::chat {
namespace {

thread_local BudgetTracker* current_tracker = nullptr;

}  // namespace

BudgetTracker::BudgetTracker(const RenderBudget& budget)
    : budget_(budget),
      deadline_(std::chrono::steady_clock::now() + budget.deadline),
      previous_(current_tracker),
      containers_(new std::vector<Value>()) {
  current_tracker = this;
}

BudgetTracker::~BudgetTracker() {
  current_tracker = previous_;
  for (Value& v : *containers_) {
    if (v.is_list()) v.AsList().clear();
    else v.AsDict().items.clear();
  }
  delete containers_;
}

BudgetTracker* BudgetTracker::Current() { return current_tracker; }

void BudgetTracker::Exceeded(absl::StatusCode code, const std::string& what, Location where) const {
  throw BudgetError(code, absl::StrCat("the chat template exceeded its budget of ", what), where);
}

void BudgetTracker::CheckElements(int64_t n, Location where) const {
  if (n < 0 || n > budget_.max_elements - elements_) {
    Exceeded(absl::StatusCode::kResourceExhausted, absl::StrCat(budget_.max_elements, " list and dict elements"), where);
  }
}

void BudgetTracker::Register(const Value& container, size_t items) {
  const int64_t n = static_cast<int64_t>(items) + 1;
  CheckElements(n, where_);
  elements_ += n;
  containers_->push_back(container);
}

void BudgetTracker::CheckBytes(int64_t n, Location where) const {
  if (n < 0 || n > budget_.max_bytes - bytes_) {
    Exceeded(absl::StatusCode::kResourceExhausted, absl::StrCat(budget_.max_bytes, " bytes of strings"), where);
  }
}

void BudgetTracker::ChargeBytes(int64_t n, Location where) {
  CheckBytes(n, where);
  bytes_ += n;
}

void BudgetTracker::Iteration(Location where) {
  if (++iterations_ > budget_.max_iterations) {
    Exceeded(absl::StatusCode::kResourceExhausted,
             absl::StrCat(budget_.max_iterations, " loop iterations and macro calls"), where);
  }
  if (++ticks_ % kPollEvery == 0) Poll(where);
}

void BudgetTracker::Enter(Location where) {
  if (depth_ >= budget_.max_depth) {
    Exceeded(absl::StatusCode::kResourceExhausted,
             absl::StrCat(budget_.max_depth, " levels of nesting (macro calls, lists and dicts inside one another)"),
             where);
  }
  ++depth_;
}

void BudgetTracker::Poll(Location where) {
  if (std::chrono::steady_clock::now() > deadline_) {
    Exceeded(absl::StatusCode::kDeadlineExceeded, absl::StrCat(budget_.deadline.count(), " ms of rendering time"),
             where);
  }
  if (budget_.cancelled && budget_.cancelled()) {
    throw BudgetError(absl::StatusCode::kCancelled, "the chat template render was cancelled", where);
  }
}

}  // namespace shardserve::chat
