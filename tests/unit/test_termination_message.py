"""trainer.contract.termination.write, the one writer of a pod's termination message (the
launcher, the pre-flight check, the agent and a store read that gave up all call it)."""
from __future__ import annotations

from trainer.contract import termination


def test_the_three_cases(tmp_path):
    said: list[str] = []
    path = tmp_path / "termination-log"
    termination.write(str(path), "preflight-failed: node n1", said.append)
    assert path.read_text() == "preflight-failed: node n1" and not said
    termination.write(None, "outside a pod", said.append)  # no path: nothing written, nothing said
    assert not said
    termination.write(str(tmp_path / "missing" / "log"), "x", said.append)  # never raises
    assert len(said) == 1 and "could not write the termination message to" in said[0]
