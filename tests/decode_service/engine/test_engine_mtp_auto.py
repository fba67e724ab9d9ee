"""`--mtp-depth auto`: the flag parses (CLI and settings) and reaches the engine, which measures its step costs at
start, chooses a depth per batch bucket and drafts that many tokens, its greedy outputs still equal D = 0's."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from common.errors import ConfigError
from common.settings import MTP_AUTO, VLLM_MTP_ACCEPTANCE, DecodeEngineSettings, decode_settings, mtp_depth_arg
from decode_service.engine.engine import Engine
from tests.decode_service.engine.test_engine_mtp import SPECS, fresh, run, settings, tiny  # noqa: F401
from tools.cli import build_parser


def test_the_flag_parses_into_the_engine_settings():
    args = build_parser().parse_args(
        ["decode", "--checkpoint", "ckpt", "--mtp-depth", "auto", "--mtp-acceptance", "0.8,0.5,0.25"]
    )
    engine = decode_settings(args).engine
    assert engine.mtp_depth == MTP_AUTO and engine.mtp_acceptance == (0.8, 0.5, 0.25)
    default = decode_settings(build_parser().parse_args(["decode", "--checkpoint", "ckpt"])).engine
    assert default.mtp_depth == 0 and default.mtp_acceptance == VLLM_MTP_ACCEPTANCE
    assert mtp_depth_arg("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="auto"):
        mtp_depth_arg("deep")
    with pytest.raises(ConfigError, match="--mtp-depth"):
        DecodeEngineSettings(mtp_depth="deep")
    with pytest.raises(ConfigError, match="--mtp-acceptance"):
        DecodeEngineSettings(mtp_depth=MTP_AUTO, mtp_acceptance=(0.5, 0.7))  # cumulative rates never grow


def test_auto_measures_chooses_and_drafts_what_it_chose(tiny):  # noqa: F811
    trunk, mtp, config = tiny
    specs = [("a", SPECS[0][1], dataclasses.replace(SPECS[0][2], max_tokens=6), ())]
    auto = settings(max_num_seqs=1, mtp_depth=MTP_AUTO, mtp_acceptance=(0.9, 0.8))
    engine = Engine(trunk, config, auto, drafter=mtp)
    table = engine.depth_table
    assert engine.speculator.num_depths == 2 == engine.speculation_depth  # the table covers 2 of the 4 depths
    assert table is not None and table.buckets == (1,) and 0 <= table.depths[0] <= 2
    assert len(table.costs[0].verify) == len(table.costs[0].chain) == 2 and table.costs[0].plain > 0
    assert engine.speculator.depth_for(1) == table.depths[0]
    engine.speculator.depth_for = lambda batch: 1  # a table of our own: one draft a round
    outs = [o.token_ids for o in engine.generate(fresh(specs))]
    assert outs == run(tiny, fresh(specs), max_num_seqs=1, mtp_depth=0)
    assert engine.speculation.num_rounds and len(engine.speculation.accepted_lengths) == 2  # 1 draft a round


def test_auto_without_the_checkpoint_drafter_is_an_error(tiny):  # noqa: F811
    trunk, _, config = tiny
    with pytest.raises(ConfigError, match="auto"):
        Engine(trunk, config, dataclasses.replace(settings(), mtp_depth=MTP_AUTO), drafter=None)


@pytest.mark.gpu
def test_auto_on_the_gpu_runs_the_graphed_chain(cuda_device, tmp_path, capsys):
    """bf16 on CUDA through `build_engine`: the batched paged speculator, its table measured at start (printed)."""
    from decode_service.engine.build import build_engine
    from decode_service.engine.request import Request
    from decode_service.engine.worker.mtp import PagedMTPSpeculator
    from tools.make_tiny_checkpoint import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, seed=3, mtp_config={"num_nextn_predict_layers": 4})
    engine = build_engine(
        tmp_path, DecodeEngineSettings(device="cuda", kv_cache_bytes=1 << 26, max_num_seqs=8, mtp_depth=MTP_AUTO)
    )
    assert isinstance(engine.speculator, PagedMTPSpeculator) and engine.speculator.graphs.capture
    with capsys.disabled():
        print("\n" + "\n".join(engine.depth_table.lines()))
    engine.speculator.depth_for = lambda batch: 4  # every round drafts through the whole chain
    requests = [Request(rid, list(p), s, mm_items=mm) for rid, p, s, mm in SPECS]
    outs = engine.generate(requests)
    assert [len(o.token_ids) for o in outs] == [s.max_tokens for _, _, s, _ in SPECS]
    assert engine.speculation.num_rounds > 0 and engine.speculation.num_draft_tokens > 0
