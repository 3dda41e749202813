// Every family's declaration (model/families/declaration.h), one .cc each; the registry
// (registry.h) lists them.
#ifndef SHARDSERVE_MODEL_FAMILIES_FAMILIES_H_
#define SHARDSERVE_MODEL_FAMILIES_FAMILIES_H_

#include "model/families/declaration.h"

namespace shardserve {

// llama.cc: the Llama-shaped decoders.
extern const FamilyDeclaration kLlamaFamily;
extern const FamilyDeclaration kMistralFamily;
extern const FamilyDeclaration kQwen2Family;
extern const FamilyDeclaration kQwen3Family;

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_FAMILIES_FAMILIES_H_
