#include "terminate_report.h"

#include <execinfo.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>

namespace pgd {

namespace {

std::terminate_handler previous_handler = nullptr;

[[noreturn]] void report_then_terminate() {
  char name[32] = "?";
  pthread_getname_np(pthread_self(), name, sizeof(name));
  const bool active = std::current_exception() != nullptr;
  // Async-signal-safe enough: dprintf and backtrace_symbols_fd write to the fd
  // directly, without stdio buffers another thread may hold.
  dprintf(STDERR_FILENO,
          "[pygraph_dist] std::terminate in thread '%s' (tid %ld), %s an active exception; "
          "native stack:\n",
          name, static_cast<long>(syscall(SYS_gettid)), active ? "with" : "without");
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  if (previous_handler != nullptr) {
    previous_handler();
  }
  std::abort();
}

}  // namespace

void install_terminate_report() {
  static std::once_flag once;
  std::call_once(once, [] { previous_handler = std::set_terminate(report_then_terminate); });
}

}  // namespace pgd
