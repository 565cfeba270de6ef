"""Peak memory per actor kind: read cheaply in each process, folded into the stats row and `status`."""
import os

from supervisor.control.memory import largest, memory_fields
from supervisor.tools.status import format_status, peak_memory_of
from workers.memory import peak_memory

MACHINE_GB = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def test_this_process_peak_is_plausible():
    peak = peak_memory()
    assert 0.01 < peak["rss_gb"] < MACHINE_GB


def test_row_fields_take_each_kinds_largest_process():
    fields = memory_fields([{"rss_gb": 1.0}, {"rss_gb": 3.0, "cuda_gb": 2.0}], {"rss_gb": 2.0}, [])
    assert fields["mem/train_peak_gb"] == 3.0 and fields["mem/train_cuda_peak_gb"] == 2.0
    assert fields["mem/engine_peak_gb"] == 2.0 and "mem/spare_peak_gb" not in fields
    assert 0 < fields["mem/supervisor_peak_gb"] < MACHINE_GB
    assert largest([]) is None


def test_status_reports_the_peak_over_the_trials_steps():
    rows = [{"mem/engine_peak_gb": 1.0, "mem/train_peak_gb": 1.5}, {"mem/spare_peak_gb": 0.9, "mem/train_peak_gb": 1.2}]
    assert list(peak_memory_of(rows).items()) == [("train", 1.5), ("engine", 1.0), ("spare", 0.9)]
    st = {"experiment_name": "e", "trial_name": "t", "checkpoint_root": "/r", "live": None, "state": "done",
          "last_valid": None, "checkpoint_error": None, "restarts": 0, "last_step": None, "events": [],
          "memory": peak_memory_of(rows)}
    assert "memory     peak train 1.50 GB, engine 1.00 GB, spare 0.90 GB" in format_status(st)
