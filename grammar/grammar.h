// The grammar engine for constrained decoding: JSON Schema, regular expressions, lists of choices
// and GBNF grammars compiled to one grammar form, and a matcher that says, at each decoding step,
// which vocabulary tokens keep the output a valid prefix of the language.
//
// Design (after xgrammar's GrammarCompiler and adaptive token mask cache, and llama.cpp's GBNF
// engine, llama-grammar.cpp):
//
//  * Grammar IR (this header). A grammar is a list of rules; a rule is a list of alternatives; an
//    alternative is a sequence of elements. An element is a reference to a rule, a character class
//    (a set of Unicode code points, matched on the UTF-8 bytes of one character), or a character
//    class star (zero or more characters of the class, matched in place so that the text of a JSON
//    string or a number's digits never leaves its rule's frame). Quantifiers and groups of the
//    inputs become helper rules (x* is `r ::= x r | ""`). Every input form lowers to this IR:
//    GBNF text (ParseGbnf), a regular expression (GrammarFromRegex), a list of choices
//    (GrammarFromChoices) and a JSON Schema (GrammarFromJsonSchema, which writes GBNF).
//
//  * The matcher (grammar/matcher.h) is a byte-level pushdown automaton over the IR, as
//    llama.cpp's: its state is a set of stacks; a stack is a chain of frames (rule, alternative,
//    element, and the bytes read so far of a partly read UTF-8 character), stored hash-consed in an
//    arena, so stacks share their bottoms and are compared by one integer (xgrammar's persistent
//    stack). Calls in tail position reuse their caller's frame, so repetition does not deepen
//    the stack. Left recursion is refused when the grammar is built.
//
//  * CompiledGrammar (grammar/matcher.h) binds a grammar to a tokenizer's vocabulary, given as the
//    byte string of every token id. For every position a stack's top can be at, it runs every
//    token from that position alone (the rest of the stack unknown) over the vocabulary sorted as
//    a trie, and sorts the tokens in three: accepted whatever lies below (they end inside the
//    top frame), rejected whatever lies below, and context-dependent: those that finish the top
//    frame with bytes left over. Those are kept as (left-over bytes -> tokens), the left-overs
//    sorted as a trie too. A step's mask is then, for each stack of the state, the precomputed
//    accepted set OR'd in, plus the left-over tries run from the frame below the top, with whole
//    subtrees pruned at the first byte they fail (each prefix's end in the sorted strings is
//    precomputed, and a byte is tested against the bytes the stacks can read before any step).
//    A matcher keeps the left-over tokens it found for each stack top, so a top met again (every
//    character of a JSON string) costs an OR. Special tokens are allowed only where a grammar names them (<[ID]>); the end of
//    sequence token(s) only where the root rule may end.
//
// Threading: a Grammar and a CompiledGrammar are immutable once built, and shared freely between
// threads (the coordinator compiles, the last-stage worker masks). A GrammarMatcher is one
// sequence's state: one thread at a time.
#ifndef SHARDSERVE_GRAMMAR_GRAMMAR_H_
#define SHARDSERVE_GRAMMAR_GRAMMAR_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve::grammar {

// Bounds on what one grammar may hold, so that hostile input is an error, never a hang or a
// crash. A JSON Schema of a real tool or API lowers to a few hundred rules.
inline constexpr int kMaxRules = 20000;
inline constexpr int kMaxElements = 200000;   // elements of all alternatives together
inline constexpr int kMaxRepeat = 1000;       // the largest m, n of a {m,n} quantifier
inline constexpr int kMaxNesting = 100;       // groups in groups, schemas in schemas
inline constexpr int kMaxInputBytes = 1 << 20;

// A set of code points: sorted, disjoint, non-adjacent inclusive ranges.
struct CharClass {
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
  bool Contains(uint32_t cp) const;
  // Whether some code point in [lo, hi] is in the set.
  bool Intersects(uint32_t lo, uint32_t hi) const;
  bool operator==(const CharClass&) const = default;
};

// Normalizes `ranges` (any order, overlapping) into a CharClass; `negate` takes the complement
// over the Unicode scalar values (0..0x10FFFF without the surrogates).
CharClass MakeCharClass(std::vector<std::pair<uint32_t, uint32_t>> ranges, bool negate);

struct Element {
  enum class Kind : uint8_t { kRule, kClass, kClassStar };
  Kind kind;
  int32_t index;  // a rule of Grammar::rules or a class of Grammar::classes
  bool operator==(const Element&) const = default;
};
using Sequence = std::vector<Element>;

struct Rule {
  std::string name;
  std::vector<Sequence> alternatives;  // an empty sequence matches the empty string
};

struct Grammar {
  std::vector<Rule> rules;
  std::vector<CharClass> classes;
  int32_t root = 0;

  // GBNF text of the grammar (one rule a line), for errors and debugging.
  std::string ToString() const;
};

// Checks a built grammar: references in range, a root, no left recursion (a rule reachable from
// itself without consuming a byte), sizes within the bounds above. Every builder below calls it.
absl::Status ValidateGrammar(const Grammar& grammar);

// GBNF as llama.cpp writes it (grammars/README.md there): `name ::= alternatives`, "literals" and
// [classes] with \n \t \r \\ \" \] \xHH \uHHHH \UHHHHHHHH escapes, [^...] negation, `.` any
// character, ( ) groups, * + ? {m} {m,} {m,n} quantifiers, # comments, and <[ID]> for special
// token ID (llama.cpp's token syntax: a chat format's marker such as gpt-oss's <|channel|>, which
// no text can spell; grammar/utf8.h). The start rule is `root`
// unless `root_rule` names another. Differences: a rule may continue on the next line anywhere
// (llama.cpp ends a rule at a newline outside parentheses); a rule with left recursion is an
// error (llama.cpp's too). Errors name the line and column.
absl::StatusOr<Grammar> ParseGbnf(std::string_view text, std::string_view root_rule = "root");

// A regular expression matched against the whole output (ECMAScript syntax as JSON Schema's
// `pattern`: literals, escapes \d \w \s \D \W \S \n \t \xHH \uHHHH, classes, `.`, groups (?: ),
// alternation, * + ? {m} {m,} {m,n} (lazy forms allowed: they match the same strings), ^ at the
// start and $ at the end). Back-references and look-arounds are refused by name, with the offset.
absl::StatusOr<Grammar> GrammarFromRegex(std::string_view regex);
// The same, as GBNF text of a rule body (for the JSON Schema writer's `pattern`).
absl::StatusOr<std::string> RegexToGbnf(std::string_view regex);

// Exactly one of `choices` (literal strings; at least one).
absl::StatusOr<Grammar> GrammarFromChoices(const std::vector<std::string>& choices);

// GBNF text of a character class: [...].
std::string CharClassGbnf(const CharClass& c);

// GBNF-quoted literal: "..." with the escapes ParseGbnf reads.
std::string GbnfLiteral(std::string_view text);

}  // namespace shardserve::grammar

#endif  // SHARDSERVE_GRAMMAR_GRAMMAR_H_
