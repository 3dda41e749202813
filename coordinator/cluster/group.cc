#include "coordinator/cluster/group.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardserve {
namespace {

// Workers a group may have (and the coordinator's --nodes x --gpus-per-node).
constexpr int kMaxWorkers = 4096;

bool IsDigit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }

// Fills every slot's group names and members from its place and g->epoch.
void NameGroups(Group* g) {
  const int tp = g->shape.tp, pp = g->shape.pp;
  const std::string e = absl::StrCat("e", g->epoch, "/");
  for (Slot& s : g->slots) {
    s.tp_group = absl::StrCat(e, "tp/stage", s.stage);
    s.tp_ranks.clear();
    for (int r = 0; r < tp; ++r) s.tp_ranks.push_back(RankOf(g->shape, s.stage, r));
    s.pp_group = absl::StrCat(e, "pp/tp", s.tp_rank);
    s.pp_ranks.clear();
    for (int st = 0; st < pp; ++st) s.pp_ranks.push_back(RankOf(g->shape, st, s.tp_rank));
    s.send_group = s.stage + 1 < pp ? absl::StrCat(s.pp_group, "/stage", s.stage, "-", s.stage + 1) : "";
    s.recv_group = s.stage > 0 ? absl::StrCat(s.pp_group, "/stage", s.stage - 1, "-", s.stage) : "";
  }
}

}  // namespace

int RankOf(const GroupShape& shape, int stage, int tp_rank) { return stage * shape.tp + tp_rank; }

const Slot& Group::at(int stage, int tp_rank) const { return slots[RankOf(shape, stage, tp_rank)]; }

bool NaturalLess(std::string_view a, std::string_view b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (IsDigit(a[i]) && IsDigit(b[j])) {
      size_t ie = i, je = j;
      while (ie < a.size() && IsDigit(a[ie])) ++ie;
      while (je < b.size() && IsDigit(b[je])) ++je;
      // Compare the digit runs as numbers: without leading zeros, the longer one is larger.
      std::string_view x = a.substr(i, ie - i), y = b.substr(j, je - j);
      x.remove_prefix(std::min(x.find_first_not_of('0'), x.size()));
      y.remove_prefix(std::min(y.find_first_not_of('0'), y.size()));
      if (x.size() != y.size()) return x.size() < y.size();
      if (x != y) return x < y;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j || (a.size() - i == b.size() - j && a < b);
}

absl::StatusOr<Group> FormGroup(const GroupShape& shape, const std::vector<Member>& registered, uint64_t epoch) {
  const int tp = shape.tp, pp = shape.pp;
  if (tp < 1 || pp < 1 || tp > kMaxWorkers || pp > kMaxWorkers || tp * pp > kMaxWorkers) {
    return absl::InvalidArgumentError(
        absl::StrCat("TP=", tp, " x PP=", pp, ": a group has 1 to ", kMaxWorkers, " workers"));
  }
  if (epoch < 1) return absl::InvalidArgumentError("group epochs start at 1, got 0");
  if (static_cast<int64_t>(registered.size()) != int64_t{tp} * pp) {
    return absl::InvalidArgumentError(absl::StrCat("TP=", tp, " x PP=", pp, " needs ", tp * pp, " workers, got ",
                                                   registered.size()));
  }
  // Stages: the nodes in natural order; TP ranks: a node's workers in registration order.
  std::map<std::string, std::vector<int>, bool (*)(std::string_view, std::string_view)> by_node(&NaturalLess);
  std::set<int> seen;
  for (size_t k = 0; k < registered.size(); ++k) {
    if (!seen.insert(registered[k].index).second) {
      return absl::InvalidArgumentError(absl::StrCat("worker index ", registered[k].index, " is registered twice"));
    }
    by_node[registered[k].node].push_back(static_cast<int>(k));
  }
  if (static_cast<int>(by_node.size()) != pp) {
    return absl::InvalidArgumentError(absl::StrCat("PP=", pp, " needs ", pp, " nodes, got ", by_node.size()));
  }
  for (const auto& [node, members] : by_node) {
    if (static_cast<int>(members.size()) != tp) {
      return absl::InvalidArgumentError(
          absl::StrCat("TP=", tp, " needs ", tp, " workers on every node; node ", node, " has ", members.size()));
    }
  }

  Group g;
  g.shape = shape;
  g.epoch = epoch;
  g.slots.resize(tp * pp);
  int stage = 0;
  for (const auto& [node, members] : by_node) {
    g.nodes.push_back(node);
    for (int tp_rank = 0; tp_rank < tp; ++tp_rank) {
      Slot& s = g.slots[RankOf(shape, stage, tp_rank)];
      s.stage = stage;
      s.tp_rank = tp_rank;
      s.rank = RankOf(shape, stage, tp_rank);
      s.worker = registered[members[tp_rank]].index;
      s.node = node;
    }
    ++stage;
  }
  NameGroups(&g);
  return g;
}

Group NextEpoch(const Group& g) {
  Group next = g;
  next.epoch = g.epoch + 1;
  NameGroups(&next);
  return next;
}

absl::StatusOr<Group> Replace(const Group& g, int stage, int tp_rank, const Member& replacement) {
  if (stage < 0 || stage >= g.shape.pp || tp_rank < 0 || tp_rank >= g.shape.tp) {
    return absl::InvalidArgumentError(absl::StrCat("slot (stage ", stage, ", tp rank ", tp_rank,
                                                   ") is outside TP=", g.shape.tp, " x PP=", g.shape.pp));
  }
  for (const Slot& s : g.slots) {
    if (s.worker == replacement.index) {
      return absl::InvalidArgumentError(absl::StrCat("worker index ", replacement.index,
                                                     " already holds stage ", s.stage, " tp rank ", s.tp_rank));
    }
  }
  const std::string& node = g.nodes[stage];
  if (replacement.node != node) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", stage, " runs on node ", node,
                                                   "; a replacement from node ", replacement.node,
                                                   " cannot join it"));
  }
  Group next = g;
  next.epoch = g.epoch + 1;
  Slot& s = next.slots[RankOf(g.shape, stage, tp_rank)];
  s.worker = replacement.index;
  NameGroups(&next);
  return next;
}

}  // namespace shardserve
