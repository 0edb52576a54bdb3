"""What each step trains on: the run's token ids, the global batch of a step, the learning rate."""

from __future__ import annotations

import math

from fastpar.data import (
    bin_dtype,
    check_bin_width,
    check_token_ids,
    global_batch,
    load_tokens,
)
from fastpar.models.common import IGNORE_INDEX
from fastpar.train.config import TrainConfig


# -- data --------------------------------------------------------------------------------------
def load_data(cfg: TrainConfig, check: bool = True):
    """This run's token ids (``fastpar.data.load_tokens``), every id checked against the
    vocabulary unless ``check`` is False (one pass; the launcher checks once, before the ranks).
    A .bin file is read as ``bin_dtype`` resolves --data-dtype (an error, even unchecked, when
    its ids cannot hold the vocabulary)."""
    is_bin = (cfg.data or "").endswith(".bin")
    dtype = bin_dtype(cfg.data_dtype, cfg.vocab, cfg.data) if is_bin else "uint16"
    tokens = load_tokens(cfg.data, tokenizer=cfg.tokenizer, dtype=dtype)
    if check:
        source = cfg.data or "the embedded corpus"
        if cfg.tokenizer and not (cfg.data or "").endswith((".npy", ".bin")):
            source += f" (tokenised with {cfg.tokenizer})"
        hint = ""
        if is_bin:
            hint = f"; read as {dtype}: is --data-dtype the one the file was written with?"
        check_token_ids(tokens, cfg.vocab, source, min_tokens=cfg.seq_len + 2, hint=hint)
        if is_bin and dtype == "uint16":
            check_bin_width(tokens, source)
        check_split(cfg, tokens)
    return tokens


def split_tokens(cfg: TrainConfig, tokens):
    """(training ids, held-out ids): with --eval-every the last ``--eval-split`` fraction of the
    token ids (rounded down, in file order) is held out for validation and training reads only
    the ids before it; without it training reads every id and nothing is held out (None)."""
    if not cfg.eval_every:
        return tokens, None
    cut = len(tokens) - int(len(tokens) * cfg.eval_split)
    return tokens[:cut], tokens[cut:]


def check_split(cfg: TrainConfig, tokens) -> None:
    """Both parts of --eval-split hold a sequence (seq_len + 2 ids), or a ValueError."""
    train, held = split_tokens(cfg, tokens)
    if held is None:
        return
    need = cfg.seq_len + 2
    if len(held) < need or len(train) < need:
        raise ValueError(
            f"--eval-split {cfg.eval_split:g} of {len(tokens)} token ids leaves {len(train)} for "
            f"training and {len(held)} held out; each part needs seq_len + 2 = {need}: use more "
            "data, a shorter --seq-len or another --eval-split"
        )


def eval_batch(cfg: TrainConfig, held, j: int, hf=None):
    """The j-th validation batch (of ``--eval-batches``), drawn from the held-out ids with the
    training batches' rule: the same batches at every evaluation and on every layout."""
    return batch_of(cfg, held, j, hf)


def batch_of(cfg: TrainConfig, tokens, step: int, hf=None):
    """The global batch of ``step``: next-token targets, or for a masked LM (BERT through
    --hf-config) masked inputs and their targets (-100 where nothing is predicted). With
    packed documents (``cfg.packs_documents``) a document's last token predicts nothing
    (its target, the next document's first token, is -100); ``documents_of`` gives the rows'
    documents."""
    x, y = global_batch(tokens, step, cfg.batch_size, cfg.seq_len, cfg.seed)
    if hf is not None and hf.masked:
        from fastpar.models.hf import masked_lm_batch

        x, y = masked_lm_batch(x, step, cfg.seed, hf.mask_id)
    if cfg.packs_documents:
        y = y.masked_fill(x == cfg.eos_id, IGNORE_INDEX)
    return x, y


def documents_of(cfg: TrainConfig, x):
    """The packed documents of a batch's rows (``fastpar.models.documents.Documents``), or None
    for a stream: in each row, each --eos-id ends a document (its last token); the window's
    first tokens, up to the first end, are a document too (the tail of one cut by the window,
    as Megatron's packed datasets have it)."""
    if not cfg.packs_documents:
        return None
    from fastpar.models.documents import Documents

    ends = (x == cfg.eos_id).long()
    return Documents.of(ends.cumsum(1) - ends, reset_positions=cfg.reset_positions)


#: the TrainConfig fields ``lr_at`` reads (``min_lr`` through ``lr_floor``): a resumed run that
#: changes one reshapes its schedule (``fastpar.train.checkpointing.compare_schedule``)
SCHEDULE_FIELDS = ("steps", "lr_schedule", "warmup", "lr", "min_lr")


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate of the step after ``step`` steps (0-based): a linear warm-up over
    --warmup steps, then --lr-schedule (cosine down to ``lr_floor`` at --steps, or constant)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    floor = cfg.lr_floor
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))
