// InputGuard: the steady-state test "is this model call the one the graph was
// captured for?", and the copy of its tensors into the graph's static inputs.
//
// The engine keys graphs by the call's pytree structure, each tensor's shape,
// dtype, device type and requires_grad, and each other leaf's type and value
// (graph_cache.lookup). Building that key in Python (tree_flatten, a tuple per
// leaf, hashing the TreeSpec) cost ~30 us per call (issue 26). Once a graph
// replays, the engine keeps a guard for it: a template of the call -- the
// same tuples, lists and dicts, with a TensorSlot where a tensor was (index
// -1: an argument left out by wrap(ignore_args=...)), and the value itself
// elsewhere -- walked here against the next call without building anything.
// A call that matches is the same key; one that does not takes the slow path.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace pgd {

// Where a tensor leaf of the captured call was: which static input it goes to,
// and the parts of its key. Index -1: an ignored argument (any int or float).
struct TensorSlot {
  int64_t index = 0;
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  c10::DeviceType device_type = c10::DeviceType::CPU;
  bool requires_grad = false;
};

class InputGuard {
 public:
  // `statics[i]`: the static input of tensor slot i.
  InputGuard(pybind11::object tmpl, std::vector<at::Tensor> statics);
  // Whether (args, kwargs) matches the template; on a match, remembers which
  // tensors to copy (copy_pending()). Nothing is copied here.
  bool match(const pybind11::handle& args, const pybind11::handle& kwargs);
  // Copies the matched call's tensors into the static inputs (non-blocking;
  // a tensor that already is its static input is not copied), then forgets them.
  void copy_pending();
  // Forgets the matched call's tensors (the call did not replay after all).
  void discard();
  size_t slots() const { return statics_.size(); }

 private:
  bool walk(const pybind11::handle& obj, const pybind11::handle& tmpl);
  pybind11::object tmpl_;
  std::vector<at::Tensor> statics_;
  std::vector<std::pair<int64_t, at::Tensor>> pending_;
};

void bind_input_guard(pybind11::module_& m);

}  // namespace pgd
