"""RolloutWorker: an inference engine holding the policy's weights, tagged with a version.

The version is the global step those weights are used for: the initial weights are version 0, and the
weights after step G's update are version G + 1. Generation (workers/generate.py) is batched and
KV-cached; every sample is drawn from its own generator seeded by (seed, step, sample index), so a
restarted engine, or any number of engines, draws the same samples. With cluster.gpus_per_engine > 0
the engine's model lives on its GPU, in one buffer that trainer ranks on that GPU write through CUDA IPC
(workers/cuda_weights.py), and its syncs are checked with digests computed on the device (`sum64`).

With rollout.engine vllm, vLLM samples (workers/vllm_engine.py) and the model here is its staging copy: a sync
lands in it as it lands in the built-in engine's model, then goes into vLLM in place; the digest the sync is
checked with, and every weight_status, is computed over what vLLM read back, not over the staging copy.
"""
from __future__ import annotations

import os

import ray
import torch

from supervisor.config import Config, RolloutEngine
from supervisor.testing.fault_points import fault_points
from workers.errors import StaleWeights, WeightSyncError
from workers.generate import Sampling, encode_prompt, generate, pack_rollouts, sample_seed
from workers.cuda_weights import CudaSharedWeights
from workers.gpu import deterministic_cuda, device_uuid
from workers.memory import peak_memory
from workers.model import build_model, build_tokenizer
from workers.shared_weights import SharedWeights
from workers.weight_sync import (flat_digest, join_group, local_digest, op_timeout, receive,
                                 receive_shared)


@ray.remote
class RolloutWorker:
    @fault_points
    def __init__(self, config: Config, index: int = 0):
        torch.set_num_threads(1)
        if config.cluster.gpus_per_engine > 0:
            deterministic_cuda()  # before any CUDA kernel (workers/gpu.py)
        self.config, self.rank = config, index  # `rank`: the engine's index, for fault points
        self.tokenizer = build_tokenizer(config.model)
        self.model = build_model(config.model, self.tokenizer, config.seed).eval()
        dtype = getattr(torch, config.engine_dtype)  # the sync casts the trainer's weights to it
        for p in self.model.parameters():  # the parameters only: buffers (RoPE's frequencies) stay the trainer's fp32
            p.data = p.data.to(dtype)
        if config.cluster.gpus_per_engine > 0:  # Ray set CUDA_VISIBLE_DEVICES to the engine's GPU
            self.model.to("cuda")
        self.dtype = next(self.model.parameters()).dtype
        # the parameters live in memory that trainer ranks can write in place: shared memory on this host (CPU),
        # or a buffer on this GPU that ranks seeing the GPU open through CUDA IPC
        self.gpu = config.cluster.gpus_per_engine > 0
        self.shared = None
        if config.rollout.shared_memory_weights:
            try:
                self.shared = CudaSharedWeights(self.model) if self.gpu else SharedWeights(self.model)
            except OSError:  # none here (self.shared stays None): the weights are streamed to it
                pass
        self.vllm = None
        if config.rollout.engine is RolloutEngine.VLLM:
            from workers.vllm_engine import VllmEngine

            self.vllm = VllmEngine(config, self.tokenizer, index)
        # the built-in engine on a GPU hashes its weights there (vLLM's are read back and hashed on the host)
        self.digest = "sum64" if self.gpu and self.vllm is None else "xxh3"
        self.weights_device = "cpu"  # where the stream's buckets land: the GPU when the group is nccl
        self.version: int | None = None
        self.names: list[str] = []  # the stream's order of the parameters, as the sync that brought `version` sent
        self.weights_group = None  # its member of the weights-update group (workers/weight_sync.py)
        self.group_name = ""

    def take_place(self, index: int) -> None:
        """A spare engine now serves as engine `index`: its fault points and, on CPU, its cores are that engine's."""
        self.rank = index
        if self.vllm is not None and self.config.cluster.gpus_per_engine == 0:
            self.vllm.bind(index, self.config.cluster.cpus_per_worker)

    @fault_points
    def where(self) -> dict:
        """Its node and process, and on a GPU the GPU's UUID (whether trainer ranks share it)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "gpu": device_uuid() if self.gpu else None}

    @fault_points
    def share_weights(self, group_name: str) -> dict | None:
        """The handle of a new segment of its shared weights, for the ranks of the weights-update group
        `group_name` alone (workers/shared_weights.py: renew); None when it offers none."""
        return self.shared.renew(group_name) if self.shared else None

    @fault_points
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> dict:
        """Join a new weights-update group as rank `rank_offset` (the trainer's rank 0 is its rank 0).
        Returns the dtype the engine wants its weights in, and the kind of digest it checks them with."""
        self.weights_group, self.group_name = None, group_name  # the previous group's connections go first
        self.weights_group = join_group(master_address, master_port, rank_offset, world_size, group_name, backend,
                                        op_timeout(self.config))
        self.weights_device = "cuda" if backend == "nccl" else "cpu"
        return {"dtype": str(self.dtype).removeprefix("torch."), "digest": self.digest}

    @fault_points
    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        version: int, shared: bool = False) -> str:
        """Receive the trainer's weights over the group, bucket by bucket, in place into the parameters; take
        `version` only when the last bucket landed and every bucket's digest agrees. With `shared`, the
        trainer ranks write them into this engine's shared weights themselves, and the group brings only the
        hashes, once all have. Returns the digest."""
        self.version = None  # from the first byte written, it holds no version
        own = dict(self.model.named_parameters())  # a tied lm_head is embed_tokens: named once
        if set(names) != set(own) or len(names) != len(own):
            raise ValueError(f"weights do not fit the engine's model: sent {sorted(set(names) - set(own))}, "
                             f"missing {sorted(set(own) - set(names))}")
        wrong = [n for n, d, shape in zip(names, dtypes, shapes)
                 if d != str(self.dtype).removeprefix("torch.") or list(own[n].shape) != list(shape)]
        if wrong:
            raise ValueError(f"weights do not fit the engine's model: dtype or shape of {wrong[:5]}")
        params, bucket_bytes = [own[n] for n in names], self.config.rollout.weight_bucket_mb * 2**20
        if shared:
            if self.shared.generation != self.group_name:  # the ranks wrote into another group's segment
                raise WeightSyncError(f"shared weights of group {self.shared.generation} written for a sync of "
                                      f"group {self.group_name}")
            digest = receive_shared([p.numel() for p in params], self.dtype, bucket_bytes, self.weights_group,
                                    op_timeout(self.config), self.digest)
        else:
            digest = receive(params, self.dtype, bucket_bytes, self.weights_group, op_timeout(self.config),
                             self.weights_device, self.digest)
        if self.vllm:
            served = self.vllm.refit(self.model, names, bucket_bytes)
            if served != digest:
                raise WeightSyncError(f"vLLM holds weights of digest {served} after loading {digest}")
        self.version, self.names = version, list(names)
        return digest

    @fault_points
    def weight_status(self) -> tuple[int | None, str]:
        """(version, digest of the weights it holds now), for the resync gate: hashed again, not remembered, so
        that whatever changed them since their sync (a late writer, a bug) shows."""
        if self.version is None:
            return None, ""
        bucket_bytes = self.config.rollout.weight_bucket_mb * 2**20
        if self.vllm:
            return self.version, self.vllm.digest(self.model, self.names, bucket_bytes)
        if self.shared and [n for n, _ in self.shared.layout] == self.names:  # in the stream's order: hashed in place
            return self.version, flat_digest(self.shared.flat().view(self.dtype), self.dtype, bucket_bytes,
                                             self.digest)
        own = dict(self.model.named_parameters())
        return self.version, local_digest([own[n] for n in self.names], self.dtype, bucket_bytes, self.digest)

    @fault_points
    def generate(self, prompts: list[str | list[dict]], sample_ids: list[int], global_step: int, version: int,
                 greedy: bool = False) -> dict:
        """Sample (or, for evaluation, greedily pick) one completion per prompt; left-padded ids and masks, and
        this process's peak memory (`memory`). Refuses unless it holds weights `version`: no rollout is ever
        drawn from the wrong weights."""
        if self.version != version:
            raise StaleWeights(f"asked for weights version {version} at step {global_step}, holds {self.version}")
        cfg, sampling = self.config, Sampling.of(self.config.rollout)
        if self.vllm:
            encoded = [encode_prompt(self.tokenizer, p, cfg.data.chat_template) for p in prompts]
            seeds = [sample_seed(cfg.seed, global_step, s) for s in sample_ids]
            responses = self.vllm.generate(encoded, seeds, cfg.data.max_new_tokens, sampling, greedy)
            return pack_rollouts(self.tokenizer, encoded, responses, sampling) | {"memory": peak_memory()}
        out = generate(self.model, self.tokenizer, prompts, sample_ids, seed=cfg.seed, step=global_step,
                       max_new_tokens=cfg.data.max_new_tokens, sampling=sampling, greedy=greedy,
                       chat_template=cfg.data.chat_template)
        return out | {"memory": peak_memory()}


def merge_rollouts(chunks: list[dict]) -> dict:
    """Concatenate engines' results in sample order, left-padding to a common width; the engines' largest peak
    memory of each kind."""
    pad_id = chunks[0]["pad_id"]
    width = max(c["input_ids"].shape[1] for c in chunks)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    return {
        "input_ids": torch.cat([pad(c["input_ids"], pad_id) for c in chunks]),
        "attention_mask": torch.cat([pad(c["attention_mask"], 0) for c in chunks]),
        "response_mask": torch.cat([pad(c["response_mask"], 0) for c in chunks]),
        "completions": [x for c in chunks for x in c["completions"]],
        "memory": {k: max(c["memory"][k] for c in chunks) for k in chunks[0]["memory"]},
    }
