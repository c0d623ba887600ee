"""vtp.argmax and vtp.sample on one process against the float64 dense reference on the full
logits (``vtp_runtime.testing.reference``), eager and triton (Triton's interpreter on CPU);
on gloo ranks in ``test_sampling_ranks.py``. The interpreter is slow: by default triton's
draws are tested against the distribution with every restriction at once, and its tokens
against eager's for every option; ``VTP_TEST_DEPTH=full`` tests each option alone as well,
as for eager."""

import math
from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from tests.helpers import SAMPLING_VOCAB as V
from tests.helpers import random_logits
from vtp_runtime import plans as plan
from vtp_runtime import sampling
from vtp_runtime.testing import conformance, reference

# the built-in backends that sample on CPU; all but eager run in Triton's (slow) interpreter here
BACKENDS = conformance.backends_with("sample")


def _chi_square_limit(df: int, z: float = 3.72) -> float:
    """The chi-square quantile at p = 1e-4 (z = 3.72), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _check_draws(ids: torch.Tensor, probs: torch.Tensor) -> None:
    """``ids`` [n] drawn independently from ``probs`` [V]: never outside the support, and a
    chi-square statistic (bins with expected counts below 5 merged) under the 1e-4 quantile."""
    n = ids.numel()
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "a token outside the restricted support was drawn"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    df = max(obs.numel() - 1, 1)
    assert stat < _chi_square_limit(df), f"chi-square {stat:.1f} over {df} degrees of freedom"


# -- one process -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_is_torch_argmax_with_ties_to_the_lowest_id(backend):
    x = torch.randint(0, 4, (40, V)).float()  # many ties at the max
    x[0] = 3.0  # every entry ties: id 0
    x[1, 5] = math.nan  # NaN counts as +inf
    x[2] = -math.inf  # a row of all -inf: id 0
    x[3, 7] = math.inf
    x[3, 9] = math.nan
    got = vtp.argmax(x, backend=backend)
    assert torch.equal(got, reference.argmax(x))
    assert torch.equal(got[4:], x[4:].argmax(-1))
    assert got[1] == 5 and got[2] == 0 and got[3] == 7


CASES: list[dict[str, Any]] = [
    {},
    {"top_k": 4},
    {"top_p": 0.6},
    {"min_p": 0.15},
    {"temperature": 0.7, "top_k": 6, "top_p": 0.8},
    {"temperature": 1.5, "top_p": 0.9, "min_p": 0.05},
    {"top_k": 8, "top_p": 0.7, "min_p": 0.1},
]


FULL = conformance.current_depth() == "full"
EVERY_RESTRICTION = {"top_k": 8, "top_p": 0.7, "min_p": 0.1}
DRAWS = [(b, o) for b in BACKENDS for o in (CASES if b == "eager" or FULL else [EVERY_RESTRICTION])]


def _options_id(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items()) or "plain"


@pytest.mark.parametrize("backend,options", DRAWS, ids=[f"{_options_id(o)}-{b}" for b, o in DRAWS])
def test_draws_follow_the_restricted_distribution(backend, options):
    """Many draws in one call (the same logits in every row: each row's noise is its own)
    against the float64 distribution, by chi-square at p = 1e-4."""
    n = 3000 if backend == "eager" else 500  # Triton runs in its (slow) interpreter here
    row = random_logits(1, V, seed=5)[0]
    ids = vtp.sample(row.expand(n, V), seed=11, backend=backend, **options)
    assert ids.shape == (n,) and ids.dtype == torch.int64
    _check_draws(ids, reference.sampling_distribution(row[None], **options)[0])


def test_the_chi_square_check_can_fail():
    """The check above rejects draws from a distribution that forgot its restriction."""
    row = random_logits(1, V, seed=5)[0]
    ids = vtp.sample(row.expand(3000, V), seed=11, backend="eager")  # no top-k
    with pytest.raises(AssertionError, match="outside the restricted support"):
        _check_draws(ids, reference.sampling_distribution(row[None], top_k=4)[0])
    with pytest.raises(AssertionError, match="chi-square"):
        _check_draws(ids, reference.sampling_distribution(row[None], temperature=0.7)[0])


def test_a_tie_at_the_kth_value_keeps_the_whole_tie():
    """top_k keeps every logit equal to the k-th largest (transformers' rule), also when the
    tie runs past the candidates of the first round."""
    row = torch.zeros(60)
    row[:3] = 5.0  # three clear winners, then a 57-way tie at the 4th value
    ids = vtp.sample(row.expand(4000, 60), seed=2, top_k=4, backend="eager")
    _check_draws(ids, reference.sampling_distribution(row[None], top_k=4)[0])
    assert (ids >= 3).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_zero_is_argmax_and_seeds_differ(backend):
    x = random_logits(32, V, seed=1)
    assert torch.equal(vtp.sample(x, seed=4, temperature=0.0, top_p=0.5, backend=backend), x.argmax(-1))
    a, b = (vtp.sample(x, seed=s, backend=backend) for s in (4, 5))
    assert not torch.equal(a, b)
    assert torch.equal(a, vtp.sample(x, seed=4, backend=backend))  # a function of the seed
    assert torch.equal(a, vtp.sample(x, seed=4 + 2**64, backend=backend))  # taken modulo 2**64


def test_eager_and_triton_give_the_same_tokens():
    """Same noise function, same keys up to the last bits of a logarithm: on these draws the
    two backends agree token for token (a near-tie could differ; none is here)."""
    x = random_logits(80, V, seed=3)
    for options in CASES:
        a = vtp.sample(x, seed=21, backend="eager", **options)
        b = vtp.sample(x, seed=21, backend="triton", **options)
        assert torch.equal(a, b), options


def test_triton_noise_is_the_reference_noise():
    """The Triton generator's bits: its keys at x = 0 are the torch function's Gumbel noise."""
    from vtp_runtime.backends.triton import TritonBackend
    from vtp_runtime.backends.triton.sampling import TritonKernels

    backend = TritonBackend()
    ids = torch.tensor([[0, 1, 2, 151935, 2**31 - 2], [7, 8, 9, 10, 11]])
    x = torch.zeros(ids.shape)
    fake = _FakeCall(temperature=1.0, row_offset=2**32 - 1)  # row numbers wrap: 2**32 - 1, then 0
    got = TritonKernels(backend.config_for(x.device)).candidate_keys(fake, x, ids, 12345, torch.zeros(2))
    rows = torch.tensor([2**32 - 1, 0])[:, None]
    want = sampling.gumbel_bits(sampling.uniform(sampling.noise_bits(12345, rows, ids)))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


class _FakeCall:
    def __init__(self, temperature, row_offset=0):
        self.options = {"temperature": temperature, "row_offset": row_offset}


def test_noise_is_uniform_and_independent_across_rows_and_ids():
    bits = sampling.noise_bits(7, torch.arange(64)[:, None], torch.arange(4096))
    w = sampling.uniform(bits)
    assert 0 < w.min() and w.max() < 1
    assert abs(w.mean().item() - 0.5) < 2e-3 and abs(w.var().item() - 1 / 12) < 1e-3
    corr = torch.corrcoef(torch.stack([w[:, :-1].reshape(-1), w[:, 1:].reshape(-1)]))[0, 1]
    assert abs(corr) < 0.01  # neighbouring ids
    corr = torch.corrcoef(torch.stack([w[:-1].reshape(-1), w[1:].reshape(-1)]))[0, 1]
    assert abs(corr) < 0.01  # neighbouring rows
    g = sampling.gumbel_bits(w) * sampling.LN2  # nats: Gumbel mean is Euler's gamma
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - math.pi**2 / 6) < 0.03


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_and_three_dimensional_logits(backend):
    x = random_logits(6, V, seed=8).view(2, 3, V)
    ids = vtp.sample(x, seed=3, top_k=5, backend=backend)
    assert ids.shape == (2, 3) and torch.equal(ids.view(-1), vtp.sample(x.view(6, V), seed=3, top_k=5, backend=backend))
    one = vtp.sample(x[0, 0], seed=3, backend=backend)
    assert one.shape == () and one == vtp.sample(x[0, :1], seed=3, backend=backend)[0]
    assert vtp.argmax(x[1, 2], backend=backend) == x[1, 2].argmax()
    view = x[:, :2]  # rows with no single stride
    assert torch.equal(
        vtp.sample(view, seed=9, backend=backend), vtp.sample(view.contiguous(), seed=9, backend=backend)
    )


def test_dtypes():
    x = random_logits(40, V, seed=4)
    want = vtp.sample(x, seed=1, backend="eager")
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        got = vtp.sample(x.to(dtype), seed=1, backend="eager")
        assert (got == want).float().mean() > 0.9  # rounding the logits moves a few draws
        assert torch.equal(vtp.argmax(x.to(dtype), backend="eager"), reference.argmax(x.to(dtype)))
    with pytest.raises(vtp.BackendUnavailable, match="dtype float64 not supported"):
        vtp.sample(x.double(), seed=1, backend="triton")


def test_new_seeds_do_not_add_plans():
    x = random_logits(4, V, seed=2)
    vtp.sample(x, seed=0, top_p=0.9, backend="eager")
    vtp.argmax(x, backend="eager")
    size = plan.size()
    for step in range(50):
        vtp.sample(x, seed=step, top_p=0.9, backend="eager")
        vtp.argmax(x, backend="eager")
    assert plan.size() == size


@pytest.mark.parametrize(
    "options,error,text",
    [
        ({"top_k": 0}, ValueError, "top_k must be an int >= 1"),
        ({"top_k": 2.0}, TypeError, "top_k must be an int >= 1"),
        ({"top_p": 0.0}, ValueError, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, ValueError, "top_p must be in (0, 1]"),
        ({"min_p": -0.1}, ValueError, "min_p must be in [0, 1]"),
        ({"temperature": -1.0}, ValueError, "temperature must be a finite number >= 0"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"seed": True}, TypeError, "seed must be an int"),
        ({"reduction": "sum"}, ValueError, "reduction does not apply"),
        ({"normalizer": 2.0}, ValueError, "normalizer does not apply"),
        ({"mask": torch.ones(3, dtype=torch.bool)}, TypeError, "unknown option(s) mask"),
    ],
)
def test_bad_options_raise_clearly(options, error, text):
    given = {"seed": 1, **options}
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        vtp.sample(torch.zeros(3, 5), **given)


def test_sampling_ops_are_not_losses_and_sample_takes_no_head():
    """sample's noise is keyed by the row of the whole call, so it takes logits only; argmax
    takes a Head (test_argmax_of_a_head)."""
    with pytest.raises(TypeError, match="returns token ids, not a loss"):
        vtp.loss("sample", torch.zeros(2, 5), seed=1)
    with pytest.raises(vtp.BackendUnavailable, match="head inputs not supported"):
        # a Head is outside sample's annotation on purpose: this checks the refusal
        vtp.sample(vtp.Head(torch.zeros(2, 4), torch.zeros(5, 4)), seed=1)  # type: ignore[arg-type]
    ex = vtp.explain("sample", torch.zeros(2, 5), seed=1, top_p=0.9)
    assert ex.backend == "triton" and ex.request.op == "sample"
    assert "`liger`" in str(ex) and "does not implement op 'sample'" in str(ex)


# -- the extremes: temperatures near 0 and huge, logits with a large offset -----------------------


def _kernels(backend: str) -> Any:
    if backend == "eager":
        from vtp_runtime.backends.eager.sampling import KERNELS

        return KERNELS
    from vtp_runtime.backends.triton import TritonBackend
    from vtp_runtime.backends.triton.sampling import TritonKernels

    return TritonKernels(TritonBackend().config_for(torch.device("cpu")))


EXTREME_LOGITS = [3.4e38, -3.4e38, 1e30, -1e30, 1e7, -1e7, 2.5, -1.0, 1e-30, -1e-45, 0.0, -math.inf, math.inf]
VALID_TEMPERATURES = [5e-324, 1e-44, 1e-38, 1e-3, 1.0, 1e20, 1e38, 1e300]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_key_of_a_finite_logit_is_finite(backend):
    """The keys, raw (relative to 0) or relative to the row's max, at every valid temperature:
    finite for every finite logit, the logit itself where it is infinite."""
    x = torch.tensor([EXTREME_LOGITS, EXTREME_LOGITS[::-1]])
    ids = torch.arange(x.shape[1]).expand_as(x).contiguous()
    finite = torch.isfinite(x)
    for t in VALID_TEMPERATURES:
        for anchor in (torch.zeros(2), torch.full((2,), 3.4e38)):
            keys = _kernels(backend).candidate_keys(_FakeCall(temperature=t), x, ids, 9, anchor)
            assert torch.isfinite(keys[finite]).all(), (t, anchor[0].item(), keys)
            assert torch.equal(keys[~finite], x[~finite]), (t, keys)


def _tiny_cases(backend: str) -> list[dict[str, Any]]:
    return [{}, {"top_k": 3}, {"top_p": 0.9}, {"min_p": 0.5}] if backend == "eager" or FULL else [{}, {"top_p": 0.9}]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_temperatures_draw_the_argmax(backend):
    """As T -> 0 the draw is the argmax. The key x log2(e) / T overflowed fp32: at T = 1e-44
    every positive logit tied at +inf (id 0 won every row)."""
    x = random_logits(12, V, seed=12, scale=3.0)  # no ties; logits up to about 9
    for t in (1e-38, 1e-44, 5e-324):
        for options in _tiny_cases(backend):
            got = vtp.sample(x, seed=5, temperature=t, backend=backend, **options)
            assert torch.equal(got, x.argmax(-1)), (t, options, got)


def test_tiny_temperatures_draw_tied_maxima_alike():
    """At any temperature > 0 tokens whose logits are equal have equal probability, so a draw
    at T = 1e-40 is uniform over a row's tied maxima (temperature=0 takes the lowest id); a
    logit 1e-6 below them has probability 0 there."""
    row = torch.zeros(V)
    row[[3, 11, 17]] = 5.0
    row[4] = 5.0 - 1e-6
    ids = vtp.sample(row.expand(3000, V), seed=1, temperature=1e-40, backend="eager")
    probs = torch.zeros(V, dtype=torch.float64)
    probs[[3, 11, 17]] = 1 / 3
    _check_draws(ids, probs)


@pytest.mark.parametrize("offset,draws", [(1e6, 100_000), (1e7, 20_000), (1e30, 20_000), (-1e30, 20_000)])
def test_a_flat_row_at_a_large_offset_is_uniform(offset, draws):
    """Keys formed on the raw logits lost the noise's resolution at a large offset (their
    rounding made ties, which the lowest id won): the chi-square test over 16 tokens caught
    it at 1e6 with 100,000 draws, beyond with 20,000."""
    ids = vtp.sample(torch.full((draws, 16), offset), seed=1, backend="eager")
    _check_draws(ids, torch.full((16,), 1 / 16, dtype=torch.float64))


OFFSET_CASES: list[tuple[dict[str, Any], float, float]] = [  # (options, scale, offset) of the logits
    ({}, 1.0, 1e6),
    ({"top_k": 8}, 1.0, -1e6),
    ({"top_p": 0.7, "temperature": 1e27}, 1e27, 1e30),
    ({"min_p": 0.1, "temperature": 0.5}, 1.0, 1e6),
    ({"top_p": 0.9, "min_p": 0.05}, 1.0, -1e6),
    ({"temperature": 1e30}, 1e30, 0.0),  # huge logits at a huge temperature: the distribution at T = 1
    ({"top_k": 6, "temperature": 1e-30}, 1e-30, 0.0),  # and tiny ones at a tiny temperature
]


@pytest.mark.parametrize(
    "options,scale,offset", OFFSET_CASES, ids=[f"{_options_id(o)}-{s}-{f}" for o, s, f in OFFSET_CASES]
)
def test_draws_at_extremes_follow_the_float64_distribution(options, scale, offset):
    row = random_logits(1, V, seed=5)[0] * scale + offset  # fp32: what the sampler reads
    ids = vtp.sample(row.expand(3000, V), seed=11, backend="eager", **options)
    _check_draws(ids, reference.sampling_distribution(row[None], **options)[0])


@pytest.mark.parametrize("temperature", [1e300, 1e40])
def test_a_huge_temperature_is_uniform_over_the_unmasked_tokens(temperature):
    """softmax(x / T) is uniform over the finite logits as T grows; -inf logits are never
    drawn (their key was NaN where log2(e) / T underflowed fp32)."""
    row = random_logits(1, 16, seed=3)[0] * 1e3
    row[[2, 9]] = -math.inf
    ids = vtp.sample(row.expand(4000, 16), seed=2, temperature=temperature, backend="eager")
    probs = torch.where(torch.isfinite(row), 1 / 14, 0.0).double()
    _check_draws(ids, probs)


def test_triton_draws_the_eager_tokens_at_extremes():
    """The two backends compute the same keys at extremes (interpreter: a few rows)."""
    for options, scale, offset in OFFSET_CASES if FULL else OFFSET_CASES[:3]:
        x = random_logits(6, V, seed=7) * scale + offset
        a = vtp.sample(x, seed=4, backend="eager", **options)
        assert torch.equal(vtp.sample(x, seed=4, backend="triton", **options), a), options
    flat = torch.full((6, 16), -1e30)
    assert torch.equal(vtp.sample(flat, seed=1, backend="triton"), vtp.sample(flat, seed=1, backend="eager"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_offset_numbers_the_rows(backend):
    """Rows split over two calls, the second numbered from row_offset, draw what one call on
    every row draws (as ranks holding other rows of one batch do)."""
    x = random_logits(10, V, seed=6)
    for options in ({}, {"top_k": 4}, {"top_p": 0.8}) if backend == "eager" or FULL else ({"top_p": 0.8},):
        whole = vtp.sample(x, seed=8, backend=backend, **options)
        split = torch.cat(
            [
                vtp.sample(x[:4], seed=8, backend=backend, **options),
                vtp.sample(x[4:], seed=8, row_offset=4, backend=backend, **options),
            ]
        )
        assert torch.equal(split, whole), options
    ids = vtp.sample(x[:8].repeat(2, 1), seed=8, backend=backend)  # the same logits in other rows ...
    assert not torch.equal(ids[:8], ids[8:])  # ... draw by their own noise


# -- GPU ---------------------------------------------------------------------------------------


def _check_draws_top(ids: torch.Tensor, probs: torch.Tensor, keep: int = 100) -> None:
    """``_check_draws`` with every token outside the ``keep`` most likely in one bin."""
    top = probs.topk(min(keep, probs.numel())).indices
    slot = torch.full((probs.numel(),), top.numel(), dtype=torch.int64)
    slot[top] = torch.arange(top.numel())
    _check_draws(slot[ids], torch.cat([probs[top], (1 - probs[top].sum()).clamp_min(0)[None]]))


@pytest.mark.gpu
@pytest.mark.parametrize("options", CASES, ids=_options_id)
def test_gpu_draws_follow_the_restricted_distribution(options):
    """The compiled kernels (fast logarithms) on CUDA, bf16 logits over a real vocabulary."""
    v = 151936
    row = (random_logits(1, v, seed=5)[0] * 2.5).bfloat16().cuda()
    ids = vtp.sample(row.expand(20000, v), seed=11, backend="triton", **options)
    probs = reference.sampling_distribution(row.float()[None], **options)[0]
    _check_draws_top(ids.cpu(), probs.cpu())


@pytest.mark.gpu
def test_gpu_argmax_and_temperature_zero():
    x = (torch.randn(300, 151936, device="cuda") * 3).bfloat16()
    x[:3] = torch.randint(0, 4, (3, 151936), device="cuda").bfloat16()  # ties
    assert torch.equal(vtp.argmax(x, backend="triton"), x.argmax(-1))
    assert torch.equal(vtp.sample(x, seed=1, temperature=0.0, backend="triton"), x.argmax(-1))
    assert torch.equal(vtp.sample(x, seed=1, backend="triton"), vtp.sample(x, seed=1, backend="triton"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options,scale,offset", OFFSET_CASES, ids=[f"{_options_id(o)}-{s}-{f}" for o, s, f in OFFSET_CASES]
)
def test_gpu_draws_at_extremes_follow_the_float64_distribution(options, scale, offset):
    """The compiled kernels (hardware lg2, denormals flushed) at extreme temperatures and
    offsets, fp32 logits."""
    row = random_logits(1, V, seed=5)[0] * scale + offset
    ids = vtp.sample(row.cuda().expand(20000, V), seed=11, backend="triton", **options)
    _check_draws(ids.cpu(), reference.sampling_distribution(row[None], **options)[0])


@pytest.mark.gpu
def test_gpu_flat_rows_tiny_temperatures_and_finite_keys():
    for offset in (1e6, 1e7, 1e30, -1e30):
        ids = vtp.sample(torch.full((20000, 16), offset, device="cuda"), seed=1, backend="triton")
        _check_draws(ids.cpu(), torch.full((16,), 1 / 16, dtype=torch.float64))
    x = random_logits(300, 4096, seed=12, scale=3.0).cuda()
    for t in (1e-38, 1e-44, 5e-324):
        assert torch.equal(vtp.sample(x, seed=5, temperature=t, backend="triton"), x.argmax(-1)), t
    from vtp_runtime.backends.triton import TritonBackend
    from vtp_runtime.backends.triton.sampling import TritonKernels

    kernels = TritonKernels(TritonBackend().config_for(torch.device("cuda")))
    z = torch.tensor([EXTREME_LOGITS, EXTREME_LOGITS[::-1]], device="cuda")
    ids = torch.arange(z.shape[1], device="cuda").expand_as(z).contiguous()
    for t in VALID_TEMPERATURES:
        for anchor in (torch.zeros(2, device="cuda"), torch.full((2,), 3.4e38, device="cuda")):
            keys = kernels.candidate_keys(_FakeCall(temperature=t), z, ids, 9, anchor)
            assert torch.isfinite(keys[torch.isfinite(z)]).all(), (t, keys)
