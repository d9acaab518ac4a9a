"""PodEnv reads the pod's environment once, at each process's entry (the launcher, the agent,
the watch, the pre-flight check, the trainer). Names outside the pod contract may be set by a
run's spec.env: a value there that is no number is said and ignored, never raised, so it cannot
end every pod at start (found by review: the first PodEnv raised ValueError on it)."""
from __future__ import annotations

import pytest

from trainium_api.spec import CONTRACT_ENV
from trainer.contract.podenv import PodEnv

POD = {"POD_NAME": "r-a1-0", "POD_NAMESPACE": "ns", "ATTEMPT": "1", "NODE_RANK": "0"}
GARBAGE = [  # name, value, the field, what it reads as
    ("WORLD_SIZE", "auto", "world_size", 1),
    ("LOCAL_WORLD_SIZE", "", "local_world_size", None),
    ("RANK", "${RANK}", "rank", 0),
    ("GROUP_RANK", "x", "group_rank", None),
    ("JOB_COMPLETION_INDEX", "", "job_completion_index", 0),
    ("TRAINER_FAULT_CKPT_WRITE_DELAY", "1s", "fault_ckpt_write_delay", 0.0),
    ("TRAINER_PREFLIGHT_SECONDS", "soon", "preflight_seconds", None),
]


@pytest.mark.parametrize("name,value,field,read", GARBAGE, ids=[g[0] for g in GARBAGE])
def test_a_number_that_is_none_is_said_and_ignored(name, value, field, read, capsys):
    env = PodEnv.from_environ({**POD, name: value})
    assert getattr(env, field) == read and env.pod_name == "r-a1-0"
    assert (f"ignoring {name}=" in capsys.readouterr().err) == (value != "")


def test_torchrun_values_are_read():
    env = PodEnv.from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
                               "GROUP_RANK": "1", "TRAINER_PREFLIGHT_SECONDS": "2.5"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.group_rank, env.preflight_seconds) \
        == (3, 1, 8, 2, 1, 2.5)


def test_none_of_them_is_the_contract():
    """Why they are tolerated: the operator refuses contract names in spec.env, not these."""
    assert not {name for name, *_ in GARBAGE} & set(CONTRACT_ENV)
