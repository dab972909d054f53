"""ServerArgs' validators, one mixin per flag group (see common.py)."""

from sglang.srt.server_args_checks.disaggregation import DisaggregationChecks
from sglang.srt.server_args_checks.hicache import HiCacheChecks
from sglang.srt.server_args_checks.model import ModelChecks
from sglang.srt.server_args_checks.parallel import ParallelChecks
from sglang.srt.server_args_checks.serving import ServingChecks
from sglang.srt.server_args_checks.speculative import SpeculativeChecks

__all__ = ["DisaggregationChecks", "HiCacheChecks", "ModelChecks", "ParallelChecks", "ServingChecks",
           "SpeculativeChecks"]
