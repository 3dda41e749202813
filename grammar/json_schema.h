// JSON Schema to grammar: the schema's instances, written as compact JSON (no whitespace between
// tokens, as xgrammar's any_whitespace=False with separators "," and ":"), so that a schema whose
// every value is bounded (enums, maxLength, maxItems, integer ranges, fixed-length patterns)
// always ends.
//
// Supported: type (one or a list), properties / required / additionalProperties, enum, const,
// anyOf / oneOf (oneOf as anyOf: exclusivity is not enforced), $ref to "#", "#/$defs/NAME" or
// "#/definitions/NAME" (recursion included), items / prefixItems / minItems / maxItems,
// minLength / maxLength, pattern (matched against the whole string, as xgrammar does), format
// (date, date-time, time, uuid, email, ipv4), minimum / maximum / exclusiveMinimum /
// exclusiveMaximum for integers and numbers (a number's bounds must be integers). Annotations
// (title, description, default, examples, ...) are ignored. Any other keyword is refused by name
// with the schema path, never ignored.
//
// Properties come in the schema's order; those not in `required` may be left out. As in
// xgrammar's strict mode, an object with `properties` and no `additionalProperties` admits no
// other property, and an array with `prefixItems` and no `items` no other item.
#ifndef SHARDSERVE_GRAMMAR_JSON_SCHEMA_H_
#define SHARDSERVE_GRAMMAR_JSON_SCHEMA_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "grammar/grammar.h"

namespace shardserve::grammar {

// GBNF text (root rule `root`) of the instances of `schema_json`.
absl::StatusOr<std::string> JsonSchemaToGbnf(std::string_view schema_json);
absl::StatusOr<Grammar> GrammarFromJsonSchema(std::string_view schema_json);
// For a grammar that joins several schemas (a chat format's calls, one schema a tool): the rule
// `root_name` of `schema_json`'s instances and its helper rules (named `prefix` and a counter),
// without the JSON rules every schema shares (json-string, json-value, ...), which
// JsonSharedGbnf() gives once.
absl::StatusOr<std::string> JsonSchemaToGbnfRules(std::string_view schema_json, std::string_view root_name,
                                                  std::string_view prefix);
std::string JsonSharedGbnf();
// Any JSON value (the OpenAI API's json_object response format), compact.
absl::StatusOr<Grammar> GrammarForAnyJson();

}  // namespace shardserve::grammar

#endif  // SHARDSERVE_GRAMMAR_JSON_SCHEMA_H_
