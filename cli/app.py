"""The `rana` command: a thin Typer app; each sub-command lives in its own module."""
from __future__ import annotations

import typer

from . import compress as compress_cmd
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


compress_cmd.register(app)

for _name in ("evaluate_cmd", "sweep_cmd", "finetune_cmd", "export_cmd"):
    try:
        _module = __import__(f"{__package__}.{_name}", fromlist=["register"])
    except ModuleNotFoundError as _e:  # a command module not present in this build
        if _name not in str(_e):
            raise
        continue
    _module.register(app)


def main() -> None:
    setup_environment()
    app()


if __name__ == "__main__":
    main()
