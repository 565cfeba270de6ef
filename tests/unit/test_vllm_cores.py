"""The vLLM engine's pure part: which cores an engine binds its threads to."""
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

