"""What each step trains on: the run's token ids, the global batch of a step, the learning rate."""

from __future__ import annotations

import contextlib
import math

import torch

from fastpar.data import (
    IGNORE_INDEX,
    Corpus,
    bin_dtype,
    check_bin_width,
    check_token_ids,
    document_batch,
    eos_starts,
    global_batch,
    load_documents,
    load_tokens,
    tokenizer_eos_id,
)
from fastpar.models.documents import Documents, documents
from fastpar.models.mtp import tokens
from fastpar.train.config import TrainConfig


# -- data --------------------------------------------------------------------------------------
def load_data(cfg: TrainConfig, check: bool = True):
    """This run's data: token ids (``fastpar.data.load_tokens``), or with packed documents
    (``cfg.packs_documents``) a ``fastpar.data.Corpus`` (the ids and their document starts and loss
    mask: ``load_documents``), every id checked against the vocabulary unless ``check`` is False
    (one pass; the launcher checks once, before the ranks). A .bin file is read as ``bin_dtype``
    resolves --data-dtype (an error, even unchecked, when its ids cannot hold the vocabulary)."""
    is_bin = (cfg.data or "").endswith(".bin")
    dtype = bin_dtype(cfg.data_dtype, cfg.vocab, cfg.data) if is_bin else "uint16"
    if cfg.packs_documents:
        data = load_documents(cfg.data, tokenizer=cfg.tokenizer, dtype=dtype, eos_id=cfg.eos_id)
        tokens = data.tokens
    else:
        data = tokens = load_tokens(cfg.data, tokenizer=cfg.tokenizer, dtype=dtype)
    if check:
        source = cfg.data or "the embedded corpus"
        if cfg.tokenizer and not (cfg.data or "").endswith((".npy", ".bin")):
            source += f" (tokenised with {cfg.tokenizer})"
        hint = ""
        if is_bin:
            hint = f"; read as {dtype}: is --data-dtype the one the file was written with?"
        check_token_ids(tokens, cfg.vocab, source, min_tokens=cfg.model.seq_len + 2, hint=hint)
        if is_bin and dtype == "uint16":
            check_bin_width(tokens, source)
        check_split(cfg, data)
    return data


def as_data(cfg: TrainConfig, data):
    """``data`` (token ids or a ``Corpus``, e.g. a caller's own) as this run reads it: a
    ``Corpus`` with packed documents (token ids cut after each --eos-id / the tokenizer's
    end-of-document token), token ids for a stream (a Corpus with a loss mask is refused: a
    stream would train on its masked tokens)."""
    if cfg.packs_documents:
        if isinstance(data, Corpus):
            return data
        eos = cfg.eos_id if cfg.eos_id is not None else tokenizer_eos_id(cfg.tokenizer)
        if eos is None:
            raise ValueError(
                f"packed documents from token ids need the end-of-document id to cut them "
                f"({cfg.document_source} gives none for ids passed in): pass --eos-id, or a "
                "fastpar.data.Corpus"
            )
        return Corpus(data, eos_starts(data, eos), None, "the token ids passed in")
    if isinstance(data, Corpus):
        if data.loss_mask is not None:
            raise ValueError(
                f"{data.source} has a loss mask, which a --pack stream run would ignore: train "
                "it with --pack documents"
            )
        return data.tokens
    return data


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
    need = cfg.model.seq_len + 2
    if len(held) < need or len(train) < need:
        raise ValueError(
            f"--eval-split {cfg.eval_split:g} of {len(tokens)} token ids leaves {len(train)} for "
            f"training and {len(held)} held out; each part needs seq_len + 2 = {need}: use more "
            "data, a shorter --seq-len or another --eval-split"
        )


def eval_batch(cfg: TrainConfig, held, j: int, hf=None):
    """The j-th validation batch (of ``--eval-batches``), drawn from the held-out data with the
    training batches' rule: the same batches at every evaluation and on every layout; (x, y,
    documents) as ``batch_of``."""
    return batch_of(cfg, held, j, hf)


def batch_of(cfg: TrainConfig, data, step: int, hf=None):
    """The global batch of ``step``: (inputs, next-token targets, documents). For a masked LM (BERT
    through --hf-config) masked inputs and their targets (-100 where nothing is predicted). ``data``
    a ``Corpus`` (packed documents): the rows' documents (``fastpar.models.documents.Documents``;
    None for a stream) and targets -100 where a document's last token would predict the next one's
    first, or where the loss mask is 0 (``fastpar.data.document_batch``)."""
    if isinstance(data, Corpus):
        if hf is not None and hf.masked:
            raise ValueError(
                "packed documents with a masked language model are not supported: use --pack stream"
            )
        x, y, ids = document_batch(data, step, cfg.batch_size, cfg.model.seq_len, cfg.seed)
        valid = y != IGNORE_INDEX  # (the MoE layers' statistics count these tokens only)
        return x, y, Documents.of(ids, reset_positions=cfg.reset_positions, valid=valid)
    x, y = global_batch(data, step, cfg.batch_size, cfg.model.seq_len, cfg.seed)
    if hf is not None and hf.masked:
        from fastpar.models.hf import masked_lm_batch

        x, y = masked_lm_batch(x, step, cfg.seed, hf.mask_id)
    return x, y, None


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


def microbatch_context(
    docs: Documents | None, x: torch.Tensor, microbatches: int, device, mtp: bool
):
    """The engine's ``context`` for a replica's rows ``x`` [B, T] (None: none needed): micro-batch i
    runs inside its rows' documents and, with ``mtp`` (--mtp-depth), its token ids
    (``fastpar.models.mtp.tokens``: the last stage's MTP modules look up the tokens ahead), on every
    stage (each reads them from the batch every rank draws alike: nothing extra is sent)."""
    if docs is None and not mtp:
        return None
    per = x.shape[0] // microbatches
    rows = [slice(i * per, (i + 1) * per) for i in range(microbatches)]
    if docs is not None:
        valid = None if docs.valid is None else docs.valid.to(device)
        docs = Documents(docs.ids.to(device), docs.reset_positions, valid)
    parts = [None if docs is None else docs.rows(r) for r in rows]
    ids = [x[r] if mtp else None for r in rows]

    @contextlib.contextmanager
    def context(i: int):
        with documents(parts[i]), tokens(ids[i]):
            yield

    return context
