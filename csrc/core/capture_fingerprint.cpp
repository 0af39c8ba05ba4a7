#include "capture_fingerprint.h"

#include <algorithm>
#include <string>

namespace pgd::core {

const char* collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return "allreduce";
    case CollectiveKind::kAllReduceCoalesced: return "allreduce_coalesced";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kReduce: return "reduce";
    case CollectiveKind::kAllGather: return "allgather";
    case CollectiveKind::kAllGatherBase: return "allgather_into_tensor";
    case CollectiveKind::kAllGatherCoalesced: return "allgather_coalesced";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kReduceScatterBase: return "reduce_scatter_tensor";
    case CollectiveKind::kReduceScatterCoalesced: return "reduce_scatter_coalesced";
    case CollectiveKind::kAllToAll: return "alltoall";
    case CollectiveKind::kAllToAllBase: return "alltoall_base";
    case CollectiveKind::kGather: return "gather";
    case CollectiveKind::kScatter: return "scatter";
    case CollectiveKind::kSend: return "send";
    case CollectiveKind::kRecv: return "recv";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kAllReduceSparse: return "allreduce_sparse";
  }
  return "unknown";
}

// Strings are built without iostreams on purpose: inside a process that has
// loaded torch's CUDA libraries, an std::ostringstream constructed in this
// library crashed (SIGSEGV on the GPU machine, torch 2.11+cu130, g++ 13),
// while plain std::string building is safe everywhere.
std::string CollectiveRecord::describe() const {
  std::string out = collective_kind_name(kind);
  if (!dtype_name.empty()) {
    out += " " + dtype_name;
  } else if (dtype >= 0) {
    out += " dtype" + std::to_string(dtype);
  }
  out += " x" + std::to_string(numel);
  if (reduce_op >= 0) {
    out += " (op " + std::to_string(reduce_op) + ")";
  }
  if (root >= 0) {
    out += " (root " + std::to_string(root) + ")";
  }
  return out;
}

bool CollectiveRecord::operator==(const CollectiveRecord& other) const {
  return kind == other.kind && dtype == other.dtype && numel == other.numel &&
      reduce_op == other.reduce_op && root == other.root;
}

void CaptureFingerprint::mix(uint64_t value) {
  // FNV-1a over the 8 bytes of `value`, little end first.
  for (int i = 0; i < 8; ++i) {
    digest_ ^= (value >> (8 * i)) & 0xffU;
    digest_ *= kFnvPrime;
  }
}

void CaptureFingerprint::record(const CollectiveRecord& rec) {
  records_.push_back(rec);
  mix(static_cast<uint64_t>(rec.kind));
  mix(static_cast<uint64_t>(static_cast<int64_t>(rec.dtype)));
  mix(static_cast<uint64_t>(rec.numel));
  mix(static_cast<uint64_t>(static_cast<int64_t>(rec.reduce_op)));
  mix(static_cast<uint64_t>(rec.root));
}

void CaptureFingerprint::clear() {
  records_.clear();
  digest_ = kFnvOffset;
}

std::optional<size_t> CaptureFingerprint::first_difference(
    const CaptureFingerprint& a,
    const CaptureFingerprint& b) {
  const size_t n = std::min(a.records_.size(), b.records_.size());
  for (size_t i = 0; i < n; ++i) {
    if (!(a.records_[i] == b.records_[i])) {
      return i;
    }
  }
  if (a.records_.size() != b.records_.size()) {
    return n;
  }
  return std::nullopt;
}

std::string CaptureFingerprint::describe(size_t max_records) const {
  std::string out = std::to_string(records_.size()) +
      (records_.size() == 1 ? " collective" : " collectives");
  const size_t shown = std::min(max_records, records_.size());
  for (size_t i = 0; i < shown; ++i) {
    out += (i == 0 ? ": " : ", ") + records_[i].describe();
  }
  if (shown < records_.size()) {
    out += ", ... (" + std::to_string(records_.size() - shown) + " more)";
  }
  return out;
}

}  // namespace pgd::core
