import json
import time

from trainer.pod.launch import exit_code_for
from trainer.contract.progress import ProgressReporter
from trainium_api import exitcodes, progress
from trainium_api.progress import ProgressReport


def test_pod_exit_code_from_workers():
    assert exit_code_for([]) == 0
    assert exit_code_for([78, -15, -15]) == exitcodes.FATAL
    assert exit_code_for([75, -15]) == exitcodes.RETRYABLE
    assert exit_code_for([143, 143]) == exitcodes.TERMINATED
    assert exit_code_for([-9]) == 1
    assert exit_code_for([1, -15]) == 1  # one worker crashed; torchrun SIGTERMed the rest


def test_progress_payload_roundtrip():
    text = ProgressReport(step=12, time=1700000000.0, tokens_per_second=1234.567, loss=2.345678,
                          last_checkpoint_step=10).to_annotation()
    assert json.loads(text) == {"step": 12, "time": 1700000000.0, "tokensPerSecond": 1234.57,
                                "loss": 2.34568, "lastCheckpointStep": 10, "lastCheckpointTime": None, "startStep": 0,
                                "evalPerplexity": None,
                                "computeSeconds": None, "preflightSeconds": None, "restoreSeconds": None,
                                "restoreSource": None, "attempt": None, "firstStepTime": None, "checkpoint": None,
                                "storeError": None, "saveFailure": None, "skippedCheckpoint": None}
    assert progress.parse(text).step == 12

    def written(**fields) -> str:
        return ProgressReport(step=12, time=time.time(), tokens_per_second=1.0, loss=2.0, last_checkpoint_step=10,
                              **fields).to_annotation()
    assert progress.parse(written(first_step_time=1700000000.12345)).first_step_time == 1700000000.123
    assert progress.parse(written(last_checkpoint_time=1700000000.5)).last_checkpoint_time == 1700000000.5
    assert ProgressReport.parse(json.dumps({"step": 3, "lastCheckpointTime": "soon"}))[0].last_checkpoint_time is None
    with_eval = written(eval_perplexity=7.123456)
    assert progress.parse(with_eval).eval_perplexity == 7.1235
    assert progress.parse(written(restore_seconds=3.14159)).restore_seconds == 3.14
    restored = progress.parse(written(restore_seconds=0.5, restore_source="memory"))
    assert (restored.restore_seconds, restored.restore_source) == (0.5, "memory")
    # a source the trainer does not write (user code can patch the annotation) is dropped, named
    forged, errors = ProgressReport.parse(json.dumps({"step": 3, "restoreSource": "/etc/passwd"}))
    assert forged.restore_source is None and forged.step == 3
    assert errors == ["restoreSource: must be one of memory, peer, store, got '/etc/passwd'"]
    assert ProgressReport.parse(json.dumps({"step": 3, "restoreSource": 7}))[0].restore_source is None
    for bad in (None, "", "{", "[]", '{"step": "x"}'):
        assert progress.parse(bad) is None


def test_the_wire_fields_come_from_the_report():
    """FIELDS is derived from ProgressReport (one source): every attribute but the store is one
    camelCase wire field, in order, then the store's four."""
    assert progress.FIELDS == ("step", "time", "tokensPerSecond", "loss", "lastCheckpointStep",
                               "lastCheckpointTime", "startStep",
                               "evalPerplexity", "computeSeconds", "preflightSeconds", "restoreSeconds",
                               "restoreSource", "attempt", "firstStepTime", "checkpoint", "storeError",
                               "saveFailure", "skippedCheckpoint")
    assert progress.STORE_FIELDS == progress.FIELDS[-4:]
    assert tuple(json.loads(ProgressReport().to_annotation())) == progress.FIELDS


def test_reporter_off_without_pod_identity(monkeypatch):
    monkeypatch.delenv("POD_NAME", raising=False)
    r = ProgressReporter(1.0)
    assert not r.enabled
    r.report(ProgressReport(step=1, tokens_per_second=1.0, loss=1.0))  # a no-op, never raises
    r.close()
