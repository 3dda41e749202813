// The chat-template runtime: walks a parsed Template (parser.h) with a context of variables and
// returns the text. Scoping follows jinja2: a `for` body is a new scope each iteration (a `set` in
// it does not leak out; namespace() objects are the way to carry state out), `if` is not a scope,
// a macro sees the scope it was defined in plus its arguments.
//
// The globals transformers adds are built in: raise_exception(msg), strftime_now(fmt), plus jinja2's
// range, namespace and dict. Thread-safe: each call owns its state (its budget tracker is the calling
// thread's for the duration of the call); `tmpl` is only read.
#ifndef SHARDSERVE_COORDINATOR_CHAT_RENDER_H_
#define SHARDSERVE_COORDINATOR_CHAT_RENDER_H_

#include <string>

#include "absl/status/statusor.h"
#include "coordinator/chat/parser.h"
#include "coordinator/chat/budget.h"
#include "coordinator/chat/value.h"

namespace shardserve::chat {

// Renders `tmpl` with the variables of `context` (a dict; later keys win) within `budget`.
// Template errors are INVALID_ARGUMENT: a template's raise_exception(msg) gives "msg (raised by the
// chat template at line L, column C)"; anything else "chat template line L, column C: what went
// wrong". A budget exceeded is RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED or CANCELLED (budget.h):
// "the chat template exceeded its budget of N <what> (line L, column C)".
absl::StatusOr<std::string> Render(const Template& tmpl, const Value& context, const RenderBudget& budget = {});

}  // namespace shardserve::chat

#endif  // SHARDSERVE_COORDINATOR_CHAT_RENDER_H_
