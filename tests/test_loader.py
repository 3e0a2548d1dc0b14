"""Loading a rank's shard: merged projections read from their checkpoint tensors, bad files refused."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from shardspec.layers.parallel import TPGroup
from shardspec.models import checkpoint as checkpoint_module
from shardspec.models.checkpoint import Checkpoint
from shardspec.models.config import ConfigError
from shardspec.models.loader import load_model
from shardspec.testing.random_checkpoint import (
    random_state_dict,
    tiny_config,
    write_checkpoint,
    write_random_checkpoint,
)


@pytest.fixture(scope="module")
def state_dict() -> dict[str, torch.Tensor]:
    return random_state_dict(tiny_config(), seed=3)


def test_a_merged_projection_stacks_this_ranks_rows_of_each_checkpoint_tensor(tmp_path: Path, state_dict):
    write_checkpoint(tmp_path, tiny_config(), state_dict)
    c = tiny_config()
    half = c["intermediate_size"] // 2
    for rank in (0, 1):
        model = load_model(tmp_path, TPGroup(rank, 2), torch.float32, torch.device("cpu"), with_mtp=False)
        rows = slice(rank * half, (rank + 1) * half)
        expected = torch.cat([state_dict["model.layers.0.mlp.gate_proj.weight"][rows],
                              state_dict["model.layers.0.mlp.up_proj.weight"][rows]])
        assert torch.equal(model.layers["0"].mlp.gate_up_proj.weight, expected)
        # a, b: one row per value head; this rank's heads of each, after its q, k, v and z rows
        heads = slice(rank * c["linear_num_value_heads"] // 2, (rank + 1) * c["linear_num_value_heads"] // 2)
        weight = model.layers["0"].linear_attn.in_proj.weight
        nv = c["linear_num_value_heads"] // 2
        assert torch.equal(weight[-2 * nv : -nv], state_dict["model.layers.0.linear_attn.in_proj_b.weight"][heads])
        assert torch.equal(weight[-nv:], state_dict["model.layers.0.linear_attn.in_proj_a.weight"][heads])


def test_a_missing_part_of_a_merged_projection_is_named(tmp_path: Path, state_dict):
    missing = "model.layers.0.linear_attn.in_proj_z.weight"
    write_checkpoint(tmp_path, tiny_config(), {k: v for k, v in state_dict.items() if k != missing})
    with pytest.raises(ConfigError, match=missing):
        load_model(tmp_path, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                                  "model.embed_tokens.weight"])
@pytest.mark.parametrize("change", ["one row short", "one row long", "one column short"])
def test_a_tensor_of_another_shape_than_the_config_implies_is_refused_on_every_rank(tmp_path: Path, state_dict,
                                                                                     name, change):
    tensor = state_dict[name]
    tensor = {"one row short": tensor[:-1], "one row long": torch.cat([tensor, tensor[:1]]),
              "one column short": tensor[:, :-1]}[change]
    write_checkpoint(tmp_path, tiny_config(), {**state_dict, name: tensor})
    for rank in (0, 1):  # rank 0's rows of a row-sharded tensor end before its last row
        with pytest.raises(ConfigError, match=name):
            load_model(tmp_path, TPGroup(rank, 2), torch.float32, torch.device("cpu"), with_mtp=False)


def test_a_stage_is_assigned_and_loaded_from_one_reading_of_config_json_and_of_each_header(tmp_path: Path,
                                                                                           monkeypatch):
    write_random_checkpoint(tmp_path, tiny_config(), seed=3, shards=2)
    reads = Counter()

    def counted(read):
        def counting(path):
            reads[Path(path).name] += 1
            return read(path)
        return counting

    monkeypatch.setattr(checkpoint_module, "read_config", counted(checkpoint_module.read_config))
    monkeypatch.setattr(checkpoint_module, "read_entries", counted(checkpoint_module.read_entries))
    checkpoint = Checkpoint.open(tmp_path)
    stage = checkpoint.stage(1, 2)
    assert checkpoint.has_mtp and checkpoint.dtype == torch.float32
    model = load_model(checkpoint, TPGroup(), checkpoint.dtype, torch.device("cpu"), stage=stage)
    assert model.has_mtp and list(model.layers) == ["2", "3"]
    shards = {file.name for file in checkpoint.files.values()}
    assert len(shards) == 2 and reads == Counter({tmp_path.name: 1} | dict.fromkeys(shards, 1))
