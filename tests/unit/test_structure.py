"""The package's shape, as a newcomer meets it: layers whose imports all point down (LAYERS),
rlserve.engine above rlserve.worker (the values they share, rlserve.sequence and
rlserve.sampling_params, below both), no function outgrows a screen, and the README's
layout names every module."""

from __future__ import annotations

import ast
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import rlserve.worker

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlserve"
MAX_FUNCTION_LINES = 60

_BELOW_THE_ENGINE = ["rlserve.sampling_params", "rlserve.sequence", "rlserve.config"] + [
    f"rlserve.worker.{m.name}" for m in pkgutil.iter_modules(rlserve.worker.__path__)]


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def test_importing_the_workers_imports_no_engine_module():
    """In a fresh interpreter, every module of rlserve.worker (and the shared values) loads
    without loading any of rlserve.engine: the worker never reaches up."""
    code = ("import importlib, json, sys\n"
            f"for name in {_BELOW_THE_ENGINE!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('rlserve.engine'))))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(_BELOW_THE_ENGINE) > 6  # the worker package was found
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def test_no_worker_module_imports_the_engine_even_lazily():
    """Function-level imports count too: the worker package names no rlserve.engine module."""
    found = []
    for path in sorted((PACKAGE / "worker").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                      if n == "rlserve.engine" or n.startswith("rlserve.engine.")]
    assert found == []


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).split("(")[0] == "triton.jit" for d in node.decorator_list)


def test_no_function_is_longer_than_a_screen():
    """Triton kernels (@triton.jit) excepted: they are one program each."""
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"longer than {MAX_FUNCTION_LINES} lines (split them along their seams):\n" + "\n".join(long)


def _readme_layout() -> set[str]:
    """The modules docs/layout.md names: under each `rlserve/...` heading, the `name.py`
    entries (several may share a line, separated by commas)."""
    section = (ROOT / "docs" / "layout.md").read_text()
    named, package = set(), None
    for line in section.splitlines():
        words = line.split()
        if words and words[0].endswith("/"):  # a folder's heading: rlserve's or another's
            package = words[0] if re.fullmatch(r"rlserve(/\w+)*/", words[0]) else None
            words = words[1:]
        if package is None:
            continue
        for word in words:
            if not re.fullmatch(r"\w+\.py,?", word):
                break
            named.add(package + word.rstrip(","))
    return named


def test_the_readme_layout_names_every_module():
    modules = {str(p.relative_to(ROOT)) for p in _modules()}
    named = _readme_layout()
    assert sorted(modules - named) == [], "modules docs/layout.md does not name"
    assert sorted(named - modules) == [], "modules docs/layout.md names that do not exist"


def test_the_readme_is_short_and_its_links_stay_inside_the_repository():
    """The README opens with the two commands and fits in 200 lines; reference material
    lives in docs/, and every path either points to lies in this repository."""
    text = (ROOT / "README.md").read_text()
    assert text.splitlines()[2].split()[:2] == ["make", "demo"] and len(text.splitlines()) < 200
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        body = page.read_text()
        assert "../" not in body, f"{page.relative_to(ROOT)} points outside the repository"
        for link in re.findall(r"\]\(([^)#]+)\)", body):
            if "://" not in link:
                assert (page.parent / link).exists(), f"{page.relative_to(ROOT)}: {link} does not exist"


def test_no_test_example_or_benchmark_rendezvous_at_the_outbound_interface():
    """get_ip() is the host's outbound interface: kept for vLLM scripts, but what this
    repository runs forms its groups at rendezvous_address (loopback for a local server)."""
    calls = [f"{path.relative_to(ROOT)}:{node.lineno}"
             for folder in ("tests", "examples", "benchmarks") for path in sorted((ROOT / folder).rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "get_ip"
             and path.name != "test_weight_transfer_unit.py"]
    assert calls == []


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The rlserve modules a file imports, function-local imports included (`from a import b`
    names module a.b when that is one, else a)."""
    rel = path.relative_to(ROOT).with_suffix("")
    me = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != me}


def _module_paths() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        modules[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    return modules


def _module_graph() -> dict[str, set[str]]:
    modules = _module_paths()
    return {m: _imported_modules(p, set(modules)) for m, p in modules.items()}


def _circle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                circle = visit(n)
                if circle:
                    return circle
        path.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            circle = visit(m)
            if circle:
                return circle
    return []


def _import_circle() -> list[str]:
    return _circle(_module_graph())


def test_no_import_circle_in_the_package():
    """No module of rlserve reaches itself through its imports, function-local ones
    included: every layer can be read (and loaded) before the ones that use it."""
    circle = _import_circle()
    assert not circle, "import circle: " + " -> ".join(circle)


# The package's layers, bottom first: a unit (a subpackage, or a module at the top) imports
# only units of layers below its own. Units that share a layer never import each other:
# rlserve.engine (the engine-core process) and rlserve.frontend (the API server's or the
# caller's) meet only in rlserve.wire.
LAYERS: list[set[str]] = [
    {"rlserve.errors", "rlserve.envs", "rlserve.flags", "rlserve.json_depth", "rlserve.process",
     "rlserve.distributed", "rlserve.version", "rlserve.memory"},
    {"rlserve.sampling_params"},
    {"rlserve.sequence", "rlserve.config"},
    {"rlserve.ops"},
    {"rlserve.model"},
    {"rlserve.weight_transfer"},
    {"rlserve.wire"},
    {"rlserve.worker"},
    {"rlserve.engine", "rlserve.frontend"},
    {"rlserve.llm", "rlserve.server", "rlserve.batch_invariant", "rlserve.moe_replay"},
    {"rlserve.cli"},
    {"rlserve.ray"},
    {"rlserve", "rlserve.__main__"},
]


def _unit(module: str) -> str:
    """The layered unit a module belongs to: its subpackage of rlserve, else itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else module


def _unit_edges() -> dict[str, set[str]]:
    """Unit -> the units it imports (function-local imports included), each edge once."""
    edges: dict[str, set[str]] = {}
    for m, imported in _module_graph().items():
        edges.setdefault(_unit(m), set()).update(_unit(n) for n in imported if _unit(n) != _unit(m))
    return edges


def test_every_unit_of_the_package_has_a_layer():
    layered = set().union(*LAYERS)
    assert sum(len(layer) for layer in LAYERS) == len(layered)  # each unit in one layer
    assert sorted(set(_unit_edges()) - layered) == [], "give the new package or module a layer in LAYERS"
    assert sorted(layered - set(_unit_edges())) == [], "LAYERS names a unit that does not exist"


def _upward(edges: dict[str, set[str]]) -> list[str]:
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    return sorted(f"{unit} -> {n}" for unit, imported in edges.items() for n in imported
                  if layer.get(n, len(LAYERS)) >= layer.get(unit, -1))


def test_every_import_points_down_the_layers():
    """Lazy imports count too: a function-local import still loads the layer above."""
    upward = _upward(_unit_edges())
    assert upward == [], "imports that do not point to a lower layer:\n" + "\n".join(upward)


def test_no_import_circle_between_packages():
    circle = _circle(_unit_edges())
    assert not circle, "import circle between packages: " + " -> ".join(circle)


def test_the_layering_rules_refuse_what_they_should():
    """The checks fail where they should: the engine reaching the front end (same layer),
    the model reaching the weight transfer (upward), a unit no layer names, a circle."""
    assert _unit("rlserve.frontend.async_engine") == "rlserve.frontend" and _unit("rlserve.llm") == "rlserve.llm"
    assert _upward({"rlserve.engine": {"rlserve.frontend"}}) == ["rlserve.engine -> rlserve.frontend"]
    assert _upward({"rlserve.model": {"rlserve.weight_transfer"}}) == ["rlserve.model -> rlserve.weight_transfer"]
    assert _upward({"rlserve.new": {"rlserve.errors"}}) != []
    assert _upward({"rlserve.weight_transfer": {"rlserve.model", "rlserve.errors"}}) == []
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_importing_the_model_loads_no_weight_transfer_module():
    """Every rank imports the model: it must not bring the trainer's client (and `requests`)
    or the receiver with it. The model says what it accepts (ExpectedParam); the weight
    transfer reads that, never the other way round."""
    code = ("import json, sys\nimport rlserve.model.base, rlserve.model.registry\n"
            "print(json.dumps(sorted(m for m in sys.modules if 'weight_transfer' in m or m == 'requests')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def test_the_weight_transfer_face_loads_one_side_at_a_time():
    """`import rlserve.weight_transfer` loads nothing more; a trainer's name loads the
    trainer side only, a server's name the server side only."""
    code = ("import json, sys\nimport rlserve.weight_transfer as wt\nout = [sorted(sys.modules)]\n"
            "wt.NCCLWeightTransferEngine\nout.append(sorted(sys.modules))\n"
            "wt.receiver_init\nout.append(sorted(sys.modules))\nprint(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    bare, trainer, both = (set(x) for x in json.loads(r.stdout.strip().splitlines()[-1]))
    wt = "rlserve.weight_transfer."
    assert not {m for m in bare if m.startswith(wt)}
    assert wt + "trainer.nccl" in trainer and wt + "server.receiver" not in trainer and "requests" not in trainer
    assert wt + "server.receiver" in both and wt + "trainer.client" not in both


def test_weight_transfer_sides_import_only_the_shared_layer():
    """What a training process imports (weight_transfer/trainer/) and what the server runs
    (weight_transfer/server/) meet only in the shared layer (the package's own modules):
    neither half imports the other, and the shared layer imports neither."""
    wt = PACKAGE / "weight_transfer"
    name = {p: ".".join(p.relative_to(ROOT).with_suffix("").parts) for p in wt.rglob("*.py") if p.name != "__init__.py"}
    trainer = {m for p, m in name.items() if p.parent.name == "trainer"}
    server = {m for p, m in name.items() if p.parent.name == "server"}
    assert len(trainer) >= 6 and len(server) >= 3  # the halves were found
    known = set(name.values())
    crossing = []
    for path, me in sorted(name.items()):
        imported = _imported_modules(path, known)
        forbidden = server if me in trainer else trainer if me in server else trainer | server
        crossing += [f"{me} -> {m}" for m in sorted(imported & forbidden)]
    assert crossing == []


def _environment_uses(path: Path) -> list[int]:
    """The lines where a module touches the process environment (os.environ, os.getenv)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                and node.attr in ("environ", "environb", "getenv", "putenv", "unsetenv")):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in ("environ", "environb", "getenv")]
    return lines


def test_the_environment_is_read_only_through_the_registry():
    """rlserve/envs.py is the one table of the variables rlserve reads: no other module
    touches the environment, except the spawn helper handing a child a copy of it."""
    uses = {str(p.relative_to(ROOT)): lines for p in _modules() if (lines := _environment_uses(p))}
    assert len(uses.pop("rlserve/process.py", [])) == 1, "process.spawn copies the environment, once"
    assert sorted(uses) == ["rlserve/envs.py"]


def test_every_variable_rlserve_names_is_registered_and_documented():
    """A variable named anywhere in rlserve's text (help, messages, docstrings) is one the
    registry knows, and docs/serving.md lists every one of them."""
    from rlserve import envs
    registered = {v.name for v in envs.VARIABLES}
    named = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named.update(re.findall(r"\b(?:RLSERVE|VLLM)_[A-Z][A-Z0-9_]*\b", node.value))
    assert len(named) > 5  # the text was read
    assert sorted(named - registered) == []
    docs = (ROOT / "docs" / "serving.md").read_text()
    assert sorted(v for v in registered if f"| `{v}`" not in docs) == []


def test_tests_import_helpers_not_conftest():
    """conftest.py holds fixtures only (pytest loads it); what a test imports lives in
    tests/helpers, a package, so it reads the same from every folder of the pyramid."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n == "conftest"]
    assert found == []
    assert sorted(p.name for p in (ROOT / "tests").iterdir() if p.suffix == ".py") == ["conftest.py"]


def test_only_the_executor_reaches_its_driver():
    """Rank 0's Worker is the executor's own: the engine, the offline LLM, tests and
    benchmarks read it through the executor's methods (info, expected_weights, lora,
    abort_transfer; local_runner for tests that look inside a step)."""
    found = []
    for folder in ("rlserve", "tests", "benchmarks", "scripts", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == PACKAGE / "worker" / "executor.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr == "driver":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_the_configs_reasoning_parsers_are_the_servers():
    """config.py names the parsers (it sits below the server); the server's table has the same."""
    from rlserve.config import REASONING_PARSER_NAMES
    from rlserve.frontend.reasoning_parsers import REASONING_PARSERS
    assert REASONING_PARSER_NAMES == tuple(sorted(REASONING_PARSERS))
