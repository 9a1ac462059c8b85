"""DESIGN invariant 5: imports flow app -> core -> models, never back; app/ never imports torch."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "app": {"torch", "transformers", "bitsandbytes", "models"},
    "core": {"app", "gradio"},
    "models": {"core", "app", "gradio"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_backward_or_forbidden_imports():
    bad = []
    for layer, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            for name in imported_roots(path) & forbidden:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_importing_the_ui_does_not_load_torch():
    code = "import sys, app.ui, app.handlers; assert 'torch' not in sys.modules, 'torch was imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_command_line_needs_only_the_standard_library():
    """launch.py parses arguments before .venv exists (`--help` on a fresh machine), so cli.py
    may import the standard library, torch-free models.quants and core.config (the drafters'
    names), which itself imports only the standard library and models.quants."""
    assert imported_roots(ROOT / "cli.py") - set(sys.stdlib_module_names) == {"models", "core"}
    assert imported_roots(ROOT / "core" / "config.py") - set(sys.stdlib_module_names) == {"models"}
    code = "import sys, cli; assert not {'torch', 'transformers', 'gradio'} & set(sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# Inside core/, rooms by role import only rooms below them (DESIGN.md section 3). config, errors and files
# are everyone's; core/ top modules sit between rooms: the engine above spec and runtime, the chat
# text helpers on their own, the bench and its served client above everything.
CORE_BASE = {"config", "errors", "files"}
CORE_ROOMS = {
    "runtime": {"runtime"},
    "spec": {"runtime", "spec"},
    "engine": {"runtime", "spec"},
    "text": set(),
    "tune": {"runtime", "spec", "tune"},
    "service": {"runtime", "spec", "tune", "service", "engine", "text"},
    "train": {"runtime", "spec", "train", "text"},
    "served": set(),
    "served_page": {"served"},   # bench --page: the page through Chromium, answers as core/served.py's
    "bench": {"runtime", "spec", "tune", "service", "engine", "text", "served", "served_page"},
}


def core_imports(path: Path) -> set[str]:
    """The core rooms or top modules `path` imports: core.<name>..."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        names |= {m.split(".")[1] for m in modules if m.startswith("core.")}
    return names


def test_core_rooms_import_only_rooms_below_them():
    bad, seen = [], set()
    for path in sorted((ROOT / "core").rglob("*.py")):
        parts = path.relative_to(ROOT / "core").parts
        room = parts[0] if len(parts) > 1 else path.stem
        if room in ("__init__",) or room in CORE_BASE:
            continue
        seen.add(room)
        assert room in CORE_ROOMS, f"core/{'/'.join(parts)} is in no known room: add it to CORE_ROOMS"
        for name in core_imports(path) - CORE_BASE - CORE_ROOMS[room]:
            bad.append(f"core/{'/'.join(parts)} ({room}) imports core.{name}")
    assert not bad, "\n".join(bad)
    assert seen == set(CORE_ROOMS)
