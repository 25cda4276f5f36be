// fiber.h: the context switch under the fiber runtime (included by runtime.cpp only).
#pragma once
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

// ---- context switch ---------------------------------------------------------------------------
// swapcontext makes a signal-mask syscall per switch (~1 us); fibers switch at every barrier, so
// on ELF x86-64 a hand-written switch saves the callee-saved registers instead (~30 ns). Other
// targets use ucontext (an aarch64 switch is easy to add, but could not be tested here).
#if defined(__ELF__) && defined(__x86_64__) && !defined(RL_FORCE_UCONTEXT)
#define RL_ASM_SWITCH 1
extern "C" void rl_swap(void** save_sp, void* load_sp);
extern "C" void rl_fiber_start();
asm(R"(
  .text
  .globl rl_swap
  .hidden rl_swap
  .type rl_swap,@function
rl_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size rl_swap, .-rl_swap

  .globl rl_fiber_start
  .hidden rl_fiber_start
  .type rl_fiber_start,@function
rl_fiber_start:
  movq %r13, %rdi
  andq $-16, %rsp
  callq *%r12
  ud2
  .size rl_fiber_start, .-rl_fiber_start
)");
#else
#define RL_ASM_SWITCH 0
#endif

namespace rl_fiber {

struct Context {
#if RL_ASM_SWITCH
  void* sp;
#else
  ucontext_t uc;
#endif
};

// Prepares `c` to run fn(arg) on [stack, stack + size); fn must never return.
void context_init(Context& c, char* stack, size_t size, void (*fn)(void*), void* arg) {
#if RL_ASM_SWITCH
  uintptr_t top = ((uintptr_t)(stack + size)) & ~(uintptr_t)15;
  uint64_t* f = (uint64_t*)(top - 8 * 8);
  uint32_t csr[2] = {0x1F80, 0x037F};  // default MXCSR, x87 control word
  memcpy(&f[0], csr, 8);
  f[1] = 0;                          // r15
  f[2] = 0;                          // r14
  f[3] = (uint64_t)arg;              // r13
  f[4] = (uint64_t)fn;               // r12
  f[5] = 0;                          // rbx
  f[6] = 0;                          // rbp
  f[7] = (uint64_t)&rl_fiber_start;  // return address
  c.sp = f;
#else
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, (void (*)())fn, 1, arg);  // pointer-sized arg: fine on LP64 glibc
#endif
}

void context_switch(Context& from, Context& to) {
#if RL_ASM_SWITCH
  rl_swap(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

}  // namespace rl_fiber
