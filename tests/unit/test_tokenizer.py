"""The sized configs' BPE tokenizer: trained here, the same on every process, and fit for the digit tasks."""
import pytest

from supervisor.config import ModelConfig, load_config
from workers.data import read_prompts
from workers.model import build_tokenizer
from workers.tokenizer import _trained


def test_training_is_deterministic():
    assert _trained.__wrapped__(2048) == _trained.__wrapped__(2048)


@pytest.fixture(scope="module")
def bpe():
    return build_tokenizer(ModelConfig(tokenizer="bpe", vocab_size=32768))


def test_vocabulary_size_and_special_tokens(bpe):
    assert len(bpe) == 32768
    assert (bpe.pad_token_id, bpe.bos_token_id, bpe.eos_token_id) == (0, 1, 2)


@pytest.mark.parametrize("config", ["configs/tiny_grpo.yaml", "configs/grpo_100m.yaml"])
def test_digit_prompts_tokenize_one_token_per_symbol(config):
    cfg = load_config(config)
    tok = build_tokenizer(cfg.model)
    for row in read_prompts(cfg.data.path):
        ids = tok.encode(row["prompt"], add_special_tokens=False)
        assert len(ids) == len(row["prompt"].split()), row
        assert tok.decode(ids).split() == row["prompt"].split()
    for d in "0123456789":  # an answer is one token, with or without its leading space
        for text in (d, " " + d):
            ids = tok.encode(text, add_special_tokens=False)
            assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True).strip() == d


def test_saved_tokenizer_reloads_with_autotokenizer(bpe, tmp_path):
    from transformers import AutoTokenizer

    bpe.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode("7 2 =") == bpe.encode("7 2 =") and len(again) == len(bpe)


def test_sized_configs_are_valid():
    for name, hidden in (("grpo_100m", 768), ("grpo_0.5b", 896)):
        cfg = load_config(f"configs/{name}.yaml")
        assert cfg.model.tokenizer.value == "bpe" and cfg.model.hidden_size == hidden
