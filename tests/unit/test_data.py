"""data.path as users keep their data: JSONL, Parquet and a directory saved by HF datasets read to the same rows;
a bad row or file is refused naming the file, the row and the key."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from supervisor.cli import main
from supervisor.config import DEFAULT_CONFIG, load_config
from workers.data import DataError, PromptLoader, read_prompts

JSONL = load_config(DEFAULT_CONFIG, []).data.path


def as_parquet(rows: list[dict], path, row_group_size: int = 16):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)  # several batches
    return path


def as_saved_dataset(rows: list[dict], path):
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def test_the_default_task_reads_the_same_from_jsonl_parquet_and_a_saved_hf_dataset(tmp_path):
    rows = read_prompts(JSONL)
    assert rows and all(set(r) == {"prompt", "answer"} for r in rows)
    for path in (as_parquet(rows, tmp_path / "data.parquet"), as_saved_dataset(rows, tmp_path / "saved")):
        assert read_prompts(path) == rows, path
        assert PromptLoader(read_prompts(path), 16, 7).batch(3, 2) == PromptLoader(rows, 16, 7).batch(3, 2)


def test_keys_named_by_the_config_and_nested_as_verl_keeps_them(tmp_path):
    verl = [{"data_source": "max_digit", "question": f"{i} {i + 1} =",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(8)]
    rows = read_prompts(as_parquet(verl, tmp_path / "verl.parquet"), "question", "reward_model.ground_truth")
    assert [(r["prompt"], r["answer"]) for r in rows] == [(f"{i} {i + 1} =", str(i + 1)) for i in range(8)]
    assert rows[0]["data_source"] == "max_digit"  # the row's own keys stay, for the reward


def test_a_chat_prompt_as_verl_keeps_it_goes_through_the_chat_template(tmp_path):
    from supervisor.config import ModelConfig
    from workers.generate import encode_prompt
    from workers.model import build_tokenizer

    chat = [{"role": "system", "content": "answer"}, {"role": "user", "content": "3 8 ="}]
    rows = read_prompts(as_parquet([{"prompt": chat, "answer": "8"}] * 4, tmp_path / "chat.parquet"))
    assert rows[0]["prompt"] == chat
    tokenizer = build_tokenizer(ModelConfig())
    assert encode_prompt(tokenizer, chat, chat_template=False) == \
        [tokenizer.bos_token_id] + tokenizer.encode("answer\n3 8 =", add_special_tokens=False)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert encode_prompt(tokenizer, chat) == tokenizer.encode("answer 3 8 = ", add_special_tokens=False)


@pytest.mark.parametrize("lines, error", [
    (['{"prompt": "1 ="}', '', '{"prompt": "2 ="', ], "data.jsonl: row 3: not JSON"),
    (['{"prompt": "1 ="}', '{"question": "2 ="}'], "data.jsonl: row 2: no 'prompt' key (data.prompt_key)"),
    (['{"prompt": 7}'], "data.jsonl: row 1: 'prompt' must be a string or a list of messages with 'role' and "
                        "'content', not int (data.prompt_key)"),
    (['["1 ="]'], "data.jsonl: row 1: a row must be a mapping of keys, not list"),
    (['{"prompt": null}'], "data.jsonl: row 1: 'prompt' is null (data.prompt_key)"),
    (['{"prompt": [{"role": "user"}]}'], "row 1: 'prompt' must be a string or a list of messages with 'role' and "
                                          "'content', not list"),
])
def test_a_bad_jsonl_row_is_named_by_its_file_and_number(tmp_path, lines, error):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        read_prompts(path)
    assert error in str(e.value)


def test_a_byte_order_mark_is_read_and_a_compressed_file_is_named(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "1 ="}\n')
    assert read_prompts(tmp_path / "bom.jsonl") == [{"prompt": "1 ="}]
    import gzip

    (tmp_path / "data.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "1 ="}\n' * 100))
    with pytest.raises(DataError, match=r"data.jsonl.gz: row 1: not UTF-8 text \(a compressed file is not read"):
        read_prompts(tmp_path / "data.jsonl.gz")


def test_a_directory_of_parquet_files_reads_in_name_order(tmp_path):
    rows = [{"prompt": f"{i} =", "answer": str(i)} for i in range(40)]
    (tmp_path / "train").mkdir()
    for part in range(2):
        as_parquet(rows[part * 20:(part + 1) * 20], tmp_path / "train" / f"part-{part:05d}.parquet")
    assert read_prompts(tmp_path / "train") == rows
    rows[25]["answer"] = None  # a missing value, as Parquet keeps it
    as_parquet(rows[20:], tmp_path / "train" / "part-00001.parquet")
    with pytest.raises(DataError, match=r"train: row 26: 'answer' is null \(data.answer_key\)"):
        read_prompts(tmp_path / "train", answer_key="answer")


def test_a_bad_parquet_or_dataset_directory_is_named(tmp_path):
    rows = [{"prompt": f"{i} =", "answer": str(i)} for i in range(40)]
    with pytest.raises(DataError, match=r"data.parquet: row 1: no 'solution' key \(data.answer_key\)"):
        read_prompts(as_parquet(rows, tmp_path / "data.parquet"), answer_key="solution")
    (tmp_path / "broken.parquet").write_text("prompt,answer\n1 =,1\n")
    with pytest.raises(DataError, match="broken.parquet: not a Parquet file"):
        read_prompts(tmp_path / "broken.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="neither saved by HF datasets .save_to_disk: state.json. nor holding Parquet"):
        read_prompts(tmp_path / "empty")
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=f"holds a DatasetDict: name one split's directory, e.g. {tmp_path}/dict/train"):
        read_prompts(tmp_path / "dict")
    assert read_prompts(tmp_path / "dict" / "train") == rows


def test_run_and_plan_refuse_a_bad_dataset_in_one_line_before_anything_starts(tmp_path):
    bad = tmp_path / "data.jsonl"
    bad.write_text('{"prompt": "1 ="}\n{"text": "2 ="}\n')
    for command in ("run", "plan"):
        r = CliRunner().invoke(main, [command, str(DEFAULT_CONFIG), f"data.path={bad}",
                                      f"cluster.fileroot={tmp_path / 'runs'}"])
        assert r.exit_code == 2 and r.output.strip().splitlines() == \
            [f"relaunch: error: {bad}: row 2: no 'prompt' key (data.prompt_key)"], r.output
    assert not (tmp_path / "runs").exists()
    r = CliRunner().invoke(main, ["plan", str(DEFAULT_CONFIG), f"data.path={tmp_path / 'nowhere'}"])
    assert r.exit_code == 2 and "data.path: no such file or directory" in r.output


def test_plan_reads_a_parquet_dataset(tmp_path):
    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in read_prompts(JSONL)]
    path = as_parquet(rows, tmp_path / "data.parquet")
    r = CliRunner().invoke(main, ["plan", str(DEFAULT_CONFIG), f"data.path={path}", "data.prompt_key=question",
                                  f"cluster.fileroot={tmp_path / 'runs'}"])
    assert r.exit_code == 0 and f"data       100 prompts in {path}" in r.output, r.output
