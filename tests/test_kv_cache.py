"""A key-value cache that grows by reallocating is refused, where a user puts one; a static one,
and look-alikes that are no cache, are not.

The fake classes follow transformers' cache protocol (``is_compileable``, ``update``,
``get_seq_length``); with transformers installed, its own ``DynamicCache`` and ``StaticCache``
are checked too.  The GPU test (tests/test_gpu_transformers.py) records a model holding one.
"""
from __future__ import annotations

import pytest
import torch

from nimble.errors import InputError
from nimble.record.kv_cache import check_module_caches, check_result_caches, is_growing_cache
from nimble.record.recorder import _as_tensor_list


class GrowingCache:
    """Appends with ``torch.cat``, as a dynamic cache does."""

    def __init__(self) -> None:
        self.keys: list = []

    @property
    def is_compileable(self) -> bool:
        return False

    def update(self, k):
        self.keys.append(k)

    def get_seq_length(self) -> int:
        return len(self.keys)


class FixedCache(GrowingCache):
    is_compileable = True


class Quantizer:
    """Says whether it compiles, as transformers' quantizers do, but is no cache."""

    is_compileable = False


class DecodeStep(torch.nn.Module):
    def __init__(self, cache) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.proj.cache = cache

    def forward(self, x):
        return self.proj(x)


def test_a_growing_cache_held_by_a_submodule_is_refused_and_named():
    with pytest.raises(InputError) as info:
        check_module_caches(DecodeStep(GrowingCache()), "DecodeStep")
    message = str(info.value)
    assert message.startswith("the attribute 'proj.cache' of DecodeStep is a GrowingCache, a "
                              "key-value cache that reallocates its tensors as it grows")
    assert "StaticCache" in message and "use_cache=False" in message


def test_a_growing_cache_in_a_list_or_dict_attribute_is_refused():
    step = DecodeStep(FixedCache())
    step.history = [FixedCache(), GrowingCache()]
    with pytest.raises(InputError, match=r"'history\[1\]'"):
        check_module_caches(step, "DecodeStep")
    step.history = {"past": GrowingCache()}
    with pytest.raises(InputError, match=r"'history\['past'\]'"):
        check_module_caches(step, "DecodeStep")


def test_a_static_cache_and_a_quantizer_are_accepted():
    step = DecodeStep(FixedCache())
    step.quantizer = Quantizer()
    check_module_caches(step, "DecodeStep")
    assert not is_growing_cache(Quantizer()) and not is_growing_cache(torch.zeros(2))


def test_a_growing_cache_in_the_result_is_refused():
    out = {"hidden": torch.zeros(2), "past": (torch.zeros(1), GrowingCache())}
    with pytest.raises(InputError, match="result of the forward of Net is a GrowingCache"):
        check_result_caches(out, "Net")
    check_result_caches({"hidden": torch.zeros(2), "past": FixedCache()}, "Net")


def test_a_growing_cache_given_as_input_is_refused_with_the_advice():
    with pytest.raises(InputError, match="input 0 is a GrowingCache.*StaticCache"):
        _as_tensor_list((GrowingCache(), torch.zeros(2)))


def test_transformers_dynamic_cache_is_growing_and_static_cache_is_not():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    assert is_growing_cache(transformers.DynamicCache())
    assert is_growing_cache(transformers.DynamicCache(config=config))
    assert not is_growing_cache(transformers.StaticCache(config=config, max_cache_len=16))
    model = transformers.LlamaModel(config)
    check_module_caches(model, "LlamaModel")  # a model holds no cache of its own
    ids = torch.randint(0, config.vocab_size, (1, 8))
    out = model(input_ids=ids, use_cache=True)
    with pytest.raises(InputError, match="is a DynamicCache"):
        check_result_caches(out, "LlamaModel")
    check_result_caches(model(input_ids=ids, use_cache=False), "LlamaModel")
