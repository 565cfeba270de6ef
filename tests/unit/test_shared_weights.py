"""An engine's weights moved into shared memory: the model is unchanged, ties stay tied, and a mapping made
through /proc sees and makes the same bytes; a handle that names other memory maps nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from workers.shared_weights import SharedWeights, attach


def tied_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=True))
    model[1].weight = model[0].weight  # tied, as a Qwen2 lm_head with its embedding
    return model


def test_the_parameters_move_into_the_segment_unchanged_and_stay_tied():
    model = tied_model()
    x = torch.tensor([[1, 2, 3]])
    before = model(x)
    shared = SharedWeights(model)
    assert torch.equal(model(x), before)
    assert model[1].weight is model[0].weight
    assert shared.layout == [("0.weight", [7, 4]), ("1.bias", [7])]  # the tie once
    assert shared.nbytes == (7 * 4 + 7) * 4


def test_a_mapping_through_proc_writes_into_the_engines_parameters():
    model = tied_model()
    shared = SharedWeights(model)
    segment = attach(shared.handle())
    assert segment is not None and segment.numel() == shared.nbytes
    segment.view(torch.float32)[:28].fill_(2.5)  # what a trainer rank does: its part, in place
    assert torch.equal(model[0].weight, torch.full((7, 4), 2.5))
    assert not torch.equal(model[1].bias, torch.full((7,), 2.5))


def test_another_process_maps_the_same_memory():
    model = tied_model()
    shared = SharedWeights(model)
    handle = shared.handle()
    code = ("import sys, torch; from workers.shared_weights import attach; "
            f"s = attach({handle!r}); s.view(torch.float32)[28:].fill_(-1.0); print(s is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip() == "True"
    assert torch.equal(model[1].bias.detach(), torch.full((7,), -1.0))


def test_a_handle_to_other_memory_maps_nothing():
    shared = SharedWeights(tied_model())
    handle = shared.handle()
    assert attach(handle | {"nonce": "00" * 16}) is None  # another segment where this one was
    assert attach(handle | {"bytes": handle["bytes"] + 4}) is None
    assert attach(handle | {"path": "/proc/999999999/fd/3"}) is None  # another host or pid namespace
