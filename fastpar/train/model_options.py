"""The trainer's own flags in the "model" section of ``python -m fastpar.train --help``: which
model and its vocabulary, the fields of ``ModelOptions``, the base of
``fastpar.train.options.TrainOptions``."""

from __future__ import annotations

from dataclasses import dataclass

from fastpar.cliutil import option
from fastpar.models import native
from fastpar.models.shape import MODEL
from fastpar.nn import styles


@dataclass
class ModelOptions:
    """The flags that choose the model (``option(resume=...)``: what resuming a checkpoint with
    another value does)."""

    model_type: str = option(
        "gpt",
        MODEL,
        words=native.REGISTRY,
        help="the model: fastpar's GPT, its Llama (GQA, RoPE, SwiGLU, RMSNorm), or its "
        "DeepSeek-V3 class (multi-head latent attention, DeepSeekMoE after --first-k-dense "
        "dense blocks)",
        resume="refuse",
    )
    hf_config: str | None = option(
        None,
        MODEL,
        metavar="FILE",
        help="a Hugging Face config.json: train that model (random init) with its family's "
        "built-in plan instead of the GPT / Llama",
    )
    vocab_size: int | None = option(
        None, MODEL, help="vocabulary size (default: the tokenizer's, else 256 bytes)"
    )
    init_from_hf: str | None = option(
        None,
        MODEL,
        metavar="DIR",
        help="a local Hugging Face directory (config.json + *.safetensors, as save_pretrained "
        "writes it): train that model from its weights (implies --hf-config DIR/config.json; "
        "each rank reads its slices; fresh optimizer, step 0; --resume's checkpoint wins)",
    )
    plan: str | None = option(
        None,
        MODEL,
        metavar="FILE",
        help=lambda: (
            "with --hf-config: the tensor-parallel plan, a TOML or JSON table of "
            f"module-name pattern -> style ({styles.listing()}; or [style, {{options}}]) as "
            "fastpar.parallelize takes it, for a family without a built-in plan (or to replace "
            "it); the LM head's logits stay split over the vocabulary"
        ),
    )
