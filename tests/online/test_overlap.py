"""The stream-vs-training-set check (`online.overlap`) and its use by `lightning-spec online`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_spec.callbacks.checkpoint import STATE_FILE, training_data
from lightning_spec.cli.online import check_stream_is_new
from lightning_spec.online.overlap import (
    check_overlap,
    drafter_training_data,
    parse_selection,
    stream_prompts,
)
from lightning_spec.online.stream import Request

DOCS = [
    "Return the absolute value of the argument, rounded toward zero when it is a float.",
    "Open a connection to the server and return a reader and writer pair for the stream.",
    "Split the path into a pair of head and tail where tail is the last component of it.",
    "Wait for the future to complete and return its result or raise the exception it set.",
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _requests(source: Path, ids: list[str]) -> list[Request]:
    return [Request(i, str(source), rid, [1, 2, 3]) for i, rid in enumerate(ids)]


def test_the_check_finds_shared_ids_identical_prompts_and_shared_word_runs(tmp_path: Path) -> None:
    stream = _jsonl(
        tmp_path / "stream.jsonl", [{"id": f"s{i}", "prompt": d} for i, d in enumerate(DOCS)]
    )
    train = _jsonl(
        tmp_path / "train.jsonl",
        [
            {
                "id": "t0",
                "prompt": "  " + DOCS[1].replace(" ", "\n "),
            },  # same prompt, other spacing
            {"id": "t1", "prompt": "As the docs say: " + DOCS[2][:-1].upper() + " and more words."},
            {"id": "t2", "prompt": "Something unrelated about cooking pasta for dinner tonight."},
        ],
    )
    prompts = stream_prompts(_requests(stream, ["s0", "s1", "s2", "s3"]))
    assert [p[2] for p in prompts] == DOCS

    report = check_overlap(prompts, [{"source": str(train), "count": None}])
    assert report["same_id"] == []
    assert report["exact"] == ["s1"]
    assert report["ngram"] == ["s1", "s2"]  # a 13-word run of s2 inside t1, case-blind
    assert report["ngram_share"] == 0.5
    # only the first `count` training conversations are the training set
    assert check_overlap(prompts, [{"source": str(train), "count": 1}])["ngram"] == ["s1"]
    # a stream taken from the training file itself: the same ids
    same = check_overlap(prompts, [{"source": str(stream), "count": 2}])
    assert same["same_id"] == ["s0", "s1"] and same["exact"] == ["s0", "s1"]
    with pytest.raises(ValueError, match="n must be"):
        check_overlap(prompts, [], n=0)


def test_selections_parse_and_drafter_records_are_read_only_when_complete(tmp_path: Path) -> None:
    assert parse_selection("sharegpt:4500") == {"source": "sharegpt", "count": 4500}
    assert parse_selection("runs/x.jsonl") == {"source": "runs/x.jsonl", "count": None}
    folder = tmp_path / "drafter"
    folder.mkdir()
    assert drafter_training_data(folder) is None  # no training_state.json
    state = {"global_step": 1, "training_data": [{"source": "sharegpt", "count": 10}]}
    (folder / STATE_FILE).write_text(json.dumps(state))
    assert drafter_training_data(folder) == [{"source": "sharegpt", "count": 10}]
    state["training_data"].insert(0, {"source": None, "drafter_init": "/old"})
    (folder / STATE_FILE).write_text(json.dumps(state))
    assert drafter_training_data(folder) is None  # a step of the chain did not record its data


def test_a_checkpoint_records_its_data_after_its_starting_drafters(tmp_path: Path) -> None:
    init = tmp_path / "init"
    init.mkdir()
    (init / STATE_FILE).write_text(
        json.dumps({"training_data": [{"source": "sharegpt", "count": 4500, "mode": "dataset"}]})
    )
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(dataset="s.jsonl", max_conversations=800, mode="regenerated")
    )
    module = SimpleNamespace(hparams={"drafter_init": str(init)})
    assert training_data(trainer, module) == [
        {"source": "sharegpt", "count": 4500, "mode": "dataset"},
        {"source": "s.jsonl", "count": 800, "mode": "regenerated"},
    ]
    unrecorded = SimpleNamespace(hparams={"drafter_init": str(tmp_path / "nowhere")})
    assert training_data(trainer, unrecorded)[0] == {
        "source": None,
        "drafter_init": str(tmp_path / "nowhere"),
    }


def test_online_refuses_a_stream_the_drafter_trained_on(tmp_path: Path) -> None:
    stream = _jsonl(
        tmp_path / "stream.jsonl", [{"id": f"s{i}", "prompt": d} for i, d in enumerate(DOCS)]
    )
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / STATE_FILE).write_text(
        json.dumps({"training_data": [{"source": str(stream), "count": 2}]})
    )
    config = {"drafter": str(drafter)}
    warm_items = _requests(stream, ["s0", "s1"])
    problem = check_stream_is_new(config, warm_items, tmp_path / "out")
    assert problem and "2 stream prompts are in the drafter's training set" in problem
    assert json.loads((tmp_path / "out" / "overlap.json").read_text())["same_id"] == ["s0", "s1"]
    assert (
        check_stream_is_new({**config, "allow_overlap": True}, warm_items, tmp_path / "o2") is None
    )
    after = [Request(i, str(stream), rid, [1]) for i, rid in enumerate(["s2", "s3"])]
    assert check_stream_is_new(config, after, tmp_path / "o3") is None  # the items after: new
    # no record and no train_data: served, with a warning
    assert check_stream_is_new({"drafter": str(tmp_path)}, after, tmp_path / "o4") is None
    # the config's train_data stands in for a folder without a record
    named = {"drafter": str(tmp_path), "train_data": [{"source": str(stream), "count": 4}]}
    assert "2 stream prompts" in (check_stream_is_new(named, after, tmp_path / "o5") or "")


def test_drop_overlap_serves_the_rest_of_the_stream(tmp_path: Path) -> None:
    stream = _jsonl(
        tmp_path / "stream.jsonl", [{"id": f"s{i}", "prompt": d} for i, d in enumerate(DOCS)]
    )
    config = {"drafter": str(tmp_path), "train_data": [{"source": str(stream), "count": 1}],
              "drop_overlap": True}  # fmt: skip
    requests = _requests(stream, ["s0", "s1", "s2"])
    assert check_stream_is_new(config, requests, tmp_path / "out") is None
    assert [r.id for r in requests] == ["s1", "s2"]  # s0 was trained on: dropped, order kept
    assert json.loads((tmp_path / "out" / "overlap.json").read_text())["dropped"] == ["s0"]


def test_live_check_and_replay_are_refused_together(tmp_path: Path) -> None:
    from lightning_spec.cli.online import load_config

    path = tmp_path / "online.yaml"
    path.write_text("drafter: d\nstream: s.jsonl\nreplay: true\nlive_check: true\n")
    with pytest.raises(ValueError, match="set replay: false with it"):
        load_config(path)
    assert load_config(path, {"replay": False})["live_check"] is True
