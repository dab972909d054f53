"""Custom logit processors (upstream SGLang's API), enabled by --enable-custom-logit-processor.

A client subclasses `CustomLogitProcessor`, sends `MyProcessor.to_str()` as the request's
`custom_logit_processor` and its own parameters as `sampling_params.custom_params`. The server
rebuilds the class with `CustomLogitProcessor.from_str(s)` (cached per string) and, each step,
calls it once per distinct processor string on the rows that use it:

    processor(logits[rows], [custom_params of each row, with "__req__" = that row's Req])

and writes the result back into those rows. It runs after penalties, the grammar mask and
logit_bias (upstream's order: the Sampler applies it to the logits `apply_logits_bias` produced),
before temperature / top-k / top-p. `req.output_ids` are the tokens generated so far, so
`len(req.output_ids)` is the index of the token being sampled (also after a retraction, which
keeps output_ids, and on every chunk of a chunked prefill, where the sample is discarded).

Security: `from_str` unpickles code (dill). That is why the feature is off by default; enable it
only for trusted clients.
"""

from __future__ import annotations

import json
import types
from abc import ABC, abstractmethod
from functools import lru_cache
from typing import Any

import torch

CUSTOM_LOGIT_PROCESSOR_DISABLED = ("custom_logit_processor is disabled on this server: start it with "
                                   "--enable-custom-logit-processor")


@lru_cache(maxsize=None)
def _cache_from_str(json_str: str):
    import dill

    data = json.loads(json_str)
    return dill.loads(bytes.fromhex(data["callable"]))


class CustomLogitProcessor(ABC):
    @abstractmethod
    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """`logits`: [n, V], the rows of the requests using this processor; one params dict per
        row. Return the new logits (modifying them in place and returning them is fine)."""
        raise NotImplementedError

    @classmethod
    def to_str(cls) -> str:
        """Upstream's wire format: JSON {"callable": <hex of dill.dumps(cls)>}. A class from any
        module but this package's own is serialised by value (its methods' code and the globals
        they name), so one defined in a test module or a notebook runs on a server that cannot
        import that module; what those globals reference (torch, helpers) is pickled as dill
        does (modules and importable functions by name)."""
        import dill

        if _package_module(cls.__module__) or cls.__module__ == "__main__":
            return json.dumps({"callable": dill.dumps(cls).hex()})  # by reference / dill's by value
        return json.dumps({"callable": dill.dumps(_by_value_copy(cls), recurse=True).hex()})

    @classmethod
    def from_str(cls, json_str: str) -> "CustomLogitProcessor":
        """An instance of the serialised class (the class is deserialised once per string)."""
        return _cache_from_str(json_str)()


def _package_module(name: str) -> bool:
    return name == "sglang" or name.startswith("sglang.")


def _by_value_copy(cls: type) -> type:
    """A twin of `cls` made of fresh objects (same code, names and module), so that dill, which
    pickles a class or function by reference only when its module attribute resolves to that very
    object, pickles the twin by value. `super()` in its methods refers to the twin."""
    cells: list = []

    def fresh(v):
        if isinstance(v, staticmethod):
            return staticmethod(fresh(v.__func__))
        if isinstance(v, classmethod):
            return classmethod(fresh(v.__func__))
        if isinstance(v, property):
            return property(*(fresh(f) if f is not None else None for f in (v.fget, v.fset, v.fdel)), v.__doc__)
        if not isinstance(v, types.FunctionType):
            return v
        closure = v.__closure__
        if closure is not None and "__class__" in v.__code__.co_freevars:
            at = v.__code__.co_freevars.index("__class__")
            cell = types.CellType()
            cells.append(cell)
            closure = closure[:at] + (cell,) + closure[at + 1:]
        f = types.FunctionType(v.__code__, v.__globals__, v.__name__, v.__defaults__, closure)
        f.__kwdefaults__, f.__qualname__, f.__module__, f.__doc__ = (v.__kwdefaults__, v.__qualname__,
                                                                     v.__module__, v.__doc__)
        f.__dict__.update(v.__dict__)
        return f

    ns = {k: fresh(v) for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    twin = type(cls)(cls.__name__, cls.__bases__, ns)
    twin.__qualname__, twin.__module__ = cls.__qualname__, cls.__module__
    for cell in cells:
        cell.cell_contents = twin
    return twin


def load_custom_logit_processor(json_str: Any) -> CustomLogitProcessor:
    """from_str with a clear ValueError for anything that is not a serialised processor class."""
    if not isinstance(json_str, str) or not json_str:
        raise ValueError("custom_logit_processor must be a non-empty string (CustomLogitProcessor.to_str())")
    try:
        data = json.loads(json_str)
        if not isinstance(data, dict) or not isinstance(data.get("callable"), str):
            raise ValueError('expected a JSON object {"callable": "<hex>"}')
        proc = CustomLogitProcessor.from_str(json_str)
    except Exception as e:
        raise ValueError(f"custom_logit_processor could not be loaded: {type(e).__name__}: {e}") from None
    if not isinstance(proc, CustomLogitProcessor):
        raise ValueError(f"custom_logit_processor must serialise a CustomLogitProcessor subclass, got "
                         f"{type(proc).__name__}")
    return proc
