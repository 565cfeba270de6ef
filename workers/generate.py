"""Sampling completions for a batch of prompts: batched, KV-cached, reproducible per (seed, step, sample).

The whole batch is left-padded and decoded together; after the first forward pass over the prompts only
the newest token goes through the model, attending to the cached keys and values, so a completion of n
tokens costs n small passes instead of n passes over the whole sequence. Every sample draws from its own
CPU generator seeded by (seed, step, sample index): the tokens do not depend on which engine, which
batch or which device produced them, and `use_cache=False` (the full recomputation) gives the same ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Sampling:
    """How a sample is drawn, beside its seed (rollout.temperature, top_p, top_k, stop): a stop token id or a stop
    string ends the completion with the token that completed it, which is trained on as EOS is; the text the
    reward sees ends before the stop string, as vLLM's does. Evaluation is greedy, and stops the same way."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, rollout) -> "Sampling":
        """From the config's `rollout` section: its `stop` list holds strings and token ids alike."""
        return cls(rollout.temperature, rollout.top_p, rollout.top_k,
                   tuple(s for s in rollout.stop if isinstance(s, str)),
                   tuple(s for s in rollout.stop if isinstance(s, int)))

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token's probabilities: temperature, then top-k and top-p (transformers' own warpers)."""
        scores = logits.float() / self.temperature
        if self.top_k:
            from transformers.generation.logits_process import TopKLogitsWarper

            scores = TopKLogitsWarper(self.top_k)(None, scores)
        if self.top_p < 1.0:
            from transformers.generation.logits_process import TopPLogitsWarper

            scores = TopPLogitsWarper(self.top_p)(None, scores)
        return torch.softmax(scores, dim=-1)

    @staticmethod
    def text(tokenizer, tokens: list[int]) -> str:
        """The text a stop string is looked for in: as decoded, with no clean-up of spaces (which can undo a match
        when a later token comes), so that a text that holds one goes on holding it as tokens are added."""
        return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def stops(self, text: str) -> bool:
        return any(s in text for s in self.stop_strings)

    @staticmethod
    def skipped(tokenizer) -> set[int]:
        """The tokens `text` drops: the special ones, listed or only flagged so among the added tokens."""
        added = getattr(tokenizer, "added_tokens_decoder", {})
        return set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}

    def stopped(self, tokenizer, tokens: list[int], skipped: set[int]) -> bool:
        """Whether the newest token completed a stop string (the tokens before it held none). Only the newest tokens
        are decoded, so that a completion's scan stays linear in its length: one per byte of the longest stop string
        (each token adds a byte at least, but for the `skipped` ones, which add none and are counted on top), and 3
        more for a character whose bytes the first of them splits."""
        n = max(len(s.encode()) for s in self.stop_strings) + 3
        window = n
        while window < len(tokens) and sum(t in skipped for t in tokens[-window:]) > window - n:
            window += 1
        return self.stops(self.text(tokenizer, tokens[-window:]))

    def stop_at(self, tokenizer, tokens: list[int]) -> list[int]:
        """`tokens` up to the one whose text completes a stop string, or all of them: the first n whose text holds
        one (searched by halves: a prefix that holds one is followed by longer ones that do)."""
        text = lambda n: self.text(tokenizer, tokens[:n])  # noqa: E731
        if not self.stop_strings or not self.stops(text(len(tokens))):
            return tokens
        low, high = 1, len(tokens)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if self.stops(text(middle)) else (middle + 1, high)
        return tokens[:low]

    def cut(self, text: str) -> str:
        """The completion's text before its first stop string."""
        ends = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        return text[:min(ends)] if ends else text


def sample_seed(seed: int, step: int, sample: int) -> int:
    """The seed of one sample's draws: a function of (seed, step, sample) alone, below 2**63."""
    return int(np.random.SeedSequence([seed, step, sample]).generate_state(1, dtype=np.uint64)[0] >> 1)


def sample_generator(seed: int, step: int, sample: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(sample_seed(seed, step, sample))
    return g


def encode_prompt(tokenizer, prompt: str | list[dict], chat_template: bool = True) -> list[int]:
    """The prompt (a string, the user's message, or a chat: a list of messages) as the model expects it: through
    its chat template when it has one, else its messages' contents, one a line, after BOS."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=False)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str | list[dict]], sample_ids: list[int], *, seed: int, step: int,
             max_new_tokens: int, sampling: Sampling = Sampling(), greedy: bool = False, chat_template: bool = True,
             use_cache: bool = True) -> dict:
    """One completion per prompt; left-padded ids, attention and response masks (on CPU) and the texts."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    encoded = [encode_prompt(tokenizer, p, chat_template) for p in prompts]
    width = max(map(len, encoded))
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
    attn = (torch.arange(width) >= torch.tensor([width - len(e) for e in encoded]).unsqueeze(1)).long().to(device)
    gens = [sample_generator(seed, step, s) for s in sample_ids]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    skipped = Sampling.skipped(tokenizer) if sampling.stop_strings else set()
    response, past = [], None
    for _ in range(max_new_tokens):
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        if past is None:
            out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=use_cache)
        else:
            out = model(input_ids=ids[:, -1:], attention_mask=attn, position_ids=positions[:, -1:],
                        past_key_values=past, use_cache=True)
        past = out.past_key_values if use_cache else None
        probs = sampling.warp(out.logits[:, -1]).cpu()
        if greedy:
            nxt = probs.argmax(dim=-1)
        else:
            nxt = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(gens)])
        nxt = torch.where(done.cpu(), torch.full_like(nxt, pad), nxt).to(device)
        response.append(~done)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        attn = torch.cat([attn, (~done).long()[:, None]], dim=1)
        done |= nxt == tokenizer.eos_token_id
        if sampling.stop_token_ids:
            done |= torch.isin(nxt, torch.tensor(sampling.stop_token_ids, dtype=nxt.dtype, device=device))
        if sampling.stop_strings:
            done |= torch.tensor([not finished and sampling.stopped(tokenizer, row[width:], skipped)
                                  for row, finished in zip(ids.tolist(), done.tolist())], device=device)
        if done.all():
            break
    ids, attn = ids.cpu(), attn.cpu()
    response_mask = torch.zeros_like(ids)
    response_mask[:, width:] = torch.stack(response, dim=1).long().cpu()
    completions = [sampling.cut(tokenizer.decode(row[width:][response_mask[i, width:].bool()],
                                                 skip_special_tokens=True)) for i, row in enumerate(ids)]
    return {"input_ids": ids, "attention_mask": attn, "response_mask": response_mask,
            "completions": completions, "pad_id": pad}


def pack_rollouts(tokenizer, encoded: list[list[int]], responses: list[list[int]],
                  sampling: Sampling = Sampling()) -> dict:
    """An engine's completions (token ids, ending at EOS or at the length limit) in the layout `generate`
    returns: prompts left-padded to one width, completions right-padded after them, and their masks."""
    pad, width = tokenizer.pad_token_id, max(map(len, encoded))
    length = max(map(len, responses), default=0)
    ids = torch.full((len(encoded), width + length), pad, dtype=torch.long)
    attn, response_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(zip(encoded, responses)):
        ids[i, width - len(prompt):width] = torch.tensor(prompt, dtype=torch.long)
        ids[i, width:width + len(response)] = torch.tensor(response, dtype=torch.long)
        attn[i, width - len(prompt):width + len(response)] = 1
        response_mask[i, width:width + len(response)] = 1
    completions = [sampling.cut(tokenizer.decode(r, skip_special_tokens=True)) for r in responses]
    return {"input_ids": ids, "attention_mask": attn, "response_mask": response_mask,
            "completions": completions, "pad_id": pad}
