"""quant/observer.py — observers, qparams, quantize/dequantize, against numpy references written
here (and, where torch.ao's own observers answer sanely, against those too)."""
import io
import itertools
import pickle
import warnings

import numpy as np
import pytest
import torch

from cpu_opt.quant.observer import (HistogramObserver, MinMaxObserver, MovingAverageMinMaxObserver, Observer,
                                    ObserverFactory, PerChannelAbsMaxObserver, PerChannelMinMaxObserver,
                                    PlaceholderObserver, choose_qparams, dequantize, quant_range, quantize)

EPS = np.float32(np.finfo(np.float32).eps)
DTYPES = [torch.quint8, torch.qint8]
PER_TENSOR = [torch.per_tensor_affine, torch.per_tensor_symmetric]
PER_CHANNEL = [torch.per_channel_affine, torch.per_channel_symmetric]
RANGES = {(torch.quint8, False): (0, 255), (torch.quint8, True): (0, 127),
          (torch.qint8, False): (-128, 127), (torch.qint8, True): (-64, 63)}


# ---------------------------------------------------------------------------------------------
# numpy references

def ref_qparams(lo, hi, dtype, qscheme, reduce_range):
    """torch.ao's _calculate_qparams in numpy float32 (elementwise), except the quint8 symmetric
    zero point on a reduced range: the range's midpoint 64 (torch answers 128, outside 0..127)."""
    qmin, qmax = RANGES[(dtype, reduce_range)]
    lo = np.minimum(np.asarray(lo, np.float32), np.float32(0))
    hi = np.maximum(np.asarray(hi, np.float32), np.float32(0))
    if qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric):
        bound = np.maximum(-lo, hi)
        scale = np.maximum(bound / np.float32((qmax - qmin) / 2), EPS).astype(np.float32)
        zp = np.full(scale.shape, 0 if dtype == torch.qint8 else {255: 128, 127: 64}[qmax], np.int64)
    else:
        scale = np.maximum((hi - lo) / np.float32(qmax - qmin), EPS).astype(np.float32)
        zp = np.clip(qmin - np.round(lo / scale).astype(np.int64), qmin, qmax)
    return scale, zp


def ref_quantize(x, scale, zp, qmin, qmax):
    return np.clip(np.round(x / scale) + zp, qmin, qmax)


def l2_error(x, scale, zp, qmin, qmax):
    x = x.astype(np.float64)
    q = ref_quantize(x, np.float64(scale), zp, qmin, qmax)
    return float(np.sum(((q - zp) * np.float64(scale) - x) ** 2))


def batches(seed, n=4, shape=(64, 32), shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (0.5 + i) + shift * i for i in range(n)]


def assert_qparams(got, expected):
    scale, zp = got
    assert scale.dtype == torch.float32 and zp.dtype == torch.int64
    np.testing.assert_allclose(scale.numpy(), expected[0], rtol=1e-6, atol=0)
    np.testing.assert_array_equal(zp.numpy(), expected[1])


# ---------------------------------------------------------------------------------------------
# ranges

@pytest.mark.parametrize("dtype,reduce_range", list(RANGES))
def test_quant_range_follows_torch_convention(dtype, reduce_range):
    assert quant_range(dtype, reduce_range) == RANGES[(dtype, reduce_range)]
    obs = MinMaxObserver(dtype=dtype, reduce_range=reduce_range)
    assert (obs.qmin, obs.qmax) == (obs.quant_min, obs.quant_max) == RANGES[(dtype, reduce_range)]


def test_custom_quant_range():
    obs = MinMaxObserver(dtype=torch.qint8, quant_min=-127, quant_max=127)
    obs(torch.tensor([-1.0, 2.0]))
    scale, zp = obs.calculate_qparams()
    assert (obs.qmin, obs.qmax) == (-127, 127)
    assert scale.item() == pytest.approx(3.0 / 254) and zp.item() == -127 + round(1.0 / (3.0 / 254))


# ---------------------------------------------------------------------------------------------
# min-max observers against numpy

DATA_KINDS = ["mixed", "positive", "negative", "zeros"]


def make_data(kind, seed):
    xs = batches(seed, shift=0.3)
    if kind == "positive":
        xs = [x.abs() + 0.25 for x in xs]
    elif kind == "negative":
        xs = [-x.abs() - 0.25 for x in xs]
    elif kind == "zeros":
        xs = [torch.zeros_like(x) for x in xs]
    return xs


@pytest.mark.parametrize("kind", DATA_KINDS)
@pytest.mark.parametrize("dtype,qscheme,reduce_range", itertools.product(DTYPES, PER_TENSOR, [False, True]))
def test_minmax_observer_matches_numpy(dtype, qscheme, reduce_range, kind):
    xs = make_data(kind, seed=1)
    obs = MinMaxObserver(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
    for x in xs:
        assert obs(x) is x
    data = np.concatenate([x.numpy().ravel() for x in xs])
    scale, zp = obs.calculate_qparams()
    assert scale.shape == () and zp.shape == ()
    assert_qparams((scale, zp), ref_qparams(data.min(), data.max(), dtype, qscheme, reduce_range))
    assert obs.min_val.item() == data.min() and obs.max_val.item() == data.max()


@pytest.mark.parametrize("dtype,qscheme,reduce_range", itertools.product(DTYPES, PER_TENSOR, [False, True]))
def test_moving_average_matches_hand_ema(dtype, qscheme, reduce_range):
    c = 0.2
    xs = batches(2, n=6, shift=0.5)
    obs = MovingAverageMinMaxObserver(averaging_constant=c, dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
    lo, hi = float(xs[0].min()), float(xs[0].max())       # the first batch sets the range
    for i, x in enumerate(xs):
        obs(x)
        if i:
            lo += c * (float(x.min()) - lo)
            hi += c * (float(x.max()) - hi)
    assert obs.min_val.item() == pytest.approx(lo, rel=1e-6)
    assert obs.max_val.item() == pytest.approx(hi, rel=1e-6)
    assert abs(lo - float(min(x.min() for x in xs))) > 0.1   # the EMA is not the running min
    assert_qparams(obs.calculate_qparams(), ref_qparams(obs.min_val.item(), obs.max_val.item(), dtype, qscheme,
                                                        reduce_range))
    np.testing.assert_allclose(obs.calculate_qparams()[0].numpy(),
                               ref_qparams(lo, hi, dtype, qscheme, reduce_range)[0], rtol=1e-5)


@pytest.mark.parametrize("shape,ch_axis", [((8, 4, 3, 3), 0), ((2, 5, 6), -1), ((3, 7, 2), 1)])
@pytest.mark.parametrize("dtype,qscheme,reduce_range", itertools.product(DTYPES, PER_CHANNEL, [False, True]))
def test_per_channel_minmax_matches_numpy(dtype, qscheme, reduce_range, shape, ch_axis):
    xs = batches(3, n=3, shape=shape, shift=0.2)
    xs[1] = xs[1].clone()
    xs[1].select(ch_axis, 0).abs_()                        # one all-positive channel in a batch
    obs = PerChannelMinMaxObserver(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
    for x in xs:
        assert obs(x) is x
    data = np.stack([x.numpy() for x in xs])              # batch axis in front
    axis = ch_axis % len(shape) + 1
    other = tuple(d for d in range(data.ndim) if d != axis)
    lo, hi = data.min(axis=other), data.max(axis=other)
    scale, zp = obs.calculate_qparams()
    assert scale.shape == zp.shape == (shape[ch_axis],)
    assert_qparams((scale, zp), ref_qparams(lo, hi, dtype, qscheme, reduce_range))


@pytest.mark.parametrize("dtype,qscheme,reduce_range", [
    c for c in itertools.product(DTYPES, PER_TENSOR, [False, True])
    if not (c[0] == torch.quint8 and c[1] == torch.per_tensor_symmetric and c[2])])   # torch: zp 128 on 0..127
def test_minmax_agrees_with_torch_ao(dtype, qscheme, reduce_range):
    tq = pytest.importorskip("torch.ao.quantization.observer")
    xs = batches(4, shift=0.4)
    ours = MinMaxObserver(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
    per_channel_qscheme = {torch.per_tensor_affine: torch.per_channel_affine,
                           torch.per_tensor_symmetric: torch.per_channel_symmetric}[qscheme]
    ours_pc = PerChannelMinMaxObserver(ch_axis=1, dtype=dtype, qscheme=per_channel_qscheme, reduce_range=reduce_range)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = tq.MinMaxObserver(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
        theirs_pc = tq.PerChannelMinMaxObserver(ch_axis=1, dtype=dtype, qscheme=per_channel_qscheme,
                                                reduce_range=reduce_range)
        for x in xs:
            ours(x), theirs(x), ours_pc(x), theirs_pc(x)
        pairs = [(ours.calculate_qparams(), theirs.calculate_qparams()),
                 (ours_pc.calculate_qparams(), theirs_pc.calculate_qparams())]
    for (s, z), (ts, tz) in pairs:
        torch.testing.assert_close(s.reshape(-1), ts.reshape(-1).float(), rtol=1e-6, atol=0)
        assert torch.equal(z.reshape(-1), tz.reshape(-1).long())


def test_choose_qparams_is_the_observer_formula():
    lo, hi = torch.tensor([-1.0, 0.5, -3.0]), torch.tensor([2.0, 4.0, -1.0])
    for dtype, qscheme in itertools.product(DTYPES, PER_CHANNEL):
        got = choose_qparams(lo, hi, dtype=dtype, qscheme=qscheme, reduce_range=True)
        assert_qparams(got, ref_qparams(lo.numpy(), hi.numpy(), dtype, qscheme, True))


# ---------------------------------------------------------------------------------------------
# histogram observer

def outlier_data(seed=0, n=500_000):
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(n).astype(np.float32)
    data[:2] = [40.0, -25.0]          # two far outliers: clipping them is L2-optimal at this n
    return data


def test_histogram_l2_affine_near_brute_force_and_clips_outliers():
    data = outlier_data()
    obs = HistogramObserver(method="l2")
    for chunk in np.array_split(data, 4):                  # several batches: the range grows
        obs(torch.from_numpy(chunk.copy()))
    qmin, qmax = 0, 255
    scale, zp = obs.calculate_qparams()
    ours = l2_error(data, scale.item(), zp.item(), qmin, qmax)
    # brute force over clipping ranges: quantize-dequantize the data itself for each candidate
    los = np.concatenate([np.linspace(-7.0, -2.5, 10), [-10.0, -15.0, data.min()]])
    his = np.concatenate([np.linspace(2.5, 7.0, 10), [10.0, 15.0, 20.0, 30.0, data.max()]])
    errors = {}
    for lo, hi in itertools.product(los, his):
        s, z = ref_qparams(lo, hi, torch.quint8, torch.per_tensor_affine, False)
        errors[(lo, hi)] = l2_error(data, s, int(z), qmin, qmax)
    best = min(errors.values())
    no_clip = errors[(data.min(), data.max())]
    assert best < 0.5 * no_clip                            # the data does reward clipping
    assert ours <= 1.15 * best, (ours, best, obs.clipping_range())
    lo, hi = obs.clipping_range()
    assert -25.0 < lo < -2.5 and 2.5 < hi < 40.0           # both outliers clipped, the bulk kept
    assert_qparams((scale, zp), ref_qparams(lo, hi, torch.quint8, torch.per_tensor_affine, False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_histogram_l2_symmetric_near_brute_force(dtype):
    data = outlier_data(seed=1)
    obs = HistogramObserver(method="l2", dtype=dtype, qscheme=torch.per_tensor_symmetric)
    obs(torch.from_numpy(data))
    qmin, qmax = RANGES[(dtype, False)]
    scale, zp = obs.calculate_qparams()
    ours = l2_error(data, scale.item(), zp.item(), qmin, qmax)
    errors = []
    for t in np.concatenate([np.linspace(2.0, 8.0, 61), [40.0]]):
        s, z = ref_qparams(-t, t, dtype, torch.per_tensor_symmetric, False)
        errors.append(l2_error(data, s, int(z), qmin, qmax))
    assert min(errors) < 0.5 * errors[-1]
    assert ours <= 1.1 * min(errors)
    assert 2.0 < obs.clipping_range()[1] < 25.0


def test_histogram_l2_keeps_the_range_of_outlier_free_data():
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(5)) * 4 - 1   # uniform: nothing to clip
    obs = HistogramObserver()
    obs(x)
    lo, hi = obs.clipping_range()
    spread = (x.max() - x.min()).item()
    # at most a sliver clipped (clipping the ends of a uniform a little does lower the L2 error)
    assert lo <= x.min().item() + 0.01 * spread and hi >= x.max().item() - 0.01 * spread


@pytest.mark.parametrize("percentile", [99.0, 99.9, 99.99])
@pytest.mark.parametrize("n_batches", [1, 5])
def test_histogram_percentile_matches_numpy(percentile, n_batches):
    rng = np.random.default_rng(7)
    data = np.concatenate([rng.standard_normal(60_000), rng.exponential(3.0, 20_000)]).astype(np.float32)
    rng.shuffle(data)
    obs = HistogramObserver(method="percentile", percentile=percentile)
    chunks = np.array_split(data, n_batches)
    chunks[-1] = chunks[-1] * 1.0
    for chunk in chunks:
        obs(torch.from_numpy(np.ascontiguousarray(chunk)))
    assert obs.histogram.sum().item() == pytest.approx(data.size)
    width = (data.max() - data.min()) / obs.bins
    lo, hi = obs.clipping_range()
    ref_lo, ref_hi = np.percentile(data.astype(np.float64), [100 - percentile, percentile])
    tolerance = width if n_batches == 1 else 2 * width    # re-binning as the range grows smears by a bin
    assert abs(lo - ref_lo) <= tolerance and abs(hi - ref_hi) <= tolerance, (lo, ref_lo, hi, ref_hi, width)
    assert_qparams(obs.calculate_qparams(), ref_qparams(lo, hi, torch.quint8, torch.per_tensor_affine, False))


def test_histogram_growth_keeps_counts_in_place():
    obs = HistogramObserver(bins=100)
    obs(torch.linspace(0, 1, 1001))
    obs(torch.tensor([-1.0, 3.0]))                         # range 0..1 -> -1..3
    assert obs.min_val.item() == -1.0 and obs.max_val.item() == 3.0
    h = obs.histogram
    assert h.sum().item() == pytest.approx(1003)
    assert h[25:50].sum().item() == pytest.approx(1001, abs=1e-6)   # [0, 1] is bins 25..49 of the new range
    assert h[0].item() == 1 and h[99].item() == 1


def test_histogram_constant_input():
    obs = HistogramObserver()
    obs(torch.full((10,), 2.0))
    assert_qparams(obs.calculate_qparams(), ref_qparams(2.0, 2.0, torch.quint8, torch.per_tensor_affine, False))
    obs(torch.tensor([-2.0]))
    assert obs.histogram.sum().item() == 11 and obs.histogram[-1].item() == 10


# ---------------------------------------------------------------------------------------------
# SmoothQuant statistics, placeholder

def test_per_channel_abs_max():
    xs = batches(8, n=3, shape=(2, 5, 6))
    obs = PerChannelAbsMaxObserver()
    for x in xs:
        assert obs(x) is x
    ref = np.abs(np.stack([x.numpy() for x in xs])).max(axis=(0, 1, 2))
    np.testing.assert_array_equal(obs.abs_max().numpy(), ref)
    obs.abs_max().zero_()                                   # a copy: the statistics are untouched
    np.testing.assert_array_equal(obs.abs_max().numpy(), ref)
    obs0 = PerChannelAbsMaxObserver(ch_axis=1)
    obs0(xs[0])
    np.testing.assert_array_equal(obs0.abs_max().numpy(), np.abs(xs[0].numpy()).max(axis=(0, 2)))
    with pytest.raises(NotImplementedError, match="abs_max"):
        obs.calculate_qparams()


def test_placeholder_records_nothing():
    obs = PlaceholderObserver(dtype=torch.qint8, reduce_range=True)
    x = torch.randn(3)
    assert obs(x) is x and obs.is_dynamic and len(obs.state_dict()) == 0
    assert (obs.qmin, obs.qmax) == (-64, 63)
    with pytest.raises(RuntimeError, match="per call"):
        obs.calculate_qparams()
    assert not MinMaxObserver().is_dynamic


# ---------------------------------------------------------------------------------------------
# state_dict: save, reload into a fresh observer, resume

OBSERVER_CASES = {
    "minmax": lambda: MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    "moving_average": lambda: MovingAverageMinMaxObserver(averaging_constant=0.3),
    "per_channel": lambda: PerChannelMinMaxObserver(ch_axis=1, dtype=torch.qint8, qscheme=torch.per_channel_symmetric),
    "histogram_l2": lambda: HistogramObserver(bins=256),
    "histogram_percentile": lambda: HistogramObserver(bins=512, method="percentile", percentile=99.0),
    "abs_max": lambda: PerChannelAbsMaxObserver(),
}


def _result(obs):
    return (obs.abs_max(),) if isinstance(obs, PerChannelAbsMaxObserver) else obs.calculate_qparams()


@pytest.mark.parametrize("case", list(OBSERVER_CASES))
def test_state_dict_resumes_calibration(case):
    xs = batches(9, n=6, shape=(16, 12), shift=0.7)        # the range grows batch by batch
    whole = OBSERVER_CASES[case]()
    for x in xs:
        whole(x)
    first = torch.nn.Sequential(OBSERVER_CASES[case]())    # inside a module, as in a prepared model
    for x in xs[:3]:
        first(x)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = torch.nn.Sequential(OBSERVER_CASES[case]())
    resumed.load_state_dict(torch.load(buffer))            # strict: every buffer is there
    for x in xs[3:]:
        resumed(x)
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()["0." + name], value), name
    for got, expected in zip(_result(resumed[0]), _result(whole)):
        assert torch.equal(got, expected)


def test_unobserved_state_dict_loads_and_still_has_no_data():
    saved = PerChannelMinMaxObserver().state_dict()
    fresh = PerChannelMinMaxObserver()
    fresh.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="no data"):
        fresh.calculate_qparams()


def test_histogram_state_dict_with_other_bins_is_refused():
    obs = HistogramObserver(bins=64)
    obs(torch.randn(10))
    with pytest.raises(RuntimeError, match="bins"):
        HistogramObserver(bins=128).load_state_dict(obs.state_dict())


# ---------------------------------------------------------------------------------------------
# factories

def test_with_args_factory():
    factory = MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    same = MinMaxObserver.with_args(qscheme=torch.per_tensor_symmetric, dtype=torch.qint8)
    assert isinstance(factory, ObserverFactory)
    assert factory == same and hash(factory) == hash(same)
    assert factory != MinMaxObserver.with_args(dtype=torch.qint8)
    assert factory != MovingAverageMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    a, b = factory(), factory()
    assert a is not b and isinstance(a, MinMaxObserver) and a.dtype == torch.qint8
    assert factory(reduce_range=True).qmax == 63
    assert pickle.loads(pickle.dumps(factory)) == factory
    assert repr(factory) == "MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)"
    assert factory.kwargs == {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric}
    with pytest.raises(ValueError, match="qscheme"):
        MinMaxObserver.with_args(qscheme=torch.per_channel_affine)
    with pytest.raises(TypeError):
        MinMaxObserver.with_args(bogus=1)


def test_extra_repr_names_the_config():
    text = repr(PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    assert "ch_axis=0" in text and "torch.qint8" in text and "per_channel_symmetric" in text
    assert "method='percentile'" in repr(HistogramObserver(method="percentile"))


# ---------------------------------------------------------------------------------------------
# bad input

ALL_OBSERVERS = [MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver, HistogramObserver,
                 PerChannelAbsMaxObserver]


@pytest.mark.parametrize("cls", ALL_OBSERVERS)
def test_no_data_raises(cls):
    obs = cls()
    obs(torch.empty(0, 4))                                  # empty: ignored
    with pytest.raises(RuntimeError, match="no data"):
        obs.abs_max() if cls is PerChannelAbsMaxObserver else obs.calculate_qparams()


@pytest.mark.parametrize("cls", ALL_OBSERVERS + [PlaceholderObserver])
def test_non_floating_input_raises(cls):
    with pytest.raises(TypeError, match="floating"):
        cls()(torch.arange(6).reshape(2, 3))
    with pytest.raises(TypeError):
        cls()([1.0, 2.0])


@pytest.mark.parametrize("cls", ALL_OBSERVERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused(cls, bad):
    x = torch.randn(4, 3)
    x[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        cls()(x)


def test_empty_input_returns_same_object():
    x = torch.empty(0)
    assert MinMaxObserver()(x) is x


@pytest.mark.parametrize("cls,qscheme", [
    (MinMaxObserver, torch.per_channel_affine), (MovingAverageMinMaxObserver, torch.per_channel_symmetric),
    (HistogramObserver, torch.per_channel_affine), (PerChannelMinMaxObserver, torch.per_tensor_affine),
    (PerChannelMinMaxObserver, torch.per_tensor_symmetric), (MinMaxObserver, "affine")])
def test_wrong_qscheme_raises(cls, qscheme):
    with pytest.raises(ValueError, match="qscheme"):
        cls(qscheme=qscheme)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.qint32, torch.uint8, "int8"])
def test_wrong_dtype_raises(dtype):
    with pytest.raises(ValueError, match="dtype"):
        MinMaxObserver(dtype=dtype)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="together"):
        MinMaxObserver(quant_min=0)
    with pytest.raises(ValueError, match="reduce_range"):
        MinMaxObserver(reduce_range=True, quant_min=0, quant_max=100)
    with pytest.raises(ValueError, match="quant_min"):
        MinMaxObserver(dtype=torch.qint8, quant_min=-200, quant_max=100)
    with pytest.raises(ValueError, match="averaging_constant"):
        MovingAverageMinMaxObserver(averaging_constant=0)
    with pytest.raises(ValueError, match="bins"):
        HistogramObserver(bins=1)
    with pytest.raises(ValueError, match="method"):
        HistogramObserver(method="kl")
    with pytest.raises(ValueError, match="percentile"):
        HistogramObserver(percentile=40)
    with pytest.raises(ValueError, match="ch_axis"):
        PerChannelMinMaxObserver(ch_axis=3)(torch.randn(2, 2))
    obs = PerChannelMinMaxObserver()
    obs(torch.randn(4, 2))
    with pytest.raises(ValueError, match="channels"):
        obs(torch.randn(5, 2))


# ---------------------------------------------------------------------------------------------
# quantize / dequantize

SCALES = [0.125, 0.1, 0.03, 0.0071, 1 / 3, 2.5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_round_trip_exact_on_grid(dtype, scale):
    qmin, qmax = RANGES[(dtype, False)]
    g = torch.Generator().manual_seed(10)
    zp = 3 if dtype == torch.qint8 else 131
    q = torch.randint(qmin, qmax + 1, (4096,), generator=g)
    x = dequantize(q.to(torch.int8 if dtype == torch.qint8 else torch.uint8), scale, zp)
    assert x.dtype == torch.float32
    np.testing.assert_array_equal(x.numpy(), ((q - zp).float() * torch.tensor(scale, dtype=torch.float32)).numpy())
    back = quantize(x, scale, zp, dtype)
    assert back.dtype == (torch.int8 if dtype == torch.qint8 else torch.uint8)
    assert torch.equal(back.long(), q)
    # values off the grid by less than half a step quantize to the grid point
    offset = (torch.rand(4096, generator=g) - 0.5) * 0.98
    off_grid = ((q - zp).double() + offset.double()) * scale
    assert torch.equal(quantize(off_grid.float(), scale, zp, dtype).long(), q)


def _assert_matches_torch(ours, ref, x_over_scale):
    """Equal, except where fused and unfused float rounding can disagree: within 1e-4 of a tie."""
    diff = (ours.int() - ref.int()).abs()
    near_tie = (x_over_scale.double().frac().abs() - 0.5).abs() < 1e-4
    assert diff.max().item() <= 1
    assert not bool((diff > 0)[~near_tie].any())
    assert (diff > 0).sum().item() <= 1e-4 * diff.numel()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_matches_torch_quantize_per_tensor(dtype, scale):
    zp = -5 if dtype == torch.qint8 else 120
    x = torch.randn(60_000, generator=torch.Generator().manual_seed(11)) * 40 * scale
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.quantize_per_tensor(x, scale, zp, dtype)
    ours = quantize(x, scale, zp, dtype)
    _assert_matches_torch(ours, ref.int_repr(), x / scale)
    torch.testing.assert_close(dequantize(ours, scale, zp), ref.dequantize(), rtol=0, atol=scale * 1.0001)
    assert torch.equal(dequantize(ref.int_repr(), scale, zp), ref.dequantize())


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_ties_round_half_to_even_like_torch(dtype):
    scale, zp = 0.25, (0 if dtype == torch.qint8 else 100)  # power of two: x / scale is exact
    k = torch.arange(-60, 60, dtype=torch.float32)
    x = (k + 0.5) * scale
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.quantize_per_tensor(x, scale, zp, dtype).int_repr()
    ours = quantize(x, scale, zp, dtype)
    assert torch.equal(ours, ref)
    np.testing.assert_array_equal(ours.numpy().astype(np.int64) - zp, np.round(k.numpy() + 0.5).astype(np.int64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_quantize_matches_torch_quantize_per_channel(dtype, axis):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(6, 5, 700, generator=g) * 3
    channels = x.shape[axis]
    scales = torch.rand(channels, generator=g) * 0.05 + 0.01
    zps = torch.randint(-20, 20, (channels,), generator=g) + (0 if dtype == torch.qint8 else 128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.quantize_per_channel(x, scales, zps, axis % 3, dtype)
    ours = quantize(x, scales, zps, dtype, axis=axis)
    shape = [1, 1, 1]
    shape[axis] = -1
    _assert_matches_torch(ours, ref.int_repr(), x / scales.reshape(shape))
    assert torch.equal(dequantize(ref.int_repr(), scales, zps, axis=axis), ref.dequantize())


def test_quantize_clamps_to_given_range_and_checks_arguments():
    x = torch.tensor([-100.0, 0.0, 100.0])
    assert quantize(x, 1.0, 0, torch.qint8).tolist() == [-100, 0, 100]
    assert quantize(x, 0.1, 0, torch.qint8).tolist() == [-128, 0, 127]
    assert quantize(x, 0.1, 0, torch.qint8, quant_min=-64, quant_max=63).tolist() == [-64, 0, 63]
    assert quantize(x, 1.0, 28, torch.quint8, quant_min=0, quant_max=127).tolist() == [0, 28, 127]
    with pytest.raises(TypeError, match="floating"):
        quantize(torch.arange(3), 1.0, 0, torch.qint8)
    with pytest.raises(ValueError, match="dtype"):
        quantize(x, 1.0, 0, torch.float32)
    with pytest.raises(ValueError, match="scale"):
        quantize(x, torch.tensor([1.0, 2.0]), 0, torch.qint8)
    with pytest.raises(ValueError, match="scale"):
        quantize(x.reshape(3, 1), torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), torch.qint8, axis=0)
    with pytest.raises(ValueError, match="positive"):
        quantize(x, 0.0, 0, torch.qint8)
    with pytest.raises(TypeError, match="integer"):
        dequantize(x, 1.0, 0)


def test_observer_base_is_abstract():
    with pytest.raises(NotImplementedError):
        Observer()(torch.randn(2))
