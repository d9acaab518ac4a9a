import json

from trainer.pod.launch import exit_code_for
from trainer.contract.progress import ProgressReporter
from trainium_api import exitcodes, progress


def test_pod_exit_code_from_workers():
    assert exit_code_for([]) == 0
    assert exit_code_for([78, -15, -15]) == exitcodes.FATAL
    assert exit_code_for([75, -15]) == exitcodes.RETRYABLE
    assert exit_code_for([143, 143]) == exitcodes.TERMINATED
    assert exit_code_for([-9]) == 1
    assert exit_code_for([1, -15]) == 1  # one worker crashed; torchrun SIGTERMed the rest


def test_progress_payload_roundtrip():
    text = progress.payload(12, 1234.567, 2.345678, 10, now=1700000000.0)
    assert json.loads(text) == {"step": 12, "time": 1700000000.0, "tokensPerSecond": 1234.57,
                                "loss": 2.34568, "lastCheckpointStep": 10, "startStep": 0, "evalPerplexity": None,
                                "computeSeconds": None, "preflightSeconds": None, "restoreSeconds": None,
                                "restoreSource": None, "attempt": None, "firstStepTime": None, "checkpoint": None,
                                "storeError": None, "saveFailure": None, "skippedCheckpoint": None}
    assert progress.parse(text)["step"] == 12
    assert progress.parse(progress.payload(12, 1.0, 2.0, 10, first_step_time=1700000000.12345))["firstStepTime"] \
        == 1700000000.123
    with_eval = progress.payload(12, 1.0, 2.0, 10, eval_perplexity=7.123456)
    assert progress.parse(with_eval)["evalPerplexity"] == 7.1235
    assert progress.parse(progress.payload(12, 1.0, 2.0, 10, restore_seconds=3.14159))["restoreSeconds"] == 3.14
    restored = progress.parse(progress.payload(12, 1.0, 2.0, 10, restore_seconds=0.5, restore_source="memory"))
    assert (restored["restoreSeconds"], restored["restoreSource"]) == (0.5, "memory")
    # a source the trainer does not write (user code can patch the annotation) is dropped, named
    forged, errors = progress.parse_report(json.dumps({"step": 3, "restoreSource": "/etc/passwd"}))
    assert forged["restoreSource"] is None and forged["step"] == 3
    assert errors == ["restoreSource: must be one of memory, peer, store, got '/etc/passwd'"]
    assert progress.parse_report(json.dumps({"step": 3, "restoreSource": 7}))[0]["restoreSource"] is None
    for bad in (None, "", "{", "[]", '{"step": "x"}'):
        assert progress.parse(bad) is None


def test_reporter_off_without_pod_identity(monkeypatch):
    monkeypatch.delenv("POD_NAME", raising=False)
    r = ProgressReporter(1.0)
    assert not r.enabled
    r.report(1, 1.0, 1.0, None)  # a no-op, never raises
    r.close()
