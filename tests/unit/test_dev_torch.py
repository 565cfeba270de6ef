"""dev.sh's torch choice: the CPU build on a machine without a GPU, whatever indexes pip knows."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("dev_torch", Path(__file__).parents[2] / "dev_torch.py")
dev_torch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dev_torch)

INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("has_gpu, index, answers, expected", [
    # a stock machine that knows only PyPI: the CPU index is added and the +cpu pin can only match there
    (False, INDEX, True, ["--extra-index-url", INDEX, "torch==2.13.0+cpu"]),
    # this machine: the index does not answer, the wheel comes from the configured mirror / find-links
    (False, INDEX, False, ["torch==2.13.0+cpu"]),
    # RELAUNCH_TORCH_INDEX= (empty): only the indexes pip is configured with
    (False, "", True, ["torch==2.13.0+cpu"]),
    # a GPU: the CUDA build from the default index, never the CPU index
    (True, INDEX, True, ["torch>=2.6,<2.14"]),
])
def test_torch_pip_args(has_gpu, index, answers, expected):
    assert dev_torch.torch_pip_args(has_gpu, index, answers) == expected


def test_an_unreachable_index_is_given_up_quickly(monkeypatch):
    """The probe is bounded: an index that never answers costs PROBE_SECS, not pip's retries."""
    monkeypatch.setattr(dev_torch, "PROBE_SECS", 0.2)
    assert dev_torch.answers("http://127.0.0.1:9/simple") is False
