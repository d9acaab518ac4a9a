"""The import map holds (issue 42): no import cycle in any of our packages, and the operator and
the trainer reach each other only through the API package. tools/imports.py reads every import
statement, lazy ones inside functions included."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import imports  # noqa: E402


def test_no_import_cycle():
    assert imports.cycles(imports.graph()) == []


def test_each_package_imports_only_the_api():
    reaches = imports.package_edges(imports.graph())
    assert reaches == {"trainium_api": [], "trainium_operator": ["trainium_api"], "trainer": ["trainium_api"]}


def test_the_map_sees_lazy_imports_and_cycles(tmp_path, monkeypatch):
    """The checker itself: a cycle made by an import inside a function is found."""
    pkg = tmp_path / "trainer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "c.py").write_text("import trainer.a\n")
    monkeypatch.setattr(imports, "PACKAGES", {"trainer": pkg})
    edges = imports.graph()
    assert edges["trainer.c"] == {"trainer.a"}
    assert imports.cycles(edges) == [["trainer.a", "trainer.b"]]
