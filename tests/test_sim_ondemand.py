"""The on-demand synthetic environment: determinism, hash uniformity, agreement with its dense form."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from capg_rec.sim.ondemand import OnDemandSyntheticEnv, _hashed_uniform


def test_vectors_depend_only_on_the_id():
    env = OnDemandSyntheticEnv(3, num_users=50, num_items=10**9)
    ids = torch.tensor([5, 10**9 - 1, 123456789])
    alone = env.item_vectors(ids[1:2])
    together = env.item_vectors(ids)
    torch.testing.assert_close(together[1:2], alone, rtol=0, atol=0)
    torch.testing.assert_close(together.norm(dim=1), torch.ones(3, dtype=torch.float64))
    assert not torch.equal(env.user_vectors(ids[:1]), env.item_vectors(ids[:1]))  # separate streams
    assert not torch.equal(OnDemandSyntheticEnv(4, num_items=10).item_vectors(ids[:1]), env.item_vectors(ids[:1]))


def test_hashed_uniforms_are_uniform():
    """Mean and variance of 200k hashed uniforms within CLT bounds (1e-6, Bonferroni over 2)."""
    u = _hashed_uniform(7, 1, torch.arange(20000), 10).flatten()
    z = stats.norm.isf(1e-6 / 4)
    n = u.numel()
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) <= z * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) <= z * math.sqrt((1 / 80 - 1 / 144) / n)
    corr = torch.corrcoef(u.view(-1, 10).T)  # coordinates uncorrelated
    assert float((corr - torch.eye(10, dtype=corr.dtype)).abs().max()) <= z / math.sqrt(20000)


def test_matches_its_dense_table():
    env = OnDemandSyntheticEnv(1, num_users=30, num_items=200)
    dense = env.to_matrix_env()
    g = torch.Generator().manual_seed(0)
    users = env.sample_users(8, g)
    items = torch.randint(200, (8, 5), generator=g)
    torch.testing.assert_close(env.expected_reward(users, items), dense.expected_reward(users, items))
    torch.testing.assert_close(env.ranking_scores(users, items), dense.ranking_scores(users, items))
    assert env.optimal_value(3) == pytest.approx(dense.optimal_value(3), rel=1e-6)
    a = env.sample_reward(users, items, torch.Generator().manual_seed(1))
    b = dense.sample_reward(users, items, torch.Generator().manual_seed(1))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    q, ids = env.top_items(users, 4, chunk_size=37)
    assert torch.equal(ids, dense.q[users].topk(4, dim=1).indices)


def test_errors():
    with pytest.raises(ValueError, match="seed"):
        OnDemandSyntheticEnv(-1)
    with pytest.raises(ValueError, match="num_items"):
        OnDemandSyntheticEnv(0, num_items=0)
    # regressions (found by review): ids outside the env were scored (a hash of any integer is a vector), a seed of
    # 2^70 failed in the generator, N = 2^63 (beyond the hashes' 2^62) was taken
    env = OnDemandSyntheticEnv(0, num_users=5, num_items=30)
    for users, items, name in (([7], [[1]], "users"), ([1], [[31]], "items"), ([1], [[-3]], "items")):
        with pytest.raises(ValueError, match=f"{name} must hold ids in"):
            env.expected_reward(torch.tensor(users), torch.tensor(items))
    with pytest.raises(TypeError, match="items must be an integer tensor"):
        env.ranking_scores(torch.tensor([1]), torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match="seed must be in"):
        OnDemandSyntheticEnv(2**70)
    with pytest.raises(TypeError, match="seed must be an int"):
        OnDemandSyntheticEnv("0")
    with pytest.raises(ValueError, match="num_items"):
        OnDemandSyntheticEnv(0, num_items=2**63)
    # regressions (found by review): a numpy seed failed in torch's generator, devices and generators gave torch's
    # errors naming nothing
    assert OnDemandSyntheticEnv(np.int64(3), num_users=5, num_items=30).name == \
        OnDemandSyntheticEnv(3, num_users=5, num_items=30).name
    with pytest.raises(ValueError, match="device must name a torch device"):
        OnDemandSyntheticEnv(0, device="foo")
    assert OnDemandSyntheticEnv(0, num_users=5, num_items=30, device=None).device == torch.get_default_device()
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        env.sample_users(3, generator=5)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        env.sample_reward(torch.tensor([1]), torch.tensor([[1]]), generator=5)


def test_review_regressions(monkeypatch):
    """Each answered wrongly (or named nothing) before its fix: int32, int16 and uint8 ids overflowed in the hash and
    gave other users' and items' vectors; N above 2^32 (one 32-bit hash per vector) repeated vectors; optimal_value
    took users outside [0, U) and none (NaN); top_items took chunk sizes <= 0; and the scans held [U, chunk] (and
    to_matrix_env [U, N, d]) temporaries at once, now blocks of users, with the same results."""
    env = OnDemandSyntheticEnv(3, num_users=40, num_items=300)
    users, items = torch.tensor([0, 7, 39]), torch.tensor([[5, 299], [0, 1], [17, 18]])
    ref = env.expected_reward(users, items)
    for dtype in (torch.int32, torch.int16):
        assert torch.equal(env.expected_reward(users.to(dtype), items.to(dtype)), ref)
        assert torch.equal(env.item_vectors(items.to(dtype)), env.item_vectors(items))
    assert torch.equal(env.expected_reward(users.to(torch.uint8), items[:, :1].to(torch.uint8)), ref[:, :1])
    for dtype in (torch.uint16, torch.uint32, torch.uint64):  # torch's NotImplementedError (a later review)
        assert torch.equal(env.expected_reward(users.to(dtype), items.to(dtype)), ref)
        assert torch.equal(env.to_matrix_env().expected_reward(users.to(dtype), items.to(dtype)),
                           env.to_matrix_env().expected_reward(users, items))
    with pytest.raises(ValueError, match=r"users must hold ids in \[0, 40\), got ids of 2\^63 or more"):
        env.user_vectors(torch.tensor([2**64 - 1], dtype=torch.uint64))  # not as the negative int64 it reads as
    with pytest.raises(ValueError, match="num_items"):
        OnDemandSyntheticEnv(0, num_items=2**32 + 1)
    for bad in (torch.tensor([40]), torch.tensor([-1]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError, match="users"):
            env.optimal_value(users=bad)
    with pytest.raises(ValueError, match="num_outputs"):
        env.optimal_value(301)
    for size in (0, -5):
        with pytest.raises(ValueError, match="chunk_size"):
            env.top_items(users, 2, chunk_size=size)
    whole, dense = env.top_items(torch.arange(40), 3, chunk_size=64), env.to_matrix_env()
    monkeypatch.setattr("capg_rec.sim.ondemand._BLOCK", 700)  # a few users per block
    chunked = env.top_items(torch.arange(40), 3, chunk_size=64)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
    again = env.to_matrix_env()
    assert all(torch.equal(getattr(again, t), getattr(dense, t)) for t in ("q", "reward_std", "lsr_scores"))
