// The fingerprint of a captured collective sequence.
//
// NCCL treats "this launch is graph-captured" as a collective property: every
// rank must capture the same collectives in the same order, or replaying the
// graphs deadlocks or mixes buffers. The engine therefore records each
// collective issued during capture and all-reduces a digest of the sequence
// before the first replay. Order matters, so the digest is a running hash, not
// a sum.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pgd::core {

enum class CollectiveKind : uint8_t {
  kAllReduce = 1,
  kAllReduceCoalesced,
  kBroadcast,
  kReduce,
  kAllGather,
  kAllGatherBase,
  kAllGatherCoalesced,
  kReduceScatter,
  kReduceScatterBase,
  kReduceScatterCoalesced,
  kAllToAll,
  kAllToAllBase,
  kGather,
  kScatter,
  kSend,
  kRecv,
  kBarrier,
  kAllReduceSparse,
};

const char* collective_kind_name(CollectiveKind kind);

// One collective as it was issued: enough to tell two ranks' sequences apart,
// nothing that legitimately differs between ranks (pointers, rank ids).
struct CollectiveRecord {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  int dtype = -1;          // opaque dtype code (at::ScalarType on the torch side)
  std::string dtype_name;  // for messages only; not part of the digest
  int64_t numel = 0;       // elements moved by this rank (sum over tensors)
  int reduce_op = -1;      // opaque reduce-op code, -1 where none applies
  int64_t root = -1;       // root / peer rank where the op has one, else -1

  std::string describe() const;
  bool operator==(const CollectiveRecord& other) const;
};

class CaptureFingerprint {
 public:
  void record(const CollectiveRecord& rec);
  void clear();

  // Order-sensitive 64-bit FNV-1a digest of every record so far, masked to 62
  // bits so that it survives a negation in an int64 MIN/MAX all-reduce.
  uint64_t digest() const { return digest_ & kDigestMask; }
  size_t size() const { return records_.size(); }
  bool empty() const { return records_.empty(); }
  const std::vector<CollectiveRecord>& records() const { return records_; }

  // Index of the first record where the two sequences differ (a missing record
  // counts as a difference), or nullopt if they are identical.
  static std::optional<size_t> first_difference(
      const CaptureFingerprint& a,
      const CaptureFingerprint& b);

  // "3 collectives: allreduce float32 x1048576 (sum), ..." (truncated).
  std::string describe(size_t max_records = 8) const;

  static constexpr uint64_t kDigestMask = (uint64_t{1} << 62) - 1;

 private:
  void mix(uint64_t value);

  std::vector<CollectiveRecord> records_;
  uint64_t digest_ = kFnvOffset;

  static constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
  static constexpr uint64_t kFnvPrime = 0x100000001b3ULL;
};

}  // namespace pgd::core
