"""`metal_kernel`: mx.fast.metal_kernel's interface, run on the CPU through the interpreter."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from . import compiler, signature, translate
from .compiler import MetalInterpretError

_NUMPY = {
    mx.bool_: np.bool_,
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
    mx.int8: np.int8,
    mx.int16: np.int16,
    mx.int32: np.int32,
    mx.int64: np.int64,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,  # stored as raw bits; numpy has no bfloat16
    mx.float32: np.float32,
}
_MAX_THREADS_PER_THREADGROUP = 1024
_ERR_LEN = 4096
_in_process = threading.Lock()


class _LaunchArgs(ctypes.Structure):  # csrc/abi.h rl_launch_args
    _fields_ = [
        ("buffers", ctypes.POINTER(ctypes.c_void_p)),
        ("grid", ctypes.c_int64 * 3),
        ("threadgroup", ctypes.c_int64 * 3),
        ("stack_size", ctypes.c_int64),
        ("order", ctypes.c_int64),
        ("poison_byte", ctypes.c_int64),
        ("err", ctypes.c_char_p),
        ("err_len", ctypes.c_int64),
    ]


def _settings() -> dict[str, float | int | bool]:
    order = os.environ.get("ROOFLINE_INTERPRET_ORDER", "alternate")
    return {
        "isolate": os.environ.get("ROOFLINE_INTERPRET_ISOLATE", "1") != "0",
        "timeout": float(os.environ.get("ROOFLINE_INTERPRET_TIMEOUT", "300")),
        "stack": int(os.environ.get("ROOFLINE_INTERPRET_STACK_KB", "256")) * 1024,
        "order": {"alternate": 0, "forward": 1, "reverse": 2}[order],
        "poison": int(os.environ.get("ROOFLINE_INTERPRET_POISON", "0xff"), 0) & 0xFF,
    }


def _check_dtype(dtype: mx.Dtype, what: str) -> None:
    if dtype not in _NUMPY:
        raise MetalInterpretError(
            f"[metal_kernel] {what} of dtype {dtype} is not supported by the interpreter"
            + (" (Metal has no double)" if dtype == mx.float64 else "")
        )


def _to_numpy(x: mx.array, contiguous: bool) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    a = np.asarray(x)  # a view of MLX's memory (strided if x is)
    return np.ascontiguousarray(a) if contiguous else a


def _shared_buffer(nbytes: int) -> mmap.mmap:
    # MAP_SHARED | MAP_ANONYMOUS: the forked kernel process writes outputs the parent reads
    return mmap.mmap(-1, max(nbytes, 1))


def _fill_value(value: float, dtype: mx.Dtype) -> np.ndarray:
    a = mx.array(value).astype(dtype)
    return _to_numpy(a, True).reshape(1)


class MetalKernel:
    """Callable like the object mx.fast.metal_kernel returns."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        compile_options: dict | None = None,
    ) -> None:
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options  # math_mode: the interpreter is always IEEE
        self._infos = signature.shape_infos(source, self.input_names)
        self._attrs = signature.attributes(source)
        self._built: dict[tuple, tuple[signature.GeneratedKernel, ctypes._CFuncPtr]] = {}

    def generate(
        self,
        inputs: Sequence[mx.array],
        output_dtypes: Sequence[mx.Dtype],
        template: Sequence[tuple[str, signature.TemplateArg]] | None = None,
    ) -> signature.GeneratedKernel:
        """The source MLX would generate for these inputs (what `verbose=True` prints)."""
        specs = [
            signature.InputSpec(n, x.dtype, x.ndim, x.size)
            for n, x in zip(self.input_names, inputs)
        ]
        template = list(template or [])
        signature.check_template(template)
        return signature.generate(
            self.name, self.header, self.source, specs, self.output_names, list(output_dtypes),
            template, self._attrs, self._infos, self.atomic_outputs,
        )  # fmt: skip

    def __call__(
        self,
        *,
        inputs: Sequence[mx.array | float | int | bool],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Sequence[tuple[str, signature.TemplateArg]] | None = None,
        init_value: float | None = None,
        verbose: bool = False,
        stream: object = None,
    ) -> list[mx.array]:
        self._check_counts(inputs, output_shapes, output_dtypes)
        arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        for x in arrays:
            _check_dtype(x.dtype, "an input")
        for d in output_dtypes:
            _check_dtype(d, "an output")
        gen, run = self._build(arrays, output_dtypes, template)
        if verbose:
            print(signature.verbose_text(self.name, gen.source), end="", flush=True)

        tx, ty, tz = threadgroup
        if tx * ty * tz > _MAX_THREADS_PER_THREADGROUP:
            raise ValueError(
                f"Thread group size ({tx * ty * tz}) is greater than  the maximum allowed threads "
                f"per threadgroup ({_MAX_THREADS_PER_THREADGROUP})."
            )
        settings = _settings()
        mx.eval(arrays)
        keep: list[object] = []  # everything a buffer pointer points into
        pointers: list[int] = []
        for x, info in zip(arrays, self._infos):
            a = _to_numpy(x, self.ensure_row_contiguous)
            keep.append(a)
            pointers.append(a.ctypes.data)
            if x.ndim > 0:
                extra = []
                if info.shape:
                    extra.append(np.asarray(a.shape, dtype=np.int32))
                if info.strides:
                    extra.append(np.asarray([s // a.itemsize for s in a.strides], dtype=np.int64))
                if info.ndim:
                    extra.append(np.asarray([a.ndim], dtype=np.int32))
                keep += extra
                pointers += [e.ctypes.data for e in extra]
        outputs = []
        for shape, dtype in zip(output_shapes, output_dtypes):
            np_dtype = np.dtype(_NUMPY[dtype])
            count = int(np.prod(shape, dtype=np.int64))
            buf = _shared_buffer(count * np_dtype.itemsize)
            out = np.frombuffer(buf, dtype=np_dtype, count=count)
            if init_value is None:
                out.view(np.uint8)[:] = settings["poison"]  # unwritten outputs show
            else:
                out[:] = _fill_value(init_value, dtype)[0]
            keep.append(buf)
            outputs.append(out)
            pointers.append(out.ctypes.data)

        err = ctypes.create_string_buffer(_ERR_LEN)
        args = _LaunchArgs(
            buffers=(ctypes.c_void_p * max(len(pointers), 1))(*pointers),
            grid=(ctypes.c_int64 * 3)(*grid),
            threadgroup=(ctypes.c_int64 * 3)(*threadgroup),
            stack_size=settings["stack"],
            order=settings["order"],
            poison_byte=settings["poison"],
            err=ctypes.cast(err, ctypes.c_char_p),
            err_len=_ERR_LEN,
        )
        if settings["isolate"]:
            rc = run(ctypes.byref(args), 1, settings["timeout"])
        else:
            with _in_process:  # the runtime's state is per process
                rc = run(ctypes.byref(args), 0, settings["timeout"])
        if rc != 0:
            msg = err.value.decode(errors="replace")
            raise MetalInterpretError(f"[metal_kernel] kernel `{self.name}` ({gen.name}): {msg}")
        results = []
        for out, shape, dtype in zip(outputs, output_shapes, output_dtypes):
            arr = mx.array(out.copy()).reshape(tuple(shape))
            results.append(arr.view(mx.bfloat16) if dtype == mx.bfloat16 else arr)
        del keep
        return results

    def _build(self, arrays, output_dtypes, template):
        # the generated source depends on dtypes, ndim == 0 and size < 8 only, not on shapes
        key = (
            tuple((x.dtype, x.ndim == 0, x.size < signature.MAX_CONSTANT_ARRAY_SIZE) for x in arrays),
            tuple(output_dtypes),
            tuple((n, a) for n, a in (template or [])),
        )
        if key not in self._built:
            gen = self.generate(arrays, output_dtypes, template)
            specs = [
                signature.InputSpec(n, x.dtype, x.ndim, x.size)
                for n, x in zip(self.input_names, arrays)
            ]
            stub = translate.launch_stub(
                gen, specs, self._infos, list(output_dtypes), self._attrs, self.atomic_outputs
            )
            lib = compiler.build_kernel(self.name, translate.translation_unit(gen, stub))
            run = lib.rl_kernel_run
            run.argtypes = [ctypes.POINTER(_LaunchArgs), ctypes.c_int, ctypes.c_double]
            run.restype = ctypes.c_int
            self._built[key] = (gen, run)
        return self._built[key]

    def _check_counts(self, inputs, output_shapes, output_dtypes) -> None:
        for what, got, want in (
            ("inputs", len(inputs), len(self.input_names)),
            ("output_shapes", len(output_shapes), len(self.output_names)),
            ("output_dtypes", len(output_dtypes), len(self.output_names)),
        ):
            if got != want:
                raise ValueError(
                    f"[metal_kernel] Expected `{what}` to have size {want} but got size {got}."
                )


def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    compile_options: dict | None = None,
) -> MetalKernel:
    """mx.fast.metal_kernel, interpreted on the CPU: same arguments, same call, same generated
    source; threadgroups run as cooperative fibers (see kernels_metal/interpret/README.md)."""
    return MetalKernel(
        name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs,
        compile_options,
    )  # fmt: skip
