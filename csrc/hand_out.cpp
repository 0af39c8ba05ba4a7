#include "hand_out.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#ifdef PGD_WITH_CUDA
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

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

// The copy itself, as clone(format) makes it: for a plain CUDA tensor whose
// elements fill one span of memory, an allocation from the caching allocator
// and one cudaMemcpyAsync of that span on the current stream, without the
// dispatcher and TensorIterator that clone() goes through (session 37: no
// host gain measurable on the shared H100 host; the same bytes either way).
// clone(Contiguous) of a contiguous tensor has row-major strides, and
// clone(Preserve) of a non-overlapping, dense one has its source's strides
// (channels_last, transposed, size-1 dimensions included), so both are kept;
// anything else (sparse, conj/neg bits, no storage) is clone().
at::Tensor copy_of(const at::Tensor& t, at::MemoryFormat format) {
#ifdef PGD_WITH_CUDA
  const bool plain = t.is_cuda() && t.layout() == at::kStrided && t.has_storage() && !t._is_zerotensor() &&
                     !t.is_conj() && !t.is_neg();
  const bool preserve = format == at::MemoryFormat::Preserve;
  if (plain && (preserve ? t.is_non_overlapping_and_dense() : t.is_contiguous())) {
    const c10::cuda::CUDAGuard guard(t.device());
    at::Tensor out = preserve ? at::detail::empty_strided_cuda(t.sizes(), t.strides(), t.scalar_type(), t.device())
                              : at::detail::empty_cuda(t.sizes(), t.scalar_type(), t.device(), std::nullopt);
    // Dense and non-overlapping, with strides >= 0: the elements are the
    // numel() slots from the first one, in both tensors alike.
    const size_t nbytes = t.numel() * t.element_size();
    if (nbytes > 0) {
      C10_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), t.const_data_ptr(), nbytes, cudaMemcpyDeviceToDevice,
                                     c10::cuda::getCurrentCUDAStream(t.device().index()).stream()));
    }
    return out;
  }
#endif
  return t.detach().clone(format);
}

at::Tensor hand_out_loss(const at::Tensor& loss) {
  at::Tensor out = copy_of(loss, at::MemoryFormat::Contiguous);
  NodePtr node = make_node<GraphedLossBackward>();
  node->add_input_metadata(out);
  torch::autograd::impl::set_gradient_edge(out, torch::autograd::Edge(std::move(node), 0));
  return out;
}

void bind_hand_out(pybind11::module_& m) {
  m.def("hand_out_loss", &hand_out_loss, pybind11::arg("loss"),
        "A fresh copy of the loss, requiring grad, not a leaf, with nothing behind its grad_fn.");
  m.def(
      "fresh_copy", [](const at::Tensor& t) { return copy_of(t, at::MemoryFormat::Preserve); },
      pybind11::arg("tensor"),
      "tensor.detach().clone(), strides included, made with one cudaMemcpyAsync for a dense CUDA "
      "tensor (tier 2's outputs at each forward replay).");
}

}  // namespace pgd
