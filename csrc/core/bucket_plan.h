// Gradient bucket planning: which parameters share one all-reduce.
//
// Torch-free on purpose: the engine describes parameters by size, dtype code and
// device code, and gets back an assignment it can turn into flat buffers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pgd::core {

// One parameter as the planner sees it. `dtype` and `device` are opaque codes
// (the Python side passes at::ScalarType and a device index); parameters with
// different codes never share a bucket because one collective moves one dtype
// on one device.
struct ParamSpec {
  int64_t numel = 0;
  int64_t element_size = 0;  // bytes per element
  int dtype = 0;
  int device = 0;
  bool requires_grad = true;
  // Reduced on its own, never sharing a bucket: sparse gradients (DDP's
  // expect_sparse_gradient) and parameters reduced outside the graph, so that
  // a bucket leaving the graph takes no other parameter with it.
  bool isolated = false;
};

struct Bucket {
  std::vector<int64_t> params;   // indices into the ParamSpec list, in ready order
  std::vector<int64_t> offsets;  // element offset of each param inside the flat buffer
  int64_t numel = 0;  // the flat buffer's elements, padding between slots included
  int64_t bytes = 0;  // the parameters' bytes (what the cap counts), padding not included
  int dtype = 0;
  int device = 0;
  bool isolated = false;  // holds exactly one ParamSpec with isolated = true
};

struct BucketPlan {
  std::vector<Bucket> buckets;
  // For every ParamSpec: its bucket index and element offset, or -1 when the
  // parameter does not require grad (it never produces a gradient to reduce).
  std::vector<int64_t> bucket_of_param;
  std::vector<int64_t> offset_of_param;

  // Human-readable one-line-per-bucket description for reports.
  std::string describe() const;
};

// Assign parameters to buckets the way DDP does before its first rebuild:
// walk parameters in reverse registration order (gradients of the last layers
// are ready first in backward), keep dtype/device groups apart, and close a
// bucket once adding the next parameter would exceed the cap. The first bucket
// uses `first_bucket_cap_bytes` (DDP: 1 MiB) so the first all-reduce starts
// early in backward. A parameter larger than the cap gets a bucket of its own.
// An isolated parameter gets a bucket of its own where it is met in that walk
// and leaves its group's open bucket open (DDP does the same for sparse ones).
// Each parameter's offset in its bucket is a multiple of `align_elements`
// (the padding between slots stays zero): a gradient view at an offset of,
// say, 10 floats is not 16-byte aligned, and torch's multi_tensor_apply
// kernels (fused AdamW, foreach copies) then take their unvectorised path for
// that tensor. 16 elements keep every view 16-byte aligned for any dtype, a
// bf16 send buffer's views included. DDP packs without padding. (At 3+ ranks
// a ring all-reduce sums in an order that follows element positions, so the
// padding can move a reduced gradient by 1 ulp against a packed layout.)
// Throws std::invalid_argument for non-positive caps or alignment, or negative sizes.
inline constexpr int64_t kBucketAlignElements = 16;
BucketPlan plan_buckets(
    const std::vector<ParamSpec>& params,
    int64_t bucket_cap_bytes,
    int64_t first_bucket_cap_bytes,
    int64_t align_elements = kBucketAlignElements);

}  // namespace pgd::core
