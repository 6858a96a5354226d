"""The package's shape, read from its own source with `ast` (no import runs): every import statement,
module-level or inside a function, and every module named by a string (`importlib.import_module`, a
registry's table of module paths, an f-string's constant prefix).

- No import circle between files of `longstraw_mcore/` (the strongly connected components of the
  import graph are single files), and no file over 500 lines.
- The parts' directions: parallel/ knows no model or schedule (it imports ops/, config/ and the
  bootstrap only); the objective (loss/) sees no layers; layers (models/) know no schedule (of
  prompt_state/ they see the mixer-facing protocol only); prompt_state/ imports no model; the library
  never imports its command line (cli, commands/, __main__, the MPI entry point launch_mpi, and the Python
  API api.py: the front end of a user's own driver loop, on which `train` is built); the
  family registry (families/) is consulted only from the top (the command line; tools and tests are
  outside the package); config/ is the bottom (it imports nothing of the package but itself).

What this does not cover: imports made by third-party code, and attribute access on objects handed
in (duck typing), which is how lower layers reach what the top hands them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = "longstraw_mcore"
ROOT = Path(__file__).resolve().parents[2] / PKG
MODULE_RE = re.compile(rf"^{PKG}(\.\w+)*$")
COMMAND_LINE = {f"{PKG}.cli", f"{PKG}.__main__", f"{PKG}.launch_mpi", f"{PKG}.api"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _resolve(name: str, mods: dict) -> str | None:
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: str, path: Path, mods: dict) -> set[str]:
    """Every module of the package `mod` names: imports anywhere in the file, and module paths as strings."""
    tree = ast.parse(path.read_text())
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_RE.match(node.value):
            names.add(node.value)
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            prefix = str(node.values[0].value)
            if prefix.startswith(PKG + ".") and prefix.endswith("."):  # f"longstraw_mcore.commands.{x}": any of them
                names.update(m for m in mods if m.startswith(prefix))
    out = {_resolve(n, mods) for n in names if n.startswith(PKG + ".")}
    # (`from longstraw_mcore import cpu_compat` also runs the package's __init__: the legend, no imports)
    return {m for m in out if m is not None and m != mod}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, mods) for m, f in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one file (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _part(mod: str) -> str:
    """The first component under the package: `parallel`, `models`, ... (`cpu_compat` for a top file)."""
    rest = mod[len(PKG) + 1:] if mod != PKG else ""
    return rest.split(".")[0] if rest else ""


def _violations(graph, who, allowed=None, forbidden=None) -> list[str]:
    bad = []
    for m, deps in sorted(graph.items()):
        if not who(m):
            continue
        for d in sorted(deps):
            if (allowed is not None and not allowed(d)) or (forbidden is not None and forbidden(d)):
                bad.append(f"{m} -> {d}")
    return bad


def test_no_import_circle_no_long_file_and_the_parts_directions():
    graph = _graph()
    assert len(graph) > 90 and f"{PKG}.replay.engine" in graph  # the walk found the package
    # an import the parser must see: a function-level one, and a registry's module path as a string
    assert f"{PKG}.models.qwen3_5" in graph[f"{PKG}.families.qwen3_5"]
    assert f"{PKG}.families.glm_dsa" in graph[f"{PKG}.families"]

    assert _cycles(graph) == []
    long = {m: n for m, f in _modules().items() if (n := len(f.read_text().splitlines())) > 500}
    assert long == {}

    def part_in(*parts):
        return lambda m: _part(m) in parts

    def is_cli(m):
        return m in COMMAND_LINE or _part(m) == "commands"

    problems = {
        "parallel knows no model or schedule": _violations(
            graph, part_in("parallel"), allowed=part_in("parallel", "ops", "config", "cpu_compat", "launch_local")),
        "the objective sees no layers": _violations(graph, part_in("loss"), allowed=part_in("loss", "config", "data")),
        "layers know no schedule": _violations(
            graph, part_in("models"),
            forbidden=lambda d: _part(d) in ("replay", "train", "rollout", "tasks", "planner", "checkpoint", "families",
                                             "bench", "data") or is_cli(d)
            or (_part(d) == "prompt_state" and d != f"{PKG}.prompt_state.hooks")),
        "prompt state imports no model": _violations(
            graph, part_in("prompt_state"),
            forbidden=lambda d: _part(d) in ("models", "replay", "train", "rollout", "planner", "families") or is_cli(d)),
        "ops are the bottom": _violations(graph, part_in("ops"), allowed=part_in("ops", "config")),
        "config is the bottom": _violations(graph, part_in("config"), allowed=part_in("config")),
        "the library never imports its command line": _violations(graph, lambda m: not is_cli(m), forbidden=is_cli),
        "the registry is consulted from the top": _violations(
            graph, lambda m: not is_cli(m) and _part(m) != "families", forbidden=part_in("families")),
    }
    assert {k: v for k, v in problems.items() if v} == {}
