"""The Metal source MLX generates for `mx.fast.metal_kernel`, rebuilt in Python.

Mirrors MLX 0.32 `mlx/backend/common/metal_kernel.cpp` (`write_signature`, `write_template`, the
kernel name) line for line, so the interpreter compiles the very source Metal would; the tests
compare it with MLX's own output (printed by `verbose=True` while exporting a function).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

# Inputs with fewer elements are passed in the constant address space (MLX's rule).
MAX_CONSTANT_ARRAY_SIZE = 8

# MLX's `metal_attributes`, in its order: (attribute, Metal type).
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# MLX's get_type_string.
_TYPE_STRINGS = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
    mx.float64: "double",
    mx.complex64: "complex64_t",
}

TemplateArg = int | bool | mx.Dtype


def type_string(dtype: mx.Dtype) -> str:
    return _TYPE_STRINGS[dtype]


@dataclass(frozen=True)
class ShapeInfo:
    shape: bool  # `<name>_shape` appears in the source
    strides: bool
    ndim: bool


@dataclass(frozen=True)
class InputSpec:
    """What the signature needs to know about one input array."""

    name: str
    dtype: mx.Dtype
    ndim: int
    size: int

    @property
    def location(self) -> str:
        return "constant" if self.size < MAX_CONSTANT_ARRAY_SIZE else "device"


def shape_infos(source: str, input_names: list[str]) -> list[ShapeInfo]:
    return [
        ShapeInfo(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def attributes(source: str) -> list[tuple[str, str]]:
    """The thread attributes MLX adds to the signature: those whose name occurs in the source."""
    return [(attr, dtype) for attr, dtype in METAL_ATTRIBUTES if attr in source]


def check_template(template: list[tuple[str, TemplateArg]]) -> None:
    for _, arg in template:
        if not isinstance(arg, (bool, int, mx.Dtype)):
            raise ValueError(
                "[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, `int` or `bool`."
            )


def write_template(template: list[tuple[str, TemplateArg]]) -> str:
    parts = []
    for _, arg in template:
        if isinstance(arg, bool):  # before int: bool is an int in Python; ostream prints 1/0
            parts.append("1" if arg else "0")
        elif isinstance(arg, int):
            parts.append(str(arg))
        else:
            parts.append(type_string(arg))
    return "<" + ", ".join(parts) + ">"


def kernel_name(
    name: str,
    inputs: list[InputSpec],
    output_dtypes: list[mx.Dtype],
    template: list[tuple[str, TemplateArg]],
) -> str:
    kname = "custom_kernel_" + name
    if template:
        template_hash = re.sub(r"<|>|(, )", "_", write_template(template))[:-1]
        kname += "_" + template_hash
    for spec in inputs:
        kname += "_" + type_string(spec.dtype)
        if spec.ndim == 0:
            kname += "s"
        elif spec.size < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for dtype in output_dtypes:
        kname += "_" + type_string(dtype)
    return kname


def write_signature(
    func_name: str,
    header: str,
    source: str,
    inputs: list[InputSpec],
    output_names: list[str],
    output_dtypes: list[mx.Dtype],
    template: list[tuple[str, TemplateArg]],
    attrs: list[tuple[str, str]],
    infos: list[ShapeInfo],
    atomic_outputs: bool,
) -> str:
    out = [header]
    if template:
        params = []
        for tname, arg in template:
            kind = "bool" if isinstance(arg, bool) else "int" if isinstance(arg, int) else "typename"
            params.append(f"{kind} {tname}")
        out.append("template <" + ", ".join(params) + ">\n")
    out.append(f"[[kernel]] void {func_name}(\n")
    index = 0
    for spec, info in zip(inputs, infos):
        ref = "&" if spec.ndim == 0 else "*"
        out.append(
            f"  const {spec.location} {type_string(spec.dtype)}{ref} {spec.name} [[buffer({index})]],\n"
        )
        index += 1
        if spec.ndim > 0:
            if info.shape:
                out.append(f"  const constant int* {spec.name}_shape [[buffer({index})]],\n")
                index += 1
            if info.strides:
                out.append(f"  const constant int64_t* {spec.name}_strides [[buffer({index})]],\n")
                index += 1
            if info.ndim:
                out.append(f"  const constant int& {spec.name}_ndim [[buffer({index})]],\n")
                index += 1
    for name, dtype in zip(output_names, output_dtypes):
        tstr = type_string(dtype)
        if atomic_outputs:
            tstr = f"atomic<{tstr}>"
        out.append(f"  device {tstr}* {name} [[buffer({index})]]")
        # MLX compares the running buffer index with the number of inputs + outputs (not
        # counting shape buffers); replicated, quirk included.
        if index < len(inputs) + len(output_names) - 1 or attrs:
            out.append(",\n")
        else:
            out.append(") {\n")
        index += 1
    for i, (attr, dtype) in enumerate(attrs):
        out.append(f"  {dtype} {attr} [[{attr}]]")
        out.append(",\n" if i < len(attrs) - 1 else ") {\n")
    out.append(source)
    out.append("\n}\n")
    return "".join(out)


@dataclass(frozen=True)
class GeneratedKernel:
    name: str  # the host name, e.g. custom_kernel_myexp_float_float
    template_def: str  # e.g. "<float, 3>", or "" without template arguments
    body: str  # header + signature + source: what the C++ translation compiles
    source: str  # exactly what MLX prints and hands to the Metal compiler


def generate(
    name: str,
    header: str,
    source: str,
    inputs: list[InputSpec],
    output_names: list[str],
    output_dtypes: list[mx.Dtype],
    template: list[tuple[str, TemplateArg]],
    attrs: list[tuple[str, str]],
    infos: list[ShapeInfo],
    atomic_outputs: bool,
) -> GeneratedKernel:
    kname = kernel_name(name, inputs, output_dtypes, template)
    body = write_signature(
        kname, header, source, inputs, output_names, output_dtypes, template, attrs, infos,
        atomic_outputs,
    )
    full = body
    template_def = ""
    if template:
        template_def = write_template(template)
        inst = kname + template_def
        full += (
            f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({inst}) {inst};\n'
        )
    return GeneratedKernel(kname, template_def, body, full)


def verbose_text(name: str, source: str) -> str:
    """What MLX prints for `verbose=True`."""
    return f"Generated source code for `{name}`:\n```\n{source}\n```\n"
