"""MSL source (as MLX generates it) to a C++ translation unit for the shim.

The kernel text is kept as it is, line for line (compiler messages point at lines of the source
`verbose=True` prints); only what C++ cannot say is rewritten:
- `threadgroup T name[N * M][K];` declarations (any constant size expressions) become function
  statics, registered with the runtime, which poisons them before every threadgroup (all fibers of
  a group share them, as on a GPU; initializers are dropped); `threadgroup` as a pointer,
  reference or parameter qualifier becomes nothing;
- Metal attributes (`[[kernel]]`, `[[buffer(0)]]`, `[[thread_position_in_grid]]`...) are dropped;
- half literals (`1.0h`) become `((half)(1.0))`;
- the explicit instantiation line is dropped: the launch stub below instantiates the kernel.
"""

from __future__ import annotations

import re

from .signature import GeneratedKernel, InputSpec, ShapeInfo, type_string

_ATTRIBUTE_NAMES = (
    "kernel|vertex|fragment|host_name|buffer|texture|sampler|threadgroup|function_constant|"
    "max_total_threads_per_threadgroup|user|stage_in|visible|"
    "dispatch_quadgroups_per_threadgroup|dispatch_simdgroups_per_threadgroup|"
    "dispatch_threads_per_threadgroup|grid_origin|grid_size|quadgroup_index_in_threadgroup|"
    "quadgroups_per_threadgroup|simdgroup_index_in_threadgroup|simdgroups_per_threadgroup|"
    "thread_execution_width|thread_index_in_quadgroup|thread_index_in_simdgroup|"
    "thread_index_in_threadgroup|thread_position_in_grid|thread_position_in_threadgroup|"
    "threadgroup_position_in_grid|threadgroups_per_grid|threads_per_grid|threads_per_simdgroup|"
    "threads_per_threadgroup"
)
_ATTRIBUTE = re.compile(r"\[\[\s*(?:" + _ATTRIBUTE_NAMES + r")\s*(?:\([^()\]]*\))?\s*\]\]")

# Comments and literals are copied untouched; the named groups are what gets rewritten.
_TOKENS = re.compile(
    r"(?P<comment>//[^\n]*|/\*.*?\*/)"
    r"|(?P<string>\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*')"
    r"|(?P<half>(?<![\w.])(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[hH]\b)"
    r"|(?P<tg>\bthreadgroup\b)",
    re.S,
)
_IDENT = re.compile(r"[A-Za-z_]\w*")
_ALIGNAS = re.compile(r"alignas\s*\((?:[^()]|\([^()]*\))*\)")


def _storage_declaration(decl: str) -> tuple[list[str], str] | None:
    """`decl` is what follows `threadgroup` up to the `;`. When it declares storage (`float
    a[N * D][4], b;`, `atomic<uint> n;`, `float m[2] = {...}`), its names and `decl` without the
    initializers (newlines kept); None when `threadgroup` qualifies a pointer, a reference, a cast
    or a parameter.

    Array sizes are arbitrary constant expressions; only the type and declarator names (outside
    brackets and initializers) must be free of `*&(){}`."""
    check = _ALIGNAS.sub(lambda m: " " * len(m.group()), decl)
    names: list[str] = []
    drops: list[tuple[int, int]] = []
    depth = angle = 0  # ([{ nesting; template <> nesting in a type
    seg, named, init = 0, False, -1  # current declarator's start, its name seen, initializer start

    def name_here(i: int) -> None:
        nonlocal named
        if not named:
            idents = _IDENT.findall(check[seg:i])
            if idents:
                names.append(idents[-1])
            named = True

    for i, ch in enumerate(check):
        if depth == 0 and init < 0:  # type and declarator
            if ch == "<":
                angle += 1
            elif ch == ">":
                angle -= 1
            elif ch in "*&(){}#":
                return None
            elif ch == "[":
                name_here(i)
                depth += 1
            elif ch == "=":
                name_here(i)
                init = i
            elif ch == "," and angle == 0:
                name_here(i)
                seg, named = i + 1, False
        elif ch in "[({":
            depth += 1
        elif ch in "])}":
            depth -= 1
            if depth < 0:  # closes a parameter list: `threadgroup float x[4], uint i) {`
                return None
        elif ch == "," and depth == 0:  # end of an initializer
            drops.append((init, i))
            seg, named, init = i + 1, False, -1
    if depth or angle:
        return None
    if init >= 0:
        drops.append((init, len(check)))
    else:
        name_here(len(check))
    if not names:
        return None
    for a, b in reversed(drops):
        decl = decl[:a] + "\n" * decl.count("\n", a, b) + decl[b:]
    return names, decl


def _registrations(names: list[str]) -> str:
    return "".join(
        f' ::rl::tg_register((void*)&{n}, sizeof({n}), "{n}", __LINE__);' for n in names
    )


def msl_to_cpp(text: str) -> str:
    text = _ATTRIBUTE.sub("", text)
    out: list[str] = []
    pos = 0
    for m in _TOKENS.finditer(text):
        if m.start() < pos:  # inside a declaration already copied
            continue
        out.append(text[pos : m.start()])
        pos = m.end()
        kind = m.lastgroup
        if kind == "half":
            out.append(f"((half)({m.group()[:-1]}))")
        elif kind == "tg":
            semi = text.find(";", m.end())
            line = text[text.rfind("\n", 0, m.start()) + 1 : m.start()]
            storage = None
            if semi >= 0 and not line.lstrip().startswith("#"):
                storage = _storage_declaration(text[m.end() : semi])
            if storage:
                # storage: shared by the threadgroup's fibers, poisoned before each group
                names, decl = storage
                out.append("static" + decl + ";" + _registrations(names))
                pos = semi + 1
            else:  # an address-space qualifier
                out.append(" " * len("threadgroup"))
        else:
            out.append(m.group())
    out.append(text[pos:])
    return "".join(out)


# Attributes the launch stub passes, by MLX name -> expression over `const rl_thread* t`.
def _attribute_expr(attr: str, mtype: str) -> str:
    field = {"grid_size": "threads_per_grid"}.get(attr, attr)
    return f"::rl::u3(t->{field})" if mtype == "uint3" else f"t->{field}"


def launch_stub(
    gen: GeneratedKernel,
    inputs: list[InputSpec],
    infos: list[ShapeInfo],
    output_dtypes: list,
    attrs: list[tuple[str, str]],
    atomic_outputs: bool,
) -> str:
    args, index = [], 0
    for spec, info in zip(inputs, infos):
        t = type_string(spec.dtype)
        args.append(f"*(const {t}*)b[{index}]" if spec.ndim == 0 else f"(const {t}*)b[{index}]")
        index += 1
        if spec.ndim > 0:
            if info.shape:
                args.append(f"(const int*)b[{index}]")
                index += 1
            if info.strides:
                args.append(f"(const int64_t*)b[{index}]")
                index += 1
            if info.ndim:
                args.append(f"*(const int*)b[{index}]")
                index += 1
    for dtype in output_dtypes:
        t = type_string(dtype)
        args.append(f"(atomic<{t}>*)b[{index}]" if atomic_outputs else f"({t}*)b[{index}]")
        index += 1
    args += [_attribute_expr(a, m) for a, m in attrs]
    call_args = ",\n      ".join(args)
    return f"""
static void rl_entry(void** b) {{
  const rl_thread* t = rl_current();
  (void)t;
  {gen.name}{gen.template_def}(
      {call_args});
}}

extern "C" __attribute__((visibility("default"))) int rl_kernel_run(
    rl_launch_args* a, int isolated, double timeout_s) {{
  return isolated ? rl_run_isolated(a, rl_entry, timeout_s) : rl_run(a, rl_entry);
}}
"""


def translation_unit(gen: GeneratedKernel, stub: str) -> str:
    return (
        '#include "shim.h"\n'
        f'#line 1 "{gen.name}.metal"\n'
        f"{msl_to_cpp(gen.body)}"
        f'#line 1 "{gen.name}.launch.cpp"\n'
        f"{stub}"
    )
