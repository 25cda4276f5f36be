"""The dependency direction of DESIGN.md (docs/architecture.md, "What may import what"), checked by importing every
module of app, mlx_engine, kernels_metal and quant, each alone in a fresh interpreter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.torch_support import available, require


def imported_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_front_ends_import_no_mlx_or_torch() -> None:
    mods = imported_after("import app.cli, mlx_engine, mlx_engine.api")
    assert not {"mlx", "mlx_lm", "torch", "kernels_metal"} & mods


# Each module imported alone, in a child forked from one interpreter (cheap, and nothing one module imports hides
# another's): module -> the top-level packages in sys.modules after it, or "!error" where it does not import. The
# parent first imports argv[1] (comma-separated), packages every module probed may import, so no child pays for them.
PROBE = """
import importlib, os, sys
for name in filter(None, sys.argv[1].split(",")):
    importlib.import_module(name)
out = []
for name in sys.argv[2:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            msg = " ".join(sorted({m.split(".")[0] for m in sys.modules}))
        except BaseException as e:
            msg = "!" + repr(e)
        with os.fdopen(w, "w") as f:
            f.write(msg)
        os._exit(0)  # no atexit: a child that imported MLX leaves at once
    os.close(w)
    with os.fdopen(r) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    out.append(name + "\\t" + msg)
print("\\n".join(out))
"""
PACKAGES = ("app", "mlx_engine", "kernels_metal", "quant")
TORCH_BACKEND = "mlx_engine.backends.torch"  # the one place torch may be imported
# what every module under a prefix may import, preloaded by the probe (nothing banned below)
PRELOAD = {"app": ("numpy", "rich", "textual"), "mlx_engine": ("numpy", "mlx.core", "mlx.nn"),
           TORCH_BACKEND: ("numpy", "mlx.core", "mlx.nn", "torch"), "kernels_metal": ("numpy", "mlx.core"),
           "quant": ("numpy",)}


def preload_of(module: str) -> str:
    prefix = max((p for p in PRELOAD if module == p or module.startswith(p + ".")), key=len)
    return ",".join(PRELOAD[prefix])


def in_torch_backend(module: str) -> bool:
    return module == TORCH_BACKEND or module.startswith(TORCH_BACKEND + ".")


def every_module(*packages: str) -> list[str]:
    """Every module and subpackage of `packages` (pkgutil's walk, the packages themselves included); without torch
    (the optional extra), the torch backend's modules are left out: test_the_torch_backend_keeps_the_rules checks
    them where torch is installed."""
    import importlib
    import pkgutil

    names = []
    for name in packages:
        pkg = importlib.import_module(name)
        names += [name] + [m.name for m in pkgutil.walk_packages(pkg.__path__, name + ".")]
    return names if available("torch") else [n for n in names if not in_torch_backend(n)]


@pytest.fixture(scope="module")
def imports() -> dict[str, set[str]]:
    names, rows = every_module(*PACKAGES), {}
    for preload in sorted(set(map(preload_of, names))):
        mods = [n for n in names if preload_of(n) == preload]
        r = subprocess.run([sys.executable, "-c", PROBE, preload, *mods], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        rows.update(line.split("\t", 1) for line in r.stdout.splitlines())
    assert set(rows) == set(names), "the probe lost modules"
    failed = {n: m for n, m in rows.items() if m.startswith("!")}
    assert not failed, failed
    return {n: set(m.split()) for n, m in rows.items()}


def modules_in(*packages: str) -> set[str]:
    """The module names of every .py file under `packages` (dotted), read from the tree, not imported."""
    root = Path(__file__).resolve().parent.parent
    return {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            for package in packages for f in (root / Path(*package.split("."))).rglob("*.py")}


def test_the_walk_finds_every_module(imports: dict[str, set[str]]) -> None:
    assert {m for m in modules_in(*PACKAGES) if available("torch") or not in_torch_backend(m)} == set(imports)


def test_the_torch_backend_keeps_the_rules(imports: dict[str, set[str]]) -> None:
    """Where torch is installed, the probe imported every module of the torch backend too (the other tests here
    then hold them to the rules); without it, this test skips and the rest check everything else."""
    require("torch")
    torch_modules = modules_in(TORCH_BACKEND)
    assert torch_modules and torch_modules <= set(imports)
    assert offenders({n: imports[n] for n in torch_modules}, "mlx_engine", lambda n: {"textual", "app"}) == {}


def offenders(imports: dict[str, set[str]], package: str, banned: Any) -> dict[str, list[str]]:
    """Modules of `package` that import a banned package (`banned(module)`: the set for that module)."""
    found = {n: sorted(banned(n) & m) for n, m in imports.items() if n.split(".")[0] == package}
    return {n: b for n, b in found.items() if b}


def test_no_front_end_module_imports_mlx_torch_or_kernels(imports: dict[str, set[str]]) -> None:
    assert offenders(imports, "app", lambda n: {"mlx", "mlx_lm", "torch", "triton", "kernels_metal"}) == {}


def test_the_chat_app_and_the_shared_tool_calls_keep_apart_from_the_web_server(imports: dict[str, set[str]]) -> None:
    """The TUI never imports the server (its web stack: starlette) nor, until a config asks for MCP servers, the MCP
    SDK; app/toolcalls, which both use, imports neither Textual nor the web stack."""
    tui = {n: m for n, m in imports.items() if n.startswith("app.tui")}
    assert tui and offenders(tui, "app", lambda n: {"starlette", "uvicorn", "mcp"}) == {}
    shared = imported_after("import app.toolcalls.tools, app.toolcalls.tool_formats, app.toolcalls.schemas")
    assert not {"starlette", "uvicorn", "textual", "mcp"} & shared  # (the probe above preloads textual for app)


def test_no_engine_module_imports_textual_or_app(imports: dict[str, set[str]]) -> None:
    """...nor torch, outside the optional torch backend (mlx_engine/backends/torch/)."""
    assert offenders(imports, "mlx_engine", lambda n: {"textual", "app"} | (
        set() if in_torch_backend(n) else {"torch", "triton"})) == {}


def test_kernels_never_import_the_engine(imports: dict[str, set[str]]) -> None:
    assert offenders(imports, "kernels_metal", lambda n: {"mlx_engine", "app", "textual"}) == {}


def test_quant_imports_nothing_of_ours_and_no_array_library_but_numpy(imports: dict[str, set[str]]) -> None:
    """The formats' home sits below the kernels (kernels_metal and mlx_engine both import it): numpy and gguf-py
    only, and gguf-py's package __init__ (its writer, sentencepiece, yaml) not at import."""
    assert offenders(imports, "quant", lambda n: {"app", "mlx_engine", "kernels_metal", "mlx", "mlx_lm", "torch",
                                                  "triton", "textual", "gguf"}) == {}


def test_only_the_torch_backend_imports_torch() -> None:
    """torch (and triton) is an optional extra: only mlx_engine/backends/torch/ may import it."""
    root = Path(__file__).resolve().parent.parent
    allowed = root / "mlx_engine" / "backends" / "torch"
    pattern = re.compile(r"^\s*(import|from)\s+(torch|triton)\b", re.MULTILINE)
    offenders = [str(f.relative_to(root)) for folder in ("mlx_engine", "app", "kernels_metal", "quant")
                 for f in sorted((root / folder).rglob("*.py"))
                 if allowed not in f.parents and pattern.search(f.read_text())]
    assert not offenders, offenders


def test_the_torch_backend_reads_the_environment_in_one_module() -> None:
    """The torch backend's environment variables are read (and inductor's cache dir set) in `switches.py` only, each
    with its help text there; what a user sets per model is a load option."""
    root = Path(__file__).resolve().parent.parent
    folder = root / "mlx_engine" / "backends" / "torch"
    readers = sorted(str(f.relative_to(folder)) for f in folder.rglob("*.py") if "os.environ" in f.read_text())
    assert readers == ["switches.py"], readers


def test_roofline_switches_are_read_in_two_modules() -> None:
    """Every ROOFLINE_* variable the engine reads, and the help text that says what it does, is in
    `mlx_engine/switches.py` or, for the torch backend, `backends/torch/switches.py`: no other module both reads the
    environment and names a ROOFLINE_* variable."""
    root = Path(__file__).resolve().parent.parent
    readers = sorted(str(f.relative_to(root)) for f in (root / "mlx_engine").rglob("*.py")
                     if re.search(r"os\.environ|getenv", text := f.read_text()) and re.search(r"[\"']ROOFLINE_", text))
    assert readers == ["mlx_engine/backends/torch/switches.py", "mlx_engine/switches.py"], readers


def test_reading_gguf_skips_gguf_pys_init_but_keeps_it_whole() -> None:
    """The GGUF reader and architecture tables import gguf-py's `constants` and `tensor_mapping` without its
    package __init__, which imports its writer, sentencepiece and yaml (2 MB of RSS and 0.1 s at every GGUF
    load); `gguf.GGUFWriter` and `from gguf import GGUFReader` still run it."""
    code = ("import mlx_engine.loading.gguf_arch, mlx_engine.loading.gguf_file, sys\n"
            "heavy = {'sentencepiece', 'yaml', 'gguf.gguf_writer', 'gguf.vocab'} & set(sys.modules)\n"
            "assert not heavy, sorted(heavy)\n"
            "import gguf\nfrom gguf import GGUFReader\n"
            "assert gguf.GGUFWriter.__name__ == 'GGUFWriter' and 'gguf.gguf_writer' in sys.modules\n"
            "assert gguf.quants.dequantize and gguf.constants.GGML_QUANT_SIZES\n")
    assert "gguf" in imported_after(code)


def test_loading_a_model_skips_mlx_lms_init_but_keeps_it_whole() -> None:
    """`Engine.load` imports mlx-lm's light model modules without mlx-lm's package __init__, which imports
    transformers (and torch where installed): 4 s at every start. The first use of a name only that __init__
    defines runs it, so code that wants all of mlx-lm still gets it."""
    golden = Path(__file__).resolve().parent / "data" / "golden" / "llama"
    code = (f"from mlx_engine import Engine\nimport sys\nEngine.load({str(golden)!r}).close()\n"
            "heavy = {'transformers', 'torch'} & set(sys.modules)\nassert not heavy, sorted(heavy)\n"
            "import mlx_lm\nfrom mlx_lm import load, stream_generate\n"
            "assert mlx_lm.__version__ and callable(load) and 'transformers' in sys.modules\n"
            "from mlx_lm.models.cache import KVCache\nassert KVCache().offset == 0")
    mods = imported_after(code)
    assert "mlx_lm" in mods


# ---- import circles -----------------------------------------------------------------------------------------


def import_graph(*packages: str) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports, read from the source (module level and inside functions;
    `if TYPE_CHECKING:` blocks left out). `from pkg import name` counts as importing `pkg.name` where that is a
    module, else `pkg`."""
    import ast

    root = Path(__file__).resolve().parent.parent
    files = {m: root / Path(*m.split(".")) for m in modules_in(*packages)}
    files = {m: (f / "__init__.py" if f.is_dir() else f.with_suffix(".py")) for m, f in files.items()}

    def owner(name: str) -> str | None:  # the innermost module of ours that `name` is or lies in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: list[str] = []
        nodes = [ast.parse(path.read_text())]
        while nodes:
            node = nodes.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                nodes.extend(node.orelse)
                continue
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            nodes.extend(ast.iter_child_nodes(node))
        graph[module] = {o for t in targets if (o := owner(t)) and o != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_circles_finds_a_circle_through_a_function_level_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [{"a", "b", "c"}]


def test_no_import_circles() -> None:
    """Inside app, mlx_engine and kernels_metal no module imports, directly or through others, one that imports it
    back, at module level or inside a function."""
    found = circles(import_graph(*PACKAGES))
    assert found == []
