"""`memcalc hf-families`: the transformers families `--hf-config` reads, each with the decoder layer it was
measured on (memcalc.model.families.FAMILIES) and whether the hf step timeline walks it (its WALKED), and the model
types it refuses with what they lack."""

from __future__ import annotations

import click

from memcalc.model.families import FAMILIES, UNREAD


@click.command("hf-families")
@click.option("--fields", "show_fields", is_flag=True, help="Also list the config.json fields read for each family.")
def command(show_fields: bool) -> None:
    """List the Hugging Face families --hf-config reads: model_type, transformers' config class, the decoder
    layer memcalc's --impl hf rules were measured on (a family read but run by another's layer says which), and
    whether the step timeline walks its model (estimate --totals' peak; else states + saved activations).

    \b
    Example: memcalc hf-families
             memcalc estimate --impl hf --hf-config path/to/config.json
    """
    from memcalc.sizing.timeline.hf import WALKED

    width = max(len(name) for name in (*FAMILIES, *UNREAD))
    class_width = max(len(f.config_class) for f in FAMILIES.values())
    for f in FAMILIES.values():
        layer = f.layer if f.runs_as is None else f"{FAMILIES[f.runs_as].layer} (as {f.runs_as})"
        peak = "peak walked" if (f.runs_as or f.name) in WALKED else "peak not walked"
        click.echo(f"{f.name:<{width}}  {f.config_class:<{class_width}}  {peak:<15}  measured on {layer}")
        if show_fields:
            click.echo(f"{'':<{width}}  reads {', '.join(f.reads())}")
    for name, what in UNREAD.items():
        click.echo(f"{name:<{width}}  refused: {what}")
