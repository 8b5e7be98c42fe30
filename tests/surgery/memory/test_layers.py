"""Which decoder blocks a memory policy touches (flexengine/surgery/memory/layers.py): the model's blocks where its
family keeps them, and memory.layers' selections against hand-listed indices."""

from __future__ import annotations

import pytest

from flexengine.core.errors import UserError
from flexengine.surgery.memory.layers import decoder_layers, select_layers
from tests.helpers import make_llama, make_mistral


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("all", [0, 1, 2, 3, 4, 5]),
        ("every_2", [1, 3, 5]),
        ("every_4", [3]),
        ("first_2", [0, 1]),
        ("last_2", [4, 5]),
        ("5,0,3", [0, 3, 5]),
        ("none", []),
    ],
)
def test_select_layers(spec, expected):
    assert select_layers(spec, 6) == expected


@pytest.mark.parametrize("spec", ["every_x", "7", "0,-1", "some"])
def test_select_layers_rejects_bad_specs(spec):
    with pytest.raises(UserError, match="memory.layers"):
        select_layers(spec, 6)


@pytest.mark.parametrize(
    ("spec", "n_layers", "expected"),
    [
        ("spread_2", 6, [1, 4]),  # (i + 1/2) x 6 / 2 = 1.5, 4.5
        ("spread_3", 32, [5, 16, 26]),  # 5.33, 16, 26.67
        ("spread_9", 4, [0, 1, 2, 3]),  # more than there are: every block once
        ("every_0", 6, []),
        ("last_9", 3, [0, 1, 2]),
        ("first_9", 3, [0, 1, 2]),
        ("", 6, []),
        (" all ", 2, [0, 1]),  # Hydra may hand the value with spaces
        (3, 6, [3]),  # an int from YAML (memory.layers: 3)
    ],
)
def test_select_layers_edges(spec, n_layers, expected):
    assert select_layers(spec, n_layers) == expected


def test_a_block_past_the_model_is_named_with_the_range():
    with pytest.raises(UserError, match=r"blocks \[6\] do not exist \(the model has 6: 0..5\)"):
        select_layers("0,6", 6)


@pytest.mark.parametrize("make", [lambda: make_llama(num_hidden_layers=3), make_mistral])
def test_decoder_layers_are_the_models_own_block_list(make):
    model = make()
    layers = decoder_layers(model)
    assert layers is model.model.layers and len(layers) == model.config.num_hidden_layers
