"""Multi-rank parity and training, each scenario one ``torchrun`` launch on CPU (gloo).

Every rank's exit code is checked (torchrun fails if any rank does) and every rank must have
written its results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")

ROOT = Path(__file__).resolve().parents[1]
# gloo on CPU always; NCCL where there are GPUs, for the scenarios that put their tensors on the rank's device
BACKENDS = ["gloo", *(["nccl"] if torch.cuda.is_available() else [])]


def worlds(*sizes: int, backend: str) -> list[int]:
    """The world sizes this machine can run on ``backend`` (NCCL: one GPU per rank)."""
    return [w for w in sizes if backend == "gloo" or w <= torch.cuda.device_count()]


def launch(script: str, world: int, out: Path, *args: str, timeout: float = 900, backend: str = "gloo",
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``world`` ranks of ``integration/script`` on ``backend`` (NCCL: one GPU per rank)."""
    # the ranks run a script from integration/: put this checkout first on their path, before any installed capg_rec
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path,
           "CAPG_BACKEND": backend, **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "integration" / script), "--out", str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_parity_with_one_process(world, tmp_path):
    """Raw reductions, sampled candidates, losses and rows after one step equal the 1-process run, with
    and without masked items, with ranks that hold no users and with an empty batch; gather makes no
    host sync with validation off; bad set-ups and bad values on one rank raise the same error on
    every rank. 10,001 items do not split evenly over 2 or 3 ranks."""
    run = launch("parity.py", world, tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    reports = [json.loads((tmp_path / f"parity_rank{r}.json").read_text()) for r in range(world)]
    for report in reports:
        assert report["world_size"] == world and report["failures"] == []
        assert len(report["errors"]) == len(reports[0]["errors"]) > 400
        assert max(report["errors"].values()) <= report["tolerance"]
        assert report["messages"] == reports[0]["messages"]  # the same error, word for word, on every rank
    for part in ("/masked/", "/empty_ranks/", "/empty_batch/", "one_rank/", "no_host_sync/", "table_wise_small/",
                 "snips/", "shared_seed/", "context_baseline/"):
        assert any(part in check for check in reports[0]["errors"]), part
    assert len(reports[0]["messages"]) == (9 if world == 1 else 14)


def test_training_matches_one_process(tmp_path):
    run = launch("train.py", 2, tmp_path, "--steps", "12")
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads((tmp_path / "train.json").read_text())
    assert summary["steps_with_identical_candidates"] == 12
    assert max(summary["relative_deviation"].values()) <= 1e-4


@pytest.mark.parametrize("backend", [b for b in BACKENDS if worlds(2, backend=b)])
def test_train_pipeline_sparse_dist_equals_the_plain_loop(backend, tmp_path):
    """TorchRec's TrainPipelineSparseDist (fx trace, pipelined input dist) gives the same candidates,
    rewards and parameters (tables, user tower) at every step as a plain loop, on 2 ranks."""
    run = launch("pipeline.py", 2, tmp_path, "--steps", "4", backend=backend)
    assert run.returncode == 0, run.stderr[-4000:]
    for r in range(2):
        report = json.loads((tmp_path / f"pipeline_rank{r}.json").read_text())
        assert report["pipelined_modules"] == ["ShardedEmbeddingCollection"]  # the lookup really is pipelined
        assert max(report["errors"].values()) <= 1e-6, report["errors"]
        assert sum(k.startswith("final/") for k in report["errors"]) == 6


@pytest.mark.parametrize("backend", [b for b in BACKENDS if worlds(2, backend=b)])
def test_train_pipeline_sparse_dist_trains_from_logs_through_the_sampled_mode(backend, tmp_path):
    """Off-policy CA-PG on the sampled catalog, with each batch's negative sample and logged candidates
    listed in its sparse features: the pipeline prefetches that one lookup and gives the same losses and
    parameters at every step as a plain loop, on 2 ranks."""
    run = launch("pipeline.py", 2, tmp_path, "--steps", "4", "--sampled", backend=backend)
    assert run.returncode == 0, run.stderr[-4000:]
    for r in range(2):
        report = json.loads((tmp_path / f"pipeline_rank{r}.json").read_text())
        assert report["pipelined_modules"] == ["ShardedEmbeddingCollection"]
        assert max(report["errors"].values()) <= 1e-6, report["errors"]
        assert sum(k.startswith("step") and k.endswith("/loss") for k in report["errors"]) == 4
        assert sum(k.startswith("final/") for k in report["errors"]) == 6


@pytest.mark.parametrize("backend", [b for b in BACKENDS if worlds(2, backend=b)])
@pytest.mark.parametrize("in_loader", [False, True], ids=["before_training", "in_the_data_loader"])
def test_train_pipeline_sparse_dist_trains_on_policy_through_the_sampled_mode_with_an_index_head(backend, in_loader,
                                                                                                   tmp_path):
    """On-policy CA-PG on the sampled catalog: each batch lists a negative sample and its users' best items
    from an IndexHead (the index rebuilt every other batch, collectively); the task draws the candidates from
    that catalog. The pipeline gives the same candidates, rewards and parameters at every step as a plain loop,
    on 2 ranks, with the heads found before training, or as the README shows, in the data loader: as the pipeline
    fetches each batch, two ahead, while its lookups are in flight (review: TorchRec's 'Invalid PipelinedForward
    usage' on both ranks), against a plain loop that finds each head at the same point (batch t + 2's before step
    t), over 6 steps, the index then rebuilt from trained weights."""
    steps = 6 if in_loader else 4
    run = launch("pipeline.py", 2, tmp_path, "--steps", str(steps), "--index-head",
                 *(["--head-in-loader"] if in_loader else []), backend=backend)
    assert run.returncode == 0, run.stderr[-4000:]
    for r in range(2):
        report = json.loads((tmp_path / f"pipeline_rank{r}.json").read_text())
        assert report["pipelined_modules"] == ["ShardedEmbeddingCollection"]
        assert max(report["errors"].values()) <= 1e-6, report["errors"]
        assert sum(k.startswith("step") and k.endswith("/candidates") for k in report["errors"]) == steps
        assert sum(k.startswith("final/") for k in report["errors"]) == 6


@pytest.mark.parametrize("backend, world", [(b, w) for b in BACKENDS for w in worlds(1, 2, 3, backend=b)])
def test_towers_and_bag_collections_match_one_process(backend, world, tmp_path):
    """Item tower (chunked, recomputed) + bag-collection user side + user tower: after one step of CA-PG
    and of V-PG-SwR, every parameter (item/user tables, both towers) equals the 1-process step to 1e-5
    relative, with the item table row-wise and table-wise (ranks without item rows), the last rank's features with
    int32 lengths; so does the serving export (item vectors gathered from the shards, user vectors, greedy top-K
    through the index). KJTs of two layouts (lengths or values dtypes, weights) raise a ValueError on every rank."""
    run = launch("towers.py", world, tmp_path, backend=backend)
    assert run.returncode == 0, run.stderr[-4000:]
    for r in range(world):
        errors = json.loads((tmp_path / f"towers_rank{r}.json").read_text())["errors"]
        assert max(errors.values()) <= 1e-5
        for part in ("item_tower.0.weight", "user_tower.0.weight", "item_table", "user_table", "history_table"):
            assert any(part in k and "/update/" in k for k in errors), part
        for part in ("item_vectors", "user_vectors", "greedy_top_k"):
            assert {f"{s}/export/{part}" for s in ("row_wise", "table_wise")} <= errors.keys(), part
        if world > 1:  # and ranks whose KJTs' layouts differ (found by review)
            assert {f"{s}/faults/{fault}" for s in ("row_wise", "table_wise") for fault in (
                "bag_lengths_dtype", "bag_values_dtype", "features_weights")} <= errors.keys()


def test_faults_on_one_rank_raise_on_every_rank_in_bounded_time(tmp_path):
    """A rank whose input check fails makes every rank raise the same ValueError (each skips the batch
    and the next step runs in step); a frozen rank makes the others fail after the world group's
    timeout (4 s here: the catalog's own process group inherits it) and fails itself when it wakes."""
    timeout = 4  # gloo: NCCL's watchdog aborts the process on a timeout instead of raising
    run = launch("faults.py", 2, tmp_path, timeout=120, env={"CAPG_COLLECTIVE_TIMEOUT_S": str(timeout)})
    assert run.returncode == 0, run.stderr[-4000:]
    reports = [json.loads((tmp_path / f"faults_rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["warm_up"]["raised"] is None and report["after_skip"]["raised"] is None
        assert report["skipping_rank"]["raised"] == "ValueError"
        assert "rewards must be finite" in report["skipping_rank"]["message"]
        assert report["frozen_rank"]["raised"] is not None
    # the rank left waiting fails after about the timeout, not when the sleeper (3 timeouts) wakes
    assert timeout - 0.5 <= reports[0]["frozen_rank"]["seconds"] <= 2 * timeout
    # the rank whose rewards were NaN says so; the other says the check failed elsewhere
    assert "(in another process)" in reports[0]["skipping_rank"]["message"]
    assert "(in another process)" not in reports[1]["skipping_rank"]["message"]


def test_a_killed_rank_makes_the_others_fail_in_bounded_time(tmp_path):
    """The last rank exits after a step (killed: no error, no goodbye); the other fails in its next step
    within the world group's timeout instead of waiting forever."""
    timeout = 4
    started = time.monotonic()
    run = launch("faults.py", 2, tmp_path, "--kill", timeout=120, env={"CAPG_COLLECTIVE_TIMEOUT_S": str(timeout)})
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((tmp_path / "faults_rank0.json").read_text())
    assert report["warm_up"]["raised"] is None
    assert report["killed_rank"]["raised"] is not None and report["killed_rank"]["seconds"] <= 2 * timeout
    assert not (tmp_path / "faults_rank1.json").exists()
    assert time.monotonic() - started < 120


def test_two_tower_example_runs_through_the_pipeline(tmp_path):
    """The TorchRec-shaped example (bag-collection user tower, item tower, TrainPipelineSparseDist) trains a
    few steps on 2 ranks and writes its learning curve."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "torchrec_two_tower.py"), "--steps", "3", "--num-items", "300",
           "--batch-size", "8", "--loss", "capg_swr", "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert curve["world_size"] == 2 and len(curve["reward"]) == 3 and (tmp_path / "curve.png").exists()


def test_step_cost_benchmark_runs(tmp_path):
    """integration/bench.py at a tiny size: the in-batch baseline and an estimator, unsharded and on 1 rank,
    every configuration's step and sampling time written with its ratio to in-batch softmax, and with
    --alternate the steps without checks timed apart."""
    run = subprocess.run([sys.executable, str(ROOT / "integration" / "bench.py"), "--out", str(tmp_path),
                          "--num-items", "500", "--batch", "4", "--candidates", "3", "--dim", "4", "--steps", "2",
                          "--worlds", "1", "--estimators", "capg_swr", "--alternate"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert {(r["estimator"], r["mode"]) for r in results} == {(e, m) for e in ("in_batch", "capg_swr")
                                                               for m in ("unsharded", "sharded")}
    assert all(r["step_s"] > 0 and r["step_over_in_batch"] > 0 for r in results)
    assert all(r["step_over_in_batch"] == 1.0 for r in results if r["estimator"] == "in_batch")
    assert all(r["unchecked_step_s"] > 0 for r in results) and "(checks off:" in run.stdout


def test_sampled_mode_checks_agree_whatever_each_rank_holds(tmp_path):
    """Ranks whose batches differ (no users, 1,500 users against 4, a -1 pad in one rank's candidates, nothing
    listed on one rank, a candidate rewritten on one rank after the loss, a bad logged id, a row or a sample too
    small for the draw) pass together or raise together, in the sampled mode and on the whole sharded catalog
    (the exact method and the logged propensities included). Regressions: each case hung or aborted gloo (the
    checks' agreement had as many entries as the rank's checks, which differ with the data; the exact method's
    empty batch left the catalog's collective backward out), or raised on one rank alone."""
    run = launch("uneven.py", 2, tmp_path, timeout=600, env={"CAPG_COLLECTIVE_TIMEOUT_S": "60"})
    assert run.returncode == 0, run.stderr[-4000:]
    first, second = (json.loads((tmp_path / f"uneven_rank{r}.json").read_text()) for r in range(2))
    # regressions (found by review): with rank 1 empty and its head and sample smaller than the draw or mean-field's
    # head, rank 1 raised alone (the draw) or the ranks hung (mean-field: rank 1 took a check that rank 0 skipped)
    for case in ("empty/mean_field", "empty/with_replacement", "wide", "rewritten", "exact/empty", "propensity/empty",
                 "short_pool/empty", "empty/mean_field_small", "empty/draw", "empty/greedy", "head_then_other_k",
                 "head_then_other_k/whole", "ties", "uneven_sum", "chunk_default", "chunk_default/empty"):
        # ties (found by review): torch.topk merged them; chunk_default (a review): each rank sized its own
        assert first[case] == second[case] == "ok", (case, first[case], second[case])
    # raised on one rank alone (the others hung): logged ids out of range, a uniform draw a row cannot fill, a draw
    # that one rank's head and sample cannot fill
    assert first["propensity/bad_id"] == "ValueError: shown must hold ids in [0, 3001)"
    assert second["propensity/bad_id"].startswith("ValueError: an input check failed in another process")
    assert "but row 0 has 4" in first["uniform_short"] and "another process's rows" in second["uniform_short"]
    assert "another process's SampledCatalog" in first["short_pool"] and "row 0 has 33;" in second["short_pool"]
    for case in ("pad/capg", "pad/vpg"):
        assert first[case] == "ValueError: candidates must hold ids in [0, 3001)"
    # as many checks on both ranks: the other one's message; else (CA-PG checks rank 0's ids the long way) a pointer
    assert second["pad/vpg"] == first["pad/vpg"] + " (in another process)"
    assert second["pad/capg"] == "ValueError: an input check failed in another process (which raised its error)"
    assert second["nothing_listed"].startswith("ValueError: an item of candidates was not looked up")
    assert first["nothing_listed"] == second["nothing_listed"] + " (in another process)"
    # regressions (found by review): gloo aborted one rank; a row too few in one rank's dense hung the other
    assert first["k_draw"] == second["k_draw"]
    assert first["k_draw"].startswith("ValueError: every rank must draw alike (the same K in sample_candidates)")
    assert first["k_draw/sampled"] == second["k_draw/sampled"] == ("ValueError: num_candidates must be the same in "
                                                                    "every process that shares this SampledCatalog, "
                                                                    "got 5 to 6")  # drew 5 and 6 silently
    # regressions (found by review): a catalog shared through agree alone raised on rank 1 alone (the draw) or hung
    # (mean-field), the draw's and head's one checks agreeing through a private hook that it does not override;
    # after mean-field, ranks asking for different numbers of best items hung ("head_then_other_k", above)
    for case in ("agree_only/draw", "agree_only/mean_field"):
        assert "another process's SampledCatalog" in first[case] and "this SampledCatalog" in second[case], case
    assert first["dense_rows"] == second["dense_rows"]
    assert first["dense_dtype"] == second["dense_dtype"]
    assert first["user_vectors_dense"] == second["user_vectors_dense"]  # the other rank returned (out of step)
    assert first["user_vectors_dense"].startswith("ValueError: dense must have shape [B, F] with B = 4")
    # regressions (found by review): the sampled mode took masks outside the catalog silently, or raised on rank 1 alone
    # found by review: a user's method of the wrong shape on rank 1 alone raised there, and rank 0 hung
    assert second["user_method_shape"].startswith("ValueError: Squeezed().log_inclusion must return the items' shape")
    assert first["user_method_shape"].startswith("ValueError: an input check failed in another process")
    # found by review: a DrawnSample of fewer ids than its sampler draws was taken (every sum scaled by their ratio)
    assert first["short_sample"] == second["short_sample"] == (
        "ValueError: sample must hold the 400 ids that UniformSampler(num_samples=400) draws (-1: unused slots, not "
        "counted), got 3 (on rank 1 of the process group)")
    assert first["masked/range"] == second["masked/range"]
    assert first["masked/range"].startswith("ValueError: masked_items must hold ids in [-1, 3001)")
    assert first["masked/float"] == second["masked/float"]
    assert first["masked/float"].startswith("TypeError: masked_items must have an integer dtype")
    assert first["with_catalog_local"] == second["with_catalog_local"] == "ok"
    # regression (found by review): no contexts on rank 1 failed inside torch there, between the baseline's collectives
    assert first["baseline_contexts"] == second["baseline_contexts"]
    assert first["baseline_contexts"].startswith("TypeError: contexts must be a 1-dim tensor of ids")
    assert first["baseline_contexts"].endswith("(on rank 1 of the process group)")
    # regression (found by review): checked before the exchange, on rank 1 alone
    assert first["user_vectors_catalog"] == second["user_vectors_catalog"]
    assert "must not have the catalog feature" in first["user_vectors_catalog"]
    assert "dense must have the user tower's dtype torch.float32, got torch.float64" in first["dense_dtype"]
    # regressions (found by review): a loss's malformed input on one rank raised there and left the other waiting
    for where in ("sampled", "whole", "masked"):
        assert second[f"structure/rewards/{where}"] == "ValueError: rewards must have shape [4, 2], got [4, 1]"
        assert second[f"structure/chosen/{where}"].startswith("TypeError: chosen must")
        assert second[f"structure/rows/{where}"].startswith("ValueError: candidates must")
        # regression (found by review): the loss modules checked candidates' width on their own rank first
        assert second[f"structure/width/{where}"] == "ValueError: candidates must have num_candidates=5 columns, got 4"
        for what in ("rewards", "chosen", "rows", "width"):  # a review: rank 0 blamed a check of its own that passed
            assert first[f"structure/{what}/{where}"] in (
                "ValueError: an input check failed in another process (which raised its error)",
                "ValueError: an input of the loss had the wrong type or shape (in another process)"), (what, where)
    # regression (found by review): a draw's bad K or generator raised on rank 1 alone, and rank 0 waited for it
    for case in [f"arguments/{what}/{where}" for what in ("k_zero", "k_above_n", "k_float", "generator")
                 for where in ("sampled", "whole")] + ["arguments/greedy", "arguments/explore"]:
        assert first[case] == "ValueError: an input check failed in another process (which raised its error)", case
        assert second[case].startswith(("ValueError: num_candidates must be", "TypeError: num_candidates must be",
                                        "TypeError: generator must be")), (case, second[case])
    assert first["dense_rows"].startswith("ValueError: dense must have shape [B, F] with B = 4")
    # regressions (found by review): the whole sharded catalog's own argument checks raised on rank 1 alone and rank 0
    # hung; keys in another order were looked up under the wrong features (silently) or hung; float64 rewards on one
    # rank and float32 on the other aborted gloo in the baselines
    for what, message in (("k", "k must be in [1, 3001], got 3002"), ("experts", "experts must be in [0, 2), got [5]"),
                          ("powers", "num_powers must be >= 1, got 0"),
                          ("other_k", "every rank must draw alike (the same K in sample_candidates) and ask "
                                      "top_items for the same k, experts and perturb (a draw of K from a mixture asks "
                                      "each expert block for its share of K), got top_items' k = [3, 4] by rank"),
                          ("other_perturb", "every rank must draw alike (the same K in sample_candidates) and ask "
                                            "top_items for the same k, experts and perturb")):
        case = f"catalog_arguments/{what}"
        assert first[case] == second[case] and first[case].startswith(f"ValueError: {message}"), (case, first[case])
    for case in ("key_order/one_rank", "key_order/both"):
        assert first[case] == second[case], case
        assert first[case].startswith("ValueError: features must list the catalog feature 'catalog' last"), case
    assert first["baseline_dtype"] == second["baseline_dtype"] == "ok"


def test_sampled_mode_matches_one_process(tmp_path):
    """Each rank's sampled catalog (its own negatives and head, looked up through the sharded table) draws
    the candidates, sums and losses of one process rebuilding that rank's batch, and one step updates
    every row as that process does; a head id or a named item one rank did not list raises the same
    error on every rank, and so do a draw that one rank's head and sample cannot fill and a resampled catalog
    with a sampler that is not a listed sample; an IndexHead on a rank without users keeps the ranks in step."""
    run = launch("sampled.py", 2, tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    reports = [json.loads((tmp_path / f"sampled_rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert max(report["errors"].values()) <= 1e-5, report["errors"]
        assert sum("/update/" in key for key in report["errors"]) == 4
        assert report["messages"] == reports[0]["messages"]
    head, asked, resampled, resampled_head = reports[0]["messages"]
    assert "every id of head_items must be listed" in head and "on rank 1" in head
    assert "was not looked up" in asked and "rank(s) [0]" in asked
    # regression: a wrong sampler on rank 0 alone raised there only, and rank 1 waited in a collective
    assert "sampler must be a DrawnSample" in resampled and "rank(s) [0]" in resampled
    assert "an item of the sample or head_items was not looked up" in resampled_head and "rank(s) [1]" in resampled_head
    # an item that rank 0's loss names without having listed it: both ranks raise in the loss's one agreement
    assert "an item of candidates was not looked up" in reports[0]["losses"][0]
    assert reports[1]["losses"][0] == reports[0]["losses"][0] + " (in another process)"
    # ... and a caller that goes on gets the same error again, from a check of its own, on every rank
    assert "was not looked up" in reports[0]["losses"][1] and "rank(s) [0]" in reports[1]["losses"][1]
    # one validated step (forward, draw in 2 expert blocks, resampled, loss) takes 4 check collectives with SwR: the
    # forward's, the draw's (one for both blocks), the resampled catalog's and the loss's checks; mean-field adds one,
    # exact_top agreed with its head's room. Regression: 7 and 9 (~0.5-1.5 ms each with gloo on 2 cores): the draw
    # agreed on enough items and then on each block's room, the loss's lookups of the ids its checks had vouched
    # for exchanged once more, and mean-field agreed on exact_top and its head's room apart
    assert reports[0]["collectives"] == reports[1]["collectives"] == {"with_replacement": 4, "mean_field": 5}
    # regression: an IndexHead on a rank without users failed there (a reshape of 0 elements) and not on the other
    assert reports[0]["index_head_shape"] == [4, 2, 7] and reports[1]["index_head_shape"] == [0, 2, 7]
    # regression: exact_top (which picks the methods' paths) was each rank's own
    assert reports[0]["exact_top"] == reports[1]["exact_top"] == 6
    # a draw that rank 1's head and sample cannot fill: both ranks raise (rank 0 naming the other process)
    assert "row 0 has 0 under expert 0" in reports[1]["draws"][0]
    assert "another process's SampledCatalog" in reports[0]["draws"][0]

