"""`memcalc configs`: the model configs shipped with memcalc, each with its one-line description."""

from __future__ import annotations

import click

from memcalc.config.shipped import catalogue, shipped_dir
from memcalc.text import printable


@click.command("configs")
@click.option("--path", "show_path", is_flag=True, help="Print the folder that holds them, and nothing else.")
def command(show_path: bool) -> None:
    """List the shipped model configs: any of these names works as --config NAME.

    \b
    Example: memcalc configs
             memcalc estimate --config gpt3-175b
             cp "$(memcalc configs --path)/tiny.yaml" my-model.yaml   # a start for your own
    """
    if show_path:
        click.echo(str(shipped_dir()))
        return
    shipped = catalogue()
    width = max(len(s.name) for s in shipped)
    for s in shipped:
        click.echo(f"{s.name:<{width}}  {printable(s.description)}")
