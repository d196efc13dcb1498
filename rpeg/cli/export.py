"""``rpeg export RUN_DIR [--step N] -o DIR``: the trained actor as a Hugging Face folder.

    $ rpeg export runs/smollm2_gsm-20261201-101500 -o out/gsm
    exported actor (step 40, version 40) to out/gsm: config.json, tokenizer, model.safetensors
    $ python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('out/gsm')"

A LoRA actor exports its adapter folder, or with ``--merge`` the model with the
adapters folded in (the backend's ``export``, ``backends.api.Exporter``).
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def export(
        run_dir: Path = typer.Argument(..., help="A run directory written by rpeg run."),
        out: Path = typer.Option(..., "-o", "--out", help="The folder to write (replaced)."),
        step: int = typer.Option(None, "--step", min=0,
                                 help="The checkpoint at this step (default: the newest)."),
        model: str = typer.Option("actor", "--model", help="The model to export."),
        merge: bool = typer.Option(False, "--merge",
                                   help="LoRA: the model with the adapters folded in, not "
                                        "the adapter folder."),
    ) -> None:
        """Write a trained model as a Hugging Face folder (transformers and vLLM load it)."""
        import backends

        # through the registry (backends.api.Exporter): the torch executor writes every
        # trained replica's checkpoint, so its backend reads them back
        got = backends.load("torch", "export")(run_dir, out, step=step, model=model,
                                               merge=merge)
        what = {"model": "config.json, tokenizer, model.safetensors",
                "merged": "config.json, tokenizer, model.safetensors (LoRA merged)",
                "adapter": "adapter_config.json, adapter_model.safetensors, tokenizer"}
        print(f"exported {got.model} (step {got.step}, version {got.version}) to {got.path}: "
              f"{what[got.kind]}")
