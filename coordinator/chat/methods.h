// The methods of str and dict that real chat templates call (`content.strip()`, `message.get('x')`,
// `d.items()`), with Python semantics. A namespace() object has none: its attributes are its keys.
#ifndef SHARDSERVE_COORDINATOR_CHAT_METHODS_H_
#define SHARDSERVE_COORDINATOR_CHAT_METHODS_H_

#include <optional>
#include <string>

#include "coordinator/chat/value.h"

namespace shardserve::chat {

// Whether `obj` has a method `name` (GetAttr binds it, ahead of a dict key of the same name).
bool HasMethod(const Value& obj, const std::string& name);
// Calls `obj`'s method `name`; nullopt when `obj` has no method `name`. Bad arguments throw
// TemplateError at args.where.
std::optional<Value> CallMethod(const Value& obj, const std::string& name, CallArgs& args);

}  // namespace shardserve::chat

#endif  // SHARDSERVE_COORDINATOR_CHAT_METHODS_H_
