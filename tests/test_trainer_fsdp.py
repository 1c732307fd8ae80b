"""The HuggingFace ``Trainer`` under FSDP2 with lowmemopt's 8-bit optimizers (AdamW, GaLore-AdamW, CAME, Muon,
APOLLO-Mini) on gloo CPU ranks: train and save (sharded and full state dicts), resume in a fresh 2-rank job started by
``accelerate launch`` with ``examples/accelerate_fsdp2.yaml`` and in a 1-rank job, against the uninterrupted run; and
Muon under FSDP2 CPU offload against one process.

The cases live in ``tests/trainer_fsdp_worker.py``; three jobs run them (each process start costs seconds).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from spawn import check_ranks, run_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "trainer_fsdp_worker.py")
CONFIG = ROOT / "examples" / "accelerate_fsdp2.yaml"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, dict[str, list[str]]]:
    """{job: {case: each rank's result}}: train on 2 ranks, then resume on 2 (accelerate launch) and on 1."""
    out = tmp_path_factory.mktemp("trainer_fsdp")

    def job(world, cases, extra=()):
        for stale in out.glob("rank*.json"):
            stale.unlink()
        return run_job(WORKER, out, world, cases, extra, timeout=300)

    results = {"train": job(2, ["train", "muon_cpu_offload"])}
    if all(r == "ok" for r in results["train"]["train"]):
        results["resume2"] = job(2, ["resume"], ("--accelerate", str(CONFIG)))
        results["resume1"] = job(1, ["resume"])
    return results


def test_trainer_fsdp2_trains_and_saves(jobs):
    check_ranks(jobs["train"], "train")


def test_resume_in_a_fresh_job_under_accelerate_launch_is_bit_for_bit(jobs):
    if "resume2" not in jobs:
        pytest.fail("the training job failed: nothing to resume", pytrace=False)
    check_ranks(jobs["resume2"], "resume")


def test_resume_on_one_rank_reshards(jobs):
    if "resume1" not in jobs:
        pytest.fail("the training job failed: nothing to resume", pytrace=False)
    check_ranks(jobs["resume1"], "resume")


def test_muon_under_cpu_offload_equals_one_process(jobs):
    check_ranks(jobs["train"], "muon_cpu_offload")


def test_the_accelerate_config_is_the_recipes_and_parses():
    """accelerate reads the file as an FSDP2 config, and docs/distributed.md's recipe launches this file."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONFIG))
    assert str(config.distributed_type) in ("FSDP", "DistributedType.FSDP")
    assert config.fsdp_config["fsdp_version"] == 2
    assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert not config.use_cpu and config.mixed_precision == "no"
    page = (ROOT / "docs" / "distributed.md").read_text()
    launches = re.findall(r"accelerate launch --config_file (\S+)", page)
    assert launches and all(os.path.normpath(p) == os.path.relpath(CONFIG, ROOT) for p in launches), launches
