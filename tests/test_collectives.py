"""@all_reduced, @rank_zero_only, rank_zero_first and object collectives on real ranks.

One torchrun job per world size (2 and 3) runs every scenario of
``tests/scripts/collective_scenarios.py``; each test below checks one behaviour
on every rank.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import REPO, run_torchrun

FAST = 5.0  # seconds within which a failure must reach every rank


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"ws{n}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    world: int = request.param
    out = tmp_path_factory.mktemp(f"scenarios{world}")
    script = REPO / "tests" / "scripts" / "collective_scenarios.py"
    result = run_torchrun(script, str(out), nproc=world, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def values(ranks: list[Any], scenario: str) -> list[Any]:
    for rank, record in enumerate(ranks):
        assert record[scenario]["ok"], f"rank {rank}: {record[scenario]}"
    return [record[scenario]["value"] for record in ranks]


def errors(ranks: list[Any], scenario: str) -> list[dict[str, Any]]:
    for rank, record in enumerate(ranks):
        assert not record[scenario]["ok"], f"rank {rank} did not raise: {record[scenario]}"
        assert record[scenario]["seconds"] < FAST, f"rank {rank} took {record[scenario]}"
    return [record[scenario] for record in ranks]


def number(leaf: dict[str, Any]) -> Any:
    return leaf["value"]


def test_mean_is_the_same_on_every_rank(ranks: list[Any]) -> None:
    world = len(ranks)
    assert [number(v) for v in values(ranks, "mean_of_floats")] == [(world + 1) / 2] * world


def test_every_op_by_name(ranks: list[Any]) -> None:
    world = len(ranks)
    expected = {
        "m": {"type": "float", "value": (world + 1) / 2},
        "s": {"type": "int", "value": world * (world + 1) // 2},
        "hi": {"type": "int", "value": world},
        "lo": {"type": "int", "value": 1},
        "p": {"type": "int", "value": 2 if world == 2 else 6},
    }
    assert values(ranks, "every_op") == [expected] * world


def test_a_single_op_applies_to_every_leaf(ranks: list[Any]) -> None:
    world = len(ranks)
    result = values(ranks, "single_op_for_everything")[0]
    firsts = {op: [item["value"] for item in result[op]["items"]] for op in result}
    assert firsts["sum"] == [world * (world + 1) / 2, 10 * world * (world + 1) / 2]
    assert firsts["max"] == [world, 10.0 * world]
    assert firsts["min"] == [1.0, 10.0]
    assert firsts["prod"][0] == (2.0 if world == 2 else 6.0)


def test_weighted_mean_weighs_each_rank_by_its_count(ranks: list[Any]) -> None:
    # rank 0: 1 sample, loss 1; rank 1: 3 samples, loss 4; rank 2: no samples.
    for value in values(ranks, "weighted_mean"):
        assert value["loss"] == {"type": "tensor:torch.float32:cpu", "value": 3.25}
        assert value["acc"]["value"] == pytest.approx(0.325)
        assert value["count"] == {"type": "int", "value": 4}


def test_a_total_weight_of_zero_gives_nan_not_zero(ranks: list[Any]) -> None:
    for value in values(ranks, "zero_total_weight"):
        assert value == {
            "loss": {"type": "float", "value": "nan"},
            "count": {"type": "int", "value": 0},
        }


def test_leaf_kinds_survive_a_mean(ranks: list[Any]) -> None:
    world = len(ranks)
    mean = (world + 1) / 2
    for value in values(ranks, "leaf_kinds_under_mean"):
        assert value["int"] == {"type": "float", "value": mean}
        assert value["float"] == {"type": "float", "value": mean - 0.5}
        assert value["bool"] == {"type": "float", "value": pytest.approx(1 / world)}
        assert value["np_float32"] == {"type": "float32:float32", "value": mean}
        assert value["np_int64"] == {"type": "float64:float64", "value": mean}
        assert value["np_array"] == {"type": "ndarray:float64", "value": [mean - 1, 2 * mean - 2]}
        assert value["tensor_0d"] == {"type": "tensor:torch.float32:cpu", "value": mean}
        assert value["tensor_int"] == {
            "type": "tensor:torch.float32:cpu",
            "value": [mean - 1, mean],
        }
        assert value["tensor_2d"]["value"] == [[mean - 1] * 2] * 2
        assert value["tensor_bool"]["type"] == "tensor:torch.float32:cpu"


def test_leaf_kinds_survive_a_sum_and_integers_stay_integers(ranks: list[Any]) -> None:
    world = len(ranks)
    total = world * (world + 1) // 2
    for value in values(ranks, "leaf_kinds_under_sum"):
        assert value["int"] == {"type": "int", "value": total}
        assert value["bool"] == {"type": "int", "value": 1}  # how many ranks said True
        assert value["np_int64"] == {"type": "int64:int64", "value": total}
        assert value["np_array"] == {
            "type": "ndarray:int64",
            "value": [total - world, 2 * (total - world)],
        }
        assert value["tensor_int"] == {
            "type": "tensor:torch.int64:cpu",
            "value": [total - world, total],
        }
        assert value["tensor_bool"] == {"type": "tensor:torch.int64:cpu", "value": 1}


def test_nested_dicts_use_the_nearest_count(ranks: list[Any]) -> None:
    world = len(ranks)
    value = values(ranks, "nested_structures")[0]
    assert value["train"]["loss"]["value"] == (world + 1) / 2  # counts 1 each
    assert value["train"]["count"]["value"] == world
    val_count = sum(range(world))  # rank r has r samples of loss 2r
    assert value["val"]["loss"]["value"] == pytest.approx(
        sum(2 * r * r for r in range(world)) / val_count
    )
    pair = value["val"]["parts"]["items"][1]
    assert pair["type"] == "Pair"  # namedtuples come back as themselves
    assert value["lr"]["type"] == "tuple"
    assert value["lr"]["items"][1]["value"] == pytest.approx(0.2 * world)  # op "max"


@pytest.mark.parametrize(
    ("scenario", "details"),
    [
        ("mismatch_same_length", ["rank 1 lacks ['acc']", "adds ['f1']"]),
        ("mismatch_different_length", ["rank 1 adds ['hist']"]),
        ("mismatch_shape", ["['x'] as tensor:torch.float32[3]", "rank 0: tensor:torch.float32[2]"]),
    ],
)
def test_different_structures_are_an_error_on_every_rank(
    ranks: list[Any], scenario: str, details: list[str]
) -> None:
    for error in errors(ranks, scenario):
        assert error["type"] == "ReductionError"
        assert "ranks returned different structures" in error["message"]
        for detail in details:
            assert detail in error["message"]


def test_a_non_numeric_leaf_on_one_rank_is_an_error_on_every_rank(ranks: list[Any]) -> None:
    found = errors(ranks, "non_numeric_leaf_on_one_rank")
    last = len(ranks) - 1
    assert found[last]["type"] == "TypeError"
    assert found[last]["message"].startswith("['tag'] is str 'best'")
    for error in found[:last]:
        assert error["type"] == "ReductionError"
        assert f"rank {last} could not reduce its result" in error["message"]
        assert "['tag'] is str" in error["message"]


def test_an_exception_inside_on_one_rank_reaches_every_rank(ranks: list[Any]) -> None:
    found = errors(ranks, "exception_inside_on_one_rank")
    assert found[1]["type"] == "KeyError"
    for rank, error in enumerate(found):
        if rank != 1:
            assert error["type"] == "ReductionError"
            assert "rank 1: KeyError: 'validation shard missing'" in error["message"]


def test_one_collective_for_all_mean_and_sum_leaves(ranks: list[Any]) -> None:
    for counts in values(ranks, "collectives_per_call"):
        assert counts["32 mean+sum"]["value"] == 1
        assert counts["with max"]["value"] == 2  # one more for the "max" leaves only
        assert counts["1000 first call"]["value"] == 2  # the buffer grows once...
        assert counts["1000 second call"]["value"] == 1  # ...then it is one again
        assert counts["1000 value"]["value"] == (len(ranks) - 1) / 2


def test_ctx_all_reduce_is_the_functional_form(ranks: list[Any]) -> None:
    world = len(ranks)
    count = world * (world + 1) // 2
    loss = sum(r * (r + 1) for r in range(world)) / count
    for value in values(ranks, "functional_all_reduce"):
        assert value["count"]["value"] == count
        assert value["loss"]["value"] == pytest.approx(loss)


@pytest.mark.parametrize(
    ("scenario", "error_type", "message"),
    [
        ("barrier_failure_on_rank_zero", "OSError", "disk full while writing checkpoint"),
        ("broadcast_failure_on_rank_zero", "ValueError", "no run name"),
        ("rank_zero_first_failure", "RuntimeError", "download failed"),
    ],
)
def test_a_failure_on_rank_zero_is_raised_on_every_rank(
    ranks: list[Any], scenario: str, error_type: str, message: str
) -> None:
    found = errors(ranks, scenario)
    assert found[0] == {**found[0], "type": error_type, "message": message}
    for error in found[1:]:
        assert error["type"] == "RankZeroError"
        assert error["message"].startswith(f"rank 0 raised {error_type}: {message}")
        assert "Traceback on rank 0" in error["message"]
        assert "collective_scenarios.py" in error["message"]  # rank 0's own frames


def test_broadcast_returns_rank_zeros_result_everywhere(ranks: list[Any]) -> None:
    assert all(
        v == {"name": {"type": "str", "value": "chosen-by-0"}}
        for v in values(ranks, "broadcast_success")
    )


def test_rank_zero_only_runs_on_rank_zero_and_others_get_default(ranks: list[Any]) -> None:
    results = values(ranks, "plain_rank_zero_only")
    assert [item["value"] for item in results[0]["items"]] == ["ran", "ran"]
    for other in results[1:]:
        assert [item["value"] for item in other["items"]] == [None, "skipped"]


def test_barrier_makes_every_rank_wait_for_rank_zero(ranks: list[Any]) -> None:
    assert all(
        v == {"type": "bool", "value": True} for v in values(ranks, "barrier_waits_for_rank_zero")
    )


def test_rank_zero_first_lets_the_others_read_what_rank_zero_made(ranks: list[Any]) -> None:
    assert all(v["value"] == "filled by 0" for v in values(ranks, "rank_zero_first_order"))


def test_local_rank_zero_of_each_node_serves_its_own_node(ranks: list[Any]) -> None:
    for rank, value in enumerate(values(ranks, "local_rank_zero_on_two_fake_nodes")):
        node = rank // 2
        assert [item["value"] for item in value["items"]] == [
            f"node {node} value from rank {2 * node}",
            2 * node,
        ]


def test_broadcast_and_all_gather_take_objects_of_any_size(ranks: list[Any]) -> None:
    world = len(ranks)
    for value in values(ranks, "objects"):
        assert [item["value"] for item in value["lengths"]["items"]] == [
            1000 * r for r in range(world)
        ]
        assert value["broadcast"]["from"]["value"] == world - 1
        assert value["broadcast"]["tensor"] == {
            "type": "tensor:torch.int64:cpu",
            "value": [0, 1, 2],
        }


def test_decorators_work_under_a_group_someone_else_created(ranks: list[Any]) -> None:
    world = len(ranks)
    results = values(ranks, "foreign_group_decorators")
    for rank, value in enumerate(results):
        reduced, chosen, ran = (item["value"] for item in value["items"])
        assert reduced == (world - 1) / 2
        assert chosen == 100  # rank 0's value, broadcast
        assert ran == ("ran" if rank == 0 else None)
