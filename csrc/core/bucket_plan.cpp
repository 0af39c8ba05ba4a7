#include "bucket_plan.h"

#include <map>
#include <stdexcept>
#include <utility>

namespace pgd::core {

BucketPlan plan_buckets(
    const std::vector<ParamSpec>& params,
    int64_t bucket_cap_bytes,
    int64_t first_bucket_cap_bytes,
    int64_t align_elements) {
  if (bucket_cap_bytes <= 0 || first_bucket_cap_bytes <= 0) {
    throw std::invalid_argument(
        "bucket caps must be positive (got bucket_cap_bytes=" +
        std::to_string(bucket_cap_bytes) + ", first_bucket_cap_bytes=" +
        std::to_string(first_bucket_cap_bytes) + ")");
  }
  if (align_elements <= 0) {
    throw std::invalid_argument("align_elements must be positive (got " +
                                std::to_string(align_elements) + ")");
  }
  BucketPlan plan;
  plan.bucket_of_param.assign(params.size(), -1);
  plan.offset_of_param.assign(params.size(), -1);

  // Open bucket per (dtype, device) group: parameters of other groups may be
  // interleaved without closing it, exactly like DDP's per-type accumulation.
  // Each group has its own first (small) bucket, as in DDP's
  // compute_bucket_assignment_by_size.
  using Group = std::pair<int, int>;
  std::map<Group, int64_t> open;  // group -> index in plan.buckets
  std::map<Group, bool> first_closed;

  auto close = [&](std::map<Group, int64_t>::iterator it) {
    first_closed[it->first] = true;
    open.erase(it);
  };

  for (int64_t i = static_cast<int64_t>(params.size()) - 1; i >= 0; --i) {
    const ParamSpec& p = params[static_cast<size_t>(i)];
    if (p.numel < 0 || p.element_size <= 0) {
      throw std::invalid_argument(
          "parameter " + std::to_string(i) + " has numel=" +
          std::to_string(p.numel) + " element_size=" +
          std::to_string(p.element_size));
    }
    if (!p.requires_grad) {
      continue;
    }
    const auto key = std::make_pair(p.dtype, p.device);
    const int64_t bytes = p.numel * p.element_size;
    if (p.isolated) {
      Bucket b;
      b.dtype = p.dtype;
      b.device = p.device;
      b.isolated = true;
      b.params.push_back(i);
      b.offsets.push_back(0);
      b.numel = p.numel;
      b.bytes = bytes;
      plan.bucket_of_param[static_cast<size_t>(i)] = static_cast<int64_t>(plan.buckets.size());
      plan.offset_of_param[static_cast<size_t>(i)] = 0;
      plan.buckets.push_back(std::move(b));
      continue;
    }
    auto cap_of = [&](const Group& g) {
      return first_closed[g] ? bucket_cap_bytes : first_bucket_cap_bytes;
    };

    auto it = open.find(key);
    if (it != open.end()) {
      const Bucket& b = plan.buckets[static_cast<size_t>(it->second)];
      if (b.bytes > 0 && b.bytes + bytes > cap_of(key)) {
        close(it);
        it = open.end();
      }
    }
    if (it == open.end()) {
      Bucket b;
      b.dtype = p.dtype;
      b.device = p.device;
      plan.buckets.push_back(std::move(b));
      it = open.emplace(key, static_cast<int64_t>(plan.buckets.size()) - 1).first;
    }
    const int64_t bucket_index = it->second;
    Bucket& b = plan.buckets[static_cast<size_t>(bucket_index)];
    const int64_t offset = (b.numel + align_elements - 1) / align_elements * align_elements;
    b.params.push_back(i);
    b.offsets.push_back(offset);
    plan.bucket_of_param[static_cast<size_t>(i)] = bucket_index;
    plan.offset_of_param[static_cast<size_t>(i)] = offset;
    b.numel = offset + p.numel;
    b.bytes += bytes;  // the cap counts the gradients' bytes, as DDP's does, not the padding
    if (b.bytes >= cap_of(key)) {
      close(it);
    }
  }
  return plan;
}

std::string BucketPlan::describe() const {
  // No iostreams in the core: see capture_fingerprint.cpp.
  std::string out;
  for (size_t i = 0; i < buckets.size(); ++i) {
    const Bucket& b = buckets[i];
    out += "bucket " + std::to_string(i) + ": " + std::to_string(b.params.size()) +
        " params, " + std::to_string(b.numel) + " elements, " + std::to_string(b.bytes) +
        " bytes, dtype " + std::to_string(b.dtype) + ", device " +
        std::to_string(b.device) + (b.isolated ? ", isolated" : "") + "\n";
  }
  return out;
}

}  // namespace pgd::core
