#include "model/weight_source.h"

#include "absl/strings/str_cat.h"
#include "model/checkpoint.h"
#include "model/dummy_weights.h"

namespace shardserve {

absl::StatusOr<LoadFormat> ParseLoadFormat(absl::string_view name) {
  if (name == "auto") return LoadFormat::kAuto;
  if (name == "dummy") return LoadFormat::kDummy;
  return absl::InvalidArgumentError(absl::StrCat("load-format must be auto or dummy, got '", name, "'"));
}

absl::Status WeightSource::ReadOnDevice(const std::string& name, const std::vector<int64_t>&, const Slice&, Backend*,
                                        Tensor*) const {
  return absl::UnimplementedError(absl::StrCat("tensor \"", name, "\": this weight source reads on the host only"));
}

absl::StatusOr<std::unique_ptr<WeightSource>> OpenWeightSource(const std::filesystem::path& dir,
                                                               const ModelConfig& config, LoadFormat format,
                                                               uint64_t dummy_seed, bool dummy_on_device) {
  if (format == LoadFormat::kDummy) return std::make_unique<DummyWeights>(config, dummy_seed, dummy_on_device);
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  if (!checkpoint.ok()) return checkpoint.status();
  return std::unique_ptr<WeightSource>(std::move(*checkpoint));
}

void NoteEagle3Embedding(const WeightSource& weights, ModelConfig* head) {
  if (!head->eagle3.has_value()) return;
  // (a tensor of another shape is held: the worker refuses it, naming both shapes)
  head->eagle3->embedding_in_checkpoint = !absl::IsNotFound(
      weights.CheckShape("embed_tokens.weight", {head->eagle3->embedding_vocab_size, head->hidden_size}));
}

}  // namespace shardserve
