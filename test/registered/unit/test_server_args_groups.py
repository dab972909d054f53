"""ServerArgs' validators live in one mixin per flag group (srt/server_args_checks/); ServerArgs stays
the one dataclass. These tests hold the split: every group's check runs, in validate()'s order, and a
bad flag of each group is named by its own group's check."""

from __future__ import annotations

import inspect

import pytest

import sglang.srt.server_args_checks as checks
from sglang.srt.server_args import ServerArgs, ServerArgsError

MODEL = "builtin:tiny-deepseek-v32"
MIXINS = [getattr(checks, n) for n in checks.__all__]


def _check_methods() -> set[str]:
    return {name for mixin in MIXINS for name, _ in inspect.getmembers(mixin, inspect.isfunction)
            if name.startswith("_check_")}


def test_server_args_is_one_dataclass_with_every_group_mixed_in():
    assert all(issubclass(ServerArgs, m) for m in MIXINS)
    assert all(not hasattr(m, "__dataclass_fields__") for m in MIXINS)  # the fields stay in ServerArgs
    assert len(_check_methods()) >= 14


def test_validate_runs_every_group_check_once(monkeypatch):
    called: list[str] = []
    for name in _check_methods():
        monkeypatch.setattr(ServerArgs, name, lambda self, _n=name: called.append(_n))
    ServerArgs(model_path=MODEL).validate()
    assert sorted(called) == sorted(_check_methods()), "a group's _check_* method is not run by validate()"
    assert len(called) == len(set(called))
    assert called[0] == "_check_model"  # the model path is named before anything that reads the model


# One bad flag per group: the error names that flag (and the first bad group wins when several are bad).
BAD = [
    ({"dtype": "fp7"}, "dtype"),
    ({"page_size": 3}, "page_size"),
    ({"nsa_index_topk_pattern": "FX"}, "nsa_index_topk_pattern"),
    ({"attn_cp_size": 2}, "attn_cp_size"),
    ({"port": 0}, "port"),
    ({"log_level": "loud"}, "log_level"),
    ({"max_payload_size": 0}, "max_payload_size"),
    ({"speculative_num_draft_tokens": 3}, "speculative_num_draft_tokens"),
    ({"hicache_ratio": -1.0}, "hicache_ratio"),
    ({"hicache_storage_backend": "file"}, "hicache_storage_backend"),
    ({"disaggregation_bootstrap_port": 0}, "disaggregation_bootstrap_port"),
    ({"port": 0, "dtype": "fp7"}, "dtype"),                 # model group before serving
    ({"hicache_ratio": -1.0, "max_payload_size": 0}, "max_payload_size"),  # endpoints before hicache
]


@pytest.mark.parametrize("kwargs,flag", BAD, ids=[",".join(k) for k, _ in BAD])
def test_a_bad_flag_is_named_by_its_group(kwargs, flag):
    with pytest.raises(ServerArgsError) as e:
        ServerArgs(model_path=MODEL, **kwargs).validate()
    assert e.value.flag == flag and str(e.value).startswith(f"--{flag.replace('_', '-')}: ")


def test_choices_come_from_the_instance_fields():
    with pytest.raises(ServerArgsError, match=r"'fifo' is not one of \['fcfs', 'lpm'\]"):
        ServerArgs(model_path=MODEL, schedule_policy="fifo").validate()
    ServerArgs(model_path=MODEL).validate()  # the defaults are valid
