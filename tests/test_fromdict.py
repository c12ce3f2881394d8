"""A dataclass from a dict (dtfm/fromdict.py), and the configs read through it: an unknown key
is an error that names it, every config comes back from its own dict."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dtfm.fromdict import from_dict
from dtfm.sched.compression import CodecSpeed
from dtfm.train import CompressionConfig, GPTSpec, TrainConfig, get_preset


@dataclass(frozen=True)
class Point:
    x: float
    y: float = 0.0


def test_known_keys_build_the_dataclass_and_unknown_ones_are_named():
    assert from_dict(Point, {"x": 1.0}, "point") == Point(1.0, 0.0)
    with pytest.raises(ValueError, match=r"unknown point fields \['z'\]; expected \['x', 'y'\]"):
        from_dict(Point, {"x": 1.0, "z": 2.0}, "point")
    with pytest.raises(TypeError):  # a missing field without a default: the dataclass's own error
        from_dict(Point, {"y": 1.0}, "point")
    with pytest.raises(TypeError):
        from_dict(dict, {}, "not a dataclass")


def test_convert_applies_after_the_keys_are_checked():
    assert from_dict(Point, {"x": "1.5"}, "point", float) == Point(1.5)
    with pytest.raises(ValueError, match="unknown point fields"):  # not float()'s error
        from_dict(Point, {"x": 1.0, "z": "not a number"}, "point", float)


@pytest.mark.parametrize("value", [get_preset("tiny"), TrainConfig(seed=3), CompressionConfig(),
                                   CodecSpeed(int8_encode_ns_per_elem=2.0)])
def test_every_config_comes_back_from_its_dict_and_refuses_an_unknown_key(value):
    cls = type(value)
    assert cls.from_dict(value.to_dict()) == value
    with pytest.raises(ValueError, match=r"unknown .* fields \['surplus'\]"):
        cls.from_dict({**value.to_dict(), "surplus": 1})


def test_codec_speeds_read_numbers_as_floats():
    assert CodecSpeed.from_dict({"int8_encode_ns_per_elem": 2}).int8_encode_ns_per_elem == 2.0
    assert isinstance(GPTSpec.from_dict(get_preset("tiny").to_dict()), GPTSpec)
