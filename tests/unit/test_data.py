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


@pytest.mark.parametrize("lines, error", [
    (['{"prompt": "1 ="}', '', '{"prompt": "2 ="', ], "data.jsonl: row 3: not JSON"),
    (['{"prompt": "1 ="}', '{"question": "2 ="}'], "data.jsonl: row 2: no 'prompt' key (data.prompt_key)"),
    (['{"prompt": ["a", "b"]}'], "data.jsonl: row 1: 'prompt' must be a string, not list (data.prompt_key)"),
    (['["1 ="]'], "data.jsonl: row 1: a row must be a mapping of keys, not list"),
])
def test_a_bad_jsonl_row_is_named_by_its_file_and_number(tmp_path, lines, error):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        read_prompts(path)
    assert error in str(e.value)


def test_a_bad_parquet_or_dataset_directory_is_named(tmp_path):
    rows = [{"prompt": f"{i} =", "answer": str(i)} for i in range(40)]
    with pytest.raises(DataError, match=r"data.parquet: row 1: no 'solution' key \(data.answer_key\)"):
        read_prompts(as_parquet(rows, tmp_path / "data.parquet"), answer_key="solution")
    (tmp_path / "broken.parquet").write_text("prompt,answer\n1 =,1\n")
    with pytest.raises(DataError, match="broken.parquet: not a Parquet file"):
        read_prompts(tmp_path / "broken.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="without state.json: not a dataset saved by HF datasets"):
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
