// runtime.cpp: runs a kernel launch threadgroup by threadgroup; each threadgroup's threads are
// cooperative fibers on one OS thread, so threadgroup_barrier and SIMD-group operations are
// rendezvous points. Divergent barriers and deadlocks end the launch with a message, never a hang.
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include "abi.h"

#include "fiber.h"

namespace {

using rl_fiber::Context;
using rl_fiber::context_init;
using rl_fiber::context_switch;

enum State : unsigned char { READY, WAIT_TG, WAIT_SIMD, DONE };

struct Fiber {
  Context ctx;
  char* stack;
  State state;
  int line;  // where it waits
  rl_thread t;
};

struct TgVar {
  void* p;
  size_t n;
};

constexpr size_t kMaxThreadgroupMemory = 32768;  // Apple GPUs: 32 KiB per threadgroup
constexpr int kMaxTgVars = 256;
constexpr size_t kStackPoison = 2048;  // bytes at the top of each fresh stack

struct Runtime {
  rl_launch_args* args;
  rl_entry_fn entry;
  Fiber* fibers;
  int nthreads;  // in the current threadgroup
  int cur;
  int live;
  int finished;
  int tg_arrived;
  int tg_line;
  int failed;
  Context sched;
  rl_simd_group sgs[RL_MAX_THREADS / RL_SIMD_WIDTH];
  TgVar vars[kMaxTgVars];
  int nvars;
  size_t tg_bytes;
  size_t stack_size;
};

// Fiber stacks, each above a guard page; kept from launch to launch (mapping and protecting
// them costs more than a small kernel's run). Allocated before the fork in isolated runs.
struct Stacks {
  char* base = nullptr;
  size_t bytes = 0;
  size_t stack_size = 0;
  int count = 0;
  size_t page = 0;
  char* stack(int i) const { return base + (stack_size + page) * (size_t)i + page; }
} g_stacks;

bool ensure_stacks(int count, size_t stack_size) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  stack_size = (stack_size + page - 1) / page * page;
  if (g_stacks.base && g_stacks.count >= count && g_stacks.stack_size == stack_size) return true;
  if (g_stacks.base) munmap(g_stacks.base, g_stacks.bytes);
  g_stacks = Stacks{};
  size_t bytes = (stack_size + page) * (size_t)count;
  char* base = (char*)mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return false;
  g_stacks = Stacks{base, bytes, stack_size, count, page};
  for (int i = 0; i < count; ++i) mprotect(g_stacks.stack(i) - page, page, PROT_NONE);
  return true;
}

Runtime* g_rt = nullptr;

Fiber& current() { return g_rt->fibers[g_rt->cur]; }

void yield_to_scheduler() {
  Fiber& f = current();
  context_switch(f.ctx, g_rt->sched);
}

const char* where(const Fiber& f, char* buf, size_t n) {
  const rl_thread& t = f.t;
  snprintf(buf, n,
           "thread_position_in_grid=(%u,%u,%u), threadgroup_position_in_grid=(%u,%u,%u), "
           "thread_index_in_threadgroup=%u",
           t.thread_position_in_grid[0], t.thread_position_in_grid[1],
           t.thread_position_in_grid[2], t.threadgroup_position_in_grid[0],
           t.threadgroup_position_in_grid[1], t.threadgroup_position_in_grid[2],
           t.thread_index_in_threadgroup);
  return buf;
}

void set_error(const char* fmt, va_list ap) {
  if (g_rt->failed) return;
  g_rt->failed = 1;
  vsnprintf(g_rt->args->err, (size_t)g_rt->args->err_len, fmt, ap);
}

void set_errorf(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error(fmt, ap);
  va_end(ap);
}

void simd_complete(rl_simd_group& g, int sg) {
  g.fn(&g);
  for (int lane = 0; lane < RL_SIMD_WIDTH; ++lane) {
    if (g.waiting[lane]) {
      g.waiting[lane] = 0;
      g_rt->fibers[sg * RL_SIMD_WIDTH + lane].state = READY;
    }
  }
  g.arrived = 0;
}

void fiber_main(void*) {
  Runtime& R = *g_rt;
  R.entry(R.args->buffers);
  Fiber& f = current();
  f.state = DONE;
  R.live--;
  R.finished++;
  char buf[256];
  if (R.tg_arrived > 0) {
    rl_fail("divergent threadgroup_barrier: thread (%s) returned while %d thread(s) of its "
            "threadgroup wait at threadgroup_barrier (line %d)",
            where(f, buf, sizeof buf), R.tg_arrived, R.tg_line);
  }
  int sg = (int)f.t.simdgroup_index_in_threadgroup;
  rl_simd_group& g = R.sgs[sg];
  g.live--;
  if (g.arrived > 0 && g.arrived == g.live) simd_complete(g, sg);
  context_switch(f.ctx, R.sched);  // never resumed
  abort();
}

void poison_threadgroup_memory() {
  for (int i = 0; i < g_rt->nvars; ++i)
    memset(g_rt->vars[i].p, (int)g_rt->args->poison_byte, g_rt->vars[i].n);
}

void describe_deadlock() {
  Runtime& R = *g_rt;
  char buf[256];
  int tg_waiters = 0, simd_waiters = 0;
  const Fiber *tg_first = nullptr, *simd_first = nullptr;
  for (int i = 0; i < R.nthreads; ++i) {
    const Fiber& f = R.fibers[i];
    if (f.state == WAIT_TG) {
      if (!tg_first) tg_first = &f;
      tg_waiters++;
    } else if (f.state == WAIT_SIMD) {
      if (!simd_first) simd_first = &f;
      simd_waiters++;
    }
  }
  if (tg_first && simd_first) {
    const rl_simd_group& g = R.sgs[simd_first->t.simdgroup_index_in_threadgroup];
    set_errorf("divergent barrier (deadlock): %d thread(s) wait at threadgroup_barrier (line %d) "
               "while %d wait at %s (line %d), e.g. thread (%s)",
               tg_waiters, tg_first->line, simd_waiters, g.name, g.line,
               where(*simd_first, buf, sizeof buf));
  } else {
    set_errorf("deadlock: %d thread(s) wait at a barrier and none can proceed", tg_waiters + simd_waiters);
  }
}

int run_threadgroup(const uint32_t gpos[3]) {
  Runtime& R = *g_rt;
  rl_launch_args& a = *R.args;
  uint32_t dtg[3], size[3], ngroups[3], grid[3];
  for (int d = 0; d < 3; ++d) {
    grid[d] = (uint32_t)a.grid[d];
    dtg[d] = (uint32_t)(a.threadgroup[d] < a.grid[d] ? a.threadgroup[d] : a.grid[d]);
    ngroups[d] = (grid[d] + dtg[d] - 1) / dtg[d];
    uint32_t rest = grid[d] - gpos[d] * dtg[d];
    size[d] = rest < dtg[d] ? rest : dtg[d];
  }
  int n = (int)(size[0] * size[1] * size[2]);
  int dn = (int)(dtg[0] * dtg[1] * dtg[2]);
  R.nthreads = n;
  R.live = n;
  R.finished = 0;
  R.tg_arrived = 0;
  int nsg = (n + RL_SIMD_WIDTH - 1) / RL_SIMD_WIDTH;
  for (int s = 0; s < nsg; ++s) {
    rl_simd_group& g = R.sgs[s];
    g.live = (s + 1) * RL_SIMD_WIDTH <= n ? RL_SIMD_WIDTH : n - s * RL_SIMD_WIDTH;
    g.arrived = 0;
    memset(g.waiting, 0, sizeof g.waiting);
  }
  for (int i = 0; i < n; ++i) {
    Fiber& f = R.fibers[i];
    rl_thread& t = f.t;
    uint32_t lx = (uint32_t)i % size[0], ly = ((uint32_t)i / size[0]) % size[1],
             lz = (uint32_t)i / (size[0] * size[1]);
    uint32_t local[3] = {lx, ly, lz};
    for (int d = 0; d < 3; ++d) {
      t.thread_position_in_threadgroup[d] = local[d];
      t.thread_position_in_grid[d] = gpos[d] * dtg[d] + local[d];
      t.threadgroup_position_in_grid[d] = gpos[d];
      t.threads_per_threadgroup[d] = size[d];
      t.dispatch_threads_per_threadgroup[d] = dtg[d];
      t.threadgroups_per_grid[d] = ngroups[d];
      t.threads_per_grid[d] = grid[d];
      t.grid_origin[d] = 0;
    }
    t.thread_index_in_threadgroup = (uint32_t)i;
    t.thread_index_in_simdgroup = (uint32_t)i % RL_SIMD_WIDTH;
    t.simdgroup_index_in_threadgroup = (uint32_t)i / RL_SIMD_WIDTH;
    t.simdgroups_per_threadgroup = (uint32_t)nsg;
    t.dispatch_simdgroups_per_threadgroup = (uint32_t)((dn + RL_SIMD_WIDTH - 1) / RL_SIMD_WIDTH);
    t.thread_index_in_quadgroup = (uint32_t)i % 4;
    t.quadgroup_index_in_threadgroup = (uint32_t)i / 4;
    t.quadgroups_per_threadgroup = (uint32_t)((n + 3) / 4);
    t.dispatch_quadgroups_per_threadgroup = (uint32_t)((dn + 3) / 4);
    t.threads_per_simdgroup = RL_SIMD_WIDTH;
    t.thread_execution_width = RL_SIMD_WIDTH;
    // uninitialized private variables read the poison too (as far as they live on the stack)
    memset(f.stack + R.stack_size - kStackPoison, (int)a.poison_byte, kStackPoison);
    context_init(f.ctx, f.stack, R.stack_size, fiber_main, nullptr);
    f.state = READY;
    f.line = 0;
  }
  poison_threadgroup_memory();

  uint64_t linear = gpos[0] + (uint64_t)ngroups[0] * (gpos[1] + (uint64_t)ngroups[1] * gpos[2]);
  bool reverse = a.order == 2 || (a.order == 0 && (linear & 1));
  while (R.live > 0) {
    bool progress = false;
    for (int k = 0; k < n; ++k) {
      int i = reverse ? n - 1 - k : k;
      if (R.fibers[i].state != READY) continue;
      R.cur = i;
      context_switch(R.sched, R.fibers[i].ctx);
      if (R.failed) return 1;
      progress = true;
    }
    if (!progress) {
      describe_deadlock();
      return 1;
    }
  }
  return 0;
}


}  // namespace

extern "C" {

const rl_thread* rl_current(void) { return &current().t; }

void rl_fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error(fmt, ap);
  va_end(ap);
  yield_to_scheduler();  // the scheduler sees `failed` and never resumes this fiber
  abort();
}

void rl_threadgroup_barrier(int line) {
  Runtime& R = *g_rt;
  Fiber& f = current();
  char buf[256];
  if (R.finished > 0)
    rl_fail("divergent threadgroup_barrier (line %d): reached by thread (%s) after %d thread(s) "
            "of its threadgroup returned",
            line, where(f, buf, sizeof buf), R.finished);
  if (R.tg_arrived == 0) {
    R.tg_line = line;
  } else if (R.tg_line != line) {
    rl_fail("divergent threadgroup_barrier: thread (%s) reached the barrier at line %d while "
            "%d thread(s) wait at the one at line %d",
            where(f, buf, sizeof buf), line, R.tg_arrived, R.tg_line);
  }
  f.state = WAIT_TG;
  f.line = line;
  if (++R.tg_arrived == R.nthreads) {
    for (int i = 0; i < R.nthreads; ++i) R.fibers[i].state = READY;
    R.tg_arrived = 0;
  }
  yield_to_scheduler();
}

rl_simd_slot* rl_simd_exchange(const void* in, uint32_t size, uint32_t arg, int op,
                               const char* name, int line, rl_simd_fn fn) {
  Runtime& R = *g_rt;
  Fiber& f = current();
  int sg = (int)f.t.simdgroup_index_in_threadgroup;
  int lane = (int)f.t.thread_index_in_simdgroup;
  rl_simd_group& g = R.sgs[sg];
  if (g.arrived == 0) {
    g.op = op;
    g.line = line;
    g.name = name;
    g.fn = fn;
  } else if (g.op != op || g.line != line) {
    char buf[256];
    rl_fail("divergent SIMD-group operation: thread (%s) reached %s (line %d) while %d lane(s) "
            "of its SIMD-group wait at %s (line %d)",
            where(f, buf, sizeof buf), name, line, g.arrived, g.name, g.line);
  }
  rl_simd_slot& s = g.slot[lane];
  memcpy(s.in, in, size);
  s.arg = arg;
  g.waiting[lane] = 1;
  f.state = WAIT_SIMD;
  f.line = line;
  if (++g.arrived == g.live) simd_complete(g, sg);
  yield_to_scheduler();
  return &s;
}

void rl_threadgroup_register(void* p, size_t n, const char* name, int line) {
  Runtime& R = *g_rt;
  for (int i = 0; i < R.nvars; ++i)
    if (R.vars[i].p == p) return;
  if (R.nvars == kMaxTgVars) rl_fail("too many threadgroup variables");
  R.vars[R.nvars++] = TgVar{p, n};
  R.tg_bytes += n;
  if (R.tg_bytes > kMaxThreadgroupMemory)
    rl_fail("threadgroup memory of %zu bytes (after `%s`, line %d) exceeds the %zu bytes a "
            "threadgroup may use on Apple GPUs",
            R.tg_bytes, name, line, kMaxThreadgroupMemory);
  memset(p, (int)R.args->poison_byte, n);
}

int rl_run(rl_launch_args* args, rl_entry_fn entry) {
  static Runtime R;  // large; one launch at a time per process
  memset(&R, 0, sizeof R);
  R.args = args;
  R.entry = entry;
  R.cur = -1;
  g_rt = &R;
  if (args->err_len > 0) args->err[0] = 0;
  for (int d = 0; d < 3; ++d) {
    if (args->grid[d] <= 0) return 0;  // an empty dispatch runs nothing
    if (args->threadgroup[d] <= 0) {
      set_errorf("threadgroup dimensions must be positive");
      return 1;
    }
    if (args->grid[d] > 0xFFFFFFFFll) {
      set_errorf("grid dimension %lld does not fit in uint", (long long)args->grid[d]);
      return 1;
    }
  }
  int64_t tx = args->threadgroup[0] < args->grid[0] ? args->threadgroup[0] : args->grid[0];
  int64_t ty = args->threadgroup[1] < args->grid[1] ? args->threadgroup[1] : args->grid[1];
  int64_t tz = args->threadgroup[2] < args->grid[2] ? args->threadgroup[2] : args->grid[2];
  int64_t asked = args->threadgroup[0] * args->threadgroup[1] * args->threadgroup[2];
  if (asked > RL_MAX_THREADS) {
    set_errorf("Thread group size (%lld) is greater than  the maximum allowed threads per "
               "threadgroup (%d).",
               (long long)asked, RL_MAX_THREADS);
    return 1;
  }
  int max_threads = (int)(tx * ty * tz);
  if (!ensure_stacks(max_threads, (size_t)args->stack_size)) {
    set_errorf("cannot map fiber stacks for %d threads", max_threads);
    return 1;
  }
  R.stack_size = g_stacks.stack_size;
  R.fibers = (Fiber*)calloc((size_t)max_threads, sizeof(Fiber));
  for (int i = 0; i < max_threads; ++i) R.fibers[i].stack = g_stacks.stack(i);
  int rc = 0;
  uint32_t ng[3];
  for (int d = 0; d < 3; ++d) {
    int64_t t = d == 0 ? tx : d == 1 ? ty : tz;
    ng[d] = (uint32_t)((args->grid[d] + t - 1) / t);
  }
  for (uint32_t z = 0; z < ng[2] && rc == 0; ++z)
    for (uint32_t y = 0; y < ng[1] && rc == 0; ++y)
      for (uint32_t x = 0; x < ng[0] && rc == 0; ++x) {
        uint32_t gpos[3] = {x, y, z};
        rc = run_threadgroup(gpos);
      }
  free(R.fibers);
  R.fibers = nullptr;
  g_rt = nullptr;
  return rc;
}

}

#include "isolate.h"
