"""The vLLM engine's pure parts: which cores an engine binds its threads to, and what a dead engine core does."""
import importlib.util

import pytest

from workers.vllm_engine import engine_cores


@pytest.mark.parametrize("allowed, index, threads, cores", [
    ([0, 1], 0, 1, [0]),
    ([0, 1], 1, 1, [1]),          # a second engine on the node takes the other core
    ([0, 1], 2, 1, [0]),          # more engines than cores: they wrap around
    ([4, 5, 6, 7], 1, 2, [6, 7]),
    ([1, 0], 0, 4, [0, 1]),       # more threads than cores: each core once
])
def test_engines_on_one_node_bind_to_different_cores(allowed, index, threads, cores):
    assert engine_cores(allowed, index, threads) == cores


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (./dev.sh installs it)")
def test_an_engine_core_that_died_ends_the_process_and_nothing_else_does():
    from vllm.v1.engine.exceptions import EngineDeadError

    from workers.vllm_engine import _or_exit

    exits = []

    def dead():
        raise EngineDeadError()

    _or_exit(dead, exit=exits.append)
    assert exits == [1]
    with pytest.raises(ValueError):  # any other error is the caller's to classify
        _or_exit(lambda: int("x"), exit=exits.append)
    assert exits == [1] and _or_exit(lambda: 7, exit=exits.append) == 7
