"""SS-GRPO: vectorized functions against explicit-loop references, and loss behaviour."""

from __future__ import annotations

import math

import pytest
import torch

from rubricem_core.recipes import RECIPES, Recipe, get_recipe, recipe_names
from rubricem_core.scaffold import STAGES
from rubricem_core.ssgrpo import (
    UNSCORED_STAGE_RETURNS,
    LambdaSpecError,
    as_lambda,
    lambda_matrix,
    policy_loss,
    stage_advantages,
    stage_returns,
    token_advantages,
)

K = len(STAGES)
LAMBDA_SPECS = [
    "stage_local",
    "terminal",
    "causal",
    {"name": "discounted", "gamma": 0.7},
    "discounted(0.5)",
    [[1, 0.5, 0, 2], [0, 1, 0.3, 0], [0, 0, 1, 1], [0, 0, 0, 1]],
]
SPEC_IDS = ["stage_local", "terminal", "causal", "discounted0.7", "discounted0.5", "explicit"]
CLIPS = [(0.2, 0.2), (0.2, 0.28), (0.1, 0.4)]


# ------------------------------------------------------------------------ loop references ----


def ref_returns(R: list[list[float]], lam: list[list[float]], unscored: str = "none") -> list[list[float]]:
    n = len(R)
    out = [[0.0] * K for _ in range(n)]
    for i in range(n):
        for k in range(K):
            terms = [lam[k][j] * R[i][j] for j in range(K) if lam[k][j] != 0 and not math.isnan(R[i][j])]
            own_missing = unscored == "none" and lam[k][k] != 0 and math.isnan(R[i][k])
            out[i][k] = math.nan if own_missing or not terms else sum(terms)
    return out


def ref_grpo(column: list[float], eps: float = 1e-6) -> list[float]:
    """Plain GRPO normalization of one stage; NaN entries are skipped and get 0."""
    values = [v for v in column if not math.isnan(v)]
    if len(values) < 2 or max(values) == min(values):
        return [0.0] * len(column)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [0.0 if math.isnan(v) else (v - mean) / (std + eps) for v in column]


def ref_advantages(G: list[list[float]], eps: float = 1e-6) -> list[list[float]]:
    columns = [ref_grpo([row[k] for row in G], eps) for k in range(K)]
    return [[columns[k][i] for k in range(K)] for i in range(len(G))]


def ref_token_advantages(A, stage_ids, mask):
    return [
        [A[i][s] if m and s >= 0 else 0.0 for s, m in zip(sids, ms)]
        for i, (sids, ms) in enumerate(zip(stage_ids, mask))
    ]


def ref_policy_loss(logp, old, ref, adv, mask, clip_low, clip_high, kl_coef):
    total, kl_total, count = 0.0, 0.0, 0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
            pg = -min(ratio * adv[i][t], clipped * adv[i][t])
            kl = 0.0
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                kl = math.exp(d) - d - 1
            total += pg + kl_coef * kl
            kl_total += kl
            count += 1
    return total / count, kl_total / count


def random_scores(seed: int, n: int = 8) -> torch.Tensor:
    """Scores in [0,1] with the NaN patterns the judge produces: a stage with no rubrics (whole
    column), failed judgments (whole rows), and a few stray cells."""
    g = torch.Generator().manual_seed(seed)
    R = torch.rand(n, K, generator=g, dtype=torch.float64)
    R[:, int(torch.randint(0, K - 1, (1,), generator=g))] = math.nan
    R[int(torch.randint(0, n, (1,), generator=g))] = math.nan
    stray = torch.rand(n, K, generator=g) < 0.1
    R[stray] = math.nan
    R[:, 1] = torch.where(torch.isnan(R[:, 1]), R[:, 1], torch.round(R[:, 1] * 2) / 2)  # ties
    return R


def same(a: torch.Tensor, b: list[list[float]]) -> bool:
    return torch.allclose(a.double(), torch.tensor(b, dtype=torch.float64), atol=1e-9, equal_nan=True)


# --------------------------------------------------------------------------- equivalence ----


@pytest.mark.parametrize("spec", LAMBDA_SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("seed", range(5))
def test_returns_and_advantages_match_loop(spec, seed):
    R = random_scores(seed)
    lam = as_lambda(spec).double()
    G = stage_returns(R, lam)
    assert same(G, ref_returns(R.tolist(), lam.tolist()))
    A = stage_advantages(G)
    assert same(A, ref_advantages(G.tolist()))
    assert torch.isfinite(A).all()
    # Failed rows (all NaN) get exactly 0 everywhere.
    failed = torch.isnan(R).all(1)
    assert failed.any() and (A[failed] == 0).all()


def test_the_config_offers_exactly_the_unscored_stage_rules_stage_returns_knows():
    """The rule's names live in ssgrpo (floor 1); the config (floor 2, no torch at import) repeats them as
    its Literal, so this test is what keeps the two in step."""
    from typing import get_args

    from rubricem_core.config.training import RLConfig

    assert get_args(RLConfig.model_fields["unscored_stage_return"].annotation) == UNSCORED_STAGE_RETURNS


@pytest.mark.parametrize("unscored", UNSCORED_STAGE_RETURNS)
@pytest.mark.parametrize("spec", LAMBDA_SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("seed", range(3))
def test_unscored_stage_returns_match_loop(spec, seed, unscored):
    R = random_scores(seed)
    R[:, 1] = math.nan  # no research rubric for this query
    lam = as_lambda(spec).double()
    G = stage_returns(R, lam, unscored)
    assert same(G, ref_returns(R.tolist(), lam.tolist(), unscored))
    assert torch.isnan(G[torch.isnan(R).all(1)]).all()  # a failed judgment has no return either way


def test_downstream_gives_an_unscored_stage_the_later_scores():
    """Worked by hand, causal Λ, research unscored: G_research = R_review + R_answer under downstream."""
    nan = math.nan
    R = torch.tensor([[1.0, nan, 1.0, 1.0], [1.0, nan, 0.0, 0.0], [1.0, nan, 1.0, 0.0]], dtype=torch.float64)
    none = stage_returns(R, "causal")
    down = stage_returns(R, "causal", "downstream")
    assert torch.isnan(none[:, 1]).all()
    assert down[:, 1].tolist() == [2.0, 0.0, 1.0] and down[:, 0].tolist() == [3.0, 1.0, 2.0]
    assert torch.equal(none[:, [0, 2, 3]], down[:, [0, 2, 3]])  # scored stages are untouched
    A_none, A_down = stage_advantages(none), stage_advantages(down)
    assert (A_none[:, 1] == 0).all()
    assert A_down[0, 1] > 0 > A_down[1, 1] and A_down[2, 1] == pytest.approx(0.0)
    # terminal and stage_local are unchanged: their diagonal already decides
    for spec in ("terminal", "stage_local"):
        assert same(stage_returns(R, spec, "downstream"), stage_returns(R, spec).tolist())
    with pytest.raises(ValueError, match="unscored stage return 'later'"):
        stage_returns(R, "causal", "later")


@pytest.mark.parametrize("seed", range(4))
def test_advantages_match_loop_on_degenerate_columns(seed):
    g = torch.Generator().manual_seed(100 + seed)
    G = torch.randn(6, K, generator=g, dtype=torch.float64) * 3
    G[:, 0] = 0.1  # zero variance, though the float mean of 0.1s is not exactly 0.1
    G[:, 1] = math.nan
    G[1:, 1] = 0.7  # five equal values and a NaN
    G[:, 2] = math.nan
    G[3, 2] = 1.0  # one valid entry
    G[4, 3] = math.nan
    A = stage_advantages(G)
    assert same(A, ref_advantages(G.tolist()))
    assert (A[:, :3] == 0).all() and A[4, 3] == 0 and A[:, 3].abs().sum() > 0


@pytest.mark.parametrize("value", [0.1, 0.7, 1 / 3])
def test_tied_float32_group_gives_exactly_zero(value):
    # float32 mean of seven 0.7s is off by ~6e-8; divided by (std + 1e-6) that would be a fake 0.06.
    G = torch.full((7, K), value, dtype=torch.float32)
    assert (stage_advantages(G) == 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_token_advantages_match_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n, T = 5, 23
    A = torch.randn(n, K, generator=g)
    stage_ids = torch.randint(-1, K, (n, T), generator=g)
    mask = torch.rand(n, T, generator=g) < 0.6
    out = token_advantages(A, stage_ids, mask)
    assert same(out, ref_token_advantages(A.tolist(), stage_ids.tolist(), mask.tolist()))
    assert (out[~mask] == 0).all() and (out[stage_ids == -1] == 0).all()


@pytest.mark.parametrize("clip", CLIPS, ids=str)
@pytest.mark.parametrize("with_ref", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_policy_loss_matches_loop(clip, with_ref, seed):
    g = torch.Generator().manual_seed(seed)
    n, T = 4, 17
    logp = -torch.rand(n, T, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(n, T, generator=g, dtype=torch.float64) * 0.4  # ratios well outside the clip
    ref = logp + torch.randn(n, T, generator=g, dtype=torch.float64) * 0.3 if with_ref else None
    adv = torch.randn(n, T, generator=g, dtype=torch.float64)
    mask = torch.rand(n, T, generator=g) < 0.7
    loss, metrics = policy_loss(logp, old, ref, adv, mask, clip[0], clip[1], kl_coef=0.05)
    want, want_kl = ref_policy_loss(
        logp.tolist(),
        old.tolist(),
        None if ref is None else ref.tolist(),
        adv.tolist(),
        mask.tolist(),
        clip[0],
        clip[1],
        0.05,
    )
    assert loss.item() == pytest.approx(want, abs=1e-10)
    assert metrics["kl"] == pytest.approx(want_kl, abs=1e-10)
    assert metrics["n_tokens"] == mask.sum().item()
    assert 0 < metrics["clip_fraction"] < 1


# -------------------------------------------------------------------------- Λ semantics ----


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("other_stages", ["nan", "scored"])
def test_terminal_broadcasts_answer_advantage(seed, other_stages):
    R = torch.rand(8, K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if other_stages == "nan":
        R[:, :-1] = math.nan  # the baseline: only the answer stage has rubrics
    R[2] = math.nan  # a failed judgment
    A = stage_advantages(stage_returns(R, "terminal"))
    answer_grpo = torch.tensor(ref_grpo(R[:, -1].tolist()), dtype=torch.float64)
    assert answer_grpo.abs().sum() > 0
    for k in range(K):
        assert torch.allclose(A[:, k], answer_grpo, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_stage_local_is_per_stage_grpo(seed):
    R = random_scores(seed)
    A = stage_advantages(stage_returns(R, "stage_local"))
    for k in range(K):
        assert torch.allclose(A[:, k], torch.tensor(ref_grpo(R[:, k].tolist()), dtype=torch.float64), atol=1e-12)


def test_causal_credits_downstream_and_nan_stage_gets_zero():
    R = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [math.nan] * 4], dtype=torch.float64)
    R[:2, 1] = math.nan  # research had no rubrics for this query
    G = stage_returns(R, "causal")
    assert G[0].tolist()[0] == 2.0 and G[0, 2] == 2.0 and G[0, 3] == 1.0
    assert torch.isnan(G[:, 1]).all() and torch.isnan(G[2]).all()
    A = stage_advantages(G)
    assert (A[:, 1] == 0).all() and (A[2] == 0).all()
    assert A[0, 0] > 0 > A[1, 0]  # plan credited for the downstream answer, though its own score ties


def test_failed_rows_do_not_shift_the_group_statistics():
    R = random_scores(7)
    R[:, 0] = torch.linspace(0, 1, R.shape[0], dtype=torch.float64)
    failed = torch.isnan(R).all(1)
    A = stage_advantages(stage_returns(R, "causal"))
    A_kept = stage_advantages(stage_returns(R[~failed], "causal"))
    assert torch.allclose(A[~failed], A_kept) and (A[failed] == 0).all()


@pytest.mark.parametrize("spec", LAMBDA_SPECS, ids=SPEC_IDS)
def test_returns_change_with_scores(spec):
    R = torch.full((4, K), 0.5, dtype=torch.float64)
    R[0, -1] = 1.0  # one rollout with a better answer
    A = stage_advantages(stage_returns(R, spec))
    lam = as_lambda(spec)
    # Every stage whose return includes the answer score ranks rollout 0 first; others see no signal.
    for k in range(K):
        if lam[k, -1] != 0:
            assert A[0, k] > 0 and (A[1:, k] < 0).all()
        else:
            assert (A[:, k] == 0).all()


# ------------------------------------------------------------------------------ the loss ----


def test_masked_tokens_get_exactly_zero_gradient():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 10, generator=g)).requires_grad_()
    mask = torch.rand(3, 10, generator=g) < 0.5
    old = torch.where(mask, logp.detach() + 0.1, torch.full_like(logp, math.nan))  # NaN: never sampled
    ref = torch.where(mask, logp.detach() - 0.2, torch.full_like(logp, math.nan))
    adv = torch.where(mask, torch.randn(3, 10, generator=g), torch.full_like(logp, math.nan))
    loss, metrics = policy_loss(logp, old, ref, adv, mask, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
    assert (logp.grad[~mask] == 0).all()
    assert (logp.grad[mask] != 0).all()


@pytest.mark.parametrize("clip_low,clip_high", CLIPS)
def test_clipping_by_hand(clip_low, clip_high):
    # Four tokens: (ratio, advantage) = (1.5, +1), (0.5, +1), (0.5, −1), (1.5, −1).
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.5]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, metrics = policy_loss(logp, old, None, adv, mask, clip_low, clip_high, kl_coef=0.0)
    # Clipped branch active only where it is pessimistic: ratio above 1+hi for A>0, below 1−lo for A<0.
    per_token = [-min(1.5, 1 + clip_high), -0.5, max(0.5, 1 - clip_low), 1.5]
    assert loss.item() == pytest.approx(sum(per_token) / 4)
    loss.backward()
    # ∂/∂logp of −ρA is −ρA where unclipped, 0 where clipped; then / 4 tokens.
    want_grad = [0.0 if 1.5 > 1 + clip_high else -1.5 / 4, -0.5 / 4, 0.0 if 0.5 < 1 - clip_low else 0.5 / 4, 1.5 / 4]
    assert logp.grad[0].tolist() == pytest.approx(want_grad)
    n_clipped = (1.5 > 1 + clip_high) + (0.5 < 1 - clip_low)
    assert metrics["clip_fraction"] == pytest.approx(n_clipped / 4)
    assert metrics["ratio_max"] == pytest.approx(1.5) and metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["pg_loss"] == pytest.approx(loss.item())


def test_k3_kl_nonnegative_and_zero_at_reference():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 12, generator=g)
    mask = torch.ones(4, 12, dtype=torch.bool)
    zero_adv = torch.zeros(4, 12)
    loss_same, m_same = policy_loss(logp, logp, logp, zero_adv, mask, kl_coef=1.0)
    assert loss_same.item() == 0.0 and m_same["kl"] == 0.0 and m_same["approx_kl"] == 0.0
    for scale in (0.01, 0.5, 3.0):
        ref = logp + torch.randn(4, 12, generator=g) * scale
        loss, m = policy_loss(logp, logp, ref, zero_adv, mask, kl_coef=1.0)
        assert m["kl"] > 0 and loss.item() == pytest.approx(m["kl"])
        d = ref - logp
        assert ((d.exp() - d - 1) >= 0).all()


def test_token_level_aggregation_over_the_batch():
    # A long and a short rollout: each token weighs the same (not each sequence).
    logp = torch.zeros(2, 6)
    adv = torch.tensor([[1.0] * 6, [-3.0] * 6])
    mask = torch.tensor([[1] * 6, [1, 0, 0, 0, 0, 0]])
    loss, metrics = policy_loss(logp, logp, None, adv, mask)
    assert loss.item() == pytest.approx((-6 * 1.0 + 3.0) / 7)
    assert loss.item() != pytest.approx((-1.0 + 3.0) / 2)
    assert metrics["n_tokens"] == 7


def test_empty_mask_gives_connected_zero_loss():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = policy_loss(logp, logp.detach(), None, torch.ones(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and metrics["n_tokens"] == 0 and (logp.grad == 0).all()


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("clip", CLIPS, ids=str)
def test_sgd_step_moves_logp_with_the_advantage(sign, clip):
    torch.manual_seed(0)
    V, n, T = 11, 3, 8
    logits = torch.randn(n, T, V, requires_grad=True)
    tokens = torch.randint(0, V, (n, T))

    def logp_of() -> torch.Tensor:
        return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    mask = torch.ones(n, T)
    mask[:, :2] = 0  # "prompt" tokens
    before = logp_of().detach()
    loss, _ = policy_loss(logp_of(), before, before, torch.full((n, T), sign), mask, clip[0], clip[1])
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    delta = logp_of().detach() - before
    assert (sign * delta[:, 2:] > 0).all()
    assert (delta[:, :2] == 0).all()  # masked positions were never pushed


def test_pipeline_scores_to_update():
    # Two rollouts, one stage each of plan/answer tokens: a better answer raises both stages' tokens
    # under causal credit, and only the answer's under stage_local.
    R = torch.tensor([[0.5, math.nan, math.nan, 1.0], [0.5, math.nan, math.nan, 0.0]])
    stage_ids = torch.tensor([[-1, 0, 0, 3, 3], [-1, 0, 0, 3, 3]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    tok_causal = token_advantages(stage_advantages(stage_returns(R, "causal")), stage_ids, mask)
    tok_local = token_advantages(stage_advantages(stage_returns(R, "stage_local")), stage_ids, mask)
    assert tok_causal[0, 1] > 0 > tok_causal[1, 1]
    assert tok_local[0, 1] == 0 and tok_local[0, 3] > 0 > tok_local[1, 3]
    assert tok_causal[0, 0] == 0 and tok_local[1, 0] == 0


# ------------------------------------------------------------------------- Λ constructors ----


def test_lambda_presets():
    assert torch.equal(lambda_matrix("stage_local"), torch.eye(4))
    assert lambda_matrix("terminal").tolist() == [[0, 0, 0, 1]] * 4
    assert lambda_matrix("causal").tolist() == [[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]]
    d = lambda_matrix("discounted", gamma=0.5)
    assert d.tolist() == [[1, 0.5, 0.25, 0.125], [0, 1, 0.5, 0.25], [0, 0, 1, 0.5], [0, 0, 0, 1]]
    assert lambda_matrix("causal", K=2).shape == (2, 2)
    assert torch.equal(as_lambda("discounted(0.5)"), d)
    assert torch.equal(as_lambda({"name": "discounted", "gamma": 0.5}), d)
    assert torch.equal(as_lambda(d), d)
    assert torch.equal(as_lambda("discounted(1)"), lambda_matrix("causal"))


@pytest.mark.parametrize(
    "spec,message",
    [
        ("nope", "unknown lambda preset 'nope'"),
        ("discounted", "needs gamma"),
        ({"name": "discounted", "gamma": 1.5}, "in [0, 1]"),
        ({"name": "causal", "gamma": 0.5}, "only to the 'discounted'"),
        ({"name": "causal", "beta": 1}, "unknown keys ['beta']"),
        ({"gamma": 0.5}, "needs a 'name'"),
        ("discounted(x)", "not a number"),
        ([[1, 0], [0, 1]], "must be 4×4; it has 2 rows"),
        ([[1, 0, 0, 0]] * 3 + [[0, 0, 1]], "row 3 is 3"),
        ([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0.5, 1, 0], [0, 0, 0, 1]], "lambda[2][1] = 0.5: entries below the diagonal"),
        ([[1, 0, 0, 0], [0, 2, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], "lambda[1][1] = 2.0: diagonal"),
        ([[1, math.inf, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], "lambda[0][1] = inf is not finite"),
        ([[1, "a", 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], "lambda[0][1] = 'a' is not a number"),
        (lambda_matrix("terminal"), "lambda[0][0] = 0.0: diagonal"),
        (3, "got int"),
    ],
)
def test_as_lambda_rejects_bad_specs(spec, message):
    with pytest.raises(LambdaSpecError) as err:
        as_lambda(spec)
    assert message in str(err.value)


def test_bad_shapes_are_reported():
    with pytest.raises(ValueError, match="lambda must be 3×3"):
        stage_returns(torch.zeros(2, 3), torch.eye(4))
    with pytest.raises(ValueError, match="stage_ids must lie in -1..3"):
        token_advantages(torch.zeros(2, 4), torch.full((2, 3), 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="stage_ids and mask must both be"):
        token_advantages(torch.zeros(2, 4), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match="share one shape"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), None, torch.zeros(1, 1), torch.ones(1, 1), clip_low=1.0)


# ------------------------------------------------------------------------------- recipes ----


def test_recipes():
    assert recipe_names() == ["baseline", "ss_grpo", "meta_policy", "full"]
    base, ss, meta, full = (get_recipe(n) for n in recipe_names())
    assert torch.equal(base.lam(), lambda_matrix("terminal")) and base.judged_stages == ["answer"]
    assert not base.reflection and meta.reflection and not ss.reflection and full.reflection
    assert torch.equal(ss.lam(), lambda_matrix("causal")) and ss.judged_stages == list(STAGES)
    # meta_policy = baseline + reflection; full = ss_grpo + reflection.
    assert meta.model_dump(exclude={"name", "reflection"}) == base.model_dump(exclude={"name", "reflection"})
    assert full.model_dump(exclude={"name", "reflection"}) == ss.model_dump(exclude={"name", "reflection"})
    copy = get_recipe("full")
    copy.lambda_spec = "stage_local"
    assert RECIPES["full"].lambda_spec == "causal"


@pytest.mark.parametrize("overrides", [{}, {"rl.kl_coef": 0.05, "rl.clip_low": 0.1, "rl.clip_high": 0.28}], ids=str)
def test_update_config_comes_from_the_rl_section(overrides):
    from rubricem_core.config import load_config
    from rubricem_core.rl.update import UpdateConfig

    cfg = load_config("tiny", overrides)
    config = UpdateConfig.from_rl(cfg.rl, temperature=0.7)
    expected = {"kl_coef": 0.001, "clip_low": 0.2, "clip_high": 0.2} | {
        k.split(".")[1]: v for k, v in overrides.items()
    }
    assert (config.kl_coef, config.clip_low, config.clip_high) == (
        expected["kl_coef"],
        expected["clip_low"],
        expected["clip_high"],
    )
    assert config.temperature == 0.7 and config.max_tokens_per_batch == cfg.rl.max_tokens_per_batch


def test_older_run_configs_with_a_null_kl_coef_load_with_the_default():
    from rubricem_core.config import RLConfig

    assert RLConfig(kl_coef=None).kl_coef == 0.001
    with pytest.raises(ValueError, match="clip_low"):
        RLConfig(clip_low=1.0)


def test_recipe_validation():
    with pytest.raises(ValueError, match=r"unknown recipe 'grpo'; expected one of \['baseline'"):
        get_recipe("grpo")
    with pytest.raises(ValueError, match="unknown stages"):
        Recipe(name="x", lambda_spec="causal", judged_stages=["plan", "summary"], reflection=False)
    with pytest.raises(ValueError, match="entries below the diagonal"):
        Recipe(
            name="x",
            lambda_spec=[[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],
            judged_stages=["answer"],
            reflection=False,
        )
    with pytest.raises(ValueError, match="extra"):
        Recipe(name="x", lambda_spec="causal", judged_stages=["answer"], reflection=False, lr=1.0)
    r = Recipe(
        name="x", lambda_spec={"name": "discounted", "gamma": 0.9}, judged_stages=["answer", "plan"], reflection=False
    )
    assert r.judged_stages == ["plan", "answer"] and r.lam()[0, 1].item() == pytest.approx(0.9)
