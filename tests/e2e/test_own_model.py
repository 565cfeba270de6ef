"""Bring your own model: a run from a local HuggingFace directory (Llama architecture, its own trained BPE
tokenizer and chat template) on the multi-token task, and the checkpoint tools on what it wrote —
export at any world size, verify, inspect — including a checkpoint whose DCP metadata is a pickle payload.

One job on one shared cluster; the tools run without a cluster; one more job resumes the tampered trial.
"""
from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, Trial, relaunch
from safetensors.torch import load_file, save_file
from tiny_hf import CHAT_TEMPLATE, save_tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from supervisor.checkpoint.durable import file_digest
from workers.weight_sync import local_digest

pytestmark = pytest.mark.e2e

CONFIG = REPO / "configs" / "count_on.yaml"
# 3 epochs of 12 steps; a recover checkpoint and an HF export at every epoch's end (steps 11, 23, 35); no warm
# spares (nothing here fails: harness.suite_job says what they cost a job).
RUN = ["total_train_epochs=3", "actor.lr=1e-2", "recover.freq_steps=12", "saver.freq_epochs=1",
       "recover.spare_workers=0"]


class CountOnTrial(Trial):
    def __init__(self, fileroot: Path):
        super().__init__(fileroot)
        self.root = self.root.parent.parent / "count-on" / "trial0"
        self.logs = self.logs.parent.parent / "count-on" / "trial0"

    def step_dir(self, step: int) -> Path:
        return self.root / "default" / "recover_checkpoint" / f"globalstep{step}"


@pytest.fixture(scope="module")
def own_model(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama", REPO / "examples/count_on/data.jsonl")


@pytest.fixture(scope="module")
def own_run(cluster, own_model, tmp_path_factory) -> CountOnTrial:
    trial = CountOnTrial(tmp_path_factory.mktemp("own") / "runs")
    r = relaunch("run", str(CONFIG), f"model.path={own_model}", *RUN, *trial.overrides, "--address", cluster.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return trial


def test_run_from_own_hf_model_starts_from_its_weights_learns_and_exports_it(own_run, own_model, tmp_path):
    trial = own_run
    source = AutoModelForCausalLM.from_pretrained(own_model, dtype=torch.float32)
    assert source.config.model_type == "llama"
    # The weights every engine got before any update (version 0) are the source's, bit for bit.
    first_sync = trial.events("resync")[0]
    params = [p for _, p in source.named_parameters()]
    assert first_sync["version"] == 0 and first_sync["checksum"] == local_digest(params, torch.float32, 64 * 2**20)

    stats = trial.stats()
    assert [s["global_step"] for s in stats] == list(range(36))
    first, last = (sum(s["reward"] for s in part) / len(part) for part in (stats[:6], stats[-12:]))
    assert last > first + 0.04, (first, last)  # sampled per-position reward on 3-token answers

    exports = trial.exports()
    assert [p.name.rsplit("globalstep", 1)[1] for p in exports] == ["11", "23", "35"]
    newest = exports[-1]
    tok, src_tok = AutoTokenizer.from_pretrained(newest), AutoTokenizer.from_pretrained(own_model)
    assert tok.get_vocab() == src_tok.get_vocab() and tok.chat_template == CHAT_TEMPLATE
    assert (newest / "generation_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(newest)
    ids = tok.apply_chat_template([{"role": "user", "content": "3 8 ="}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] > ids.shape[1]

    # verify: the Saver's export of step 35 is the recover checkpoint of step 35, tensor by tensor ...
    ok = relaunch("verify", str(newest), "--against", str(trial.step_dir(35)))
    assert ok.returncode == 0 and "match" in ok.stdout, ok.stdout + ok.stderr
    # ... an older export is not, and one changed tensor is named
    older = relaunch("verify", str(exports[1]), "--against", str(trial.step_dir(35)))
    assert older.returncode == 1 and "DIFFERS model.layers.0" in older.stdout, older.stdout
    changed = tmp_path / "changed"
    shutil.copytree(newest, changed)
    weights = load_file(changed / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] += 0.25
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    bad = relaunch("verify", str(changed), "--against", str(newest))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert [x for x in bad.stdout.splitlines() if x.startswith("DIFFERS")] == \
        ["DIFFERS model.layers.1.mlp.up_proj.weight: max abs difference 0.25 > 0"]


def test_exports_of_one_and_two_rank_checkpoints_are_identical_sharded_and_cast(own_run, tmp_path):
    two_ranks = own_run.step_dir(35)
    rewrite = subprocess.run([sys.executable, str(Path(__file__).parent / "rewrite_checkpoint.py"), str(two_ranks),
                              str(tmp_path / "rewritten"), "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rewrite.returncode == 0, rewrite.stderr[-3000:]
    one_rank = Path(rewrite.stdout.split()[-1])
    assert json.loads((one_rank / "manifest.json").read_text())["world_size"] == 1
    assert json.loads((two_ranks / "manifest.json").read_text())["world_size"] == 2

    outs = {}
    for name, ckpt in (("two", two_ranks), ("one", one_rank)):
        outs[name] = tmp_path / f"hf-{name}"
        r = relaunch("export", str(ckpt), "--out", str(outs[name]))
        assert r.returncode == 0, r.stderr[-2000:]
    assert (outs["one"] / "model.safetensors").read_bytes() == (outs["two"] / "model.safetensors").read_bytes()
    assert (outs["one"] / "model.safetensors").read_bytes() == \
        (own_run.exports()[-1] / "model.safetensors").read_bytes()  # and the Saver's own export
    assert relaunch("verify", str(outs["one"]), "--against", str(two_ranks)).returncode == 0

    sharded = tmp_path / "hf-bf16"
    r = relaunch("export", str(one_rank), "--out", str(sharded), "--dtype", "bfloat16", "--max-shard-size", "50KB")
    assert r.returncode == 0, r.stderr[-2000:]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(sharded)
    assert model.dtype == torch.bfloat16
    full = load_file(outs["one"] / "model.safetensors")
    assert all(torch.allclose(p.float(), full[n], atol=2e-2) for n, p in model.state_dict().items())
    cast = relaunch("verify", str(sharded), "--against", str(outs["one"]), "--atol", "0.02")
    assert cast.returncode == 1 and "dtype torch.bfloat16 != torch.float32" in cast.stdout
    assert relaunch("export", str(one_rank), "--out", str(sharded)).returncode == 2  # never overwrites


def test_inspect_describes_a_checkpoint_and_reports_a_damaged_one(own_run, tmp_path):
    r = relaunch("inspect", str(own_run.step_dir(35)))
    assert r.returncode == 0, r.stderr
    for expected in ("valid        yes", "global step  35  (epoch 2, epoch step 11", "world size   2",
                     "engine       fsdp", "__0_0.distcp", "__1_0.distcp", "rng_rank1.pt",
                     "training goes on at global step 36"):
        assert expected in r.stdout, (expected, r.stdout)
    damaged = tmp_path / "globalstep35"
    shutil.copytree(own_run.step_dir(35), damaged)
    shard = damaged / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    r = relaunch("inspect", str(damaged))
    assert r.returncode == 2
    assert f"valid        NO: {shard}: size 100, expected" in r.stdout


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return subprocess.call, (["touch", str(self.marker)],)


def test_pickle_payload_in_dcp_metadata_runs_nothing_on_export_verify_inspect_or_resume(cluster, own_model, own_run,
                                                                                        tmp_path):
    trial = CountOnTrial(tmp_path / "runs")
    shutil.copytree(own_run.fileroot, trial.fileroot)
    newest = trial.step_dir(35)
    marker = tmp_path / "payload-ran"
    (newest / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"size": (newest / ".metadata").stat().st_size,
                                      "sha256": file_digest(newest / ".metadata")}
    (newest / "manifest.json").write_text(json.dumps(manifest))

    refused = f"{newest / '.metadata'}: cannot load (refusing to load subprocess.call"
    for args in (("export", str(newest), "--out", str(tmp_path / "x")),
                 ("verify", str(trial.exports()[-1]), "--against", str(newest)),
                 ("inspect", str(newest))):
        r = relaunch(*args)
        assert r.returncode == 2 and refused in r.stdout + r.stderr, (args, r.stdout, r.stderr)
    assert not (tmp_path / "x").exists()

    # resume: the refused checkpoint is damaged, so the run falls back to step 23 and trains on
    r = relaunch("run", str(CONFIG), f"model.path={own_model}", *RUN[1:], "total_train_epochs=4", *trial.overrides,
                 "--address", cluster.address)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert any(refused in e["reason"] for e in trial.events("fallback"))
    assert trial.events("loaded")[-1]["global_step"] == 23
    assert [s["global_step"] for s in trial.stats()] == list(range(48))
    assert not marker.exists()


def _deepspeed_shaped(published: Path, dst: Path, payload, run_backend: str) -> Path:
    """A copied step directory made to look written by DeepSpeed, as a new user might be handed one: no DCP
    files, DeepSpeed-named files holding `payload`, `engine: deepspeed` and matching hashes in its manifest,
    and `run_backend` in its run_config.json."""
    shutil.copytree(published, dst)
    for f in [*dst.glob("*.distcp"), dst / ".metadata"]:
        f.unlink()
    tag = dst / f"global_step{dst.name[len('globalstep'):]}"
    tag.mkdir()
    torch.save({"module": payload}, tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": payload}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (dst / "latest").write_text(tag.name)
    run_config = json.loads((dst / "run_config.json").read_text())
    run_config["actor"]["backend"] = run_backend
    (dst / "run_config.json").write_text(json.dumps(run_config))
    manifest = json.loads((dst / "manifest.json").read_text())
    files = {n: e for n, e in manifest["files"].items() if (dst / n).is_file()}
    for f in [*tag.iterdir(), dst / "latest", dst / "run_config.json"]:
        files[str(f.relative_to(dst))] = {"size": f.stat().st_size, "sha256": file_digest(f)}
    (dst / "manifest.json").write_text(json.dumps(dict(manifest, files=files, engine="deepspeed")))
    return tag


def test_a_deepspeed_shaped_pickle_payload_runs_nothing_on_export_or_verify(reference, tmp_path):
    published = sorted((reference.root / "default" / "recover_checkpoint").glob("globalstep*"),
                       key=lambda p: int(p.name[10:]))[-1]
    marker = tmp_path / "payload-ran"
    for run_backend in ("fsdp", "deepspeed"):  # the manifest's claim alone, and with the run's config agreeing
        step_dir = tmp_path / run_backend / published.name
        tag = _deepspeed_shaped(published, step_dir, _Payload(marker), run_backend)
        refused = (f"{step_dir / 'manifest.json'}: engine deepspeed, but run_config.json says actor.backend fsdp"
                   if run_backend == "fsdp" else f"unsafe checkpoint: {tag}/")
        for args in (("export", str(step_dir), "--out", str(tmp_path / "x")),
                     ("verify", str(step_dir), "--against", str(reference.exports()[-1]))):
            r = relaunch(*args)
            last = r.stderr.strip().splitlines()[-1]
            assert r.returncode == 2 and last.startswith("relaunch: error:") and refused in last, (args, r.stderr)
            assert "Traceback" not in r.stderr and not marker.exists()
    assert not (tmp_path / "x").exists()
