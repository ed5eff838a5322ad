#!/usr/bin/env python3
"""The module layering of docs/design.md ("Modules and dependencies"), checked.

Reads every #include "module/..." in src/, nvme/, cpu_adam/ and kernels/ and every import of one tool by
another in tools/, and fails (exit 1, one line per finding) when
  - a module includes a module of its own layer or of a layer above it (the arrows point one way:
    cli -> engine -> checkpoint -> {plan, comm, model} -> memory -> {kernels, data} ->
    {config, nvme, cpu_adam} -> util), or
  - the files' include graph, or the tools' import graph, has a circle.

  tools/check_layers.py [REPO]      (REPO: the repository's root; default: this file's parent's parent)
"""
import os
import re
import sys

# Lower layers first; a module may include modules of lower layers only.
LAYERS = [
    ["util"],
    ["config", "nvme", "cpu_adam"],
    ["kernels", "data"],
    ["memory"],
    ["plan", "comm", "model"],
    ["checkpoint"],
    ["engine"],
    ["cli"],
]
LAYER_OF = {m: i for i, layer in enumerate(LAYERS) for m in layer}
ROOTS = ["src", "nvme", "cpu_adam", "kernels"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/([^"]+)"')
IMPORT = re.compile(r"^\s*(?:from\s+([A-Za-z_][A-Za-z0-9_]*)\s+import\b|import\s+([A-Za-z_][A-Za-z0-9_, ]*))")


def module_of(rel):
    parts = rel.split("/")
    return parts[1] if parts[0] == "src" else parts[0]


def header_path(repo, module, rest):
    for base in (os.path.join("src", module), module):
        if os.path.exists(os.path.join(repo, base, rest)):
            return os.path.join(base, rest)
    return None


def find_circle(graph):
    """One circle of `graph` (a list of nodes, first == last), or None."""
    state, stack = {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def check_sources(repo):
    problems, files = [], {}
    for root in ROOTS:
        for d, _, names in os.walk(os.path.join(repo, root)):
            for name in sorted(names):
                if not name.endswith((".h", ".cc", ".cu")):
                    continue
                rel = os.path.relpath(os.path.join(d, name), repo)
                mod = module_of(rel)
                if mod not in LAYER_OF:
                    problems.append(f"{rel}: module '{mod}' has no layer in tools/check_layers.py")
                    continue
                files[rel] = set()
                with open(os.path.join(repo, rel), errors="replace") as f:
                    for n, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m or m.group(1) not in LAYER_OF:
                            continue
                        target = m.group(1)
                        if target != mod and LAYER_OF[target] >= LAYER_OF[mod]:
                            problems.append(f"{rel}:{n}: {mod} includes {target}/{m.group(2)}, "
                                            f"which is not below it (docs/design.md, Modules and dependencies)")
                        path = header_path(repo, target, m.group(2))
                        if path:
                            files[rel].add(path)
    circle = find_circle(files)
    if circle:
        problems.append("include circle: " + " -> ".join(circle))
    return problems, len(files)


def check_tools(repo):
    tools = os.path.join(repo, "tools")
    names = {n[:-3] for n in os.listdir(tools) if n.endswith(".py")}
    graph = {}
    for n in sorted(names):
        deps = set()
        with open(os.path.join(tools, n + ".py"), errors="replace") as f:
            for line in f:
                m = IMPORT.match(line)
                if not m:
                    continue
                mods = [m.group(1)] if m.group(1) else [x.strip() for x in m.group(2).split(",")]
                deps.update(x.split(" ")[0] for x in mods if x.split(" ")[0] in names and x.split(" ")[0] != n)
        graph[n] = deps
    circle = find_circle(graph)
    return (["tools import circle: " + " -> ".join(circle)] if circle else []), len(graph)


def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    problems, nfiles = check_sources(repo)
    tool_problems, ntools = check_tools(repo)
    problems += tool_problems
    for p in problems:
        print(p)
    if nfiles < 50 or ntools < 5:
        print(f"found only {nfiles} source files and {ntools} tools under {repo}: not the repository's root?")
        return 1
    if not problems:
        print(f"layers hold: {nfiles} source files, {ntools} tools, no include or import circle")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
