"""Per-rank loading: every rank's slices, re-assembled by the plan, equal the single-process loader bit for bit,
and no rank reads more of a sharded tensor than its slice."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import common.checkpoint_files
from common.checkpoint import CheckpointFiles, load_decoder_weights, load_mtp_weights, plan_decoder_weights
from common.checkpoint_shard import load_decoder_shard, load_mtp_shard
from common.config import load_model_config
from common.errors import CheckpointError, ConfigError
from common.nvfp4 import dequant_nvfp4
from common.tensor_parallel import Shard, assemble, take
from tools.make_tiny_checkpoint import make_tiny_checkpoint

# Vocab not divisible by 4 (padded last shard); 6 experts over 4 ranks (uneven expert parallelism); I = 64 so
# an NVFP4 w2 K-slice is one 16-element block at TP=4.
TINY = {"vocab_size": 510, "unpadded_vocab_size": 500, "n_routed_experts": 6, "intermediate_size": 64}
LAYOUTS = [(1, False), (2, False), (4, False), (2, True), (4, True)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[bool, object]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        nvfp4: make_tiny_checkpoint(root / f"nvfp4-{nvfp4}", nvfp4=nvfp4, seed=7, **TINY) for nvfp4 in (False, True)
    }


def full_weights(directory, dtype):
    config = load_model_config(directory)
    return load_decoder_weights(CheckpointFiles(directory), config, dtype=dtype, progress=False), config


def ranks(directory, config, size, ep, dtype):
    return [
        load_decoder_shard(CheckpointFiles(directory), config, size, r, ep, dtype, progress=False) for r in range(size)
    ]


def check_reassembles(full: dict, per_rank: list, attr: str = "shards") -> None:
    for key, tensor in full.items():
        shards = [getattr(plan, attr)[key] for _, _, plan in per_rank]
        local = [w[key] for w, _, _ in per_rank]
        assert all(x.dtype == tensor.dtype for x in local), key
        got = assemble(shards, local, tensor.shape[shards[0].dim or 0])
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key


@pytest.mark.parametrize(("size", "ep"), LAYOUTS)
@pytest.mark.parametrize("nvfp4", [False, True])
def test_released_layout_shards_equal_the_full_load(checkpoints, nvfp4, size, ep) -> None:
    (full, report), config = full_weights(checkpoints[nvfp4], torch.float32)
    per_rank = ranks(checkpoints[nvfp4], config, size, ep, torch.float32)
    assert report.nvfp4_layers == ((3, 4, 5) if nvfp4 else ())
    for weights, rank_report, plan in per_rank:
        assert sorted(weights) == sorted(full)
        assert rank_report.consumed == report.consumed and rank_report.ignored == report.ignored
        assert len(rank_report.consumed) + len(rank_report.ignored) == len(CheckpointFiles(checkpoints[nvfp4]).names())
        assert plan.nvfp4_layers == report.nvfp4_layers
    check_reassembles(full, per_rank)
    if size == 2 and not ep:  # global layers have 1 KV head: both ranks hold all of it
        assert all(w["layers.5.attn.wk_dv.weight"].shape[0] == config.text.head_dim for w, _, _ in per_rank)


@pytest.mark.parametrize(("size", "ep"), [(2, False), (4, False), (4, True)])
def test_nvfp4_local_slices_dequantise_to_slices_of_the_full_tensor(checkpoints, size, ep) -> None:
    (full, _), config = full_weights(checkpoints[True], torch.bfloat16)
    for weights, _, plan in ranks(checkpoints[True], config, size, ep, torch.bfloat16):
        for stack in ("w13_weight", "w2_weight"):
            key = f"layers.4.mlp.experts.{stack}"
            whole = dequant_nvfp4(full[key], full[key + "_scale"], full[key + "_scale2"])
            local = dequant_nvfp4(weights[key], weights[key + "_scale"], weights[key + "_scale2"])
            logical = plan.shards[key]
            if stack == "w2_weight" and not ep:  # the packed shard is in bytes; the logical one in elements
                logical = Shard(logical.rule, 2, tuple((2 * a, 2 * b) for a, b in logical.ranges))
            assert torch.equal(local, take(whole, logical)), key


def test_hf_saved_layout_shards_equal_the_full_load(tmp_path) -> None:
    pytest.importorskip("transformers")
    from tests.reference.hf_tiny import build_hf_model, raw_config

    build_hf_model(raw_config(TINY), seed=3).save_pretrained(tmp_path, save_original_format=False)
    (full, report), config = full_weights(tmp_path, torch.float32)
    assert report.layout == "hf"
    for size, ep in ((2, False), (4, True)):
        check_reassembles(full, ranks(tmp_path, config, size, ep, torch.float32))


def test_mtp_shards_equal_the_full_load(checkpoints) -> None:
    directory = checkpoints[False]
    config = load_model_config(directory)
    full, report = load_mtp_weights(CheckpointFiles(directory), config, torch.float32, progress=False)
    per_rank = []
    for r in range(4):
        files = CheckpointFiles(directory)
        _, _, plan = load_decoder_shard(files, config, 4, r, dtype=torch.float32, progress=False)
        weights, rank_report = load_mtp_shard(files, config, plan, torch.float32, progress=False)
        assert rank_report.consumed == report.consumed
        per_rank.append((weights, rank_report, plan))
    check_reassembles(full, per_rank, "mtp_shards")


class _CountingHandle:
    """A safe_open handle that refuses whole-tensor reads and counts the bytes of lazy slices."""

    def __init__(self, handle, counts: dict[str, int], whole: list[str]):
        self._handle, self._counts, self._whole = handle, counts, whole

    def get_tensor(self, name: str):
        self._whole.append(name)
        if not name.endswith(".original_shape"):  # the 3-integer NVFP4 shape sidecar the planner checks
            raise AssertionError(f"whole tensor {name} read")
        return self._handle.get_tensor(name)

    def get_slice(self, name: str):
        handle, counts = self._handle, self._counts

        class _Slice:
            def __getitem__(self, index):
                x = handle.get_slice(name)[index]
                counts[name] = counts.get(name, 0) + x.numel() * x.element_size()
                return x

        return _Slice()


def test_a_rank_reads_only_its_slices(checkpoints, monkeypatch) -> None:
    directory = checkpoints[True]
    config = load_model_config(directory)
    counts: dict[str, int] = {}
    whole: list[str] = []
    real = common.checkpoint_files.safe_open
    monkeypatch.setattr(
        common.checkpoint_files, "safe_open", lambda *a, **k: _CountingHandle(real(*a, **k), counts, whole)
    )
    files = CheckpointFiles(directory)
    raw_names = plan_decoder_weights(files, config)[1]
    _, _, plan = load_decoder_shard(files, config, 2, 1, dtype=torch.bfloat16, progress=False)
    assert whole and all(n.endswith(".original_shape") for n in whole)
    sharded = 0
    for key, shard in plan.shards.items():
        raw = raw_names[key][0]
        expected = math.prod(shard.local_shape(files.shape(raw))) - (
            shard.pad * math.prod(files.shape(raw)[1:]) if shard.pad else 0
        )
        expected *= files.dtype(raw).itemsize
        assert counts[raw] == expected, key
        if shard.dim is not None and shard.ranges != ((0, files.shape(raw)[shard.dim]),):
            assert counts[raw] < files.nbytes(raw), key
            sharded += 1
    # per layer wq/wr/wo + k/v/k_sconv/v_sconv (sliding only: the global KV head is on both ranks) + the MLP's
    # w13/w2 (dense) or shared + routed w13/w2 (+ their two block scales in NVFP4), plus embed and unembed
    assert sharded == 2 * (3 + 4 + 2) + (3 + 4 + 4) + 2 * (3 + 4 + 6) + (3 + 6) + 2
    assert sum(counts.values()) < 0.75 * sum(files.nbytes(n) for n in files.names() if n.startswith("model.llm."))


def test_progress_bar_names_the_rank(checkpoints, capsys) -> None:
    directory = checkpoints[False]
    load_decoder_shard(CheckpointFiles(directory), load_model_config(directory), 2, 1, progress=True)
    assert "loading decoder weights (rank 1/2)" in capsys.readouterr().err


def test_a_size_that_cannot_shard_the_heads_is_named(checkpoints) -> None:
    directory = checkpoints[False]
    with pytest.raises(
        ConfigError, match=r"tensor_parallel_size=3 does not divide the sliding layers' query heads \(4\)"
    ):
        load_decoder_shard(CheckpointFiles(directory), load_model_config(directory), 3, 0, progress=False)


def test_a_missing_mtp_tensor_fails_every_rank_naming_it(checkpoints, tmp_path) -> None:
    directory = shutil.copytree(checkpoints[False], tmp_path / "no-wo")
    gone = "model.mtp.layers.1.transformer_block.attn.wo_ud.weight"
    tensors = load_file(directory / "mtp.safetensors")
    del tensors[gone]
    save_file(tensors, directory / "mtp.safetensors")
    config = load_model_config(directory)
    for r in range(2):
        files = CheckpointFiles(directory)
        _, _, plan = load_decoder_shard(files, config, 2, r, dtype=torch.float32, progress=False)
        with pytest.raises(CheckpointError, match=gone.removeprefix("model.mtp.")):
            load_mtp_shard(files, config, plan, torch.float32, progress=False)
