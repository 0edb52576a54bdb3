"""``python -m fastpar.export``: a training checkpoint -> a Hugging Face directory, checked.

    python -m fastpar.export ckpt/step_000030 hf_out --check --generate 12 --prompt "Beautiful is"

Which HF family a run becomes, ``--check`` and ``--generate``: docs/hf.md ("Export to
transformers")."""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
import sys

import torch

from fastpar.cliutil import Parser
from fastpar.data import EOS_TOKENS
from fastpar.models import native
from fastpar.tolerance import cast, compare


def run_config(path: str):
    """The ``TrainConfig`` saved with a training checkpoint."""
    from fastpar.checkpoint import CheckpointReader
    from fastpar.train import TrainConfig
    from fastpar.train.config import flag_specs

    saved = (CheckpointReader(path).common().get("extra") or {}).get("config")
    if not isinstance(saved, dict):
        raise ValueError(
            f"{path} holds no training settings (it was not written by fastpar.train, or by an "
            f"older fastpar): export its tensors with fastpar.checkpoint.export_hf instead"
        )
    known = {spec.name for spec in flag_specs()}
    return TrainConfig.from_flags(**{k: v for k, v in saved.items() if k in known})


def fastpar_model(cfg, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """fastpar's own single-process model of the run, holding ``state``'s weights; maps token
    ids [B, T] to logits [B, T, V]."""
    from fastpar.checkpoint import import_state_dict

    if cfg.hf_config:
        from fastpar.models.hf import build, load_config

        model = build(load_config(cfg.hf_config))
        import_state_dict(state, dict(model.named_parameters()))
        return _Logits(model, hf=True)
    from fastpar.models import build_model

    model = torch.nn.Sequential(*build_model(cfg.model, None))
    import_state_dict(state, dict(model.named_parameters()))
    with torch.no_grad():  # the routers' expert_bias buffers (--expert-bias) steer the choice
        for name, b in model.named_buffers():
            if name.endswith("expert_bias") and name in state:
                b.copy_(state[name])
    return _Logits(model, hf=False)


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, hf: bool):
        super().__init__()
        self.model, self.hf = model, hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.hf:
            return self.model(input_ids=ids).logits
        return self.model(ids).view(*ids.shape, -1)


def resolve(path: str) -> str:
    """``path`` itself if it is a checkpoint, else the newest complete checkpoint under it (a
    run's --checkpoint-dir)."""
    from fastpar.train import latest_checkpoint

    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"{path} is neither a checkpoint nor a directory holding a complete one")
    return latest


def export(path: str, out_dir: str, tokenizer: str | None = None) -> tuple:
    """Write the HF directory; returns (run config, global fastpar state, HF config dict)."""
    from fastpar.checkpoint import export_hf, export_state_dict

    path = resolve(path)
    cfg = run_config(path)
    state = export_state_dict(path)
    tokenizer = tokenizer or cfg.tokenizer
    tokens = special_tokens(cfg, tokenizer)
    ids = {f"{kind}_token_id": i for kind, (_, i) in tokens.items()}
    if cfg.hf_config:
        from fastpar.models.hf import load_config

        config = load_config(cfg.hf_config)
        for key, value in ids.items():  # the run's tokens; the config's own where it has none
            setattr(config, key, value)
        export_hf(state, out_dir, config)
        config = config.to_dict()
    else:
        mapping, model_class = hf_mapping(cfg)
        model_cfg = cfg.model
        try:
            hf_state = mapping.to_hf(state, model_cfg)
        except ValueError as exc:
            raise ValueError(f"{path} (--model {cfg.model_type}) does not export: {exc}") from None
        config = {**mapping.hf_config(model_cfg), **dict.fromkeys(SPECIAL_IDS), **ids}
        # what the HF class does not hold (DeepSeek-V3's MTP layers) is written beside it
        beside = getattr(mapping, "is_mtp_name", lambda name, cfg: False)
        extra = {k: hf_state.pop(k) for k in list(hf_state) if beside(k, model_cfg)}
        if model_class is None:
            export_hf(hf_state, out_dir, config, extra=extra)
        else:  # fastpar's own HF model: its config class and code go with the weights
            export_hf(
                hf_state, out_dir, model_class.config_class(**config), model_class=model_class
            )
            mapping.write_code(out_dir)
    if tokenizer:
        shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))
        names = {f"{kind}_token": name for kind, (name, _) in tokens.items() if name}
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **names}, f, indent=2)
    return cfg, state, config


def hf_mapping(cfg):
    """(the module mapping the run's model to Hugging Face, its own HF model class or None):
    the native model's ``exporter`` (``fastpar.models.native``: ``llama_hf``, ``deepseek_hf``
    (DeepseekV3ForCausalLM), ``gpt_hf`` (GPT-2) when GPT-2 computes the GPT, else ``gpt_code``
    with ``FastparGPTForCausalLM``, code written beside the weights; needs transformers)."""
    model = native.get(cfg.model_type)
    if model.exporter is None:
        raise ValueError(f"--model {cfg.model_type} does not export to Hugging Face")
    mapping, model_class = model.exporter(cfg.model)
    if model_class is not None:
        where, _, name = model_class.rpartition(".")
        model_class = getattr(importlib.import_module(where), name)
    return mapping, model_class


#: the special tokens an export carries, each the first of its names the tokenizer has
SPECIAL_NAMES = {
    "eos": EOS_TOKENS,
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "pad": ("<pad>", "<|pad|>", "<|padding|>"),
}
SPECIAL_IDS = tuple(f"{kind}_token_id" for kind in SPECIAL_NAMES)


def special_tokens(cfg, tokenizer: str | None) -> dict[str, tuple[str | None, int]]:
    """{"eos" / "bos" / "pad": (token, id)} the export's config and tokenizer carry: the
    tokenizer's tokens of those names (``SPECIAL_NAMES``; eos as ``fastpar.data.tokenizer_eos_id``
    finds it), and --eos-id (which wins, as it does in training) as eos without a name when the
    tokenizer has no token of that id."""
    out: dict[str, tuple[str | None, int]] = {}
    tok = None
    if tokenizer:
        from fastpar.data import load_tokenizer

        tok = load_tokenizer(tokenizer)
        for kind, names in SPECIAL_NAMES.items():
            for name in names:
                if (i := tok.token_to_id(name)) is not None:
                    out[kind] = (name, int(i))
                    break
    if cfg.eos_id is not None:
        name = tok.id_to_token(cfg.eos_id) if tok is not None else None
        out["eos"] = (name, int(cfg.eos_id))
    return out


def _prompt_ids(cfg, prompt: str, tokenizer: str | None) -> torch.Tensor:
    if tokenizer:
        from fastpar.data import load_tokenizer

        ids = load_tokenizer(tokenizer).encode(prompt).ids
    else:
        ids = list(prompt.encode())
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens")
    return torch.tensor([ids])


def _fitted(ids: torch.Tensor, generate: int, seq_len: int) -> torch.Tensor:
    """The prompt's first ``seq_len - generate`` tokens (the model saw no position past
    ``seq_len``), saying so when it cuts; ValueError when ``generate`` leaves no room."""
    if generate < 0 or generate >= seq_len:
        raise ValueError(
            f"--generate {generate} leaves no room for a prompt in the run's seq_len {seq_len}: "
            f"use 0 to {seq_len - 1}"
        )
    room = seq_len - generate
    if ids.shape[1] > room:
        print(
            f"the prompt's {ids.shape[1]} tokens + --generate {generate} exceed the run's seq_len "
            f"{seq_len}: checking with its first {room} tokens"
        )
        ids = ids[:, :room]
    return ids


def check(out_dir: str, cfg, state, prompt: str, generate: int, tokenizer: str | None) -> bool:
    """Logits of the exported directory (through transformers) against fastpar's model, and
    optionally greedy generation by both. Prints what it finds; returns whether they agree."""
    import transformers

    # eager attention and experts: transformers' fused CPU expert kernels need widths that are
    # multiples of 4 elements; the check compares math, not kernels
    with open(os.path.join(out_dir, "config.json")) as f:
        custom = "auto_map" in json.load(f)
    if custom:  # fastpar's own model code, written beside the weights (auto_map names it)
        kw = dict(trust_remote_code=True)
    else:
        kw = dict(attn_implementation="eager", experts_implementation="eager")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, **kw)
    hf.eval()
    ours = fastpar_model(cfg, state).eval()
    ids = _fitted(_prompt_ids(cfg, prompt, tokenizer), generate, cfg.model.seq_len)
    with torch.no_grad():
        got, single = hf(ids).logits, ours(ids)
        exact = cast(copy.deepcopy(ours), torch.float64)(ids)
    # the longest sum into a logit: a matrix's inner dimension or the attended tokens
    widths = ("hidden_size", "intermediate_size", "moe_intermediate_size", "n_inner")
    length = max([ids.shape[1], *(int(getattr(hf.config, w, None) or 0) for w in widths)])
    verdict = compare(got, single, exact, length=length, what="logits")
    diff = float((got - single).abs().max())
    ok = verdict.ok
    print(
        f"transformers {type(hf).__name__} from {out_dir}: max |HF logit - fastpar logit| = "
        f"{diff:.2e} over {ids.shape[1]} tokens; against fastpar's model in float64 "
        f"{verdict}: " + ("equal" if ok else "DIFFERENT")
    )
    if generate:
        kw = dict(max_new_tokens=generate, do_sample=False, pad_token_id=0)
        got = hf.generate(ids, **kw)
        want = ids
        with torch.no_grad():  # greedy, without a cache: fastpar's model recomputes the prefix
            for _ in range(generate):
                want = torch.cat([want, ours(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
        same = torch.equal(got, want)
        ok &= same
        text = _decode(got[0].tolist(), tokenizer)
        print(f"generated by transformers ({generate} tokens, greedy): {text!r}")
        print("fastpar's own greedy decoding: " + ("the same tokens" if same else "DIFFERENT"))
    return ok


def _decode(ids: list[int], tokenizer: str | None) -> str:
    if tokenizer:
        from fastpar.data import load_tokenizer

        return load_tokenizer(tokenizer).decode(ids)
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    from fastpar.checkpoint import CheckpointError

    ap = Parser(prog="python -m fastpar.export", description=__doc__.splitlines()[0])
    ap.add_argument(
        "checkpoint",
        help="a checkpoint written by fastpar.train, or its --checkpoint-dir (the newest one)",
    )
    ap.add_argument("out_dir", help="the Hugging Face directory to write")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run's)")
    ap.add_argument("--check", action="store_true", help="load with transformers, compare logits")
    ap.add_argument(
        "--generate", type=int, default=0, help="greedy tokens to decode (with --check)"
    )
    ap.add_argument("--prompt", default="Beautiful is better than", help="text to start from")
    args = ap.parse_args(argv)
    try:
        path = resolve(args.checkpoint)
        cfg, state, _ = export(path, args.out_dir, args.tokenizer)
        print(f"exported {path} -> {args.out_dir}")
        if not args.check:
            return 0
        tokenizer = args.tokenizer or cfg.tokenizer
        return 0 if check(args.out_dir, cfg, state, args.prompt, args.generate, tokenizer) else 1
    except (ValueError, ImportError, OSError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
