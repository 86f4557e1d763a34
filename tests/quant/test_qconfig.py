"""quant/qconfig.py — QConfig validation, equality and hashing; QConfigMapping precedence; the
presets, whose activation range follows the VNNI feature."""
import dataclasses
import pickle

import pytest
import torch
from torch import nn

from cpu_opt.platform import hw
from cpu_opt.quant.observer import (HistogramObserver, MinMaxObserver, PerChannelAbsMaxObserver,
                                    PerChannelMinMaxObserver, PlaceholderObserver)
from cpu_opt.quant.qconfig import (QConfig, QConfigMapping, default_qconfig_mapping, default_reduce_range,
                                   dynamic_qconfig, static_qconfig, transformer_qconfig_mapping,
                                   weight_only_qconfig)

WEIGHT = PerChannelMinMaxObserver.with_args(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)


def qc(**kw):
    return QConfig(activation=kw.pop("activation", MinMaxObserver.with_args()), weight=kw.pop("weight", WEIGHT), **kw)


@pytest.fixture(params=[True, False], ids=["vnni", "no_vnni"])
def vnni(request, monkeypatch):
    monkeypatch.setattr(hw, "has_vnni", lambda info: request.param)
    return request.param


# ---------------------------------------------------------------------------------------------
# QConfig

def test_qconfig_equality_and_hashing():
    a = static_qconfig(reduce_range=False)
    b = QConfig(activation=HistogramObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                                                       reduce_range=False),
                weight=PerChannelMinMaxObserver.with_args(qscheme=torch.per_channel_symmetric, dtype=torch.qint8,
                                                          ch_axis=0))
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != static_qconfig(reduce_range=True)
    assert a != dataclasses.replace(a, smoothquant_alpha=0.5)
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dynamic = True


def test_qconfig_factories_build_fresh_observers():
    config = static_qconfig(reduce_range=True)
    first, second = config.activation(), config.activation()
    assert first is not second
    assert isinstance(first, HistogramObserver) and first.qmax == 127
    weight = config.weight()
    assert isinstance(weight, PerChannelMinMaxObserver)
    assert (weight.dtype, weight.qscheme, weight.ch_axis) == (torch.qint8, torch.per_channel_symmetric, 0)


def test_qconfig_accepts_observer_classes():
    config = QConfig(activation=MinMaxObserver, weight=PerChannelMinMaxObserver)
    assert config == QConfig(activation=MinMaxObserver, weight=PerChannelMinMaxObserver)
    assert isinstance(config.activation(), MinMaxObserver)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"activation": MinMaxObserver()}, TypeError, "instance"),
    ({"weight": None}, TypeError, "weight"),
    ({"weight": PerChannelMinMaxObserver()}, TypeError, "instance"),
    ({"activation": "minmax"}, TypeError, "activation"),
    ({"activation": lambda: MinMaxObserver()}, TypeError, "activation"),
    ({"weight": PlaceholderObserver.with_args()}, ValueError, "weight"),
    ({"weight": PerChannelAbsMaxObserver.with_args()}, ValueError, "weight"),
    ({"activation": PerChannelAbsMaxObserver.with_args()}, ValueError, "activation"),
    ({"activation": PlaceholderObserver.with_args()}, ValueError, "dynamic"),
    ({"activation": None, "dynamic": True}, ValueError, "activation"),
    ({"per_token": True}, ValueError, "per_token"),
    ({"dynamic": 1}, TypeError, "dynamic"),
    ({"per_token": "yes"}, TypeError, "per_token"),
    ({"smoothquant_alpha": 0.0}, ValueError, "smoothquant_alpha"),
    ({"smoothquant_alpha": 1.0}, ValueError, "smoothquant_alpha"),
    ({"smoothquant_alpha": 1.5}, ValueError, "smoothquant_alpha"),
    ({"smoothquant_alpha": True}, TypeError, "smoothquant_alpha"),
    ({"smoothquant_alpha": "0.5"}, TypeError, "smoothquant_alpha"),
    ({"activation": None, "smoothquant_alpha": 0.5}, ValueError, "smoothquant_alpha"),
])
def test_qconfig_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        qc(**kwargs)


def test_qconfig_valid_combinations():
    assert qc(activation=None).weight_only
    assert not qc().weight_only
    dyn = qc(activation=PlaceholderObserver.with_args(), dynamic=True, per_token=True, smoothquant_alpha=0.3)
    assert dyn.dynamic and dyn.per_token and dyn.smoothquant_alpha == 0.3
    assert qc(activation=MinMaxObserver.with_args(), dynamic=True).dynamic   # a static observer gives the dtype


# ---------------------------------------------------------------------------------------------
# QConfigMapping

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
        self.fc = nn.Linear(4, 4)


class MyLinear(nn.Linear):
    pass


Q = {name: qc(smoothquant_alpha=alpha) for name, alpha in
     [("global", 0.1), ("type", 0.2), ("subtype", 0.3), ("encoder", 0.4), ("layer", 0.5), ("exact", 0.6)]}


def test_mapping_setters_chain_and_check():
    mapping = QConfigMapping()
    assert mapping.set_global(Q["global"]) is mapping
    assert mapping.set_object_type(nn.Linear, Q["type"]) is mapping
    assert mapping.set_module_name("encoder", None) is mapping
    with pytest.raises(TypeError, match="qconfig"):
        mapping.set_global("int8")
    with pytest.raises(TypeError, match="object_type"):
        mapping.set_object_type(nn.Linear(2, 2), Q["type"])
    with pytest.raises(ValueError, match="name"):
        mapping.set_module_name("", Q["type"])


def test_mapping_resolution_order():
    linear, my_linear, relu = nn.Linear(2, 2), MyLinear(2, 2), nn.ReLU()
    mapping = QConfigMapping()
    assert mapping.qconfig_for("fc", linear) is None                        # nothing set: fp32
    mapping.set_global(Q["global"])
    assert mapping.qconfig_for("fc", linear) == Q["global"]
    mapping.set_object_type(nn.Linear, Q["type"])
    assert mapping.qconfig_for("fc", linear) == Q["type"]
    assert mapping.qconfig_for("fc", my_linear) == Q["type"]               # isinstance
    assert mapping.qconfig_for("act", relu) == Q["global"]
    mapping.set_object_type(MyLinear, Q["subtype"])
    assert mapping.qconfig_for("fc", my_linear) == Q["subtype"]            # exact type before isinstance
    assert mapping.qconfig_for("fc", linear) == Q["type"]
    mapping.set_module_name("encoder", Q["encoder"])
    assert mapping.qconfig_for("encoder.layer.0.0", linear) == Q["encoder"]  # parent name before type
    assert mapping.qconfig_for("encoder", relu) == Q["encoder"]
    assert mapping.qconfig_for("encoder2.fc", linear) == Q["type"]         # a prefix only at a dot
    assert mapping.qconfig_for("enc.fc", linear) == Q["type"]
    mapping.set_module_name("encoder.layer", Q["layer"])
    assert mapping.qconfig_for("encoder.layer.0.0", linear) == Q["layer"]   # the longest parent wins
    assert mapping.qconfig_for("encoder.fc", linear) == Q["encoder"]
    mapping.set_module_name("encoder.layer.0.0", Q["exact"])
    assert mapping.qconfig_for("encoder.layer.0.0", linear) == Q["exact"]
    assert mapping.qconfig_for("encoder.layer.1.0", linear) == Q["layer"]
    assert mapping.qconfig_for("head", None) == Q["global"]                 # no module: names and global only


def test_isinstance_follows_insertion_order():
    class Base(nn.Module):
        pass

    class Mixin:
        pass

    class Both(Base, Mixin):
        pass

    first = QConfigMapping().set_object_type(Mixin, Q["type"]).set_object_type(Base, Q["subtype"])
    second = QConfigMapping().set_object_type(Base, Q["subtype"]).set_object_type(Mixin, Q["type"])
    assert first.qconfig_for("m", Both()) == Q["type"]
    assert second.qconfig_for("m", Both()) == Q["subtype"]


def test_none_keeps_layers_fp32_at_every_level():
    linear = nn.Linear(2, 2)
    mapping = (QConfigMapping().set_global(Q["global"]).set_object_type(nn.Linear, Q["type"])
               .set_module_name("encoder", None).set_module_name("encoder.layer.0.0", Q["exact"]))
    assert mapping.qconfig_for("encoder.fc", linear) is None
    assert mapping.qconfig_for("encoder.layer.0.0", linear) == Q["exact"]    # a child can opt back in
    mapping.set_object_type(nn.Linear, None)
    assert mapping.qconfig_for("head", linear) is None
    assert mapping.qconfig_for("head", nn.ReLU()) == Q["global"]
    mapping.set_global(None)
    assert mapping.qconfig_for("head", nn.ReLU()) is None


def test_mapping_over_a_real_module_tree():
    model = nn.Sequential(Encoder(), nn.Linear(4, 2))
    mapping = default_qconfig_mapping(reduce_range=False).set_module_name("0.layer.1", None)
    got = {name: mapping.qconfig_for(name, module) is not None for name, module in model.named_modules()}
    assert got == {"": False, "0": False, "0.layer": False, "0.layer.0": False, "0.layer.0.0": True,
                   "0.layer.0.1": False, "0.layer.1": False, "0.layer.1.0": False, "0.layer.1.1": False,
                   "0.fc": True, "1": True}


def test_mapping_equality_and_repr():
    a = QConfigMapping().set_object_type(nn.Linear, Q["type"]).set_module_name("x", None)
    b = QConfigMapping().set_object_type(nn.Linear, Q["type"]).set_module_name("x", None)
    assert a == b
    assert a != QConfigMapping().set_object_type(nn.Linear, Q["type"])
    assert a != QConfigMapping().set_object_type(nn.Linear, Q["type"]).set_module_name("x", None).set_global(None)
    text = repr(a)
    assert "torch.nn.modules.linear.Linear" in text and "'x': None" in text
    assert repr(QConfigMapping()) == "QConfigMapping()"


# ---------------------------------------------------------------------------------------------
# presets

def test_default_mapping_reduce_range_follows_vnni(vnni):
    assert default_reduce_range() is (not vnni)
    mapping = default_qconfig_mapping()
    for module in (nn.Linear(3, 3), nn.Conv2d(3, 3, 3), nn.Conv2d(4, 4, 3, groups=4)):
        config = mapping.qconfig_for("layer", module)
        assert config is not None and not config.dynamic and config.smoothquant_alpha is None
        activation = config.activation()
        assert isinstance(activation, HistogramObserver)
        assert (activation.dtype, activation.qscheme) == (torch.quint8, torch.per_tensor_affine)
        assert activation.reduce_range is (not vnni)
        assert (activation.qmin, activation.qmax) == ((0, 255) if vnni else (0, 127))
        weight = config.weight()
        assert isinstance(weight, PerChannelMinMaxObserver)
        assert (weight.dtype, weight.qscheme, weight.ch_axis, weight.qmin, weight.qmax) == \
            (torch.qint8, torch.per_channel_symmetric, 0, -128, 127)
    for module in (nn.Conv1d(3, 3, 3), nn.ReLU(), nn.LayerNorm(3), nn.Embedding(3, 3)):
        assert mapping.qconfig_for("other", module) is None


@pytest.mark.parametrize("reduce_range", [True, False])
def test_explicit_reduce_range_wins_over_the_feature(vnni, reduce_range):
    config = default_qconfig_mapping(reduce_range=reduce_range).qconfig_for("fc", nn.Linear(2, 2))
    assert config.activation().reduce_range is reduce_range
    assert transformer_qconfig_mapping(reduce_range=reduce_range).qconfig_for("fc", nn.Linear(2, 2)) \
        .activation().reduce_range is reduce_range


def test_default_mapping_rejects_unknown_backend():
    with pytest.raises(ValueError, match="x86"):
        default_qconfig_mapping("arm")
    with pytest.raises(TypeError, match="reduce_range"):
        default_qconfig_mapping(reduce_range="yes")


def test_transformer_mapping_static_smoothquant(vnni):
    mapping = transformer_qconfig_mapping()
    config = mapping.qconfig_for("encoder.layer.0.attention.query", nn.Linear(8, 8))
    assert config.smoothquant_alpha == 0.5 and not config.dynamic and not config.per_token
    activation = config.activation()
    assert isinstance(activation, MinMaxObserver) and activation.qscheme == torch.per_tensor_affine
    assert activation.dtype == torch.quint8 and activation.reduce_range is (not vnni)
    assert config.weight == WEIGHT
    assert mapping.qconfig_for("conv", nn.Conv2d(3, 3, 3)) is None
    assert transformer_qconfig_mapping(smoothquant_alpha=0.8).qconfig_for("fc", nn.Linear(2, 2)).smoothquant_alpha == 0.8
    assert transformer_qconfig_mapping(smoothquant_alpha=None).qconfig_for("fc", nn.Linear(2, 2)).smoothquant_alpha \
        is None
    with pytest.raises(ValueError, match="smoothquant_alpha"):
        transformer_qconfig_mapping(smoothquant_alpha=1.0)


def test_transformer_mapping_dynamic_per_token():
    config = transformer_qconfig_mapping(dynamic=True).qconfig_for("fc", nn.Linear(2, 2))
    assert config.dynamic and config.per_token and config.smoothquant_alpha == 0.5
    activation = config.activation()
    assert isinstance(activation, PlaceholderObserver) and activation.is_dynamic
    with pytest.raises(TypeError, match="dynamic"):
        transformer_qconfig_mapping(dynamic="yes")


def test_dynamic_and_weight_only_qconfigs(vnni):
    dyn = dynamic_qconfig()
    assert dyn.dynamic and not dyn.per_token and dyn.weight == WEIGHT
    assert isinstance(dyn.activation(), PlaceholderObserver) and dyn.activation().reduce_range is (not vnni)
    assert dynamic_qconfig(per_token=True).per_token
    assert dynamic_qconfig(reduce_range=False) == dynamic_qconfig(reduce_range=False)
    weight_only = weight_only_qconfig()
    assert weight_only.activation is None and weight_only.weight_only and weight_only.weight == WEIGHT
    assert hash(weight_only) == hash(weight_only_qconfig())
