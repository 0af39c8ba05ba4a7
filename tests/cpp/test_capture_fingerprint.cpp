#include <gtest/gtest.h>

#include "capture_fingerprint.h"

using pgd::core::CaptureFingerprint;
using pgd::core::CollectiveKind;
using pgd::core::CollectiveRecord;

namespace {

CollectiveRecord allreduce(int64_t numel, int dtype = 6, int op = 0) {
  CollectiveRecord r;
  r.kind = CollectiveKind::kAllReduce;
  r.dtype = dtype;
  r.dtype_name = dtype == 6 ? "float32" : "bfloat16";
  r.numel = numel;
  r.reduce_op = op;
  return r;
}

}  // namespace

TEST(CaptureFingerprint, SameSequenceSameDigest) {
  CaptureFingerprint a, b;
  for (int64_t n : {1024, 4096, 7}) {
    a.record(allreduce(n));
    b.record(allreduce(n));
  }
  EXPECT_EQ(a.digest(), b.digest());
  EXPECT_FALSE(CaptureFingerprint::first_difference(a, b).has_value());
}

TEST(CaptureFingerprint, OrderMatters) {
  CaptureFingerprint a, b;
  a.record(allreduce(1024));
  a.record(allreduce(4096));
  b.record(allreduce(4096));
  b.record(allreduce(1024));
  EXPECT_NE(a.digest(), b.digest());
  EXPECT_EQ(CaptureFingerprint::first_difference(a, b), 0u);
}

TEST(CaptureFingerprint, EachFieldMatters) {
  CaptureFingerprint base;
  base.record(allreduce(1024, 6, 0));
  const auto d = base.digest();

  CaptureFingerprint dtype, numel, op, kind, root;
  dtype.record(allreduce(1024, 15, 0));
  numel.record(allreduce(1025, 6, 0));
  op.record(allreduce(1024, 6, 2));
  auto k = allreduce(1024);
  k.kind = CollectiveKind::kBroadcast;
  kind.record(k);
  auto r = allreduce(1024);
  r.root = 1;
  root.record(r);
  for (const auto* fp : {&dtype, &numel, &op, &kind, &root}) {
    EXPECT_NE(fp->digest(), d);
  }
}

TEST(CaptureFingerprint, DtypeNameIsNotPartOfTheDigest) {
  CaptureFingerprint a, b;
  auto r = allreduce(8);
  a.record(r);
  r.dtype_name = "something else";
  b.record(r);
  EXPECT_EQ(a.digest(), b.digest());
}

TEST(CaptureFingerprint, MissingTailIsADifference) {
  CaptureFingerprint a, b;
  a.record(allreduce(1));
  a.record(allreduce(2));
  b.record(allreduce(1));
  EXPECT_EQ(CaptureFingerprint::first_difference(a, b), 1u);
  EXPECT_NE(a.digest(), b.digest());
}

TEST(CaptureFingerprint, DigestFitsInt64Negation) {
  CaptureFingerprint a;
  for (int i = 0; i < 100; ++i) {
    a.record(allreduce(i * 977 + 3));
    EXPECT_LE(a.digest(), CaptureFingerprint::kDigestMask);
  }
}

TEST(CaptureFingerprint, ClearResets) {
  CaptureFingerprint a, empty;
  a.record(allreduce(5));
  a.clear();
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(a.digest(), empty.digest());
}

TEST(CaptureFingerprint, DescribeIsReadable) {
  CaptureFingerprint a;
  for (int i = 0; i < 10; ++i) {
    a.record(allreduce(100 + i));
  }
  const std::string s = a.describe(2);
  EXPECT_NE(s.find("10 collectives"), std::string::npos) << s;
  EXPECT_NE(s.find("allreduce float32 x100"), std::string::npos) << s;
  EXPECT_NE(s.find("8 more"), std::string::npos) << s;
}
