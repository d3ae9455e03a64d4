"""Tuned MoE launch shapes (rlserve/ops/moe_configs.py): a card's table is found by its CUDA
name and the expert shape, a step takes the entry of the smallest token count at or above its
own, and a table with an unknown key is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from rlserve.ops import moe_configs


@pytest.fixture
def tables(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_configs, "TABLES", tmp_path)
    monkeypatch.setattr(moe_configs, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    moe_configs._table.cache_clear()
    yield tmp_path
    moe_configs._table.cache_clear()


def _write(device_name: str, table: dict) -> None:
    path = moe_configs.table_path(device_name, 128, 2048, 768, torch.bfloat16)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(table))


def test_a_step_takes_the_smallest_entry_at_or_above_its_tokens(tables):
    small, mid, large = (dict(BLOCK_M=m, BLOCK_N=64, BLOCK_K=128, warps=4, stages=3) for m in (16, 32, 128))
    _write("NVIDIA H100 80GB HBM3", {"1": small, "256": mid, "4096": {**large, "down": {"BLOCK_N": 256}}})
    assert (tables / "NVIDIA_H100_80GB_HBM3" / "E128-H2048-I768-bfloat16.json").is_file()
    cuda = torch.device("cuda", 0)

    def pick(tokens, inter=768, dtype=torch.bfloat16):
        return moe_configs.tuned(cuda, 128, 2048, inter, dtype, tokens)
    assert pick(1) == small
    assert pick(2) == pick(256) == mid
    assert pick(257)["BLOCK_M"] == 128 and pick(100_000)["down"] == {"BLOCK_N": 256}
    assert pick(8, inter=384) is None  # a tensor-parallel shard's shape: no table, the defaults
    assert pick(8, dtype=torch.float16) is None
    assert moe_configs.tuned(torch.device("cpu"), 128, 2048, 768, torch.bfloat16, 8) is None


@pytest.mark.parametrize("entry,bad", [(dict(BLOCK_M=16, block_n=64), "block_n"),
                                       (dict(BLOCK_M=16, down=dict(BLOCK_M=32)), "down.BLOCK_M")])
def test_a_table_with_an_unknown_key_is_refused_by_name(tables, entry, bad):
    _write("NVIDIA H100 80GB HBM3", {"64": entry})
    with pytest.raises(ValueError, match=f"entry 64: unknown keys.*{bad}"):
        moe_configs.tuned(torch.device("cuda", 0), 128, 2048, 768, torch.bfloat16, 8)
