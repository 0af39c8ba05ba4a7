// ParamWatch: the per-step checks over a wrapped model's parameters, one call each.
//
// Before every replay the engine asks whether a parameter's storage was
// replaced or its requires_grad changed (graph_cache.drift), and makes every
// trainable .grad its bucket view again (reducer.expose_grads; tier 2's
// backward also asks whether every .grad is None). As Python loops these cost
// ~0.1 us per parameter and check, ~60 us per check at 500 parameter tensors
// (issue 26); here a check is a loop over TensorImpls, without Python objects.
// The tensors are the Python parameters' own (same TensorImpl): `p.data = x`
// and `requires_grad_()` change what these see, as they change what Python sees.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

namespace pgd {

class ParamWatch {
 public:
  // `views[i]`: parameter i's view into its gradient bucket, or none.
  ParamWatch(std::vector<at::Tensor> params, const std::vector<std::optional<at::Tensor>>& views);

  // Data pointer and requires_grad of every parameter, packed (9 bytes each),
  // to be compared as bytes with the state taken at capture.
  std::string state() const;
  // Every trainable parameter's .grad becomes its bucket view where it is not
  // already (frozen parameters' are left alone). Returns how many were set.
  int64_t expose_grads() const;
  // Whether no parameter has a .grad.
  bool all_grads_none() const;
  // Indices of the trainable parameters whose .grad is not their bucket view
  // (empty in the steady state of a tier-2 accumulation).
  std::vector<int64_t> not_views() const;
  // Every parameter's .grad set to None, as Optimizer.zero_grad(set_to_none=True)
  // does for these parameters, without its per-parameter Python loop and
  // profiler range. Returns how many were set.
  int64_t clear_grads() const;
  size_t size() const { return params_.size(); }

 private:
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> views_;  // undefined where a parameter has none
};

void bind_param_watch(pybind11::module_& m);

}  // namespace pgd
