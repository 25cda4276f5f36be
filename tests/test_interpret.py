"""The Metal interpreter (kernels_metal.interpret) against MLX's source generation and numpy.

Each distinct kernel source is one C++ compile (~0.3 s warm, cached on disk by source hash), so
shapes vary at runtime (`inp_shape`, grid sizes) instead of in the source.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_metal.interpret import MetalCompileError, MetalInterpretError, metal_kernel
from kernels_metal.interpret.signature import verbose_text
from kernels_metal.interpret.translate import msl_to_cpp

# ---- generated source == MLX's ----------------------------------------------------------------

TG_REDUCE = """
    threadgroup float buf[256];
    uint tid = thread_position_in_threadgroup.x;
    uint n = threads_per_threadgroup.x;
    uint gid = thread_position_in_grid.x;
    buf[tid] = gid < inp_shape[0] ? inp[gid] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = (n + 1) / 2, m = n; m > 1; m = s, s = (s + 1) / 2) {
        if (tid < m - s) buf[tid] += buf[tid + s];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (tid == 0) out[threadgroup_position_in_grid.x] = buf[0];
"""

# (kernel kwargs, call kwargs); inputs are {"shape", "dtype"} or {"scalar": value}
SOURCE_CASES = [
    (  # MLX's documentation example: a dtype template argument
        dict(name="myexp", input_names=["inp"], output_names=["out"],
             source="uint elem = thread_position_in_grid.x;\nT tmp = inp[elem];\nout[elem] = metal::exp(tmp);"),
        dict(inputs=[{"shape": [4, 16], "dtype": "float16"}], template=[["T", {"dtype": "float32"}]],
             output_shapes=[[4, 16]], output_dtypes=["float16"]),
    ),
    (  # shape/strides/ndim parameters, int and bool template arguments, scalar and small inputs
        dict(name="strided", input_names=["a", "scale", "bias"], output_names=["out"],
             ensure_row_contiguous=False,
             source="uint i = thread_position_in_grid.x;\n"
                    "auto loc = elem_to_loc(i, a_shape, a_strides, a_ndim);\n"
                    "out[i] = a[loc] * scale * N + (FLAG ? bias[i % 4] : 0.0f);"),
        dict(inputs=[{"shape": [3, 5], "dtype": "float32"}, {"scalar": 2.0},
                     {"shape": [4], "dtype": "float32"}],
             template=[["N", 3], ["FLAG", True], ["T", {"dtype": "bfloat16"}]],
             output_shapes=[[15]], output_dtypes=["float32"]),
    ),
    (  # atomic outputs
        dict(name="hist", input_names=["idx"], output_names=["counts"], atomic_outputs=True,
             source="atomic_fetch_add_explicit(&counts[idx[thread_position_in_grid.x]], 1u, memory_order_relaxed);"),
        dict(inputs=[{"shape": [100], "dtype": "uint32"}], output_shapes=[[8]],
             output_dtypes=["uint32"], init_value=0),
    ),
    (  # threadgroup memory, barriers, several thread attributes
        dict(name="tg_reduce", input_names=["inp"], output_names=["out"], source=TG_REDUCE),
        dict(inputs=[{"shape": [1000], "dtype": "float32"}], output_shapes=[[4]], output_dtypes=["float32"]),
    ),
    (  # SIMD attributes, a header, two outputs, many dtypes
        dict(name="simd_mix", input_names=["x", "y", "z", "w"], output_names=["o1", "o2"],
             header="#include <metal_stdlib>\nusing namespace metal;\ninline float twice(float v) { return 2 * v; }\n",
             source="uint l = thread_index_in_simdgroup; uint s = simdgroup_index_in_threadgroup;\n"
                    "o1[l] = half(simd_sum(twice(float(x[l]))));\n"
                    "o2[s] = bfloat(y[l] + z[l] + w[0]) + threads_per_simdgroup;"),
        dict(inputs=[{"shape": [32], "dtype": "float16"}, {"shape": [2, 32], "dtype": "int8"},
                     {"shape": [64], "dtype": "uint8"}, {"shape": [1], "dtype": "bool_"}],
             output_shapes=[[32], [2]], output_dtypes=["float16", "bfloat16"]),
    ),
    (  # MLX's quirk: with shape buffers and several outputs, `) {` closes the signature early
        dict(name="quirk", input_names=["a"], output_names=["o1", "o2"],
             source="o1[0] = a_shape[0]; o2[0] = 0;"),
        dict(inputs=[{"shape": [16], "dtype": "int32"}], output_shapes=[[1], [1]],
             output_dtypes=["int32", "int32"]),
    ),
]  # fmt: skip

_MLX_SCRIPT = r"""
import json, sys
import mlx.core as mx

def value(spec):
    return spec["scalar"] if "scalar" in spec else mx.zeros(spec["shape"], dtype=getattr(mx, spec["dtype"]))

def targ(a):
    return getattr(mx, a["dtype"]) if isinstance(a, dict) else a

for i, (kkw, ckw) in enumerate(json.load(sys.stdin)):
    kernel = mx.fast.metal_kernel(**kkw)
    inputs = [value(s) for s in ckw["inputs"]]
    arrays = [x for x in inputs if isinstance(x, mx.array)]
    def fn(*args):
        it = iter(args)
        ins = [next(it) if isinstance(x, mx.array) else x for x in inputs]
        return kernel(inputs=ins, template=[(n, targ(a)) for n, a in ckw.get("template", [])],
                      grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=ckw["output_shapes"],
                      output_dtypes=[getattr(mx, d) for d in ckw["output_dtypes"]],
                      init_value=ckw.get("init_value"), verbose=True)
    mx.export_function(f"{sys.argv[1]}/k{i}.mlxfn", fn, *arrays)
"""


def _ours(kkw: dict, ckw: dict) -> str:
    kernel = metal_kernel(**kkw)
    inputs = [
        mx.array(s["scalar"]) if "scalar" in s else mx.zeros(s["shape"], dtype=getattr(mx, s["dtype"]))
        for s in ckw["inputs"]
    ]
    template = [
        (n, getattr(mx, a["dtype"]) if isinstance(a, dict) else a) for n, a in ckw.get("template", [])
    ]
    gen = kernel.generate(inputs, [getattr(mx, d) for d in ckw["output_dtypes"]], template)
    return verbose_text(kkw["name"], gen.source)


def test_generated_source_equals_mlx(tmp_path):
    # Without Metal, MLX still generates (and prints) the source while tracing for export.
    r = subprocess.run(
        [sys.executable, "-c", _MLX_SCRIPT, str(tmp_path)],
        input=json.dumps(SOURCE_CASES), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    theirs = r.stdout.split("Generated source code for `")[1:]
    assert len(theirs) == len(SOURCE_CASES)
    for (kkw, ckw), text in zip(SOURCE_CASES, theirs):
        assert _ours(kkw, ckw) == "Generated source code for `" + text, kkw["name"]


def test_verbose_prints_the_source(capsys):
    kernel = metal_kernel(name="copy", input_names=["inp"], output_names=["out"],
                          source="out[thread_position_in_grid.x] = inp[thread_position_in_grid.x];")  # fmt: skip
    x = mx.arange(8).astype(mx.float32)
    (out,) = kernel(inputs=[x], grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)],
                    output_dtypes=[mx.float32], verbose=True)  # fmt: skip
    printed = capsys.readouterr().out
    assert printed.startswith("Generated source code for `copy`:\n```\n[[kernel]] void custom_kernel_copy_float_float(")
    assert np.array_equal(np.array(out), np.arange(8))


# ---- running kernels ----------------------------------------------------------------------------

def _run1(kernel, inputs, grid, tg, shape, dtype=mx.float32, **kw):
    return kernel(inputs=inputs, grid=grid, threadgroup=tg, output_shapes=[shape],
                  output_dtypes=[dtype], **kw)[0]  # fmt: skip


VECTOR_SRC = """
    uint i = thread_position_in_grid.x;
    float4 v = float4(a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]);
    float4 w = float4(v.zw, v.xy) * 2.0f + float4(1.0f);   // constructors from vectors, splat
    w.yz = w.zy;                                           // swizzle assignment
    half4 h = half4(w);                                    // conversion
    float3 t = float3(h.xyz) + v.www;
    out[4 * i] = max(t.x, 0.0f);
    out[4 * i + 1] = clamp(t.y, -1.0f, 1.0f);
    out[4 * i + 2] = dot(v, float4(1, 2, 3, 4)) + fast::exp(0.0f) + precise::sqrt(abs(v.x));
    out[4 * i + 3] = select(v.x, v.y, v.x < v.y) + float(all(v.xy == v.xy)) + metal::rsqrt(4.0f);
"""


def test_vectors_swizzles_and_math():
    kernel = metal_kernel(name="vectors", input_names=["a"], output_names=["out"], source=VECTOR_SRC)
    a = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    out = np.array(_run1(kernel, [mx.array(a.ravel())], (6, 1, 1), (4, 1, 1), (24,))).reshape(6, 4)
    w = np.concatenate([a[:, 2:], a[:, :2]], 1) * 2 + 1
    w[:, [1, 2]] = w[:, [2, 1]]
    t = w[:, :3].astype(np.float16).astype(np.float32) + a[:, 3:4]
    want = np.stack([
        np.maximum(t[:, 0], 0), np.clip(t[:, 1], -1, 1),
        a @ np.array([1, 2, 3, 4], np.float32) + 1 + np.sqrt(np.abs(a[:, 0])),
        np.where(a[:, 0] < a[:, 1], a[:, 1], a[:, 0]) + 1 + 0.5,
    ], 1)  # fmt: skip
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tg_reduce():
    return metal_kernel(name="tg_reduce", input_names=["inp"], output_names=["out"], source=TG_REDUCE)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(8, 3000), tg=st.sampled_from([32, 64, 96, 256]))
def test_threadgroup_reduction_with_edge_groups(tg_reduce, n, tg):
    # grid = n threads: the last threadgroup is smaller when tg does not divide n
    x = np.random.default_rng(n).normal(size=n).astype(np.float32)
    groups = -(-n // tg)
    out = np.array(_run1(tg_reduce, [mx.array(x)], (n, 1, 1), (tg, 1, 1), (groups,)))
    want = np.array([x[g * tg : (g + 1) * tg].sum() for g in range(groups)])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


EXPR_SIZE_REDUCE = """
    threadgroup float buf[NSG * 32];           // array sizes are constant expressions
    threadgroup float sg_max[2 * NSG / 2][1];
    uint tid = thread_index_in_threadgroup;
    uint gid = thread_position_in_grid.x;
    float v = inp[gid];
    buf[tid] = v;
    float m = simd_max(v > 2.0f ? v : -INFINITY);  // a SIMD-group may have no such value
    if (thread_index_in_simdgroup == 0) sg_max[simdgroup_index_in_threadgroup][0] = m;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        float s = 0.0f, mx = -INFINITY;
        for (uint i = 0; i < threads_per_threadgroup.x; ++i) s += buf[i];
        for (uint k = 0; k < simdgroups_per_threadgroup; ++k) mx = max(mx, sg_max[k][0]);
        uint g = threadgroup_position_in_grid.x;
        out[2 * g] = s;
        out[2 * g + 1] = mx == -INFINITY ? INFINITY : mx * M_PI_F;
    }
"""


@pytest.mark.parametrize("nsg, n", [(2, 200), (4, 300)])
def test_threadgroup_arrays_sized_by_expressions(nsg, n):
    # `threadgroup float buf[NSG * 32];` once became a per-thread array (the `*` read as a pointer)
    kernel = metal_kernel(name="expr_reduce", input_names=["inp"], output_names=["out"],
                          source=EXPR_SIZE_REDUCE)  # fmt: skip
    x = np.random.default_rng(n).normal(size=n).astype(np.float32)
    tg = nsg * 32
    groups = -(-n // tg)
    out = np.array(_run1(kernel, [mx.array(x)], (n, 1, 1), (tg, 1, 1), (2 * groups,),
                         template=[("NSG", nsg)])).reshape(groups, 2)  # fmt: skip
    for g in range(groups):
        part = x[g * tg : (g + 1) * tg]
        np.testing.assert_allclose(out[g, 0], part.sum(), rtol=1e-4, atol=1e-4)
        big = part[part > 2.0]
        assert out[g, 1] == (big.max() * np.float32(np.pi) if big.size else np.inf)
    assert np.isinf(out[:, 1]).any() and np.isfinite(out[:, 1]).any()  # both cases seen


@pytest.mark.parametrize(
    "decl, names",
    [
        ("threadgroup float a[NSG * D];", ["a"]),
        ("threadgroup float a[2 * 32][4], b[(N + 1) * sizeof(float)];", ["a", "b"]),
        ("threadgroup atomic<uint> n;", ["n"]),
        ("threadgroup vec<float, 4> v[N * 2];", ["v"]),
        ("alignas(sizeof(float4)) threadgroup float q[4 * 4];", ["q"]),
        ("threadgroup float m[2] = {-INFINITY,\n 0.0f}, k[3];", ["m", "k"]),
        ("threadgroup float* p = buf + 2 * 3;", None),
        ("threadgroup float& r = buf[0];", None),
        ("threadgroup float* ptrs[4];", None),
        ("threadgroup float (*pp)[4] = &a;", None),
        ("auto p = (threadgroup float*)(q);", None),
        ("void f(threadgroup float* x, uint i) { x[0] = 1; }", None),
        ("void f(threadgroup float x[4], uint i) { x[0] = 1; }", None),
        ("#define TG threadgroup\nTG float z[4];", None),
    ],
)
def test_threadgroup_storage_or_qualifier(decl, names):
    cpp = msl_to_cpp(decl)
    assert "threadgroup" not in cpp and cpp.count("\n") == decl.count("\n")  # lines kept
    if names is None:  # an address-space qualifier: the keyword disappears
        assert "static" not in cpp and "tg_register" not in cpp
    else:  # storage shared by the threadgroup; initializers are dropped (memory starts poisoned)
        assert "static" in cpp and "INFINITY" not in cpp
        assert [part.split(",")[1].strip() for part in cpp.split("tg_register(")[1:]] == [
            f"sizeof({n})" for n in names
        ]


MSL_CONSTANTS = {
    "INFINITY": np.inf, "-INFINITY": -np.inf, "HUGE_VALF": np.inf, "HUGE_VALH": np.inf,
    "MAXFLOAT": np.finfo(np.float32).max, "FLT_MAX": np.finfo(np.float32).max,
    "FLT_MIN": np.finfo(np.float32).tiny, "FLT_EPSILON": np.finfo(np.float32).eps,
    "HALF_MAX": 65504.0, "MAXHALF": 65504.0, "HALF_MIN": 2.0**-14, "HALF_EPSILON": 2.0**-10,
    "BFLOAT_MAX": float.fromhex("0x1.fep127"), "MAXBFLOAT": float.fromhex("0x1.fep127"),
    "BFLOAT_EPSILON": 2.0**-7,
    "M_PI_F": np.float32(np.pi), "M_E_F": np.float32(np.e), "M_LN2_F": np.float32(np.log(2)),
    "M_LOG2E_F": np.float32(np.log2(np.e)), "M_SQRT2_F": np.float32(np.sqrt(2)),
    "M_SQRT1_2_F": np.float32(np.sqrt(0.5)), "M_PI_H": np.float16(np.pi),
    "M_PI_BF": 3.140625,  # pi rounded to bfloat's 8 significant bits
    "FLT_MAX_EXP": 128, "FLT_MIN_EXP": -125, "FLT_RADIX": 2, "HALF_MANT_DIG": 11,
    "BFLOAT_MANT_DIG": 8,
    "sizeof(INFINITY) + sizeof(M_PI_F) + sizeof(FLT_MAX)": 12,  # float
    "sizeof(HALF_MAX) + sizeof(M_PI_H) + sizeof(M_PI_BF)": 6,  # half, half, bfloat
}  # fmt: skip


def test_msl_constants():
    src = "constexpr float lo = -INFINITY;\nout[0] = isnan(NAN) && lo < 0;\n"
    src += "".join(f"out[{k + 1}] = {expr};\n" for k, expr in enumerate(MSL_CONSTANTS))
    kernel = metal_kernel(name="constants", input_names=["inp"], output_names=["out"], source=src)
    out = np.array(_run1(kernel, [mx.zeros(1)], (1, 1, 1), (1, 1, 1), (len(MSL_CONSTANTS) + 1,)))
    assert out[0] == 1
    for expr, got in zip(MSL_CONSTANTS, out[1:]):
        assert got == np.float32(MSL_CONSTANTS[expr]), expr


def test_missing_barrier_is_caught():
    # the planted bug: no barrier between filling threadgroup memory and the tree reduction
    buggy = TG_REDUCE.replace("threadgroup_barrier(mem_flags::mem_threadgroup);\n    for", "for", 1)
    assert buggy != TG_REDUCE
    kernel = metal_kernel(name="tg_reduce_no_barrier", input_names=["inp"], output_names=["out"], source=buggy)
    x = np.ones(512, np.float32)
    out = np.array(_run1(kernel, [mx.array(x)], (512, 1, 1), (256, 1, 1), (2,)))
    # threadgroups alternate running their threads forward and backward; in the forward one,
    # thread 0 reads buf[128] before thread 128 wrote it and gets the NaN poison
    assert np.isnan(out[0]) and out[1] == 256, out


SIMD_SRC = """
    uint i = thread_position_in_grid.x;
    float v = inp[i];
    float s = simd_sum(v);
    float m = simd_max(v);
    float p = simd_prefix_exclusive_sum(v);
    float x = simd_shuffle_xor(v, 1);
    float d = simd_shuffle_down(v, 4);
    float b = simd_broadcast(v, 2);
    uint lanes = simd_sum(1u);
    out[8 * i] = s; out[8 * i + 1] = m; out[8 * i + 2] = p; out[8 * i + 3] = x;
    out[8 * i + 4] = d; out[8 * i + 5] = b; out[8 * i + 6] = lanes;
    out[8 * i + 7] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
"""


def test_simd_group_operations_full_and_partial():
    kernel = metal_kernel(name="simd_ops", input_names=["inp"], output_names=["out"], source=SIMD_SRC)
    n, tg = 112, 48  # threadgroups of 48 = 32 + 16 lanes, the last group 16 threads
    x = np.random.default_rng(1).normal(size=n).astype(np.float32)
    out = np.array(_run1(kernel, [mx.array(x)], (n, 1, 1), (tg, 1, 1), (8 * n,))).reshape(n, 8)
    for start in range(0, n, tg):
        group = np.arange(start, min(start + tg, n))
        for sg in range(0, len(group), 32):
            idx = group[sg : sg + 32]  # one SIMD-group, possibly partial
            v, k = x[idx], len(idx)
            lane = np.arange(k)
            np.testing.assert_allclose(out[idx, 0], v.sum(), rtol=1e-5)
            assert np.array_equal(out[idx, 1], np.full(k, v.max()))
            np.testing.assert_allclose(out[idx, 2], np.cumsum(v) - v, atol=1e-5)
            xor = lane ^ 1
            ok = xor < k
            assert np.array_equal(out[idx, 3][ok], v[xor[ok]])
            down = np.where(lane + 4 < 32, lane + 4, lane)
            ok = down < k  # reading a lane that does not exist gives the poison
            assert np.array_equal(out[idx, 4][ok], v[down[ok]])
            assert np.isnan(out[idx, 4][~ok]).all()
            assert np.array_equal(out[idx, 5], np.full(k, v[2]))
            assert np.array_equal(out[idx, 6], np.full(k, k))
            assert np.array_equal(out[idx, 7], (sg // 32) * 100 + lane)


def test_atomics():
    kernel = metal_kernel(
        name="atomics", input_names=["idx", "val"], output_names=["counts"], atomic_outputs=True,
        source="""
            uint i = thread_position_in_grid.x;
            if (i >= idx_shape[0]) return;
            atomic_fetch_add_explicit(&counts[idx[i]], val[i], memory_order_relaxed);
            atomic_fetch_max_explicit(&counts[8], val[i], memory_order_relaxed);
        """,
    )  # fmt: skip
    rng = np.random.default_rng(2)
    idx = rng.integers(0, 8, size=1000).astype(np.int32)
    val = rng.integers(0, 50, size=1000).astype(np.int32)
    out = np.array(_run1(kernel, [mx.array(idx), mx.array(val)], (1024, 1, 1), (128, 1, 1), (9,),
                         mx.int32, init_value=0))  # fmt: skip
    want = np.bincount(idx, weights=val, minlength=8).astype(np.int32)
    assert np.array_equal(out[:8], want) and out[8] == val.max()


ATTRS_SRC = """
    uint3 p = thread_position_in_grid;
    uint k = (p.y * threads_per_grid.x + p.x) * 8;
    out[k] = threadgroup_position_in_grid.x; out[k + 1] = threadgroup_position_in_grid.y;
    out[k + 2] = thread_position_in_threadgroup.x; out[k + 3] = thread_position_in_threadgroup.y;
    out[k + 4] = threads_per_threadgroup.x; out[k + 5] = threads_per_threadgroup.y;
    out[k + 6] = thread_index_in_threadgroup; out[k + 7] = threadgroups_per_grid.x;
"""


def test_edge_threadgroups_in_2d():
    kernel = metal_kernel(name="attrs", input_names=["inp"], output_names=["out"], source=ATTRS_SRC)
    gx, gy, tx, ty = 10, 7, 4, 3
    out = np.array(_run1(kernel, [mx.zeros(1)], (gx, gy, 1), (tx, ty, 1), (gx * gy * 8,), mx.uint32))
    out = out.reshape(gy, gx, 8)
    y, x = np.mgrid[0:gy, 0:gx]
    size_x = np.minimum(tx, gx - (x // tx) * tx)  # edge groups are smaller
    size_y = np.minimum(ty, gy - (y // ty) * ty)
    want = np.stack([x // tx, y // ty, x % tx, y % ty, size_x, size_y,
                     (y % ty) * size_x + x % tx, np.full_like(x, -(-gx // tx))], -1)  # fmt: skip
    assert np.array_equal(out, want)


def test_half_and_bfloat_io():
    kernel = metal_kernel(
        name="half_io", input_names=["h", "b"], output_names=["oh", "ob"],
        source="""
            uint i = thread_position_in_grid.x;
            oh[i] = h[i] * h[i] + 1.5h;          // half arithmetic, rounded per operation
            ob[i] = bfloat(float(b[i]) * 3.0f);
        """,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    h = mx.array(rng.normal(size=40).astype(np.float16))
    b = mx.array(rng.normal(size=40).astype(np.float32)).astype(mx.bfloat16)
    oh, ob = kernel(inputs=[h, b], grid=(40, 1, 1), threadgroup=(16, 1, 1), output_shapes=[(40,), (40,)],
                    output_dtypes=[mx.float16, mx.bfloat16])  # fmt: skip
    assert oh.dtype == mx.float16 and ob.dtype == mx.bfloat16
    hn = np.array(h)
    assert np.array_equal(np.array(oh), (hn * hn).astype(np.float16) + np.float16(1.5))
    want_b = (b.astype(mx.float32) * 3.0).astype(mx.bfloat16)
    assert mx.array_equal(ob, want_b).item()


def test_strided_input_scalar_and_template_args():
    kernel = metal_kernel(
        name="strided", input_names=["a", "scale"], output_names=["out"], ensure_row_contiguous=False,
        source="""
            uint i = thread_position_in_grid.x;
            auto loc = elem_to_loc(i, a_shape, a_strides, a_ndim);
            out[i] = T(a[loc] * scale * N + (FLAG ? 1 : 0));
        """,
    )  # fmt: skip
    a = mx.arange(12).astype(mx.float32).reshape(3, 4).T  # not row-contiguous: strides (1, 4)
    out = _run1(kernel, [a, 0.5], (12, 1, 1), (8, 1, 1), (12,),
                template=[("T", mx.float32), ("N", 3), ("FLAG", True)])  # fmt: skip
    assert np.array_equal(np.array(out), np.array(a).ravel() * 1.5 + 1)


def test_unwritten_outputs_are_poisoned():
    kernel = metal_kernel(name="half_written", input_names=["inp"], output_names=["out"],
                          source="uint i = thread_position_in_grid.x; if (i % 2 == 0) out[i] = inp[i];")  # fmt: skip
    out = np.array(_run1(kernel, [mx.ones(8)], (8, 1, 1), (8, 1, 1), (8,)))
    assert np.array_equal(out[::2], np.ones(4)) and np.isnan(out[1::2]).all()


CONSTRUCTS_HEADER = """
#include <metal_stdlib>
#include <metal_simdgroup>
using namespace metal;
constant constexpr int TILE = 4;
constant float table[4] = {1.0f, 2.0f, 3.0f, 4.0f};
template <typename T>
METAL_FUNC float load4(const device T* p, thread float4& acc, threadgroup float* scratch, uint i) {
    acc += float4(p[0], p[1], p[2], p[3]);
    scratch[i] = acc.x;
    return acc.w;
}
"""

CONSTRUCTS_SRC = """
    uint gid = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    threadgroup float scratch[32];
    threadgroup half hs[2][32];
    float4 acc = 0;
    float w = load4(k + gid * TILE, acc, scratch, lane);          // acc = k[4g .. 4g+3]
    const device half4* kv = (const device half4*)(k) + gid;
    float4 f = float4(kv[0]);
    uint4 nib = (uint4(q[gid]) >> uint4(0, 4, 8, 12)) & 0xF;      // unpack four nibbles
    float4 deq = float4(nib) * 0.5f - 1.0f;
    float m = max(-INFINITY, simd_max(f.x));
    float e = fast::exp(f.x - m) * precise::exp(0.0f) * metal::exp2(1.0f) * M_LN2_F;
    hs[lane / 32][lane] = half(e);
    uint2 u2 = as_type<uint2>(float2(1.0f, 2.0f));
    threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
    simdgroup_barrier(mem_flags::mem_none);
    float t = 0;
    #pragma clang loop unroll(full)
    for (int i = 0; i < TILE; i++) { t += table[i]; }
    out[4 * gid] = w - acc.w + dot(f, float4(1)) - (acc.x + acc.y + acc.z + acc.w);
    out[4 * gid + 1] = dot(deq, float4(1, 10, 100, 1000));
    out[4 * gid + 2] = float(hs[0][lane ^ 1]) + scratch[lane ^ 1] + isnan(NAN) + t;
    out[4 * gid + 3] = as_type<float>(u2.y) + popcount(q[gid]) + length(float2(3, 4));
"""


def test_common_msl_constructs():
    kernel = metal_kernel(name="constructs", input_names=["k", "q"], output_names=["out"],
                          source=CONSTRUCTS_SRC, header=CONSTRUCTS_HEADER)  # fmt: skip
    rng = np.random.default_rng(4)
    k = rng.normal(size=4 * 32).astype(np.float16)
    q = rng.integers(0, 2**16, size=32).astype(np.uint32)
    out = np.array(_run1(kernel, [mx.array(k), mx.array(q)], (32, 1, 1), (32, 1, 1), (128,))).reshape(32, 4)
    kf = k.astype(np.float32).reshape(32, 4)
    nib = (q[:, None] >> np.array([0, 4, 8, 12])) & 0xF
    e = (np.exp(kf[:, 0] - kf[:, 0].max()) * 2 * np.float32(np.log(2))).astype(np.float16).astype(np.float32)
    partner = np.arange(32) ^ 1
    np.testing.assert_allclose(out[:, 0], 0, atol=1e-5)
    np.testing.assert_allclose(out[:, 1], (nib * 0.5 - 1) @ np.array([1, 10, 100, 1000]), rtol=1e-6)
    np.testing.assert_allclose(out[:, 2], e[partner] + kf[partner, 0] + 1 + 10, rtol=1e-3)
    bits = np.array([bin(v).count("1") for v in q])
    np.testing.assert_allclose(out[:, 3], 2 + bits + 5)


# ---- errors name the kernel and never take the test process down --------------------------------

def test_divergent_barrier_raises():
    kernel = metal_kernel(
        name="early_exit", input_names=["inp"], output_names=["out"],
        source="""
            uint i = thread_position_in_grid.x;
            if (i >= 5) return;  // threads that leave before the barrier: a hang on a GPU
            threadgroup_barrier(mem_flags::mem_threadgroup);
            out[i] = inp[i];
        """,
    )  # fmt: skip
    with pytest.raises(MetalInterpretError, match=r"kernel `early_exit`.*divergent threadgroup_barrier"):
        _run1(kernel, [mx.zeros(8)], (8, 1, 1), (8, 1, 1), (8,))


def test_divergent_simd_operations_raise():
    kernel = metal_kernel(
        name="simd_diverge", input_names=["inp"], output_names=["out"],
        source="""
            uint l = thread_index_in_simdgroup;
            float v = inp[l];
            out[l] = l < 16 ? simd_sum(v) : simd_max(v);
        """,
    )  # fmt: skip
    with pytest.raises(MetalInterpretError, match=r"kernel `simd_diverge`.*divergent SIMD-group"):
        _run1(kernel, [mx.zeros(32)], (32, 1, 1), (32, 1, 1), (32,))


def test_compile_error_shows_compiler_message():
    kernel = metal_kernel(name="broken", input_names=["inp"], output_names=["out"],
                          source="out[0] = inp[0] + not_declared;")  # fmt: skip
    with pytest.raises(MetalCompileError) as e:
        _run1(kernel, [mx.zeros(8)], (1, 1, 1), (1, 1, 1), (1,))
    assert "`broken`" in str(e.value) and "not_declared" in str(e.value)
    assert "error:" in str(e.value)


def test_out_of_bounds_access_is_an_exception():
    kernel = metal_kernel(name="far_write", input_names=["inp"], output_names=["out"],
                          source="out[thread_position_in_grid.x * 400000000u] = inp[0];")  # fmt: skip
    with pytest.raises(MetalInterpretError, match=r"kernel `far_write`.*SIGSEGV"):
        _run1(kernel, [mx.zeros(8)], (4, 1, 1), (4, 1, 1), (8,))


def test_threadgroup_memory_limit():
    kernel = metal_kernel(name="too_big", input_names=["inp"], output_names=["out"],
                          source="threadgroup float big[9000]; big[0] = inp[0]; out[0] = big[0];")  # fmt: skip
    with pytest.raises(MetalInterpretError, match="exceeds the 32768 bytes"):
        _run1(kernel, [mx.zeros(8)], (1, 1, 1), (1, 1, 1), (1,))


def test_endless_loop_times_out(monkeypatch):
    monkeypatch.setenv("ROOFLINE_INTERPRET_TIMEOUT", "1")
    kernel = metal_kernel(name="spin", input_names=["inp"], output_names=["out"],
                          source="volatile uint k = 0; while (inp[0] == 0.0f) { k = k + 1; } out[0] = k;")  # fmt: skip
    with pytest.raises(MetalInterpretError, match=r"kernel `spin`.*timed out"):
        _run1(kernel, [mx.zeros(8)], (1, 1, 1), (1, 1, 1), (1,))
