// What identifies the weights a worker holds, so that a new coordinator can adopt a worker that
// outlived its old one without reloading them (worker.proto HeldShard and Assignment.adopt;
// docs/healing.md "The coordinator restarts").
//
// Pure functions: ModelFingerprint reads file names, sizes and config.json, nothing else; no
// state, thread-safe.
#ifndef SHARDSERVE_MODEL_SHARD_IDENTITY_H_
#define SHARDSERVE_MODEL_SHARD_IDENTITY_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {

// What identifies the checkpoint directory `dir`, one entry each: "config.json sha256 <hex of its
// bytes>", then "<name> <size in bytes>" for every *.safetensors and *.json file in it, sorted by
// name. Cheap (the weights are not read); it tells apart another model, another config and a
// re-saved checkpoint of another size, not a same-sized file rewritten in place. NotFound without a
// readable config.json.
absl::StatusOr<std::vector<std::string>> ModelManifest(const std::string& dir);

// OK when the manifests `here` (this process's copy) and `wanted` (the coordinator's) are the same;
// FailedPrecondition naming the first difference otherwise ("model.safetensors is 1200 bytes here,
// 1180 at the coordinator", "config.json differs (SHA-256 ... here, ... at the coordinator)",
// "tokenizer.json is missing here", ...).
absl::Status SameModelFiles(const std::vector<std::string>& here, const std::vector<std::string>& wanted);

// A fingerprint of the checkpoint directory `dir`: the hex SHA-256 of its ModelManifest.
absl::StatusOr<std::string> ModelFingerprint(const std::string& dir);

// OK when a worker holding the shard `held` was loaded for (an earlier coordinator's Assignment)
// holds exactly the weights and buffers `wanted` asks for: the same model path, stage and stages,
// TP rank and size, layers, step limits, weight quantization, load format and dummy seed (the
// worker id, epoch, group names and collective timeout may differ). FailedPrecondition naming the
// first difference otherwise. (The model fingerprints are compared by the caller.)
absl::Status SameShard(const v1::Assignment& held, const v1::Assignment& wanted);

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_SHARD_IDENTITY_H_
