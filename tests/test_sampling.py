"""vtp.argmax and vtp.sample against the float64 dense reference on the full logits
(``vtp_runtime.testing.reference``), on one process and on gloo ranks with even, uneven,
empty and out-of-order shards, eager and triton (Triton's interpreter on CPU). The
interpreter is slow: by default triton's draws are tested against the distribution with
every restriction at once, its tokens on every shard layout for one set of options, and its
tokens against eager's for every option; ``VTP_TEST_DEPTH=full`` tests each option alone as
well, as for eager."""

import math
from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime import plans as plan
from vtp_runtime import sampling
from vtp_runtime.testing import conformance, reference
from vtp_runtime.testing.distributed import outcome

BACKENDS = ["eager", "triton"]

V = 23
# where each rank's shard starts and ends, as fractions of V
LAYOUTS = {
    "tp2_uneven": [(0, 0.4), (0.4, 1)],
    "tp3_reversed": [(0.65, 1), (0.17, 0.65), (0, 0.17)],  # explicit bounds, not in rank order
    "tp4_empty": [(0, 0.26), (0.26, 0.26), (0.26, 0.74), (0.74, 1)],
}


def _bounds(layout: str, rank: int, v: int) -> tuple[int, int]:
    a, b = LAYOUTS[layout][rank]
    return int(a * v), int(b * v)


def _shard(full: torch.Tensor, bounds) -> torch.Tensor:
    start, end = bounds
    return full[..., start:end]


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


def _logits(n: int = 6, v: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


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
DRAWS = [("eager", o) for o in CASES] + [("triton", o) for o in (CASES if FULL else [EVERY_RESTRICTION])]


def _options_id(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items()) or "plain"


@pytest.mark.parametrize("backend,options", DRAWS, ids=[f"{_options_id(o)}-{b}" for b, o in DRAWS])
def test_draws_follow_the_restricted_distribution(backend, options):
    """Many draws in one call (the same logits in every row: each row's noise is its own)
    against the float64 distribution, by chi-square at p = 1e-4."""
    n = 3000 if backend == "eager" else 500  # Triton runs in its (slow) interpreter here
    row = _logits(1, V, seed=5)[0]
    ids = vtp.sample(row.expand(n, V), seed=11, backend=backend, **options)
    assert ids.shape == (n,) and ids.dtype == torch.int64
    _check_draws(ids, reference.sampling_distribution(row[None], **options)[0])


def test_the_chi_square_check_can_fail():
    """The check above rejects draws from a distribution that forgot its restriction."""
    row = _logits(1, V, seed=5)[0]
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
    x = _logits(32, V, seed=1)
    assert torch.equal(vtp.sample(x, seed=4, temperature=0.0, top_p=0.5, backend=backend), x.argmax(-1))
    a, b = (vtp.sample(x, seed=s, backend=backend) for s in (4, 5))
    assert not torch.equal(a, b)
    assert torch.equal(a, vtp.sample(x, seed=4, backend=backend))  # a function of the seed
    assert torch.equal(a, vtp.sample(x, seed=4 + 2**64, backend=backend))  # taken modulo 2**64


def test_eager_and_triton_give_the_same_tokens():
    """Same noise function, same keys up to the last bits of a logarithm: on these draws the
    two backends agree token for token (a near-tie could differ; none is here)."""
    x = _logits(80, V, seed=3)
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
    x = _logits(6, V, seed=8).view(2, 3, V)
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
    x = _logits(40, V, seed=4)
    want = vtp.sample(x, seed=1, backend="eager")
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        got = vtp.sample(x.to(dtype), seed=1, backend="eager")
        assert (got == want).float().mean() > 0.9  # rounding the logits moves a few draws
        assert torch.equal(vtp.argmax(x.to(dtype), backend="eager"), reference.argmax(x.to(dtype)))
    with pytest.raises(vtp.BackendUnavailable, match="dtype float64 not supported"):
        vtp.sample(x.double(), seed=1, backend="triton")


def test_new_seeds_do_not_add_plans():
    x = _logits(4, V, seed=2)
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
    x = _logits(12, V, seed=12, scale=3.0)  # no ties; logits up to about 9
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
    row = _logits(1, V, seed=5)[0] * scale + offset  # fp32: what the sampler reads
    ids = vtp.sample(row.expand(3000, V), seed=11, backend="eager", **options)
    _check_draws(ids, reference.sampling_distribution(row[None], **options)[0])


@pytest.mark.parametrize("temperature", [1e300, 1e40])
def test_a_huge_temperature_is_uniform_over_the_unmasked_tokens(temperature):
    """softmax(x / T) is uniform over the finite logits as T grows; -inf logits are never
    drawn (their key was NaN where log2(e) / T underflowed fp32)."""
    row = _logits(1, 16, seed=3)[0] * 1e3
    row[[2, 9]] = -math.inf
    ids = vtp.sample(row.expand(4000, 16), seed=2, temperature=temperature, backend="eager")
    probs = torch.where(torch.isfinite(row), 1 / 14, 0.0).double()
    _check_draws(ids, probs)


def test_triton_draws_the_eager_tokens_at_extremes():
    """The two backends compute the same keys at extremes (interpreter: a few rows)."""
    for options, scale, offset in OFFSET_CASES if FULL else OFFSET_CASES[:3]:
        x = _logits(6, V, seed=7) * scale + offset
        a = vtp.sample(x, seed=4, backend="eager", **options)
        assert torch.equal(vtp.sample(x, seed=4, backend="triton", **options), a), options
    flat = torch.full((6, 16), -1e30)
    assert torch.equal(vtp.sample(flat, seed=1, backend="triton"), vtp.sample(flat, seed=1, backend="eager"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_offset_numbers_the_rows(backend):
    """Rows split over two calls, the second numbered from row_offset, draw what one call on
    every row draws (as ranks holding other rows of one batch do)."""
    x = _logits(10, V, seed=6)
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


# -- gloo ranks --------------------------------------------------------------------------------


def _call(rank, group, x, layout, fn):
    bounds = _bounds(layout, rank, x.shape[-1])
    kw = {"vocab_start": bounds[0], "vocab_end": bounds[1]} if layout == "tp3_reversed" else {}
    return fn(_shard(x, bounds), tp_group=group, **kw)


RANK_CASES = [{}, {"top_k": 5}, {"top_p": 0.7}, {"min_p": 0.1}, {"top_k": 7, "top_p": 0.8, "min_p": 0.05}]
# what each backend samples on every layout: triton in its interpreter every restriction at once
LAYOUT_CASES = {"eager": RANK_CASES, "triton": RANK_CASES if FULL else RANK_CASES[-1:]}


def _layout_logits(n: int, v: int, device: str) -> torch.Tensor:
    x = _logits(n, v, seed=13)
    x[:4] = torch.randint(0, 3, (4, v), generator=torch.Generator().manual_seed(1)).float()  # ties across shards
    return x.to(device)


def layout_job(rank, world, group, layout, backend, cases, n=40, v=V, device="cpu", dtype=torch.float32):
    """argmax and every case on this layout: the ids of every rank, to compare with one process."""
    x = _layout_logits(n, v, device).to(dtype)
    out: dict[str | int, torch.Tensor] = {
        "argmax": _call(rank, group, x, layout, lambda z, **kw: vtp.argmax(z, backend=backend, **kw))
    }
    for i, options in enumerate(cases):
        out[i] = _call(
            rank, group, x, layout, lambda z, o=options, **kw: vtp.sample(z, seed=77, backend=backend, **o, **kw)
        )
    return {k: t.cpu() for k, t in out.items()}


def _check_layout(results, backend, cases, n=40, v=V, device="cpu", dtype=torch.float32):
    x = _layout_logits(n, v, device).to(dtype)
    assert all(torch.equal(r[key], results[0][key]) for r in results for key in results[0])
    assert torch.equal(results[0]["argmax"], reference.argmax(x).cpu())
    for i, options in enumerate(cases):
        assert torch.equal(results[0][i], vtp.sample(x, seed=77, backend=backend, **options).cpu()), options


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_same_tokens_on_every_rank_and_every_layout(ranks, layout, backend):
    """TP 2, 3 and 4 (uneven, out of rank order, an empty shard) give the tokens of one process."""
    results = ranks(len(LAYOUTS[layout]), layout_job, layout, backend, LAYOUT_CASES[backend], timeout=300)
    _check_layout(results, backend, LAYOUT_CASES[backend])


def misuse_job(rank, world, group):
    """Bad calls on one rank or all, each followed by nothing stuck: then a normal call."""
    x = _logits(8, V, seed=6)
    z = _shard(x, _bounds("tp2_uneven", rank, V))
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = ("no error", "")
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc))

    bad = rank == 1
    attempt("top_k", lambda: vtp.sample(z, seed=1, top_k=0 if bad else 3, tp_group=group, backend="eager"))
    attempt("top_p", lambda: vtp.sample(z, seed=1, top_p=1.5, tp_group=group, backend="eager"))
    attempt("temperature", lambda: vtp.sample(z, seed=1, temperature=-1.0 if bad else 1.0, tp_group=group))
    # a float seed on one rank on purpose (the TypeError and the other rank's ShardError are checked)
    attempt("seed_type", lambda: vtp.sample(z, seed=1.0 if bad else 1, tp_group=group, backend="eager"))  # type: ignore[arg-type]
    attempt("options", lambda: vtp.sample(z, seed=1, top_p=0.5 if bad else 0.6, tp_group=group, backend="eager"))
    for backend in BACKENDS:
        vtp.sample(z, seed=1, tp_group=group, backend=backend)  # planned: later seeds are per-call data
        attempt(f"seed_{backend}", lambda b=backend: vtp.sample(z, seed=2 + rank, tp_group=group, backend=b))
        vtp.sample(z, seed=1, top_k=3, tp_group=group, backend=backend)
        attempt(f"seed_topk_{backend}", lambda b=backend: vtp.sample(z, seed=rank, top_k=3, tp_group=group, backend=b))
    healthy = vtp.sample(z, seed=5, top_p=0.9, tp_group=group, backend="eager")
    return out, healthy, torch.equal(vtp.argmax(z, tp_group=group), x.argmax(-1))


def test_bad_input_raises_on_every_rank_and_nothing_hangs(ranks):
    results = ranks(2, misuse_job, timeout=300)
    (out0, healthy0, ok0), (out1, healthy1, ok1) = results
    assert ok0 and ok1 and torch.equal(healthy0, healthy1)
    x = _logits(8, V, seed=6)
    assert torch.equal(healthy0, vtp.sample(x, seed=5, top_p=0.9, backend="eager"))
    assert out1["top_k"][0] == "ValueError" and out0["top_k"][0] == "ShardError" and "rank 1" in out0["top_k"][1]
    assert out0["top_p"] == out1["top_p"] and out0["top_p"][0] == "ValueError"
    assert out1["temperature"][0] == "ValueError" and out0["temperature"][0] == "ShardError"
    assert out1["seed_type"][0] == "TypeError" and out0["seed_type"][0] == "ShardError"
    for out in (out0, out1):
        assert out["options"][0] == "ShardError" and "top_p: rank 0 = 0.6, rank 1 = 0.5" in out["options"][1]
        for key in ("seed_eager", "seed_triton", "seed_topk_eager", "seed_topk_triton"):
            kind, msg = out[key]
            assert kind == "ShardError" and "disagree on sample's seed" in msg, (key, kind, msg)
    assert "rank 0 = 2, rank 1 = 3" in out0["seed_eager"][1]


EXTREME_LAYOUTS = {"tp2_uneven": [(0, 0.4), (0.4, 1)], "tp3_empty": [(0, 0.4), (0.4, 0.4), (0.4, 1)]}
# what the ranks sample at the extremes (options, scale, offset), both backends on every layout
EXTREME_RANK_CASES: list[tuple[dict[str, Any], float, float]] = [
    ({"temperature": 1e-40}, 1.0, 0.0),
    ({"temperature": 1e-40, "top_p": 0.9}, 1.0, 0.0),
    ({}, 1.0, 1e7),
    ({"top_p": 0.8}, 1.0, -1e7),
    ({"min_p": 0.05}, 1e29, -1e30),
    ({"top_k": 5, "temperature": 1e300}, 1e30, 0.0),
]


def _extreme_logits(n: int, scale: float, offset: float) -> torch.Tensor:
    x = _layout_logits(n, V, "cpu") * scale + offset  # fp32: ties across shards where the offset rounds
    x[:, 2::7] = -math.inf  # a masked vocabulary
    return x


def extremes_job(rank, world, group, layout, backend, cases, n):
    """Each extreme case on this layout, and the rows split over two calls (row_offset)."""
    a, b = EXTREME_LAYOUTS[layout][rank]
    bounds = (int(a * V), int(b * V))
    out = []
    for options, scale, offset in cases:
        z = _shard(_extreme_logits(n, scale, offset), bounds)
        whole = vtp.sample(z, seed=31, tp_group=group, backend=backend, **options)
        k = n // 2
        parts = [
            vtp.sample(z[:k], seed=31, tp_group=group, backend=backend, **options),
            vtp.sample(z[k:], seed=31, row_offset=k, tp_group=group, backend=backend, **options),
        ]
        out.append((whole, torch.cat(parts)))
    return out


EXTREME_CASES = {"eager": EXTREME_RANK_CASES, "triton": EXTREME_RANK_CASES if FULL else EXTREME_RANK_CASES[1::2]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", list(EXTREME_LAYOUTS))
def test_extremes_give_the_same_tokens_on_every_layout(ranks, layout, backend):
    """Tiny and huge temperatures, large offsets, masked tokens: the tokens of one process on
    every rank, at TP 2 (uneven) and 3 (an empty shard); rows split over two calls by
    row_offset draw the same."""
    n = 16 if backend == "eager" else 6
    cases = EXTREME_CASES[backend]
    results = ranks(len(EXTREME_LAYOUTS[layout]), extremes_job, layout, backend, cases, n, timeout=300)
    for i, (options, scale, offset) in enumerate(cases):
        want = vtp.sample(_extreme_logits(n, scale, offset), seed=31, backend=backend, **options)
        for result in results:
            whole, split = result[i]
            assert torch.equal(whole, want) and torch.equal(split, want), (options, scale, offset)


def dtensor_job(rank, world, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = DeviceMesh("cpu", list(range(world)))
    x = _logits(2 * 5, 9, seed=9).view(2, 5, 9)  # V=9 on 2 ranks: torch's chunks 5 + 4
    dt = DTensor.from_local(
        x[..., rank * 5 : (rank + 1) * 5], mesh, [Shard(2)], run_check=False, shape=x.shape, stride=x.stride()
    )
    ids = vtp.sample(dt, seed=3, top_k=4, backend="eager")
    top = vtp.argmax(dt)
    assert isinstance(ids, DTensor) and ids.placements == (Replicate(),) and ids.shape == (2, 5)
    assert isinstance(top, DTensor)
    return ids.to_local(), top.to_local()


def test_dtensor_logits(ranks):
    results = ranks(2, dtensor_job, timeout=120)
    x = _logits(2 * 5, 9, seed=9).view(2, 5, 9)
    for ids, top in results:
        assert torch.equal(ids, vtp.sample(x, seed=3, top_k=4, backend="eager"))
        assert torch.equal(top, x.argmax(-1))


def dp_tp_job(rank, world, group):
    """A (dp=2, tp=2) mesh: logits [4, 3, 9] sharded over the batch (dp) and the vocabulary
    (tp, 5 + 4), the two batch halves equal. Ids of the DTensor, and of plain local tensors
    numbered by row_offset; then a batch sharded past the first dimension, refused on every
    rank, and a normal call."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh("cpu", torch.arange(world).view(2, 2), mesh_dim_names=("dp", "tp"))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    dp, tp = coordinate
    tp_group = mesh.get_group("tp")
    x = _logits(6, 9, seed=10).view(2, 3, 9).repeat(2, 1, 1)  # [4, 3, 9]: batch rows 2, 3 = rows 0, 1
    cols = slice(0, 5) if tp == 0 else slice(5, 9)
    local = x[2 * dp : 2 * dp + 2, :, cols]
    dt = DTensor.from_local(local, mesh, [Shard(0), Shard(2)], run_check=False, shape=x.shape, stride=x.stride())
    out: dict[str, Any] = {}
    for name, options in (("plain", {}), ("top_k", {"top_k": 3}), ("top_p", {"top_p": 0.8})):
        ids = vtp.sample(dt, seed=5, **options)
        assert isinstance(ids, DTensor)
        out[name] = ids.full_tensor()
        out[name + "_local"] = vtp.sample(local, seed=5, row_offset=6 * dp, tp_group=tp_group, **options)
    top = vtp.argmax(dt)
    assert isinstance(top, DTensor)
    out["argmax"] = top.full_tensor()
    rows = slice(0, 2) if dp == 0 else slice(2, 3)  # the sequence (dim 1, of 3) sharded: 2 + 1
    by_sequence = DTensor.from_local(
        x[:, rows, cols], mesh, [Shard(1), Shard(2)], run_check=False, shape=x.shape, stride=x.stride()
    )
    refused = outcome(lambda: vtp.sample(by_sequence, seed=5))
    after = vtp.sample(dt, seed=5)
    assert isinstance(after, DTensor)
    return out, refused, after.full_tensor()


def test_a_dtensor_numbers_its_rows_over_the_global_batch(ranks):
    """vtp.sample(dtensor).full_tensor() is vtp.sample(full_logits): each batch shard draws
    its global rows (two shards holding equal logits draw differently); plain tensors on the
    data-parallel ranks do the same with row_offset."""
    x = _logits(6, 9, seed=10).view(2, 3, 9).repeat(2, 1, 1)
    results = ranks(4, dp_tp_job, timeout=180)
    for name, options in (("plain", {}), ("top_k", {"top_k": 3}), ("top_p", {"top_p": 0.8})):
        want = vtp.sample(x, seed=5, **options)
        assert not torch.equal(want[:2], want[2:])  # equal logits, other rows: other tokens
        for r, (out, _, _) in enumerate(results):
            assert torch.equal(out[name], want), (name, r)
            dp = r // 2
            assert torch.equal(out[name + "_local"], want[2 * dp : 2 * dp + 2]), (name, r)
    for out, (kind, msg), after in results:
        assert torch.equal(out["argmax"], x.argmax(-1))
        assert kind == "ValueError" and "not one run of the global rows" in msg, (kind, msg)
        assert torch.equal(after, vtp.sample(x, seed=5))


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
    row = (_logits(1, v, seed=5)[0] * 2.5).bfloat16().cuda()
    ids = vtp.sample(row.expand(20000, v), seed=11, backend="triton", **options)
    probs = reference.sampling_distribution(row.float()[None], **options)[0]
    _check_draws_top(ids.cpu(), probs.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_same_tokens_at_every_layout(ranks, layout):
    """TP 2, 3, 4 as processes sharing cuda:0 over gloo, V = 151936, bf16: the tokens of one process."""
    kw = {"n": 64, "v": 151936, "device": "cuda", "dtype": torch.bfloat16}
    results = ranks(len(LAYOUTS[layout]), layout_job, layout, "triton", RANK_CASES, timeout=600, **kw)
    _check_layout(results, "triton", RANK_CASES, **kw)


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
    row = _logits(1, V, seed=5)[0] * scale + offset
    ids = vtp.sample(row.cuda().expand(20000, V), seed=11, backend="triton", **options)
    _check_draws(ids.cpu(), reference.sampling_distribution(row[None], **options)[0])


@pytest.mark.gpu
def test_gpu_flat_rows_tiny_temperatures_and_finite_keys():
    for offset in (1e6, 1e7, 1e30, -1e30):
        ids = vtp.sample(torch.full((20000, 16), offset, device="cuda"), seed=1, backend="triton")
        _check_draws(ids.cpu(), torch.full((16,), 1 / 16, dtype=torch.float64))
    x = _logits(300, 4096, seed=12, scale=3.0).cuda()
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


def head_argmax_job(rank, world, group, backend):
    """argmax of a Head (hidden [2, 7, 6], weight rows split unevenly, chunks of 3 tokens)
    on every rank, and the dense argmax of the full logits in float64."""
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, 7, 6, generator=g)
    weight = torch.randn(23, 6, generator=g)
    bias = torch.randn(23, generator=g)
    weight[5] = weight[17]  # a tie across the shards: the lowest id wins
    bias[5] = bias[17]
    start, end = (0, 9) if rank == 0 else (9, 23)
    head = vtp.Head(hidden, weight[start:end], bias[start:end], chunk_rows=3)
    got = vtp.argmax(head, tp_group=group, backend=backend)
    want = (hidden.double() @ weight.double().T + bias.double()).argmax(-1)
    return got, want


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_argmax_of_a_head(ranks, backend):
    """argmax straight from the hidden states, the logits formed one token chunk at a time:
    the dense argmax of hidden @ W.T + b on every rank."""
    for got, want in ranks(2, head_argmax_job, backend, timeout=120):
        assert torch.equal(got, want)


def sequence_parallel_argmax_job(rank, world, group):
    """argmax of a sequence-parallel Head: refused with its reason on every rank, then a
    normal call."""
    hidden = torch.randn(3, 6)  # this rank's token shard
    weight = torch.randn(11, 6)
    try:
        vtp.argmax(vtp.Head(hidden, weight, sequence_parallel=True), tp_group=group)
    except Exception as exc:  # the test compares what each rank raised
        got = f"{type(exc).__name__}: {exc}"
    else:
        got = "no error"
    return got, vtp.argmax(torch.randn(3, 11, generator=torch.Generator().manual_seed(3)), tp_group=group)


def test_argmax_refuses_a_sequence_parallel_head(ranks):
    """argmax takes a Head chunk by chunk over this rank's hidden rows; a sequence-parallel
    Head (each rank a shard of the tokens) it refuses rather than answering for a shard."""
    results = ranks(2, sequence_parallel_argmax_job, timeout=120)
    for got, _ in results:
        assert "sequence-parallel head inputs not supported" in got, got
    assert torch.equal(results[0][1], results[1][1])
