#include "input_guard.h"

#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace pgd {

namespace py = pybind11;

InputGuard::InputGuard(py::object tmpl, std::vector<at::Tensor> statics)
    : tmpl_(std::move(tmpl)), statics_(std::move(statics)) {}

bool InputGuard::match(const py::handle& args, const py::handle& kwargs) {
  pending_.clear();
  // The template is the (args, kwargs) pair, as the call's pytree is.
  PyObject* t = tmpl_.ptr();
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
    return false;
  }
  bool ok = false;
  try {
    ok = walk(args, PyTuple_GET_ITEM(t, 0)) && walk(kwargs, PyTuple_GET_ITEM(t, 1));
  } catch (const std::exception&) {  // e.g. sizes() of a tensor without dense sizes: the long path decides
    ok = false;
  }
  if (!ok) {
    pending_.clear();
  }
  return ok;
}

namespace {
PyTypeObject* slot_type = nullptr;  // TensorSlot's Python type, set by bind_input_guard
}  // namespace

bool InputGuard::walk(const py::handle& obj, const py::handle& tmpl) {
  PyObject* o = obj.ptr();
  PyObject* t = tmpl.ptr();
  if (Py_TYPE(t) == slot_type) {
    const auto& slot = tmpl.cast<const TensorSlot&>();
    if (slot.index < 0) {  // an ignored argument: any int or float (IgnoredArgs.mask)
      return (PyLong_Check(o) || PyFloat_Check(o)) && !PyBool_Check(o);
    }
    if (!THPVariable_Check(o)) {
      return false;
    }
    const at::Tensor& x = THPVariable_Unpack(o);
    if (x.is_nested() || x.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      return false;
    }
    if (x.scalar_type() != slot.dtype || x.device().type() != slot.device_type ||
        x.requires_grad() != slot.requires_grad || x.sizes() != c10::IntArrayRef(slot.sizes)) {
      return false;
    }
    pending_.emplace_back(slot.index, x);
    return true;
  }
  if (Py_TYPE(o) != Py_TYPE(t)) {  // exact type: a namedtuple is not a tuple, 1 is not 1.0
    return false;
  }
  if (PyTuple_Check(t)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(t);
    if (PyTuple_GET_SIZE(o) != n) {
      return false;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!walk(PyTuple_GET_ITEM(o, i), PyTuple_GET_ITEM(t, i))) {
        return false;
      }
    }
    return true;
  }
  if (PyList_Check(t)) {
    const Py_ssize_t n = PyList_GET_SIZE(t);
    if (PyList_GET_SIZE(o) != n) {
      return false;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      // A value's __eq__ (user code) may change the call's list: re-check its
      // size, and hold the item while it is walked.
      if (PyList_GET_SIZE(o) != n) {
        return false;
      }
      const py::object item = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(o, i));
      if (!walk(item, PyList_GET_ITEM(t, i))) {
        return false;
      }
    }
    return true;
  }
  if (PyDict_Check(t)) {
    // The keys in the same order (pytree's spec keeps the order: {a, b} and
    // {b, a} are different signatures, and a forward may iterate the dict).
    if (PyDict_Size(o) != PyDict_Size(t)) {
      return false;
    }
    PyObject *tkey = nullptr, *tvalue = nullptr, *okey = nullptr, *ovalue = nullptr;
    Py_ssize_t tpos = 0, opos = 0;
    while (PyDict_Next(t, &tpos, &tkey, &tvalue)) {
      if (PyDict_Size(o) != PyDict_Size(t) || !PyDict_Next(o, &opos, &okey, &ovalue)) {
        return false;
      }
      // Held while compared and walked: a user's __eq__ may change the call's dict.
      const py::object okey_ref = py::reinterpret_borrow<py::object>(okey);
      const py::object ovalue_ref = py::reinterpret_borrow<py::object>(ovalue);
      if (okey != tkey) {  // interned keyword names are the same object
        if (Py_TYPE(okey) != Py_TYPE(tkey)) {
          return false;
        }
        const int same = PyObject_RichCompareBool(okey, tkey, Py_EQ);
        if (same != 1) {
          PyErr_Clear();
          return false;
        }
      }
      if (!walk(ovalue_ref, tvalue)) {
        return false;
      }
    }
    return true;
  }
  // A Python value the graph was captured with: the same type (checked above),
  // and equal as a dict lookup finds it: the same hash, then ==.
  if (o == t) {
    return true;
  }
  const Py_hash_t ho = PyObject_Hash(o);
  const Py_hash_t ht = PyObject_Hash(t);
  if (ho == -1 || ht == -1 || ho != ht) {
    PyErr_Clear();
    return false;
  }
  const int eq = PyObject_RichCompareBool(o, t, Py_EQ);
  if (eq < 0) {
    PyErr_Clear();
    return false;
  }
  return eq == 1;
}

void InputGuard::discard() { pending_.clear(); }

void InputGuard::copy_pending() {
  for (auto& [i, x] : pending_) {
    at::Tensor& s = statics_[static_cast<size_t>(i)];
    if (!s.is_same(x)) {
      s.copy_(x, /*non_blocking=*/true);
    }
  }
  pending_.clear();
}

void bind_input_guard(py::module_& m) {
  auto slot_class = py::class_<TensorSlot>(
      m, "TensorSlot", "A tensor leaf of a captured call in an InputGuard template.");
  slot_type = reinterpret_cast<PyTypeObject*>(slot_class.ptr());
  slot_class
      .def(py::init([](int64_t index, std::vector<int64_t> sizes, const py::object& dtype,
                       const std::string& device_type, bool requires_grad) {
             TORCH_CHECK(THPDtype_Check(dtype.ptr()), "TensorSlot: dtype must be a torch.dtype");
             TensorSlot s;
             s.index = index;
             s.sizes = std::move(sizes);
             s.dtype = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
             s.device_type = c10::Device(device_type).type();
             s.requires_grad = requires_grad;
             return s;
           }),
           py::arg("index"), py::arg("sizes"), py::arg("dtype"), py::arg("device_type"),
           py::arg("requires_grad"))
      .def_readonly("index", &TensorSlot::index);
  py::class_<InputGuard, std::shared_ptr<InputGuard>>(
      m, "InputGuard", "The steady-state signature check and input copy (csrc/input_guard.h).")
      .def(py::init<py::object, std::vector<at::Tensor>>(), py::arg("template"),
           py::arg("statics"))
      .def("match", &InputGuard::match, py::arg("args"), py::arg("kwargs"),
           "Whether the call matches the captured one (copies nothing).")
      .def("discard", &InputGuard::discard, "Forget the matched call's tensors (not replayed).")
      .def("copy_pending", &InputGuard::copy_pending,
           "Copy the matched call's tensors into the static inputs.")
      .def("__len__", &InputGuard::slots);
}

}  // namespace pgd
