"""The core is layered: no import cycles anywhere in ``src/shardax`` (module level and inside
functions alike), ``shardax.parallel`` needs nothing from shardax but ``_compat``, and the
models are architectures only (no schedule, layout or training import, no mesh-axis name)."""

import ast
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, pathlib.Path]:
    return {
        ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (SRC / "shardax").rglob("*.py")
    }


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The shardax modules ``name`` imports, wherever the import statement stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_graph_is_read():
    graph = _graph()
    assert "shardax._context" in graph["shardax.rules"]
    assert "shardax.jit" in graph["shardax.mesh"]


def test_no_import_cycles():
    graph = _graph()
    cycles, done, stack = [], set(), []

    def visit(module):
        if module in stack:
            cycles.append(" -> ".join(stack[stack.index(module):] + [module]))
            return
        if module in done:
            return
        done.add(module)
        stack.append(module)
        for target in sorted(graph[module]):
            visit(target)
        stack.pop()

    for module in sorted(graph):
        visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_context_state_is_the_bottom():
    graph = _graph()
    assert graph["shardax._compat"] == set()
    assert graph["shardax._context"] == {"shardax._compat"}


def test_frameworks_sit_below_the_rules():
    """What rules need of each framework never reaches back up into rules, jit or mesh."""
    graph = _graph()
    above = {
        (module, target)
        for module, targets in graph.items() if module.startswith("shardax.frameworks")
        for target in targets
        if not target.startswith("shardax.frameworks")
        and target not in ("shardax._context", "shardax._compat", "shardax.utils")
    }
    assert not above, f"shardax.frameworks imports {sorted(above)}"


def test_parallel_needs_only_jax_and_compat():
    graph = _graph()
    outside = {
        (module, target)
        for module, targets in graph.items() if module.startswith("shardax.parallel")
        for target in targets
        if not target.startswith("shardax.parallel") and target != "shardax._compat"
    }
    assert not outside, f"shardax.parallel imports {sorted(outside)}"


# Imports that may stand inside a function: optional dependencies (extras, or the standard
# library's tomllib before Python 3.11), which a module imports only where it needs them.
OPTIONAL = {"flax", "optax", "orbax", "grain", "tokenizers", "safetensors", "pyarrow",
            "tensorboardX", "wandb", "matplotlib", "yaml", "tomllib", "tomli", "tyro", "rich",
            "equinox", "torch", "transformers", "etils", "jinja2", "huggingface_hub", "lm_eval"}
# The CLI imports jax and the train/plan modules lazily: ``shardax --help`` and ``launch`` need
# only the core install, and JAX reads --devices / JAX_PLATFORMS from the environment when it
# is imported (the module docstring of shardax.cli says so).
LAZY_IN_CLI = ("jax", "shardax.train", "shardax.plan", "shardax.distributed", "shardax.launch")


def _function_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every import inside a function of ``path`` (``from a import b``
    gives ``a.b``)."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                found += [(node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return sorted(set(found))


# shardax modules that import an optional dependency at their top, imported where it is used.
OPTIONAL_MODULES = {"shardax.train.harness"}  # lm_eval


def _allowed(module: str, where: str) -> bool:
    if module.split(".")[0] in OPTIONAL or module in OPTIONAL_MODULES:
        return True
    return where == "shardax.cli" and any(
        module == m or module.startswith(m + ".") for m in LAZY_IN_CLI)


def test_imports_inside_functions_are_optional_dependencies():
    bad = [f"{name}:{line} imports {module}"
           for name, path in sorted(_modules().items())
           for line, module in _function_imports(path) if not _allowed(module, name)]
    assert not bad, ("imports inside functions that are not optional dependencies (move them "
                     "to the module's top, or add a real optional dependency to OPTIONAL):\n"
                     + "\n".join(bad))


def test_the_function_import_check_can_fail(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import json\n    import yaml\n    from shardax import mesh\n")
    found = _function_imports(module)
    assert found == [(2, "json"), (3, "yaml"), (4, "shardax.mesh")]
    assert [m for _, m in found if not _allowed(m, "shardax.m")] == ["json", "shardax.mesh"]
    assert _allowed("shardax.train.loop", "shardax.cli")
    assert not _allowed("shardax.train.loop", "shardax.train.build")


def test_errors_are_a_bottom_module():
    """Every layer raises the error types of ``shardax.errors`` without importing the layer
    that used to define them (``shardax verify`` and the planner's topology check need nothing
    of ``train``)."""
    graph = _graph()
    assert graph["shardax.errors"] == set()
    for module in ("shardax.plan.topology", "shardax.plan.verify"):
        assert not any(m.startswith("shardax.train") for m in graph[module]), module


def _private_imports(name: str, path: pathlib.Path) -> list[str]:
    """What module ``name`` imports that is private to another module or package: a name
    with a leading underscore from another shardax module, or a private module (``_x``) of a
    package ``name`` is not in (``shardax._compat`` and ``shardax._context`` serve every
    package)."""
    package = name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if not node.module.startswith("shardax"):
            continue
        found += [f"{node.module}.{a.name}" for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__")
                  and a.name not in ("_compat", "_context")]
        parts = node.module.split(".")
        private = [i for i, p in enumerate(parts) if p.startswith("_")
                   and p not in ("_compat", "_context")]
        owner = ".".join(parts[:private[0]]) if private else ""
        if private and name != owner and not name.startswith(owner + "."):
            found.append(node.module)
    return found if package else []


def test_no_private_helper_is_imported_across_modules():
    bad = {name: found for name, path in sorted(_modules().items())
           if (found := _private_imports(name, path))}
    assert not bad, f"private names imported from another module: {bad}"


def test_the_private_import_check_can_fail(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from shardax.hf.export import _host, save_model\n"
                      "from shardax.models._layers import param\n"
                      "from shardax import _compat\n"
                      "from shardax.utils import human_bytes as _human\n")
    assert _private_imports("shardax.layout.m", module) == [
        "shardax.hf.export._host", "shardax.models._layers"]
    assert _private_imports("shardax.models.m", module) == ["shardax.hf.export._host"]


def test_training_sits_below_the_planner():
    """The planner builds on the training wing (it resolves and compiles train steps); nothing
    of ``shardax.train`` reaches back up into ``shardax.plan``."""
    graph = _graph()
    up = sorted((module, target) for module, targets in graph.items()
                if module.startswith("shardax.train") for target in targets
                if target.startswith("shardax.plan"))
    assert not up, f"shardax.train imports the planner: {up}"


# The data pipeline sits below training: it imports nothing of shardax.train (nor the models,
# the layout or the planner). The training wing's floors, lowest first: the run machinery, the
# core of a run (config, resolve, step, build, inputs, ...: shardax.train's own modules), the
# post-training objectives, then the commands. An import in shardax.train goes to its own
# floor or one below.
TRAIN_COMMANDS = {"loop", "generate", "evaluate", "harness", "task_evals", "export"}
ABOVE_DATA = ("shardax.train", "shardax.models", "shardax.layout", "shardax.plan", "shardax.cli")


def _train_floor(module: str) -> int:
    """0 ``shardax.train.run``, 1 the core modules, 2 ``.post``, 3 the commands and the
    package's own face."""
    part = module.split(".")[2] if module.count(".") >= 2 else "__init__"
    return {"run": 0, "post": 2}.get(
        part, 3 if part in TRAIN_COMMANDS or part == "__init__" else 1)


def _imports_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    data_up = [(module, target) for module, targets in graph.items()
               if module.startswith("shardax.data") for target in targets
               if target.startswith(ABOVE_DATA)]
    train_up = [(module, target) for module, targets in graph.items()
                if module.startswith("shardax.train") for target in targets
                if target.startswith("shardax.train")
                and _train_floor(target) > _train_floor(module)]
    return sorted(data_up + train_up)


def test_data_and_training_imports_go_down_their_floors():
    """``shardax.data`` imports nothing of training, ``train/run`` nothing of the training
    core, and no post-training objective imports a command (``loop``, ``generate``, ...)."""
    graph = _graph()
    assert any(m.startswith("shardax.data.") for m in graph), "the floors are read"
    assert any(m.startswith("shardax.train.run.") for m in graph), "the floors are read"
    assert not (up := _imports_up(graph)), f"imports going up the floors: {up}"


def test_the_training_floor_check_can_fail():
    graph = {"shardax.data.chat": {"shardax.train.run.notes", "shardax.data.readers"},
             "shardax.data.packing": {"shardax.models.llama", "shardax.errors"},
             "shardax.train.run.report": {"shardax.train.config", "shardax.data.encode"},
             "shardax.train.post.grpo": {"shardax.train.step", "shardax.train.loop"},
             "shardax.train.step": {"shardax.train.post.objectives", "shardax.models"},
             "shardax.train.loop": {"shardax.train.post.grpo", "shardax.train.build"}}
    assert _imports_up(graph) == [
        ("shardax.data.chat", "shardax.train.run.notes"),
        ("shardax.data.packing", "shardax.models.llama"),
        ("shardax.train.post.grpo", "shardax.train.loop"),
        ("shardax.train.run.report", "shardax.train.config"),
        ("shardax.train.step", "shardax.train.post.objectives")]



# What a model may use of shardax.parallel: kernels and remat, no schedule (pipeline, 1f1b,
# FSDP, tensor, context, expert): the layout applies those from outside (shardax.layout).
MODEL_MAY_USE = {"shardax.parallel.attention_kernel", "shardax.parallel.grouped_kernel",
                 "shardax.parallel.moe_kernel", "shardax.parallel.remat"}


def _model_layout_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a module under shardax.models that reach into the layout: the training
    wing, the layout package, or a shardax.parallel module other than `MODEL_MAY_USE` (the
    package itself included: it imports every schedule)."""
    return sorted(
        (module, target)
        for module, targets in graph.items() if module.startswith("shardax.models")
        for target in targets
        if target.startswith(("shardax.train", "shardax.layout"))
        or (target.startswith("shardax.parallel") and target not in MODEL_MAY_USE))


def test_models_import_no_schedule_layout_or_training():
    bad = _model_layout_imports(_graph())
    assert not bad, f"shardax.models reaches into the layout: {bad}"


def test_the_model_import_check_can_fail():
    graph = {"shardax.models.x": {"shardax.parallel.pipeline", "shardax.parallel.remat"},
             "shardax.models.y": {"shardax.train.step", "shardax.parallel"},
             "shardax.layout.forward": {"shardax.parallel.pipeline"}}
    assert _model_layout_imports(graph) == [("shardax.models.x", "shardax.parallel.pipeline"),
                                            ("shardax.models.y", "shardax.parallel"),
                                            ("shardax.models.y", "shardax.train.step")]


# What only the layout may name: the mesh axes (as string literals), axis sizes, the pipeline
# schedules and the FSDP modes.
MESH_AXIS_NAMES = {"dp", "fsdp", "tp", "pp", "cp", "ep"}
LAYOUT_WORDS = re.compile(r"\baxis_size\b|1f1b|gpipe|circular|fsdp_mode|\bfsdp_recompute\b"
                          r"|\bexplicit\b|['\"](dp|fsdp|tp|pp|cp|ep)['\"]")


def _layout_words(text: str) -> list[str]:
    """What of ``text`` (Python source) names the layout: string literals equal to a mesh axis,
    and lines (docstrings and comments too) with an axis-size call, a schedule, an FSDP mode
    or a quoted mesh axis."""
    found = [repr(node.value) for node in ast.walk(ast.parse(text))
             if isinstance(node, ast.Constant) and node.value in MESH_AXIS_NAMES]
    return found + [line.strip() for line in text.splitlines() if LAYOUT_WORDS.search(line)]


def test_model_files_name_no_mesh_axis_schedule_or_fsdp_mode():
    """The architecture does not know how it runs: no model file names a mesh axis, asks an
    axis size, or names a pipeline schedule or FSDP mode (shardax.layout does)."""
    found = {str(p.relative_to(SRC)): words for p in sorted((SRC / "shardax" / "models").rglob(
        "*.py")) if (words := _layout_words(p.read_text()))}
    assert not found, found


def test_the_layout_word_check_can_fail():
    text = ('x = 1\nif axis_size("pp") > 1:\n    mesh.get("tp")\nschedule = "gpipe"\n'
            'ok = "tpu", "a tp axis"\ndoc = "on a \'cp\' mesh"\n# under explicit FSDP\n')
    assert _layout_words(text) == ["'pp'", "'tp'", 'if axis_size("pp") > 1:',
                                   'mesh.get("tp")', 'schedule = "gpipe"',
                                   'doc = "on a \'cp\' mesh"', "# under explicit FSDP"]
