// The filters (`x | name(args)`) and tests (`x is name(args)`) of jinja2 that real chat templates
// use, with the semantics jinja2 gives them in transformers' sandbox. Unknown names throw
// TemplateError naming them, at args.where; so do bad arguments.
#ifndef SHARDSERVE_COORDINATOR_CHAT_FILTERS_H_
#define SHARDSERVE_COORDINATOR_CHAT_FILTERS_H_

#include <string>

#include "coordinator/chat/value.h"

namespace shardserve::chat {

Value ApplyFilter(const std::string& name, const Value& input, CallArgs& args);
bool ApplyTest(const std::string& name, const Value& input, CallArgs& args);

}  // namespace shardserve::chat

#endif  // SHARDSERVE_COORDINATOR_CHAT_FILTERS_H_
