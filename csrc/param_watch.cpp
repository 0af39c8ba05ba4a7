#include "param_watch.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>

namespace pgd {

ParamWatch::ParamWatch(std::vector<at::Tensor> params,
                       const std::vector<std::optional<at::Tensor>>& views)
    : params_(std::move(params)) {
  TORCH_CHECK(views.size() == params_.size(), "ParamWatch: ", params_.size(), " parameters but ",
              views.size(), " views");
  views_.reserve(views.size());
  for (const auto& v : views) {
    views_.push_back(v.has_value() ? *v : at::Tensor());
  }
}

std::string ParamWatch::state() const {
  std::string out(params_.size() * 9, '\0');
  char* w = out.data();
  for (const auto& p : params_) {
    // data_ptr() as Python's Tensor.data_ptr() (it throws where that throws).
    const auto ptr = reinterpret_cast<std::uintptr_t>(p.data_ptr());
    std::memcpy(w, &ptr, sizeof(ptr));
    w[8] = p.requires_grad() ? 1 : 0;
    w += 9;
  }
  return out;
}

int64_t ParamWatch::expose_grads() const {
  int64_t set = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& v = views_[i];
    if (!v.defined() || !params_[i].requires_grad()) {
      continue;
    }
    // mutable_grad() is the setter Python's `p.grad = v` ends in
    // (THPVariable_set_grad); the views match their parameters' dtype, device
    // and shape by construction (reducer._bucket_view), which it checks.
    auto& grad = params_[i].mutable_grad();
    if (!grad.is_same(v)) {
      grad = v;
      ++set;
    }
  }
  return set;
}

bool ParamWatch::all_grads_none() const {
  for (const auto& p : params_) {
    if (p.grad().defined()) {
      return false;
    }
  }
  return true;
}

std::vector<int64_t> ParamWatch::not_views() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    // As Python's `p.requires_grad and p.grad is not view` (None is not None: equal).
    if (params_[i].requires_grad() && !params_[i].grad().is_same(views_[i])) {
      out.push_back(static_cast<int64_t>(i));
    }
  }
  return out;
}

int64_t ParamWatch::clear_grads() const {
  int64_t cleared = 0;
  for (const auto& p : params_) {
    auto& grad = const_cast<at::Tensor&>(p).mutable_grad();
    if (grad.defined()) {
      grad = at::Tensor();
      ++cleared;
    }
  }
  return cleared;
}

void bind_param_watch(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<ParamWatch, std::shared_ptr<ParamWatch>>(
      m, "ParamWatch",
      "The engine's per-step checks over the parameters, in C++ (csrc/param_watch.h).")
      .def(py::init<std::vector<at::Tensor>, const std::vector<std::optional<at::Tensor>>&>(),
           py::arg("params"), py::arg("views"))
      .def("state", [](const ParamWatch& w) { return py::bytes(w.state()); },
           "Data pointer and requires_grad of every parameter, packed: compare as bytes.")
      .def("expose_grads", &ParamWatch::expose_grads,
           "Every trainable parameter's .grad becomes its bucket view; returns how many changed.")
      .def("all_grads_none", &ParamWatch::all_grads_none, "Whether no parameter has a .grad.")
      .def("not_views", &ParamWatch::not_views,
           "Indices of the trainable parameters whose .grad is not their bucket view.")
      .def("clear_grads", &ParamWatch::clear_grads,
           "Every parameter's .grad set to None (zero_grad(set_to_none=True)); returns how many.")
      .def("__len__", &ParamWatch::size);
}

}  // namespace pgd
