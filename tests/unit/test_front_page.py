"""The README's first TrainingRun is the example the demo applies, word for word: the front page
shows the file, so an edit of one without the other fails here (STYLE 12: examples that run)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_the_first_training_run_is_the_demo_example():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A first TrainingRun", 1)[1].split("\n## ", 1)[0]
    shown = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    example = (ROOT / "examples" / "tiny-local-run.yaml").read_text()
    assert yaml.safe_load(shown) == yaml.safe_load(example)
    body = [line for line in example.splitlines() if line.strip() and not line.startswith("#")]
    assert shown.splitlines() == body, "the README shows the example as written (comments above it aside)"
