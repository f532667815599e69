"""The losses' value checks: the same errors whether values are read on the host (numpy views of CPU
tensors) or reduced as torch ops and read back in one sync (the path of CUDA tensors, forced here
on CPU), and no read-back at all on the host path."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from capg_rec import CAPGLoss, DenseCatalog, OffPolicyCAPGLoss, VPGLoss, inclusion_log_prob, sample_candidates
import capg_rec._checks
from capg_rec.testing import count_host_syncs


@pytest.fixture(params=["host", "host-sorted", "torch"])
def path(request, monkeypatch):
    """Run the checks through numpy ("host": candidates marked in a [B, N] bitmap; "host-sorted": the sort
    and [B, L, K] comparison that catalogs too large for the bitmap take) or through torch ops and one
    read-back ("torch")."""
    if request.param == "torch":
        monkeypatch.setattr(capg_rec._checks, "_host_view", lambda x: None)
    if request.param == "host-sorted":
        monkeypatch.setattr(capg_rec._checks, "_COUNTS", 0)
    return request.param


def _inputs(k: int = 5, num_items: int = 30, num_experts: int = 2):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, num_experts, num_items, generator=gen)
    candidates = sample_candidates(logits, k, generator=gen)
    return logits, candidates, candidates[:, :2].clone(), torch.rand(4, 2, generator=gen)


def _masked_candidate():
    logits, cand, chosen, rewards = _inputs()
    logits[1, 1, cand[1, -1]] = -math.inf  # the last position is drawn by expert 1
    return logits, cand, chosen, rewards


def _bad(case: str):
    logits, cand, chosen, rewards = _inputs()
    if case == "nan logits":
        logits[2, 0, 7] = math.nan
    elif case == "+inf logits":
        logits[0, 1, 3] = math.inf
    elif case == "id out of range":
        cand[3, 4] = 30
    elif case == "negative id":
        cand[0, 2] = -1
    elif case == "repeated candidate":
        cand[1, 3] = cand[1, 0]
    elif case == "repeated chosen":
        chosen[2, 1] = chosen[2, 0]
    elif case == "chosen outside candidates":
        chosen[0, 1] = next(i for i in range(30) if i not in cand[0].tolist())
    elif case == "masked candidate":
        return _masked_candidate()
    elif case == "nan rewards":
        rewards[1, 0] = math.nan
    return logits, cand, chosen, rewards


CASES = {"nan logits": "logits must be finite or -inf", "+inf logits": "logits must be finite or -inf",
         "id out of range": "candidates must hold ids in", "negative id": "candidates must hold ids in",
         "repeated candidate": "candidates must not repeat", "repeated chosen": "chosen must not repeat",
         "chosen outside candidates": "chosen must be a subset", "masked candidate": "must not hold masked items",
         "nan rewards": "rewards must be finite"}


@pytest.mark.parametrize("loss", [VPGLoss(5), CAPGLoss(5), CAPGLoss(5, method="with_replacement")], ids=repr)
@pytest.mark.parametrize("case", CASES)
def test_every_bad_value_is_named_on_both_paths(path, loss, case):
    logits, cand, chosen, rewards = _bad(case)
    with pytest.raises(ValueError, match=CASES[case]):
        loss(logits, cand, chosen, rewards)


def test_wide_rows_are_checked_for_repeats_on_both_paths(path):
    """Rows wider than 64 ids: counted on the torch path, sorted by numpy on the host path."""
    logits, cand, chosen, rewards = _inputs(k=100, num_items=300, num_experts=1)
    loss = VPGLoss(100)
    loss(logits, cand, chosen, rewards)  # valid
    cand[2, 80] = cand[2, 5]
    with pytest.raises(ValueError, match="candidates must not repeat"):
        loss(logits, cand, chosen, rewards)


def test_off_policy_logged_propensities_on_both_paths(path):
    logits, cand, chosen, rewards = _inputs()
    loss = OffPolicyCAPGLoss(5)
    loss(logits, cand, chosen, rewards, torch.full((4, 2), -1.0))
    with pytest.raises(ValueError, match="logged_log_inclusion must be <= 0"):
        loss(logits, cand, chosen, rewards, torch.full((4, 2), 0.5))
    with pytest.raises(ValueError, match="logged_log_inclusion must be finite"):
        loss(logits, cand, chosen, rewards, torch.full((4, 2), math.nan))


def test_finite_values_whose_sum_overflows_pass_and_inf_pairs_fail(path):
    """The host path's first test is that the sum is finite; a sum that overflows (or +inf and -inf that
    cancel to NaN) must send it to the entry-wise checks, not to a wrong verdict."""
    logits, cand, chosen, rewards = _inputs()
    big = torch.finfo(torch.float32).max / 2
    huge = logits.clone()
    huge[:, :, 0] = big  # every row's sum overflows; candidates keep their scores
    rewards_big = torch.full_like(rewards, big)
    CAPGLoss(5, method="with_replacement")(huge, cand, chosen, rewards_big)  # finite everywhere: valid
    VPGLoss(5)(torch.full_like(logits, big), cand, chosen, rewards_big)
    with pytest.raises(ValueError, match="must draw in a row among items more than 5.243e[+]05 below"):
        VPGLoss(5)(huge, cand, chosen, rewards_big)  # valid, but the draw's order is beyond float32 there
    masked = huge.clone()
    masked[0, 0, next(i for i in range(30) if i not in cand[0].tolist())] = -math.inf
    CAPGLoss(5, method="with_replacement")(masked, cand, chosen, rewards)  # -inf masks an item: valid
    both = logits.clone()
    both[1, 0, 3], both[2, 1, 4] = math.inf, -math.inf  # sums to NaN
    with pytest.raises(ValueError, match="logits must be finite or -inf"):
        CAPGLoss(5, method="with_replacement")(both, cand, chosen, rewards)
    with pytest.raises(ValueError, match="rewards must be finite"):
        CAPGLoss(5, method="with_replacement")(logits, cand, chosen, torch.tensor([[big, -math.inf]] * 4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_checks_read_every_dtype(path, dtype):
    """bfloat16 has no numpy dtype: its logits take the torch path inside the host one."""
    logits, cand, chosen, rewards = _bad("nan logits")
    with pytest.raises(ValueError, match="logits must be finite or -inf"):
        CAPGLoss(5)(logits.to(dtype), cand, chosen, rewards.to(dtype))
    logits, cand, chosen, rewards = _inputs()
    assert torch.isfinite(CAPGLoss(5)(logits.to(dtype), cand, chosen, rewards.to(dtype)))


def test_host_path_reads_nothing_back_and_torch_path_once(path):
    logits, cand, chosen, rewards = _inputs()
    logits.requires_grad_()
    with count_host_syncs() as calls:
        CAPGLoss(5, method="with_replacement")(logits, cand, chosen, rewards)
    if path.startswith("host"):
        assert set(calls) <= {"numpy"}  # views of host memory, not read-backs
    else:
        assert calls == ["tolist"]


@pytest.mark.parametrize("method", ["mean_field", "plugin"])
def test_a_mixtures_checks_read_back_once_on_the_torch_path(path, method):
    """What the checks add to a mixture's CA-PG loss (its calls with checks on less those with checks off): one
    read-back of their verdicts on the torch path (CUDA's). The unmasked-items check built its message from a device
    tensor on every call, a second read-back per step (found by review). (Forced on CPU, the branches that CPU
    tensors take by their device, e.g. the logits' range, read scalars too: not counted here.)"""
    logits, cand, chosen, rewards = _inputs()
    counts = {}
    for validate in (True, False):
        with count_host_syncs() as calls:
            CAPGLoss(5, method=method, validate_args=validate)(logits, cand, chosen, rewards)
        counts[validate] = collections.Counter(calls)
    added = counts[True] - counts[False]
    if path.startswith("host"):
        assert set(added) <= {"numpy"}, added
    else:
        assert added["tolist"] == 1, added


def test_valid_masked_items_pass_on_both_paths(path):
    """-inf masks an item for one expert only: a candidate drawn by the other expert is valid."""
    logits, cand, chosen, rewards = _inputs()
    logits[1, 0, cand[1, -1]] = -math.inf  # the last position is expert 1's draw
    assert torch.isfinite(CAPGLoss(5)(logits, cand, chosen, rewards))


def test_inclusion_log_prob_checks_items_on_both_paths(path):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 300, generator=gen)
    items = torch.stack([torch.randperm(300, generator=gen)[:100] for _ in range(3)])
    assert inclusion_log_prob(logits, items, 120).shape == (3, 100)
    with pytest.raises(ValueError, match=r"items must hold ids in \[0, 300\), got values in \[\d+, 300\]"):
        inclusion_log_prob(logits, torch.cat([items[:, :99], torch.full((3, 1), 300)], 1), 120)
    items[1, 70] = items[1, 3]
    assert inclusion_log_prob(logits, items, 120).shape == (3, 100)  # items may repeat here


def test_candidate_log_prob_refuses_repeats_on_both_paths(path):
    """Rows of 100 ids: the unique check sorts them (numpy on the host path, torch on the other)."""
    from capg_rec import candidate_log_prob

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 300, generator=gen)
    cand = torch.stack([torch.randperm(300, generator=gen)[:100] for _ in range(3)])
    assert candidate_log_prob(logits, cand).shape == (3,)
    cand[2, 99] = cand[2, 0]
    with pytest.raises(ValueError, match="candidates must not repeat"):
        candidate_log_prob(logits, cand)


def test_masked_candidate_check_runs_only_where_a_mask_exists(monkeypatch):
    """Dense logits read on the host without any -inf cannot hold a masked candidate: the gather of the
    drawing scores is skipped; with one -inf anywhere (or on the torch path) it runs."""
    import capg_rec.functional

    calls = []
    real = capg_rec.functional._drawing_scores
    monkeypatch.setattr(capg_rec.functional, "_drawing_scores", lambda *a: calls.append(1) or real(*a))
    logits, cand, chosen, rewards = _inputs()
    CAPGLoss(5)(logits, cand, chosen, rewards)
    assert calls == []
    logits[0, 0, next(i for i in range(30) if i not in cand[0].tolist())] = -math.inf
    CAPGLoss(5)(logits, cand, chosen, rewards)
    assert calls == [1]
    monkeypatch.setattr(capg_rec._checks, "_host_view", lambda x: None)
    CAPGLoss(5)(logits.clamp(min=-1e30), cand, chosen, rewards)
    assert calls == [1, 1]


def test_picks_checked_against_candidates_that_may_repeat_on_both_paths(path):
    """V-PG-SwR admits repeated candidates: a pick of an id drawn twice is one pick; a pick repeated is an
    error whether or not its id is a candidate (then the subset check names it)."""
    logits, cand, chosen, rewards = _inputs()
    cand[:, 3] = cand[:, 0]  # every row draws its first id twice
    chosen = cand[:, [0, 1]].clone()
    loss = VPGLoss(5, with_replacement=True)
    assert torch.isfinite(loss(logits, cand, chosen, rewards))
    with pytest.raises(ValueError, match="chosen must not repeat"):
        loss(logits, cand, cand[:, [0, 3]], rewards)  # the same id from its two slots
    outside = next(i for i in range(30) if i not in cand[2].tolist())
    chosen[2] = outside
    with pytest.raises(ValueError, match="chosen must"):
        loss(logits, cand, chosen, rewards)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_ids_of_any_integer_dtype_are_range_checked_on_both_paths(path, dtype):
    """The host range check reads ids as unsigned (negatives wrap above any catalog size)."""
    logits, cand, chosen, rewards = _inputs()
    loss = CAPGLoss(5, method="with_replacement")
    assert torch.isfinite(loss(logits, cand.to(dtype), chosen.to(dtype), rewards))
    if dtype != torch.uint8:
        bad = cand.to(dtype)
        bad[1, 2] = -3
        with pytest.raises(ValueError, match="candidates must hold ids in"):
            loss(logits, bad, chosen.to(dtype), rewards)


def test_shape_errors_name_the_width_of_each_argument():
    """candidates are [B, K] (the draw), chosen [B, L] (the picks)."""
    logits, cand, chosen, rewards = _inputs()
    with pytest.raises(ValueError, match=r"candidates must have shape \[B=4, K\]"):
        CAPGLoss(5)(logits, cand[:2], chosen, rewards)
    with pytest.raises(ValueError, match=r"chosen must have shape \[B=4, L\]"):
        CAPGLoss(5)(logits, cand, chosen[:2], rewards)


def _refusals():
    """``(call, message)``: inputs each check refuses, found by mutation testing of the checks (each mutant let its
    case through: a NaN loss, a silently masked item, a capped weight, a draw of probability 1 ...)."""
    import capg_rec.functional as F
    from capg_rec import candidate_log_prob

    g = torch.Generator().manual_seed(0)
    big, n, k = 2000, 6, 3  # more than 4096 rewards: the large host path of the finiteness check
    cand = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(big)])
    nan_rewards = torch.rand(big, k, generator=g)
    nan_rewards[5, 1] = math.nan
    logits, two = torch.randn(2, 5, generator=g), torch.tensor([[4, 1], [2, 3]])
    three = torch.tensor([[0, 1, 2], [3, 4, 0]])
    huge = torch.tensor([[0.0, 1.0, -3.3e38, 2.0]])
    return [
        (lambda: F.capg_loss(torch.randn(big, n), cand, cand.clone(), nan_rewards), "rewards must be finite"),
        (lambda: F.capg_loss(logits, two, torch.tensor([[7], [2]]), torch.ones(2, 1)), "chosen must be a subset"),
        (lambda: F.capg_loss(logits, two, torch.tensor([[1], [-1]]), torch.ones(2, 1)), "chosen must be a subset"),
        (lambda: F.capg_loss(logits, two, torch.tensor([[4], [9]]), torch.ones(2, 1)), "chosen must be a subset"),
        (lambda: F.vpg_loss(torch.randn(2, 3), torch.tensor([[0, 1, 2, 0], [2, 2, 1, 0]]), torch.tensor([[0], [2]]),
                            torch.ones(2, 1), with_replacement=True), r"num_candidates .* must be in \[1, 3\], got 4"),
        (lambda: F.offpolicy_capg_loss(logits, three, three[:, :2].clone(), torch.ones(2, 2),
                                       torch.full((2, 2), -1e300, dtype=torch.float64)),
         "logged_log_inclusion must be finite in the scores' dtype torch.float32"),
        (lambda: F.capg_loss(huge, torch.tensor([[3, 1]]), torch.tensor([[3]]), torch.ones(1, 1), temperature=0.9),
         "logits / temperature must stay finite"),
        (lambda: F.vpg_loss(huge, torch.tensor([[3, 1, 0]]), torch.tensor([[3]]), torch.ones(1, 1), temperature=0.9),
         "logits / temperature must stay finite"),
        (lambda: candidate_log_prob(torch.tensor([[0.0, -1e9, -2e9]]), torch.tensor([[0, 1, 2]])),
         "num_candidates=3 must draw in row 0 among items more than"),
        (lambda: sample_candidates(torch.randn(2, 3), 4), r"num_candidates must be in \[1, 3\], got 4"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_each_value_check_refuses_what_it_is_for(case):
    call, message = _refusals()[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_a_logged_log_propensity_on_its_bound_is_accepted():
    """The bound is inclusive: a log-propensity of exactly its tolerance above 0 passes (found by mutation testing:
    a strict bound refused it, and no test had one there)."""
    import capg_rec.functional as F
    from capg_rec.marginals import LOG_PROB_TOLERANCE

    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cand = torch.tensor([[0, 1, 2], [3, 4, 0]])
    out = F.offpolicy_capg_loss(logits, cand, cand[:, :2].clone(), torch.ones(2, 2, dtype=torch.float64),
                                torch.full((2, 2), LOG_PROB_TOLERANCE, dtype=torch.float64))
    assert torch.isfinite(out)


def test_argument_errors_found_by_review():
    """Regressions (a review of every public argument), each failing before its fix: the functional losses took a
    float or bool ``num_candidates``; a ``chosen`` wider than the candidates was blamed on ``rewards``; a tensor on
    another device than the scores gave torch's ``RuntimeError``; logits of no expert or no item named no argument of
    the call; numpy's bools were refused as flags."""
    import numpy as np

    import capg_rec.functional as F

    logits, cand, chosen, rewards = _inputs()
    logged = torch.zeros(4, 2)
    for loss, extra in ((F.capg_loss, ()), (F.vpg_loss, ()), (F.topk_reinforce_loss, (logged,)),
                        (F.offpolicy_capg_loss, (logged,)), (F.offpolicy_vpg_loss, (logged[:, 0],))):
        for bad in (5.0, True):
            with pytest.raises(TypeError, match="num_candidates must be an int"):
                loss(logits, cand, chosen, rewards, *extra, num_candidates=bad)
    wide = torch.cat([cand, cand[:, :1]], 1)
    with pytest.raises(ValueError, match=r"chosen must have at most K = 5 columns .* got 6"):
        F.capg_loss(logits, cand, wide, torch.ones(4, 6))
    meta = torch.device("meta")
    for name, args in (("candidates", (logits, cand.to(meta), chosen, rewards)),
                       ("chosen", (logits, cand, chosen.to(meta), rewards)),
                       ("rewards", (logits, cand, chosen, rewards.to(meta)))):
        for loss in (F.capg_loss, F.vpg_loss):
            with pytest.raises(ValueError, match=f"{name} must be on the scores' device cpu, got meta"):
                loss(*args)
    with pytest.raises(ValueError, match="position_weights must be on the scores' device"):
        F.capg_loss(logits, cand, chosen, rewards, position_weights=torch.ones(2, device=meta))
    with pytest.raises(ValueError, match="logged_log_inclusion must be on the scores' device"):
        F.offpolicy_capg_loss(logits, cand, chosen, rewards, torch.zeros(4, 2, device=meta))
    with pytest.raises(ValueError, match=r"logits \[B, M, N\] must have at least one expert"):
        F.capg_loss(torch.randn(4, 0, 30), cand, chosen, rewards)
    with pytest.raises(ValueError, match=r"the catalog has no items \(N = 0\)"):
        F.capg_loss(torch.randn(4, 0), cand, chosen, rewards)
    for device in ("cpu", torch.device("cpu", 0)):  # a catalog of one's own may name its device so (found by review)
        catalog = DenseCatalog(logits)
        catalog.device = device
        torch.testing.assert_close(F.capg_loss(catalog, cand, chosen, rewards), F.capg_loss(logits, cand, chosen,
                                                                                             rewards))
    expected = F.vpg_loss(logits, cand, chosen, rewards, with_replacement=True)
    torch.testing.assert_close(F.vpg_loss(logits, cand, chosen, rewards, with_replacement=np.True_,
                                          validate_args=np.True_), expected)
    assert CAPGLoss(5, validate_args=np.False_).validate_args is False
    with pytest.raises(TypeError, match="validate_args must be True or False, got numpy.int64"):
        CAPGLoss(5, validate_args=np.int64(1))


def test_every_process_takes_the_malformed_input_check_first(monkeypatch):
    """Regression (a TorchRec review on 2 ranks): a process whose loss inputs had the wrong shape put its error as
    an extra first check, the others did not, and where its placeholders then took as many checks as theirs, the
    agreement compared them one position off: a healthy rank blamed a check of its own that had passed ("candidates
    must not repeat an item within a row (in another process)"). Every process now takes that check first: the
    healthy ones pass it, under a message that names the failure in another process."""
    import capg_rec.functional

    seen = []
    real = capg_rec._checks.DeferredChecks.run

    def run(self, agree=None):
        seen.append([(ok, message) for ok, message in self._checks][:1])
        return real(self, agree)

    monkeypatch.setattr(capg_rec._checks.DeferredChecks, "run", run)
    logits, cand, chosen, rewards = _inputs()
    CAPGLoss(5)(logits, cand, chosen, rewards)
    assert seen[-1] == [(True, "an input of the loss had the wrong type or shape")]
    failed = ValueError("rewards must have shape [4, 2], got [4, 1]")
    catalog = DenseCatalog(logits)
    with pytest.raises(ValueError, match=r"rewards must have shape \[4, 2\]"):
        capg_rec.functional._check_values(catalog, cand, chosen, rewards, None, None, None, failed, distinct=True,
                                          inclusion=True, ordered=False)
    assert seen[-1] == [(False, "rewards must have shape [4, 2], got [4, 1]")]
