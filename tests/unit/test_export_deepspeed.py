"""`relaunch export` on DeepSpeed files that load safely but are not what DeepSpeed wrote: one line, no traceback."""
import pytest
import torch

from supervisor.tools.export import ExportError, deepspeed_weights


def test_deepspeed_files_that_are_not_a_zero_checkpoint_are_a_damaged_checkpoint(tmp_path):
    tag = tmp_path / "globalstep3" / "global_step3"
    tag.mkdir(parents=True)
    torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")  # no optimizer states, no shapes
    with pytest.raises(ExportError, match="damaged checkpoint: .*globalstep3: DeepSpeed cannot read it"):
        deepspeed_weights(tmp_path / "globalstep3", 3)
