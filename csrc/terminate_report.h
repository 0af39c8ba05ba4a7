// A report for std::terminate: which thread, with or without an exception,
// and its native stack, before the default handler prints its line and aborts.
//
// "terminate called without an active exception" after Python has finished
// (issue 13, item 4) says neither where nor in which thread. The usual causes
// are a joinable std::thread destroyed, or a thread ended by CPython while it
// waits for the GIL during finalization (PyThread_exit_thread unwinds it
// through a noexcept destructor). The thread's name (Gloo's pt_gloo_runloop,
// the store's pt_tcpstore_uv, the replay watchdog's pgd_wd_*) and stack tell which.
#pragma once

namespace pgd {

// Installs the report in front of the current terminate handler (once; the
// previous handler still runs, so the process aborts exactly as before).
void install_terminate_report();

}  // namespace pgd
