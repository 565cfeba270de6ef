"""Generation on its own (no Ray): the KV-cached path draws exactly the tokens of full recomputation,
and a sample's tokens depend only on (seed, step, sample), not on the batch it was drawn in."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from supervisor.config import ModelConfig
from workers.generate import Sampling, encode_prompt, generate, pack_rollouts
from workers.model import build_tokenizer

PROMPTS = ["3 8 =", "1 =", "9 9 9 9 =", "0 4 =", "7 =", "5 5 5 =", "2 6 =", "8 1 1 ="]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(ModelConfig())


def tiny(arch: str, tokenizer):
    torch.manual_seed(0)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.5,
                 pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                 eos_token_id=tokenizer.eos_token_id)
    config = LlamaConfig(**sizes) if arch == "llama" else Qwen2Config(**sizes)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def run(model, tok, prompts, ids, **kw):
    return generate(model, tok, prompts, ids, seed=3, step=7, max_new_tokens=12, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("greedy", [False, True])
def test_kv_cached_generation_draws_the_same_tokens_as_full_recomputation(tokenizer, arch, greedy):
    model = tiny(arch, tokenizer)
    cached = run(model, tokenizer, PROMPTS, list(range(8)), greedy=greedy)
    full = run(model, tokenizer, PROMPTS, list(range(8)), greedy=greedy, use_cache=False)
    for key in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(cached[key], full[key]), key
    assert cached["completions"] == full["completions"]
    assert max(len(c.split()) for c in cached["completions"]) > 3  # long completions, several decode steps


def test_a_sample_does_not_depend_on_its_batch(tokenizer):
    model = tiny("llama", tokenizer)
    whole = run(model, tokenizer, PROMPTS, list(range(8)))
    halves = [run(model, tokenizer, PROMPTS[:5], list(range(5))), run(model, tokenizer, PROMPTS[5:], list(range(5, 8)))]
    assert whole["completions"] == halves[0]["completions"] + halves[1]["completions"]
    other_step = generate(model, tokenizer, PROMPTS, list(range(8)), seed=3, step=8, max_new_tokens=12)
    assert other_step["completions"] != whole["completions"]


def test_prompts_go_through_the_chat_template_when_the_tokenizer_has_one(tokenizer):
    plain = encode_prompt(tokenizer, "3 8 =")
    assert plain == [tokenizer.bos_token_id] + tokenizer.encode("3 8 =", add_special_tokens=False)
    tokenizer.chat_template = "{% for m in messages %}<s> {{ m['content'] }} = {% endfor %}"
    try:
        assert encode_prompt(tokenizer, "3 8") == tokenizer.encode("<s> 3 8 =", add_special_tokens=False)
        assert encode_prompt(tokenizer, "3 8 =", chat_template=False) == plain
    finally:
        tokenizer.chat_template = None


def test_an_engines_completions_packed_are_the_builtin_layout(tokenizer):
    """pack_rollouts (what the vLLM engine returns through) lays out completions exactly as generate does:
    the builtin's own completions, taken apart and packed again, come back identical."""
    model = tiny("qwen2", tokenizer)
    out = run(model, tokenizer, PROMPTS, list(range(8)))
    encoded = [encode_prompt(tokenizer, p) for p in PROMPTS]
    width = max(map(len, encoded))
    responses = [row[width:][mask[width:].bool()].tolist() for row, mask in zip(out["input_ids"], out["response_mask"])]
    assert len({len(r) for r in responses}) > 1  # some completions ended at EOS before others
    packed = pack_rollouts(tokenizer, encoded, responses)
    for key in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(packed[key], out[key]), key
    assert packed["completions"] == out["completions"] and packed["pad_id"] == out["pad_id"]


def test_top_k_and_top_p_narrow_the_draw_and_stops_end_a_completion(tokenizer):
    model = tiny("llama", tokenizer)
    greedy, sampled = run(model, tokenizer, PROMPTS, list(range(8)), greedy=True), run(model, tokenizer, PROMPTS,
                                                                                       list(range(8)))
    assert sampled["completions"] != greedy["completions"]
    # one token left to draw from, by either rule: the greedy tokens, whatever the seed
    for narrow in (Sampling(top_k=1), Sampling(top_p=1e-6)):
        drawn = run(model, tokenizer, PROMPTS, list(range(8)), sampling=narrow)
        assert torch.equal(drawn["input_ids"], greedy["input_ids"]) and drawn["completions"] == greedy["completions"]
    # a wide nucleus and k draw the plain samples' tokens (the same seeds; nothing cut that mattered)
    wide = run(model, tokenizer, PROMPTS, list(range(8)), sampling=Sampling(top_k=len(tokenizer), top_p=1.0))
    assert torch.equal(wide["input_ids"], sampled["input_ids"])

    # stop: a completion ends with the token that completes a stop (a token id, or a string of one or more
    # tokens), which is trained on; the text the reward sees ends before a stop string
    words = [c.split() for c in greedy["completions"]]
    eos = [int(m.sum()) - len(w) for m, w in zip(greedy["response_mask"], words)]  # 1 where EOS ended it
    token = tokenizer.convert_tokens_to_ids("4")
    for stop, string in ((Sampling(stop_token_ids=(token,)), None), (Sampling(stop_strings=("4",)), "4"),
                         (Sampling(stop_strings=("4 4",)), "4 4")):
        out = run(model, tokenizer, PROMPTS, list(range(8)), greedy=True, sampling=stop)
        for i, full in enumerate(words):
            text = " ".join(full)
            if "4" not in full if string is None else string not in text:
                kept, expect = len(full) + eos[i], full
            else:
                at = full.index("4") if string is None else text[:text.index(string)].count(" ") + string.count(" ")
                kept, expect = at + 1, full[:at + 1] if string is None else text[:text.index(string)].split()
            assert (int(out["response_mask"][i].sum()), out["completions"][i].split()) == (kept, expect), (i, full)
            # vLLM's completions are cut afterwards by the same rule (it runs without a tokenizer): the same tokens
            drawn = greedy["input_ids"][i][greedy["response_mask"][i].bool()].tolist()
            assert stop.stop_at(tokenizer, drawn) == (drawn[:kept] if string else drawn)
        assert sum(int(m.sum()) for m in out["response_mask"]) < sum(int(m.sum()) for m in greedy["response_mask"])


def test_the_scan_for_stop_strings_looks_at_the_newest_tokens_only_and_stops_where_the_whole_text_would():
    """Byte-level BPE, where a character can take several tokens and a token can split one: token by token, the
    windowed scan first says "stopped" exactly where the whole text first holds a stop string (`stop_at`)."""
    tokenizer = build_tokenizer(ModelConfig(tokenizer="bpe", vocab_size=2048))
    text = "9 é 42 日本 = ü 1 é 4 日本語 7 é 42 = " * 3
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.bos_token_id] * 2 + \
        tokenizer.encode("本 = 5", add_special_tokens=False)
    for stops in (("4",), ("é 4",), ("日本語",), ("= ü 1 é",), ("本 = 5",), ("absent",), ("42 =", "é 42")):
        sampling = Sampling(stop_strings=stops)
        skipped = Sampling.skipped(tokenizer)
        first = next((n for n in range(1, len(tokens) + 1) if sampling.stopped(tokenizer, tokens[:n], skipped)), None)
        whole = sampling.stop_at(tokenizer, tokens)
        assert first == (len(whole) if whole != tokens or sampling.stops(sampling.text(tokenizer, tokens)) else
                         None), stops
