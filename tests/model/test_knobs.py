"""Every knob is declared once, in KNOBS, and every consumer is generated from that table."""

import pytest
from click.testing import CliRunner

from memcalc.cli import cli
from memcalc.cli.render import describe_knobs
from memcalc.config.schema import build_knobs, field_names
from memcalc.docgen.model import VARIANTS
from memcalc.errors import ConfigError
from memcalc.model.impls import IMPLEMENTATIONS
from memcalc.model.knobs import KNOBS, Knobs
from memcalc.cli.sweep_output import KNOB_COLUMNS

# A value other than the default, for each kind of knob.
OTHER = {"name": "llama", "size": 96, "count": 4, "probability": 0.0, "factor": 1.25, "flag": True}


def _other(knob):
    if knob.kind == "flag":
        return not knob.default
    return next(v for v in knob.values if v != knob.default) if knob.kind == "choice" else OTHER[knob.kind]


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.name)
def test_the_config_schema_accepts_the_knob_and_names_it_when_wrong(knob):
    assert knob.name in field_names(Knobs)
    with pytest.raises(ConfigError, match=f"field '{knob.name}'"):
        build_knobs({knob.name: "not-a-value" if knob.kind != "choice" else 7})


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.name)
def test_every_command_that_takes_knobs_has_its_flag(knob):
    for command in ("estimate", "formula", "explain", "sweep", "fit", "plot", "measure"):
        help_text = CliRunner().invoke(cli, [command, "--help"], terminal_width=200).output
        assert knob.flag in help_text, (command, knob.flag)


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.name)
def test_the_sweep_writes_a_column_for_the_knob(knob):
    assert knob.name in KNOB_COLUMNS


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.name)
def test_the_description_changes_when_the_knob_does(knob):
    assert describe_knobs(Knobs(**{knob.name: _other(knob)})) != describe_knobs(Knobs())


# loss_chunks changes torchtitan's model end, not a layer: docs/impl-torchtitan.md lists it among its own knobs
@pytest.mark.parametrize("knob", [k for k in KNOBS if k.name not in ("impl", "loss_chunks")], ids=lambda k: k.name)
def test_docs_show_a_variant_for_the_knob(knob):
    assert any(getattr(v.knobs, knob.name) != knob.default for v in VARIANTS), knob.name


def test_every_implementation_is_a_choice_of_the_impl_knob_and_back():
    impl = next(k for k in KNOBS if k.name == "impl")
    assert set(IMPLEMENTATIONS) <= set(impl.values)


def test_a_choice_compares_and_prints_as_its_text():
    knobs = build_knobs({"mlp": "swiglu"})
    assert knobs.mlp == "swiglu" and f"{knobs.mlp}" == "swiglu" and {"swiglu": 1}[knobs.mlp] == 1


def test_every_tensor_an_implementation_keeps_has_a_name_it_knows():
    from memcalc.model.knobs import Accounting

    for impl in IMPLEMENTATIONS.values():
        knobs = Knobs(impl=impl.name, **impl.knob_defaults())
        names = impl.by_name()
        for x in impl.layer_tensors(knobs, Accounting(exact=True)):
            known = names[x.name]
            assert (known.shape, known.kind, known.region) == (x.shape, x.kind, x.region), (impl.name, x.name)
