#include "hand_out.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <string>
#include <type_traits>

namespace pgd {

namespace {

// The grad_fn of a handed-out loss: the graph already ran the backward, so
// there is nothing behind it.
struct GraphedLossBackward : public torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*grads*/) override {
    return {};
  }
  std::string name() const override { return "GraphedLossBackward"; }
};

// torch's Node pointer: std::shared_ptr up to some 2.1x, c10::intrusive_ptr after.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename N>
NodePtr make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<N>();
  } else {
    return c10::make_intrusive<N>();
  }
}

}  // namespace

at::Tensor hand_out_loss(const at::Tensor& loss) {
  at::Tensor out = loss.detach().clone(at::MemoryFormat::Contiguous);
  NodePtr node = make_node<GraphedLossBackward>();
  node->add_input_metadata(out);
  torch::autograd::impl::set_gradient_edge(out, torch::autograd::Edge(std::move(node), 0));
  return out;
}

void bind_hand_out(pybind11::module_& m) {
  m.def("hand_out_loss", &hand_out_loss, pybind11::arg("loss"),
        "A fresh copy of the loss, requiring grad, not a leaf, with nothing behind its grad_fn.");
}

}  // namespace pgd
