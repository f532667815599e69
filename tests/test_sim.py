"""Environments and late-stage rankers of capg_rec.sim."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from capg_rec.sim import (AntiOptimalLSR, MatrixEnv, NoisyLSR, OptimalLSR, UniformLSR, load_kuairec, make_lsr,
                          movielens_env, synthetic_env)
from capg_rec.sim import synthetic
from capg_rec.sim.kuairec import KUAIREC_COLUMNS
from capg_rec.sim.ondemand import OnDemandSyntheticEnv
from capg_rec.sim.synthetic import PAPER_SEED
from capg_rec.sim.movielens import fit_matrix_factorization, load_movielens_ratings

ALPHA = 1e-6  # family-wise false-alarm rate of every Monte-Carlo test


# ---------------------------------------------------------------------------- synthetic
@pytest.fixture(scope="module")
def paper_env() -> MatrixEnv:
    return synthetic_env()


def test_synthetic_shapes_and_formulas(paper_env):
    env = paper_env
    assert env.q.shape == env.reward_std.shape == env.lsr_scores.shape == (1000, 1000)
    assert env.q.dtype == torch.float32
    assert bool((env.q > 1).all())
    torch.testing.assert_close(env.q, F.softplus(env.lsr_scores) + 1)  # q = softplus(q_raw) + 1
    assert bool(((env.reward_std > 0) & (env.reward_std < 1)).all())  # a sigmoid
    # The noise level σ = sigmoid(u W_noise v + 1), from the environment's own draws, and pinned at a few entries
    # (only q entered the policy-value tests: a σ of sigmoid(... - 1) went unnoticed, a review's mutation).
    parts = synthetic._draw(PAPER_SEED, 1000, 1000, 10, True)
    sigma = torch.sigmoid(parts["users"] @ parts["w_noise"] @ parts["items"].T + 1)
    torch.testing.assert_close(env.reward_std, sigma.float())
    torch.testing.assert_close(env.reward_std[0, :4], torch.tensor([0.873155, 0.747037, 0.732609, 0.594521]),
                               rtol=1e-5, atol=0.0)
    # The paper's environment (its seed, its coupling): best achievable value ≈ 9.1.
    assert env.optimal_value(1) == pytest.approx(9.109, abs=1e-3)


def test_synthetic_determinism_and_options():
    a, b = synthetic_env(3, num_users=50, num_items=40), synthetic_env(3, num_users=50, num_items=40)
    assert torch.equal(a.q, b.q) and torch.equal(a.reward_std, b.reward_std)
    assert not torch.equal(a.q, synthetic_env(4, num_users=50, num_items=40).q)
    independent = synthetic_env(3, num_users=50, num_items=40, paper_coupling=False)
    assert independent.q.shape == (50, 40) and not torch.equal(independent.q, a.q)
    assert torch.equal(synthetic_env(3, num_users=50, num_items=40, paper_coupling=np.False_).q, independent.q)
    with pytest.raises(TypeError, match="paper_coupling must be True or False, got builtins.str"):
        synthetic_env(3, num_users=50, num_items=40, paper_coupling="no")
    # Paper coupling: the item vectors are the user vectors, so raw + rawᵀ = scale · X (M0 + M0ᵀ) Xᵀ
    # has rank <= d = 10; with independent draws (and η now mixing M0 and Mz) the rank is higher.
    def sym_rank(env: MatrixEnv) -> int:
        raw = env.lsr_scores.double()
        return int(torch.linalg.matrix_rank(raw + raw.T, atol=1e-3))

    assert sym_rank(synthetic_env(3, num_users=30, num_items=30)) == 10
    assert sym_rank(synthetic_env(3, num_users=30, num_items=30, paper_coupling=False)) > 10
    with pytest.raises(ValueError, match="num_users"):
        synthetic_env(num_users=0)
    with pytest.raises(TypeError, match="seed"):
        synthetic_env(1.5)
    with pytest.raises(ValueError, match="seed"):
        synthetic_env(2**64)  # an error that names nothing before ("Overflow when unpacking long long")
    with pytest.raises(ValueError, match="scale"):
        synthetic_env(scale=-1.0)


def test_tables_are_lookups_and_rewards_are_gaussian(paper_env):
    env = paper_env
    users = torch.tensor([0, 5, 999])
    items = torch.tensor([[1, 2], [3, 4], [998, 0]])
    expected = env.expected_reward(users, items)
    assert torch.equal(expected, torch.stack([env.q[0, [1, 2]], env.q[5, [3, 4]], env.q[999, [998, 0]]]))
    n = 20000
    g = torch.Generator().manual_seed(0)
    u = torch.full((n,), 7)
    it = torch.full((n, 1), 11)
    r = env.sample_reward(u, it, g)[:, 0].double()
    q, sd = float(env.q[7, 11]), float(env.reward_std[7, 11])
    z = stats.norm.ppf(1 - ALPHA / 4)  # mean and variance checks, two-sided
    assert abs(float(r.mean()) - q) <= z * sd / math.sqrt(n)
    # Sample variance of n Gaussians: (n-1) s² / σ² ~ χ²(n-1).
    lo, hi = stats.chi2.ppf([ALPHA / 4, 1 - ALPHA / 4], n - 1)
    assert lo <= (n - 1) * float(r.var()) / sd**2 <= hi
    assert env.sample_users(64, g).shape == (64,)


def test_matrix_env_validation():
    q = torch.ones(3, 4)
    with pytest.raises(ValueError, match="reward_std"):
        MatrixEnv(q, torch.ones(3, 5), q)
    with pytest.raises(ValueError, match="reward_std"):
        MatrixEnv(q, -torch.ones(3, 4), q)
    with pytest.raises(ValueError, match="q"):
        MatrixEnv(torch.ones(3), torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="lsr_scores"):
        MatrixEnv(q, q, q * float("nan"))
    with pytest.raises(ValueError, match="relative_noise"):
        MatrixEnv.from_table(q, relative_noise=-0.1)
    env = MatrixEnv.from_table(torch.arange(12.0).view(3, 4))
    sub = env.subset(torch.tensor([2]), torch.tensor([0, 3]))
    assert torch.equal(sub.q, torch.tensor([[8.0, 11.0]])) and sub.name.startswith("matrix[subset ")
    # bool masks too; the name tells subsets apart by their tables (checkpoints and logs match environments by name)
    same = env.subset(torch.tensor([False, False, True]), torch.tensor([True, False, False, True]))
    assert torch.equal(same.q, sub.q) and same.name == sub.name
    assert env.subset(items=torch.tensor([0, 1])).name != env.subset(items=torch.tensor([2, 3])).name
    # a float64 table with the negative bit set (torch._neg_view, z.conj().imag) is named as the plain table (found by
    # review: numpy's RuntimeError, where no ids made a fresh tensor)
    table = torch.arange(12.0, dtype=torch.float64).view(3, 4)
    assert MatrixEnv.from_table(torch._neg_view(-table)).subset().name == MatrixEnv.from_table(table).subset().name


def test_subset_refuses_ids_it_cannot_take():
    """Found by review: subset indexed the tables with the ids as given: -1 became the last user or item, silently,
    an empty list made an environment of no items, and an id past the end raised torch's IndexError."""
    env = MatrixEnv.from_table(torch.arange(12.0).view(3, 4))
    for kwargs, match in (({"items": torch.tensor([-1, 0])}, r"items must hold ids in \[0, 4\)"),
                          ({"users": torch.tensor([-1])}, r"users must hold ids in \[0, 3\)"),
                          ({"items": torch.tensor([9])}, r"items must hold ids in \[0, 4\)"),
                          ({"items": torch.tensor([], dtype=torch.long)}, "items must be a non-empty 1-d"),
                          ({"users": torch.tensor([[0, 1]])}, "users must be a non-empty 1-d"),
                          ({"items": torch.tensor([True, False])}, r"items as a mask must have shape \[4\]"),
                          ({"items": torch.zeros(4, dtype=torch.bool)}, "items must be a non-empty 1-d")):
        with pytest.raises(ValueError, match=match):
            env.subset(**kwargs)
    with pytest.raises(TypeError, match="items must be an integer tensor"):
        env.subset(items=torch.tensor([0.0]))
    assert torch.equal(env.subset(users=torch.tensor([2, 2])).q, env.q[[2, 2]])  # a resample: an id twice is two


# ----------------------------------------------------------------------------- KuaiRec
def _write_kuairec(path, rows, header=KUAIREC_COLUMNS):
    lines = [",".join(header)]
    for user, video, ratio in rows:
        lines.append(f"{user},{video},1000,2000,2020-07-05 05:27:48.378,20200705.0,1593898068.378,{ratio}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_kuairec_loader(tmp_path):
    rows = [(14, 148, 0.5), (14, 183, 12.0), (19, 148, 1.5), (19, 148, 2.5), (21, 183, -1.0), (21, 148, 1.0)]
    env = load_kuairec(_write_kuairec(tmp_path / "small_matrix.csv", rows))
    # users 14, 19, 21 -> 0, 1, 2; videos 148, 183 -> 0, 1; ratio clipped to [0, 10];
    # the duplicate (19, 148) is averaged; the missing (19, 183) gets video 183's mean (10 + 0) / 2.
    expected = torch.tensor([[0.5, 10.0], [2.0, 5.0], [1.0, 0.0]])
    torch.testing.assert_close(env.q, expected)
    torch.testing.assert_close(env.reward_std, 0.3 * expected)
    torch.testing.assert_close(env.lsr_scores, expected)
    # the name carries the table: the same data elsewhere is the same env, other data another one (checkpoints
    # and reused reproduce runs of one file were taken for the other's)
    same = load_kuairec(_write_kuairec(tmp_path / "copy.csv", rows))
    other = load_kuairec(_write_kuairec(tmp_path / "other.csv", [*rows[:-1], (21, 148, 1.25)]))
    assert env.name == same.name != other.name and env.name.startswith("kuairec(table=")


@pytest.mark.parametrize("case", ["header", "text", "nan", "empty", "no_file", "id"])
def test_kuairec_bad_files(tmp_path, case):
    path = tmp_path / "bad.csv"
    if case == "header":
        _write_kuairec(path, [(1, 2, 0.5)], header=("user_id", "video_id", "watch_ratio"))
    elif case == "text":
        _write_kuairec(path, [(1, 2, "abc")])
    elif case == "nan":
        _write_kuairec(path, [(1, 2, "nan")])
    elif case == "empty":
        _write_kuairec(path, [])
    elif case == "id":
        _write_kuairec(path, [(1.5, 2, 0.5)])
    # "no_file": the path does not exist
    with pytest.raises(ValueError, match="path|bad.csv"):
        load_kuairec(path)



def test_kuairec_refuses_lines_of_other_field_counts(tmp_path):
    """Regression (a review): only user_id, video_id and watch_ratio were read, so a line of 9 fields (an unquoted
    comma in `time`) was taken with its watch ratio read from `timestamp` (1.59e9, clipped to 10); a line starting
    with '#' was dropped as a comment; a byte-order mark failed the header. Counted in blocks: a line split across
    two is counted whole, and the line named is the file's."""
    from capg_rec.sim import kuairec

    good = "1,2,1000,2000,2020-07-05 05:27:48.378,20200705.0,1593898068.378,0.5"
    nine = "1,3,1000,2000,2020-07-05,05:27:48.378,20200705.0,1593898068.378,0.2"
    header = ",".join(KUAIREC_COLUMNS)
    path = tmp_path / "m.csv"
    for block in (7, 64, 1 << 24):  # blocks shorter than a line, a few lines, the whole file
        path.write_text("\n".join([header, good, good, nine, good]) + "\n")
        with pytest.raises(ValueError, match=r"m.csv: line 4 must hold 8 comma-separated fields .* got 9"):
            kuairec._check_field_counts(str(path), block=block)
        path.write_text("\r\n".join([header, good, "", good.replace(",2,", ",7,")]))  # CRLF, a blank, no last \n
        kuairec._check_field_counts(str(path), block=block)
        # lines ended by \r alone, as np.loadtxt reads them (a diff review: such a file skipped the check whole)
        for ends in (["\r"] * 4, ["\r", "\n", "\r\n", "\n"]):
            path.write_bytes("".join(x + end for x, end in zip([header, good, good, nine], ends)).encode())
            with pytest.raises(ValueError, match=r"m.csv: line 4 must hold 8 comma-separated fields .* got 9"):
                kuairec._check_field_counts(str(path), block=block)
    for end in ("\n", "\r"):
        path.write_bytes((end.join([header, good, nine]) + end).encode())
        with pytest.raises(ValueError, match="line 3 must hold 8"):
            load_kuairec(path)
    path.write_text("\n".join([header, good, "#" + good]) + "\n")  # no comment lines
    with pytest.raises(ValueError, match="must be numeric"):
        load_kuairec(path)
    path.write_text("\ufeff" + "\n".join([header, good]) + "\n", encoding="utf-8")  # a spreadsheet's BOM
    torch.testing.assert_close(load_kuairec(path).q, torch.tensor([[0.5]]))
    path.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(128, 256)))  # gzip, not text
    with pytest.raises(ValueError, match="m.csv: not a UTF-8 text file"):
        load_kuairec(path)

def test_every_setting_that_changes_the_tables_changes_the_name(tmp_path):
    """Checkpoints, reused reproduce runs and logs are matched to an environment by its name (review: a checkpoint
    of synthetic_env() loaded into synthetic_env(scale=3, dim=4), whose tables differ, without a word). The defaults'
    names are unchanged."""
    small = dict(num_users=6, num_items=5)
    base = synthetic_env(**small)
    assert base.name == f"synthetic(seed={PAPER_SEED}, paper)"
    names = {base.name, synthetic_env(**small, scale=3.0).name, synthetic_env(**small, dim=4).name,
             synthetic_env(**small, dim=4, scale=3.0).name}
    assert len(names) == 4
    ondemand = [OnDemandSyntheticEnv(0, num_users=6, num_items=5, scale=s).name for s in (10.0, 2.0)]
    assert ondemand[0] == "ondemand_synthetic(seed=0, U=6, N=5, d=10)" != ondemand[1]
    rows = [(0, 100, 0.5), (0, 101, 1.5), (1, 100, 2.0), (1, 101, 0.25)]
    kuairec = [load_kuairec(_write_kuairec(tmp_path / "m.csv", rows), relative_noise=r).name for r in (0.3, 0.1)]
    assert kuairec[1] == kuairec[0][:-1] + ", relative_noise=0.1)"
    # written exactly (review: 6 digits named scale 10.0000001 and 10.0000004 alike), a number's type aside
    assert synthetic_env(**small, scale=10.0000001).name != synthetic_env(**small, scale=10.0000004).name
    assert synthetic_env(**small, dim=np.int64(4)).name == f"synthetic(seed={PAPER_SEED}, paper, dim=4)"
    assert synthetic_env(**small, scale=np.float32(3.0)).name == synthetic_env(**small, scale=3).name


def test_movielens_names_carry_its_settings(monkeypatch):
    import capg_rec.sim.movielens as movielens

    ratings = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 1]), torch.tensor([4.0, 3.0, 2.0, 5.0])
    monkeypatch.setattr(movielens, "load_movielens_ratings", lambda min_item_ratings: ratings)
    names = [movielens_env(**kw).name for kw in ({}, {"reg": 0.5}, {"iterations": 3}, {"relative_noise": 0.1})]
    assert names[0] == "movielens(min_item_ratings=10, rank=10, seed=0)" and len(set(names)) == 4


# --------------------------------------------------------------------------- MovieLens
def test_movielens_env_builds():
    env = movielens_env()
    assert env.q.shape == (610, 2269)
    assert float(env.q.min()) >= 0.5 and float(env.q.max()) <= 5.0
    assert 4.0 < env.optimal_value(1) <= 5.0
    users, items, ratings = load_movielens_ratings(1)
    assert len(ratings) == 100_836 and int(users.max()) + 1 == 610 and int(items.max()) + 1 == 9724


def test_matrix_factorization_recovers_a_low_rank_table_and_is_seeded():
    g = torch.Generator().manual_seed(0)
    truth = 3 + torch.randn(40, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 30, generator=g,
                                                                                  dtype=torch.float64)
    users, items = torch.meshgrid(torch.arange(40), torch.arange(30), indexing="ij")
    fit = fit_matrix_factorization(users.flatten(), items.flatten(), truth.flatten(), rank=2, reg=1e-6,
                                   iterations=50, seed=1)
    assert float((fit - truth).abs().max()) < 1e-3
    again = fit_matrix_factorization(users.flatten(), items.flatten(), truth.flatten(), rank=2, reg=1e-6,
                                     iterations=50, seed=1)
    assert torch.equal(fit, again)


# -------------------------------------------------------------------------------- LSRs
SCORES = torch.tensor([[0.3, -1.0, 2.0, 0.7]])  # K = 4


def _pl_prob(scores: list[float], order: tuple[int, ...]) -> float:
    w = [math.exp(s) for s in scores]
    p, left = 1.0, sum(w)
    for i in order:
        p *= w[i] / left
        left -= w[i]
    return p


def test_optimal_and_anti_optimal_pick_top_and_bottom():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(50, 8, generator=g)
    picks, prop = OptimalLSR()(scores, 3)
    assert torch.equal(picks, scores.argsort(dim=1, descending=True)[:, :3])
    assert torch.equal(prop, torch.ones(50, 3))
    picks, _ = AntiOptimalLSR()(scores, 2)
    assert torch.equal(picks, scores.argsort(dim=1)[:, :2])
    q = torch.rand(50, 8, generator=g)
    top = scores.argsort(dim=1, descending=True)[:, :3]
    torch.testing.assert_close(OptimalLSR().expected_value(scores, q, 3), q.gather(1, top).mean(1))


@pytest.mark.parametrize("lsr", [NoisyLSR(), UniformLSR()])
def test_stochastic_lsr_frequencies_and_propensities(lsr):
    n, length = 20000, 2
    scores = SCORES.expand(n, -1)
    g = torch.Generator().manual_seed(1)
    picks, prop = lsr(scores, length, g)
    assert picks.shape == prop.shape == (n, length)
    orders = list(itertools.permutations(range(4), length))
    base = SCORES[0].tolist() if isinstance(lsr, NoisyLSR) else [0.0] * 4
    exact = {o: _pl_prob(base, o) for o in orders}
    assert sum(exact.values()) == pytest.approx(1.0)
    # Propensities are the PL factors: their product is the probability of the ranking.
    products = prop.double().prod(dim=1)
    keys = [tuple(row) for row in picks.tolist()]
    for key, product in zip(keys[:200], products[:200].tolist()):
        assert product == pytest.approx(exact[key], rel=1e-5)
    counts = {o: 0 for o in orders}
    for key in keys:
        counts[key] += 1
    for o in orders:  # exact binomial interval per outcome, Bonferroni over the 12 outcomes
        lo, hi = stats.binom.interval(1 - ALPHA / len(orders), n, exact[o])
        assert lo <= counts[o] <= hi, (o, counts[o], exact[o] * n)


def test_expected_values_match_enumeration():
    q = torch.tensor([[1.0, 2.0, 5.0, 3.0]])
    orders = list(itertools.permutations(range(4), 2))
    exact = sum(_pl_prob(SCORES[0].tolist(), o) * (q[0, o[0]] + q[0, o[1]]) / 2 for o in orders)
    torch.testing.assert_close(NoisyLSR().expected_value(SCORES, q, 2), exact.view(1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(NoisyLSR().expected_value(SCORES, q, 1), (SCORES.softmax(1) * q).sum(1))
    torch.testing.assert_close(UniformLSR().expected_value(SCORES, q, 2), q.mean(1))


def test_lsr_validation():
    with pytest.raises(ValueError, match="name must be one of"):
        make_lsr("greedy")
    with pytest.raises(TypeError, match="name must be an LSR name in .* or a callable, got int"):  # found by review
        make_lsr(3)
    with pytest.raises(ValueError, match="num_outputs"):
        OptimalLSR()(SCORES, 5)
    with pytest.raises(ValueError, match="scores"):
        NoisyLSR()(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="temperature"):
        NoisyLSR(0.0)

    def custom(scores, length, generator):
        return scores.topk(length, dim=1).indices, None

    assert make_lsr(custom) is custom


@pytest.mark.parametrize("lsr", [OptimalLSR(), AntiOptimalLSR(), NoisyLSR(), UniformLSR()])
def test_expected_values_check_their_arguments(lsr):
    """Regression (found by review): expected_value took a q of another shape (3 values for 2 rows, or a [B] from
    broadcasting), L of 0 or above K and NaN scores from UniformLSR; and +inf scores gave NoisyLSR NaN propensities."""
    scores = torch.randn(2, 5)
    for q, length, error, match in ((torch.ones(3, 5), 1, ValueError, "q must have the shape of scores"),
                                    (torch.ones(2, 5, dtype=torch.long), 1, TypeError, "q must be a float tensor"),
                                    (torch.ones(2, 5), 0, ValueError, "num_outputs"),
                                    (torch.ones(2, 5), 6, ValueError, "num_outputs")):
        with pytest.raises(error, match=match):
            lsr.expected_value(scores, q, length)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"scores must not hold NaN or \+inf"):
            lsr.expected_value(scores.index_fill(1, torch.tensor([2]), bad), torch.ones(2, 5), 1)
        with pytest.raises(ValueError, match=r"scores must not hold NaN or \+inf"):
            lsr(scores.index_fill(1, torch.tensor([2]), bad), 2)
    assert lsr.expected_value(scores, torch.ones(2, 5), 2).shape == (2,)


def test_noisy_lsr_needs_l_scores_above_minus_inf():
    scores = torch.tensor([[0.0, 1.0, -torch.inf]])
    picks, propensities = NoisyLSR()(scores, 2)  # two finite scores: a draw of two
    assert torch.isfinite(propensities).all()
    with pytest.raises(ValueError, match="num_outputs=3 entries above -inf"):  # NaN propensities before
        NoisyLSR()(scores, 3)
    # a diff review: checked before the division by τ, which a tiny τ overflows to ±inf (NaN propensities again)
    tiny = NoisyLSR(1e-38)
    for call in (lambda: tiny(torch.tensor([[10.0, 0.0, -5.0]]), 2),
                 lambda: tiny.expected_value(torch.tensor([[10.0, 0.0, -5.0]]), torch.ones(1, 3), 1)):
        with pytest.raises(ValueError, match=r"temperature=1e-38 takes a score to \+inf"):
            call()
    with pytest.raises(ValueError, match="num_outputs=3 entries above -inf"):
        tiny(torch.tensor([[-10.0, -20.0, 1.0]]), 3)



def test_noisy_lsr_expected_value_at_a_small_temperature():
    """Regression (a review): for L > 1 the exact value ran in float32, where scores / τ beyond its resolution
    (5.2e5) were refused with a message about num_candidates, experts and soft masks: NoisyLSR(1e-6) on scores a
    few units apart. In float64 it is the greedy value; beyond float64's resolution a ValueError names τ."""
    torch.manual_seed(0)
    scores, q = 5 * torch.randn(4, 10), torch.rand(4, 10)
    greedy = OptimalLSR().expected_value(scores, q, 3)
    for temperature in (1e-4, 1e-6, 1e-12):
        value = NoisyLSR(temperature).expected_value(scores, q, 3)
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, greedy)
    # a float32 spread within resolution stays in float32, and equals a float64 computation
    mild = NoisyLSR(0.5)
    torch.testing.assert_close(mild.expected_value(scores, q, 3),
                               mild.expected_value(scores.double(), q.double(), 3).float())
    with pytest.raises(ValueError, match=r"NoisyLSR\(temperature=1e-15\)\.expected_value: scores / temperature span "
                                         r"[0-9.e+]+, more than float64 resolves .* or mask items with -inf"):
        NoisyLSR(1e-15).expected_value(scores, q, 3)
    # a diff review: scores that require grad warned (a float() of them); a soft mask within float64's resolution
    # is computed there: the third pick is one of the two far items, the likelier one (+1) e times as often
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NoisyLSR(1e-6).expected_value(scores.requires_grad_(), q, 3)
    soft = torch.tensor([[1.0, 2.0, -1e13, -1e13 + 1.0]], dtype=torch.float64)
    value = NoisyLSR(1.0).expected_value(soft, torch.tensor([[0.0, 0.0, 0.0, 3.0]], dtype=torch.float64), 3)
    torch.testing.assert_close(value, torch.tensor([math.e / (1 + math.e)], dtype=torch.float64))

def test_environments_refuse_what_they_would_answer_wrongly():
    """Regression (found by review): a negative id wrapped around to another user or item, 1-d items or a batch of
    another size broadcast to a [B, B] table, the rankers ranked NaN scores, NoisyLSR named num_candidates for
    num_outputs, wrong types were ValueErrors, and movielens_env(min_item_ratings=10**6) failed inside torch."""
    env = MatrixEnv.from_table(torch.rand(4, 6) + 1)
    for users, items in ((torch.tensor([-1]), torch.tensor([[0]])), (torch.tensor([0]), torch.tensor([[-3]])),
                         (torch.tensor([4]), torch.tensor([[0]])), (torch.tensor([0]), torch.tensor([[6]]))):
        for call in (env.expected_reward, env.ranking_scores, env.sample_reward):
            with pytest.raises(ValueError, match="must hold ids in"):
                call(users, items)
    for users, items in ((torch.arange(4), torch.arange(4)), (torch.arange(4), torch.zeros(1, 3, dtype=torch.long))):
        with pytest.raises(ValueError, match=r"shapes \[B\] and \[B, L\]"):
            env.expected_reward(users, items)
    narrow = env.expected_reward(torch.tensor([1], dtype=torch.int32), torch.tensor([[2]], dtype=torch.int16))
    assert torch.equal(narrow, env.q[1:2, 2:3])
    nan = torch.tensor([[math.nan, 1.0, 2.0]])
    for lsr in (OptimalLSR(), NoisyLSR(), UniformLSR()):
        with pytest.raises(ValueError, match="NaN"):
            lsr(nan, 1)
    with pytest.raises(ValueError, match="num_outputs must be in"):
        NoisyLSR().expected_value(torch.randn(2, 5), torch.rand(2, 5), 6)
    with pytest.raises(TypeError, match="scores"):
        OptimalLSR()([[1.0, 2.0]], 1)
    with pytest.raises(TypeError, match="q must be a 2-d float tensor"):
        MatrixEnv([[1.0]], torch.ones(1, 1), torch.ones(1, 1))
    with pytest.raises(TypeError, match="relative_noise"):
        MatrixEnv.from_table(torch.ones(2, 2), relative_noise="a")
    with pytest.raises(TypeError, match="seed"):
        movielens_env(seed=1.5)
    with pytest.raises(ValueError, match="keeps no movie"):
        movielens_env(min_item_ratings=10**6)


def test_relative_noise_must_be_finite():
    with pytest.raises(ValueError, match="relative_noise must be a finite number"):
        MatrixEnv.from_table(torch.ones(2, 2), relative_noise=math.inf)


def test_tables_names_values_and_paths_are_checked(tmp_path):
    """A review's sweep of bad input: an empty table was taken (then torch's error at the first draw), a name that
    is no str too (runs are matched by it), a q of NaN gave NaN values, a path of another type Python's error."""
    table = torch.rand(3, 5)
    for shape in ((0, 5), (3, 0)):
        with pytest.raises(ValueError, match=r"q must be a 2-d float tensor \[U, N\] of U, N >= 1"):
            MatrixEnv(torch.rand(shape), torch.rand(shape), torch.rand(shape))
    with pytest.raises(TypeError, match="name must be a str"):
        MatrixEnv(table, table, table, name=5)
    for lsr in (OptimalLSR(), NoisyLSR(), UniformLSR(), AntiOptimalLSR()):
        with pytest.raises(ValueError, match=r"q must be finite"):
            lsr.expected_value(table, table.index_fill(1, torch.tensor([1]), float("nan")), 2)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        load_kuairec(5)
    with pytest.raises(ValueError, match="name must be one of"):
        make_lsr("x")
