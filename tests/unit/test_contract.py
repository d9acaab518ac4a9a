"""The pod contract lives in the torch-free API package: the operator reads it from trainium_api and
never imports the trainer (whose image, not the operator's, carries torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "api" / "trainium_api"
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


def test_operator_does_not_import_the_trainer():
    """Read by tools/imports.py, which also sees relative and lazy imports."""
    sys.path.insert(0, str(ROOT / "tools"))
    import imports
    assert "trainer" not in imports.package_edges(imports.graph())["trainium_operator"]
