"""Parquet datasets in verl's row layout: read a row group at a time, reachable by ``env_map`` paths,
mixed with JSONL in a list, every bad file or row named; the corridor task trains from one."""

from __future__ import annotations

import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agl_core.cli import main
from agl_core.config import ConfigError, load_config
from agl_core.files.datasets import ParquetRows, check_datasets, env_from_map, load_dataset
from tests.helpers.corridor_policy import build_corridor_policy

CONFIG = "examples/corridor/config.yaml"


def verl_row(index: int, signs: list[str], split: str = "train") -> dict:
    """One row as verl's data preprocessing scripts write them (gsm8k.py and the like)."""
    return {
        "data_source": "corridor",
        "prompt": [{"role": "user", "content": "Follow the signs: " + " ".join(signs)}],
        "ability": "navigation",
        "reward_model": {"style": "rule", "ground_truth": signs[-1]},
        "extra_info": {"index": index, "split": split, "signs": signs},
    }


def corridor_rows(path: str, split: str) -> list[dict]:
    rows = [json.loads(line) for line in open(path)]
    return [verl_row(row["id"], row["signs"], split) for row in rows]


def write_parquet(path, rows, row_group_size=4):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def test_verl_layout_rows_are_reachable_by_env_map_paths(tmp_path):
    rows = [verl_row(i, ["left", "right"][i % 2 :] + ["left"]) for i in range(10)]
    path = write_parquet(tmp_path / "train.parquet", rows, row_group_size=3)
    loaded = load_dataset(str(path))
    assert isinstance(loaded, ParquetRows) and len(loaded) == 10 and pq.ParquetFile(path).num_row_groups == 4
    assert loaded[7] == rows[7] and loaded[-1] == rows[-1] and loaded[2:5] == rows[2:5]
    env_map = {
        "QUESTION": "input.prompt.0.content",
        "ANSWER": "input.reward_model.ground_truth",
        "INDEX": "input.extra_info.index",
        "SOURCE": "input.data_source",
        "SIGNS": "input.extra_info.signs",
    }
    assert env_from_map(loaded[1], env_map) == {
        "QUESTION": "Follow the signs: right left",
        "ANSWER": "left",
        "INDEX": "1",
        "SOURCE": "corridor",
        "SIGNS": '["right", "left"]',
    }
    with pytest.raises(IndexError, match="row 10 of"):
        loaded[10]
    assert pickle.loads(pickle.dumps(loaded))[3] == rows[3], "pickles as its path (verl ships rows to Ray)"


def test_rows_are_read_one_row_group_at_a_time(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "train.parquet", [verl_row(i, ["left"]) for i in range(12)], row_group_size=4)
    read = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile, "read_row_group", lambda self, i, *a, **k: read.append(i) or original(self, i, *a, **k)
    )
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("the whole file was read"))
    rows = load_dataset(str(path))
    assert read == [], "opening reads only the footer"
    assert [rows[i]["extra_info"]["index"] for i in (0, 3, 5, 9, 10)] == [0, 3, 5, 9, 10]
    assert read == [0, 1, 2], "each row group read once, when first indexed"
    cfg = load_config(
        overrides=[f"data.train_files={path}", "agentlightning.local.env_map={Q: input.prompt.0.content}"]
    )
    assert check_datasets(cfg) == {"data.train_files": 12} and read == [0, 1, 2], "the check streams batches"


def test_a_list_mixes_parquet_and_jsonl_in_order(tmp_path):
    first = write_parquet(tmp_path / "a.parquet", [verl_row(0, ["left"]), verl_row(1, ["right"])])
    second = tmp_path / "b.jsonl"
    second.write_text(json.dumps(verl_row(2, ["left"])) + "\n")
    named_oddly = write_parquet(tmp_path / "c.jsonl", [verl_row(3, ["right"])])  # told by its magic bytes, not its name
    cfg = load_config(
        overrides=[
            f"data.train_files=[{first},{second},{named_oddly}]",
            "agentlightning.local.env_map={A: input.reward_model.ground_truth}",
        ]
    )
    rows = load_dataset(cfg.data.train_files)
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2, 3] and len(rows) == 4
    assert [r["extra_info"]["index"] for r in rows[1:3]] == [1, 2]
    assert check_datasets(cfg) == {"data.train_files": 4}


def test_a_row_missing_an_env_map_field_names_file_row_and_column(tmp_path):
    rows = [verl_row(i, ["left"]) for i in range(6)]
    rows[4]["reward_model"] = None
    path = write_parquet(tmp_path / "train.parquet", rows, row_group_size=2)
    cfg = load_config(
        overrides=[f"data.train_files={path}", "agentlightning.local.env_map={ANSWER: input.reward_model.ground_truth}"]
    )
    with pytest.raises(ConfigError) as info:
        check_datasets(cfg)
    assert info.value.key == "data.train_files"
    assert info.value.message == (
        f"row 5 of 6 of {path} (column 'reward_model'): agentlightning.local.env_map.ANSWER: "
        "path 'input.reward_model.ground_truth' not found in the rollout input"
    )


def test_a_column_without_a_json_form_names_file_row_and_column(tmp_path):
    table = pa.table(
        {"data_source": ["a", "b", "c"], "extra_info": [{"blob": None}, {"blob": None}, {"blob": b"\x86\x00"}]}
    )
    path = tmp_path / "bin.parquet"
    pq.write_table(table, path)
    with pytest.raises(ConfigError) as info:
        load_dataset(str(path), "data.val_files")
    assert info.value.key == "data.val_files"
    assert info.value.message.startswith(f"{path} row 1, column 'extra_info': holds binary values")


def test_files_that_are_neither_jsonl_nor_parquet_are_named(tmp_path):
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"\x86\x00\xff garbage")
    with pytest.raises(ConfigError, match=f"{binary} is neither JSON lines \\(UTF-8\\) nor parquet"):
        load_dataset(str(binary))
    truncated = tmp_path / "cut.parquet"
    truncated.write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match=f"{truncated} is not a readable parquet file"):
        load_dataset(str(truncated))
    empty = write_parquet(tmp_path / "empty.parquet", [])
    with pytest.raises(ConfigError, match="holds no rows"):
        load_dataset(str(empty))


@pytest.mark.slow
def test_the_corridor_task_trains_from_parquet_in_verls_layout(tmp_path, capsys):
    train = write_parquet(
        tmp_path / "train.parquet", corridor_rows("examples/corridor/dataset.jsonl", "train"), row_group_size=64
    )
    val_rows = corridor_rows("examples/corridor/val.jsonl", "test")[:4]
    val = write_parquet(tmp_path / "val.parquet", val_rows[:2])
    val_jsonl = tmp_path / "val.jsonl"
    val_jsonl.write_text("".join(json.dumps(row) + "\n" for row in val_rows[2:]))
    run_dir = tmp_path / "run"
    overrides = [
        f"actor_rollout_ref.model.path={build_corridor_policy(tmp_path / 'policy')}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=3",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"data.train_files={train}",
        f"data.val_files=[{val},{val_jsonl}]",
        "agentlightning.local.env_map.CORRIDOR_SIGNS=input.extra_info.signs",
    ]
    assert main(["train", CONFIG, *overrides]) == 0, capsys.readouterr().err
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert lines[0]["val/n_rollouts"] == lines[3]["val/n_rollouts"] == 4
    assert all(line["training/n_rollouts"] == 4 and "actor/pg_loss" in line for line in lines[1:])
