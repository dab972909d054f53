"""Custom logit processors: upstream's wire format (JSON {"callable": hex(dill)}), the cached
from_str, loading errors, the Sampler applying processors grouped by string to their rows only
(after the penalties / bias, with each row's params and "__req__"), and the scripted test
processor. CPU, fast."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

dill = pytest.importorskip("dill")

from sglang.srt.layers.sampler import Sampler  # noqa: E402
from sglang.srt.sampling.custom_logit_processor import (  # noqa: E402
    CustomLogitProcessor,
    _cache_from_str,
    load_custom_logit_processor,
)
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.testing.logit_processors import (  # noqa: E402
    ScriptedTokensLogitProcessor,
    scripted_request,
    scripted_token,
)

V = 40


class BanLowIds(CustomLogitProcessor):
    """Bans ids below custom_params['below'] in its rows; records what it was called with."""

    calls: list = []

    def __call__(self, logits, custom_param_list=None):
        BanLowIds.calls.append((logits.shape[0], [p["below"] for p in custom_param_list],
                                [p["__req__"].rid for p in custom_param_list]))
        for i, p in enumerate(custom_param_list):
            logits[i, : p["below"]] = float("-inf")
        return logits


def test_wire_format_and_round_trip():
    s = ScriptedTokensLogitProcessor.to_str()
    data = json.loads(s)
    assert set(data) == {"callable"}
    assert dill.loads(bytes.fromhex(data["callable"])) is ScriptedTokensLogitProcessor
    p = CustomLogitProcessor.from_str(s)
    assert isinstance(p, ScriptedTokensLogitProcessor)
    assert _cache_from_str(s) is _cache_from_str(s)  # deserialised once per string
    assert load_custom_logit_processor(BanLowIds.to_str()).__class__.__name__ == "BanLowIds"


@pytest.mark.parametrize("bad", ["", "not json", json.dumps({"x": 1}), json.dumps({"callable": "zz"}),
                                 json.dumps({"callable": dill.dumps(int).hex()}), 5])
def test_load_errors_are_value_errors(bad):
    with pytest.raises(ValueError, match="custom_logit_processor"):
        load_custom_logit_processor(bad)


def _req(rid, n_out, eos=(1,)):
    return SimpleNamespace(rid=rid, output_ids=[7] * n_out, origin_input_ids=[3, 4], eos_token_ids=frozenset(eos))


def test_sampler_applies_processors_to_their_rows_only():
    BanLowIds.calls.clear()
    reqs = [_req("a", 0), _req("b", 0), _req("c", 0), _req("d", 2)]
    ban, script = BanLowIds.to_str(), ScriptedTokensLogitProcessor.to_str()
    procs = [ban, None, ban, script]
    params = [{"below": 30, "__req__": reqs[0]}, None, {"below": 35, "__req__": reqs[2]},
              {"token_ids": [5, 6, 9], "__req__": reqs[3]}]
    sps = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=0),
           SamplingParams(temperature=1.3, top_p=0.5)]
    logits = torch.zeros(4, V)
    logits[:, 3] = 10.0  # every row's argmax is 3 unless a processor says otherwise
    info = SamplingBatchInfo.from_params(sps, V, "cpu", custom_logit_processors=procs, custom_params=params)
    assert info.has_custom_logit_processor and len(info.custom_logit_processor) == 2
    out = Sampler()(logits, info).next_token_ids.tolist()
    assert BanLowIds.calls == [(2, [30, 35], ["a", "c"])]  # one call for both rows, in batch order
    assert out[1] == 3  # untouched row
    assert out[0] >= 30 and out[2] >= 35
    assert out[3] == 9  # scripted: step 2 of [5, 6, 9], whatever the temperature / top_p


def test_processor_runs_after_logit_bias():
    # logit_bias pushes token 2 up; the processor then bans everything below 5: bias cannot undo it.
    sp = SamplingParams(temperature=0, logit_bias={2: 100.0})
    req = _req("a", 0)
    info = SamplingBatchInfo.from_params([sp], V, "cpu", custom_logit_processors=[BanLowIds.to_str()],
                                         custom_params=[{"below": 5, "__req__": req}])
    assert Sampler()(torch.zeros(1, V), info).next_token_ids.item() >= 5


def test_scripted_token_indexing_and_eos():
    script = {"token_ids": [11, 12, 13]}
    assert [scripted_token({**script, "__req__": _req("r", n)}) for n in range(5)] == [11, 12, 13, 1, 1]
    assert scripted_token({**script, "eos_token_id": 4, "__req__": _req("r", 3)}) == 4
    assert scripted_token({**script, "__req__": _req("r", 3, eos=(9, 2))}) == 2  # the smallest EOS id
    assert scripted_token({"token_ids": [], "__req__": _req("r", 0, eos=())}) is None
    assert scripted_token(None) is None


def test_scripted_processor_batch_and_out_of_range():
    p = ScriptedTokensLogitProcessor()
    logits = torch.randn(3, V)
    keep = logits[2].clone()
    out = p(logits, [{"token_ids": [3, 4], "__req__": _req("a", 1)},
                     {"token_ids": [8], "__req__": _req("b", 0)},
                     {"token_ids": [V + 5], "__req__": _req("c", 0)}])  # id out of range: untouched
    assert out.argmax(-1).tolist()[:2] == [4, 8]
    assert torch.isinf(out[0]).sum() == V - 1 and torch.equal(out[2], keep)


def test_scripted_request_body():
    body = scripted_request([5, 6], temperature=0.5)
    assert body["sampling_params"] == {"max_new_tokens": 3, "temperature": 0.5,
                                       "custom_params": {"token_ids": [5, 6]}}
    assert isinstance(load_custom_logit_processor(body["custom_logit_processor"]), ScriptedTokensLogitProcessor)
