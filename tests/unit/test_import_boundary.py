"""Only crosspool/integrations/<engine>/ may import an engine."""

import ast
from pathlib import Path

import crosspool

ENGINES = {"vllm", "sglang", "sgl_kernel"}
ROOT = Path(crosspool.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_imports_no_engine():
    offenders = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        owner = rel.parts[1] if rel.parts[0] == "integrations" and len(rel.parts) > 2 else None
        bad = (_imports(path) & ENGINES) - ({owner} if owner else set())
        if bad:
            offenders[str(rel)] = sorted(bad)
    assert offenders == {}


def test_boundary_check_sees_imports(tmp_path):
    # The checker itself must be able to fail.
    probe = tmp_path / "probe.py"
    probe.write_text("import vllm.config\nfrom sglang.srt import server_args\n")
    assert _imports(probe) >= {"vllm", "sglang"}
