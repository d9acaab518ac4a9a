"""The pod contract lives in the torch-free API package: the operator reads it from trainium_api and
never imports the trainer (whose image, not the operator's, carries torch)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "api" / "trainium_api"
OPERATOR = ROOT / "operator" / "trainium_operator"
# What the operator shares with the trainer; each was the trainer's before.
CONTRACT = ("exitcodes", "progress", "checkpoints", "launch", "presets")


def test_api_modules_import_no_torch():
    modules = sorted(f"trainium_api.{p.stem}" for p in API.glob("*.py") if p.stem != "__init__")
    assert {f"trainium_api.{m}" for m in CONTRACT} <= set(modules)
    code = (f"import importlib, json, sys\nmods = {modules!r}\n"
            "files = [importlib.import_module(m).__file__ for m in mods]\n"
            "print(json.dumps({'files': files, 'torch': sorted(m for m in sys.modules if m.split('.')[0] == 'torch')}))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "api"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    result = json.loads(out.stdout)
    assert all(Path(f).resolve().is_relative_to(API) for f in result["files"]), result["files"]  # this tree's
    assert result["torch"] == []


def _trainer_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                  if name == "trainer" or name.startswith("trainer.")]
    return found


def test_operator_does_not_import_the_trainer():
    files = sorted(OPERATOR.rglob("*.py"))
    assert files
    offenders = [hit for f in files for hit in _trainer_imports(f)]
    assert offenders == [], "the operator imports the trainer (use trainium_api):\n" + "\n".join(offenders)
