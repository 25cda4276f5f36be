// isolate.h: the tail of runtime.cpp (one translation unit): a launch run in a forked child, so that a crash
// or a hang of the kernel becomes an error message, and the bfloat16 conversion some compilers' runtimes lack.
// Uses runtime.cpp's internals (g_rt, current, where, set_errorf, rl_run); included at its end.

namespace {

// The forked child reports crashes (out-of-bounds access, stack overflow) through this handler.
void on_fatal_signal(int sig, siginfo_t* si, void*) {
  if (g_rt && g_rt->args) {
    char buf[256] = "outside the kernel";
    const char* hint = "out-of-bounds memory access?";
    if (g_rt->fibers && g_rt->cur >= 0) {
      const Fiber& f = current();
      where(f, buf, sizeof buf);
      char* addr = (char*)si->si_addr;
      if (addr >= f.stack - 65536 && addr < f.stack + 4096)
        hint = "fiber stack overflow? raise ROOFLINE_INTERPRET_STACK_KB";
    }
    if (sig == SIGFPE) hint = "integer division by zero? (a trap on the CPU, undefined on Metal)";
    g_rt->failed = 0;
    set_errorf("crashed with signal %d (%s) at address %p in thread (%s): %s", sig,
               sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : sig == SIGFPE ? "SIGFPE" : "fatal",
               si->si_addr, buf, hint);
  }
  _exit(3);
}

void install_crash_handlers() {
  static char altstack[1 << 16];
  stack_t ss;
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  ss.ss_flags = 0;
  sigaltstack(&ss, nullptr);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  int sigs[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
  for (int s : sigs) sigaction(s, &sa, nullptr);
}

}  // namespace

extern "C" {

// Runs the launch in a forked child so that a crash or a hang becomes an error message. Outputs
// must live in MAP_SHARED memory (kernel.py allocates them so).
int rl_run_isolated(rl_launch_args* args, rl_entry_fn entry, double timeout_s) {
  size_t n = args->err_len > 0 ? (size_t)args->err_len : 1;
  char* shared_err = (char*)mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared_err == MAP_FAILED) return rl_run(args, entry);
  shared_err[0] = 0;
  char* parent_err = args->err;
  int64_t tg = 1;
  for (int d = 0; d < 3; ++d)
    tg *= args->threadgroup[d] < args->grid[d] ? args->threadgroup[d] : (args->grid[d] > 0 ? args->grid[d] : 1);
  if (tg > 0 && tg <= RL_MAX_THREADS) ensure_stacks((int)tg, (size_t)args->stack_size);
  pid_t pid = fork();
  if (pid < 0) {
    munmap(shared_err, n);
    return rl_run(args, entry);
  }
  if (pid == 0) {
    args->err = shared_err;
    install_crash_handlers();
    int rc = rl_run(args, entry);
    _exit(rc == 0 ? 0 : 1);
  }
  int status = 0;
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  long sleep_ns = 20000;
  int rc;
  for (;;) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) {
      snprintf(parent_err, n, "waitpid failed (errno %d)", errno);
      munmap(shared_err, n);
      return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &now);
    double elapsed = (double)(now.tv_sec - start.tv_sec) + 1e-9 * (double)(now.tv_nsec - start.tv_nsec);
    if (timeout_s > 0 && elapsed > timeout_s) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      snprintf(parent_err, n,
               "timed out after %.0f s (an endless loop? raise ROOFLINE_INTERPRET_TIMEOUT)", timeout_s);
      munmap(shared_err, n);
      return 1;
    }
    struct timespec ts = {0, sleep_ns};
    nanosleep(&ts, nullptr);
    if (sleep_ns < 5000000) sleep_ns *= 2;
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    rc = 0;
  } else {
    rc = 1;
    if (shared_err[0]) {
      memcpy(parent_err, shared_err, n);
      parent_err[n - 1] = 0;
    } else if (WIFSIGNALED(status)) {
      snprintf(parent_err, n, "the kernel process died with signal %d", WTERMSIG(status));
    } else {
      snprintf(parent_err, n, "the kernel process exited with status %d", WEXITSTATUS(status));
    }
  }
  munmap(shared_err, n);
  return rc;
}
}

// float -> bfloat16, rounded to nearest even (NaN kept, quiet). Clang calls it for a conversion on a CPU
// without AVX512_BF16; zig's compiler-rt has no such function, so the kernels failed to load there with
// "undefined symbol: __truncsfbf2". Weak: a runtime library that has it wins.
extern "C" __attribute__((weak)) __bf16 __truncsfbf2(float f) {
  const unsigned int u = __builtin_bit_cast(unsigned int, f);
  const unsigned short h = (u & 0x7fffffffu) > 0x7f800000u
                               ? static_cast<unsigned short>((u >> 16) | 0x40u)
                               : static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return __builtin_bit_cast(__bf16, h);
}
