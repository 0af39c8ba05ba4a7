// The loss a tier-1 replay hands to the user's loop, made in one call.
#pragma once

#include <torch/extension.h>

namespace pgd {

// A fresh copy of `loss` (the graph's static loss is overwritten by the next
// replay) that requires grad and is not a leaf: its grad_fn is a node with no
// inputs, so `loss *= 1` (transformers' compute_loss) is allowed, as on any
// interior tensor, and a backward() through it reaches nothing. One copy
// kernel; the Python spelling (detach().clone().requires_grad_().clone()) took
// two copies and four dispatches, ~20 us of host time per step (issue 26).
at::Tensor hand_out_loss(const at::Tensor& loss);

// t.detach().clone(format), made for a plain dense CUDA tensor with an
// allocation and one cudaMemcpyAsync on the current stream (no dispatcher, no
// TensorIterator): the same values, dtype, shape and strides.
at::Tensor copy_of(const at::Tensor& t, at::MemoryFormat format);

void bind_hand_out(pybind11::module_& m);

}  // namespace pgd
