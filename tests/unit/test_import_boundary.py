"""Only crosspool/integrations/<engine>/ may import an engine, and CrossPool's own modules import
each other in the allowed directions only: the data path (ops, transport, fabric), elastic KV's
channel, backing and policy (kv) and the plan stand below the integrations and the control plane."""

import ast
from pathlib import Path

import crosspool

ENGINES = {"vllm", "sglang", "sgl_kernel"}
ROOT = Path(crosspool.__file__).parent
ABOVE_DATA_PATH = {"plan", "resolve", "daemon", "integrations", "agents", "member", "front", "qualify", "bench", "cli"}
# module (a file, or a package of ROOT) -> the crosspool modules it must not import
FORBIDDEN = {
    "ops.py": ABOVE_DATA_PATH,
    "transport": ABOVE_DATA_PATH,
    "fabric": ABOVE_DATA_PATH | {"transport"},
    "kv": ABOVE_DATA_PATH | {"transport", "fabric"},  # channel, backing, policy: engine-neutral, below both ends
    "plan.py": {"integrations", "agents", "daemon", "resolve", "member"},
    "integrations": {"daemon", "agents", "resolve", "front", "qualify", "bench", "cli"},
}


def _imports(path: Path) -> set[str]:
    """Every module named by an absolute import, dotted (`crosspool.plan`, `vllm.config`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _crosspool_modules(path: Path) -> set[str]:
    """The crosspool modules (first component under crosspool) a file imports."""
    return {n.split(".")[1] for n in _imports(path) if n.startswith("crosspool.") and n.count(".") >= 1}


def test_core_imports_no_engine():
    offenders = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        owner = rel.parts[1] if rel.parts[0] == "integrations" and len(rel.parts) > 2 else None
        bad = ({n.split(".")[0] for n in _imports(path)} & ENGINES) - ({owner} if owner else set())
        if bad:
            offenders[str(rel)] = sorted(bad)
    assert offenders == {}


def test_imports_run_in_the_allowed_directions():
    offenders = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        forbidden = FORBIDDEN.get(rel.parts[0], set())
        modules = {m.removesuffix(".py") for m in _crosspool_modules(path)}
        bad = modules & {f.removesuffix(".py") for f in forbidden}
        if bad:
            offenders[str(rel)] = sorted(bad)
    assert offenders == {}


def test_boundary_checks_see_imports(tmp_path):
    # The checkers themselves must be able to fail.
    probe = tmp_path / "probe.py"
    probe.write_text("import vllm.config\nfrom sglang.srt import server_args\nfrom crosspool.plan import Plan\n")
    assert {n.split(".")[0] for n in _imports(probe)} >= {"vllm", "sglang"}
    assert "plan" in _crosspool_modules(probe)
