"""The `rana` command: a thin Typer app; each sub-command lives in its own module."""
from __future__ import annotations

import typer

from . import compress_cmd, eval_cmd, export_cmd, finetune_cmd, quantize_cmd, sweep_cmd
from .common import setup_environment

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="RaNA: adaptive rank/neuron allocation — compress, fine-tune, evaluate and export HF causal LMs.")


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="print the version and exit", is_eager=True)) -> None:
    """RaNA: adaptive rank/neuron allocation for Hugging Face causal LMs."""
    if version:
        from rana import __version__

        typer.echo(f"rana {__version__}")
        raise typer.Exit()


for _command in (compress_cmd, eval_cmd, sweep_cmd, finetune_cmd, export_cmd, quantize_cmd):
    _command.register(app)


def main() -> None:
    setup_environment()
    app()


if __name__ == "__main__":
    main()
