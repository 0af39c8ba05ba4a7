#include "python_free.h"

namespace pgd {

// Each call goes through the ProcessGroup's own method, as torch.distributed's
// Python functions do (group.allreduce([t], opts) and so on): the c10d
// dispatcher op, then the backend serving the tensors' device
// (torch/csrc/distributed/c10d/Ops.cpp). What differs is only what the Work
// can capture. PythonFreeArgs puts the caller's tensors back into the vectors
// when it goes out of scope, after the call returned its Work.

c10::intrusive_ptr<c10d::Work> python_free_allreduce(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  PythonTlsObjectsHidden hidden;
  PythonFreeArgs python_free;
  python_free(tensors);
  return pg->allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> python_free_broadcast(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  PythonTlsObjectsHidden hidden;
  PythonFreeArgs python_free;
  python_free(tensors);
  return pg->broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> python_free_allgather(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  PythonTlsObjectsHidden hidden;
  PythonFreeArgs python_free;
  python_free(outputs)(inputs);
  return pg->allgather(outputs, inputs, opts);
}

}  // namespace pgd
