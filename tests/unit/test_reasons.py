"""reasons: every event reason and condition written once, and the one rule for a condition with
an event when it flips (table)."""

from __future__ import annotations

from typing import get_args

import pytest

from tests.unit.passes import events, make_pass
from trainium_api.status import ConditionType
from trainium_operator.reasons import Cond, CondReason, Reason, report


def _values(cls) -> list[str]:
    return [v for k, v in vars(cls).items() if k.isupper()]


def test_each_name_is_written_once_and_the_condition_types_are_the_apis():
    for cls in (Reason, Cond, CondReason):
        assert len(_values(cls)) == len(set(_values(cls))), cls
    assert sorted(_values(Cond)) == sorted(get_args(ConditionType))


CASES = [
    # name, the condition as read (status, message), set (ok, message), when -> event sent
    ("first, not ok", None, (False, "m"), "flip", True),
    ("first, ok", None, (True, "m"), "flip", False),
    ("flips to not ok", ("True", "m"), (False, "m"), "flip", True),
    ("flips back", ("False", "m"), (True, ""), "flip", True),
    ("stays not ok, another message", ("False", "m"), (False, "n"), "flip", False),
    ("stays not ok, another message, change", ("False", "m"), (False, "n"), "change", True),
    ("stays not ok, same message, change", ("False", "m"), (False, "m"), "change", False),
    ("first, change", None, (False, "m"), "change", True),
    ("no flip, always", ("True", "m"), (True, "m"), "always", True),
]


@pytest.mark.parametrize("name,before,now_,when,sent", CASES, ids=[c[0] for c in CASES])
def test_a_condition_sends_its_event_by_the_rule(name, before, now_, when, sent):
    conditions = [] if before is None else [{"type": "ProgressValid", "status": before[0], "message": before[1],
                                             "reason": "X", "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    p = make_pass({"conditions": conditions})
    ok, message = now_
    report(p, Cond.PROGRESS_VALID, ok, CondReason.PARSED, message, Reason.MALFORMED_PROGRESS, when=when)
    (c,) = [c for c in p.new.conditions if c.type == Cond.PROGRESS_VALID]
    assert (c.status, c.message) == ("True" if ok else "False", message)
    assert events(p) == ([Reason.MALFORMED_PROGRESS] if sent else [])
    # lastTransitionTime moves only when the status flips
    assert (c.last_transition_time == "2026-01-01T00:00:00Z") == (before is not None and before[0] == c.status)


def test_an_event_without_a_name_is_not_sent_and_its_warning_follows_the_condition():
    p = make_pass()
    report(p, Cond.DISRUPTED, True, CondReason.MASS_DISRUPTION, "m")
    assert events(p) == []
    report(p, Cond.CHILDREN_CREATED, False, CondReason.CREATE_FAILED, "m", Reason.CREATE_FAILED, said="said")
    (e,) = [e for e in p.effects]
    assert (e.message, e.warning) == ("said", True)
