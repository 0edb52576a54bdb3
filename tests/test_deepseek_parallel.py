"""The fastpar DeepSeek under context parallelism and with multi-token prediction: every
parameter's gradient on every rank against the single-process model (``fastpar.verify``'s
references) at CP 2 (ring and all-to-all, packed documents), CP 2 x TP 2 and PP 2 with MTP;
``fastpar.verify --model deepseek`` AGREE at tp2 x pp2 x dp2 x ep2 with MTP and ZeRO-1, at
cp2 x tp2, and with MTP at tp2 x pp2 interleaved with the fused cross-entropy and recompute and
under ZB-H1; the MTP weights under DeepSeek-V3's HF names both ways (bit for bit), and a
checkpoint with MTP exported for ``DeepseekV3ForCausalLM.from_pretrained`` (its logits
fastpar's, the MTP tensors beside its own); the exported MTP tensors in transformers' own
``MtpLayer`` (its MTP drafter's layer) giving fastpar's depth-1 logits. Tolerances:
``fastpar.tolerance``'s rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _trainer import first_step_gradients, write_documents

from fastpar.models import DeepSeekConfig, build_deepseek
from fastpar.models.deepseek_hf import from_hf, hf_config, is_mtp_name, to_hf
from fastpar.train import TrainConfig

ROUTING = dict(
    router_score="sigmoid",
    router_groups=2,
    router_group_topk=1,
    expert_bias=True,
    routed_scaling_factor=2.5,
    shared_expert_ffn=16,
    moe_ffn=8,
    aux_loss="sequence",
    yarn_factor=2.0,
    yarn_original_seq_len=8,
    yarn_mscale_all_dim=1.0,
)
# q/k head 6 + 4 = 10 wide, v 5: K and V of other widths around the ring
MLA = dict(qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, kv_lora_rank=12, q_lora_rank=10)
SMALL = dict(
    steps=1,
    batch_size=4,
    microbatches=2,
    seq_len=16,
    hidden=32,
    heads=4,
    layers=2,
    quiet=True,
    eos_id=10,
    dp=1,
    ep=1,
    zero=0,
    model_type="deepseek",
    experts=4,
    **MLA,
    **ROUTING,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("dsp") / "docs.txt")


@pytest.mark.parametrize(
    "layout",
    [
        dict(cp=2, tp=1, pp=1),
        pytest.param(
            dict(cp=2, tp=1, pp=1, cp_attention="all-to-all", reset_positions=False),
            marks=pytest.mark.slow,
        ),
        pytest.param(dict(cp=2, tp=1, pp=1, pack="stream"), marks=pytest.mark.slow),
        pytest.param(dict(cp=2, tp=2, pp=1, sequence_parallel=True), marks=pytest.mark.slow),
        dict(cp=2, tp=2, pp=1, cp_attention="all-to-all", heads=8, mtp_depth=1),
        dict(tp=1, pp=2, mtp_depth=1),
        pytest.param(
            dict(tp=2, pp=2, mtp_depth=1, untied=True, sequence_parallel=True),
            marks=pytest.mark.slow,
        ),
    ],
    ids=[
        "cp2-ring-docs",
        "cp2-a2a-docs-no-reset",
        "cp2-ring-stream",
        "cp2-tp2-sp",
        "cp2-tp2-a2a-mtp",
        "pp2-mtp",
        "tp2-pp2-mtp-untied-sp",
    ],
)
def test_every_gradient_on_every_rank_is_the_single_process_models(data, layout):
    from fastpar.testing import run_ranks
    from fastpar.verify import references

    cfg = TrainConfig(**{**SMALL, **layout}, data=data)
    cfg.check()
    refs = references(cfg, None)
    results = run_ranks(first_step_gradients, cfg.world_size, cfg, refs)
    for rank, lines in enumerate(results):
        assert int(lines[0].split()[0]) > 0, lines
        assert len(lines) == 1, f"rank {rank}: " + "\n".join(lines)
    if cfg.mtp_depth:
        assert sum(int(lines[0].split()[3]) for lines in results) > 0  # the last stage's MTP


def test_the_cp_gradient_check_fails_with_the_positions_of_one_chunk(data):
    """The check above can fail: MLA's rotary dims rotated at 0..t-1 on every cp rank (the
    local positions, not the load-balanced chunks' global ones) disagree."""
    from fastpar.testing import run_ranks
    from fastpar.verify import references

    cfg = TrainConfig(**{**SMALL, "cp": 2, "tp": 1, "pp": 1}, data=data)
    refs = references(cfg, None)
    lines = run_ranks(_local_positions, cfg.world_size, cfg, refs)
    assert all(len(r) > 1 and "attn." in "\n".join(r) for r in lines), lines


def _local_positions(cfg, refs):
    import fastpar.models.mla as mla

    mla.positions = lambda t, cp_group, device: torch.arange(t, device=device)
    return first_step_gradients(cfg, refs)


# -- fastpar.verify: the trainer's run against one device ---------------------------------------
VERIFY = dict(
    model_type="deepseek",
    steps=3,
    batch_size=8,
    seq_len=16,
    hidden=32,
    heads=4,
    layers=3,
    quiet=True,
    **ROUTING,
)


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, pp=2, dp=2, ep=2, zero=1, mtp_depth=1),
        pytest.param(dict(cp=2, tp=2, pp=1, dp=1, ep=1, zero=0), marks=pytest.mark.slow),
    ],
    ids=["tp2-pp2-dp2-ep2-mtp1-z1", "cp2-tp2"],
)
def test_verify_deepseek_agrees(layout):
    from fastpar.verify import compare

    cfg = TrainConfig(**VERIFY, **layout)
    ok, text = compare(cfg)
    assert ok, text
    assert text.endswith("AGREE")


@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(
            dict(schedule="interleaved", virtual_stages=2, layers=4, fused_ce=True, recompute=True),
            marks=pytest.mark.slow,
        ),
        pytest.param(dict(schedule="zb-h1"), marks=pytest.mark.slow),
    ],
    ids=["interleaved-fused-ce-recompute", "zb-h1"],
)
def test_verify_deepseek_mtp_agrees_under_the_schedules(schedule):
    """MTP's head (a MoE block, the shared embedding's copy on the last stage) under the
    interleaved schedule with the fused cross-entropy and full recompute, and under ZB-H1's
    split backward: the trainer's run at tp 2 x pp 2 against one device."""
    from fastpar.verify import compare

    layout = dict(tp=2, pp=2, dp=1, ep=1, zero=0, steps=2, mtp_depth=1)
    cfg = TrainConfig(**{**VERIFY, **layout, **schedule})
    ok, text = compare(cfg)
    assert ok, text
    assert text.endswith("AGREE")


# -- HF names of the MTP modules ------------------------------------------------------------------
HF = dict(
    vocab_size=61,
    seq_len=16,
    hidden=32,
    heads=4,
    ffn=40,
    layers=2,
    first_k_dense=1,
    num_experts=4,
    top_k=2,
    **MLA,
    **{**ROUTING, "aux_loss": "none"},
)


@pytest.mark.parametrize("depth, tied", [(1, False), (2, True)], ids=["d1-untied", "d2-tied"])
def test_mtp_weights_map_to_deepseek_v3_names_and_back_bit_for_bit(depth, tied):
    cfg = DeepSeekConfig(**HF, mtp_depth=depth, tie_embeddings=tied)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*build_deepseek(cfg))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf = to_hf(state, cfg)
    config = hf_config(cfg)
    assert config["num_nextn_predict_layers"] == depth
    assert config["first_k_dense_replace"] == 1
    for k in range(1, depth + 1):
        layer, ours = f"model.layers.{cfg.layers + k - 1}.", f"{cfg.layers + 1}.mtp.{k - 1}."
        assert torch.equal(hf[layer + "enorm.weight"], state[ours + "enorm.weight"])
        assert torch.equal(hf[layer + "hnorm.weight"], state[ours + "hnorm.weight"])
        assert torch.equal(hf[layer + "eh_proj.weight"], state[ours + "eh_proj.weight"])
        assert torch.equal(hf[layer + "shared_head.norm.weight"], state[ours + "norm.weight"])
        assert torch.equal(hf[layer + "shared_head.head.weight"], hf["lm_head.weight"])
        assert torch.equal(hf[layer + "embed_tokens.weight"], hf["model.embed_tokens.weight"])
        # DeepSeek-V3's MTP blocks are MoE blocks (every layer after first_k_dense is)
        assert layer + "mlp.gate.e_score_correction_bias" in hf
        assert layer + "self_attn.kv_a_proj_with_mqa.weight" in hf
        assert is_mtp_name(layer + "eh_proj.weight", cfg)
    assert not is_mtp_name(f"model.layers.{cfg.layers - 1}.mlp.gate.weight", cfg)
    got_cfg, back = from_hf(hf, config)
    assert dataclasses.replace(got_cfg, aux_loss=cfg.aux_loss) == cfg  # (HF has no aux loss)
    # (the MTP head's "embedding" is a second name of 0.tok.weight)
    want = {k: t for k, t in state.items() if k != f"{cfg.layers + 1}.embedding"}
    assert sorted(back) == sorted(want)
    for k, t in want.items():
        assert torch.equal(back[k], t), k


def test_from_hf_refuses_mtp_layers_it_cannot_take():
    cfg = DeepSeekConfig(**HF, mtp_depth=1)
    torch.manual_seed(0)
    state = dict(torch.nn.Sequential(*build_deepseek(cfg)).state_dict())
    hf, config = to_hf(state, cfg), hf_config(cfg)
    without = {k: v for k, v in hf.items() if not is_mtp_name(k, cfg)}
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers 1 but the weights hold no"):
        from_hf(without, config)
    other = dict(hf, **{"model.layers.2.shared_head.head.weight": hf["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match=r"shared_head.head.weight differs from lm_head.weight"):
        from_hf(other, config)
    assert from_hf(without, {**config, "num_nextn_predict_layers": 0})[0].mtp_depth == 0


@pytest.mark.slow  # (the MtpLayer test below reads the exported names in the CPU tier)
def test_a_checkpoint_with_mtp_exports_for_from_pretrained(tmp_path):
    """Trained at pp 2 with one MTP module, exported by ``python -m fastpar.export``'s code:
    from_pretrained's logits equal fastpar's single-process model holding the checkpoint, the
    MTP tensors lie in the safetensors files under DeepSeek-V3's names, and from_hf of those
    files gives the checkpoint's tensors back bit for bit."""
    safetensors = pytest.importorskip("safetensors.torch")
    transformers = pytest.importorskip("transformers")
    from _parity import agree, exact_copy

    from fastpar.export import check, export, fastpar_model
    from fastpar.moe.layer import aux_loss_scale
    from fastpar.parity import reduction_length
    from fastpar.tolerance import nudge
    from fastpar.train import launch

    ckpt = tmp_path / "ckpt"
    cfg = TrainConfig(
        **{**VERIFY, "steps": 2},
        mtp_depth=1,
        tp=1,
        pp=2,
        dp=1,
        ep=1,
        checkpoint_dir=str(ckpt),
        save_every=2,
    )
    launch(cfg)
    out = tmp_path / "hf"
    _, state, config = export(str(ckpt / "step_000002"), str(out))
    assert config["num_nextn_predict_layers"] == 1
    files = safetensors.load_file(str(out / "model.safetensors"))
    layer = f"model.layers.{cfg.layers}."
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
        "input_layernorm.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.experts.gate_up_proj",
    ):
        assert layer + name in files, name
    head = f"{cfg.layers + 1}.mtp.0."
    assert torch.equal(files[layer + "eh_proj.weight"], state[head + "eh_proj.weight"])
    got_cfg, back = from_hf(files, config)
    assert (got_cfg.mtp_depth, got_cfg.layers, got_cfg.first_k_dense) == (1, cfg.layers, 1)
    assert set(back) - set(state) == {f"{cfg.layers + 1}.weight"}  # the tied head, named
    assert set(state) <= set(back)
    for k, t in state.items():
        assert torch.equal(back[k], t), k
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    ours = fastpar_model(cfg, state).model.eval()
    ids = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    twin = exact_copy(ours).float()
    nudge(twin, seed=1)
    with torch.no_grad(), aux_loss_scale(None):
        runs = [m(ids).view(2, 16, -1) for m in (ours, twin, exact_copy(ours))]
        length = reduction_length(ours, ids)
        agree(hf(ids).logits, runs[:2], runs[2], "from_pretrained's logits", length=length)
    assert check(str(out), cfg, state, "the fox", 3, None)


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(mtp_depth=16), r"mtp_depth \(--mtp-depth\) 16 must be below seq_len 16"),
        (dict(mtp_loss_coef=0.3), r"has no effect without MTP modules"),
        (dict(cp=2, cp_attention="all-to-all", heads=2, tp=2), r"must divide by it"),
        (dict(cp=3), r"not divisible by 6"),
    ],
)
def test_the_trainer_refuses_what_it_cannot_run(flags, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{**VERIFY, **flags}).check()


def test_the_mtp_module_is_what_transformers_mtp_layer_computes_from_the_exported_weights():
    """fastpar's depth-1 logits against transformers' own ``MtpLayer`` (the MTP drafter's layer:
    [enorm(e); hnorm(h)] -> eh_proj -> a ``DeepseekV3DecoderLayer`` -> post_norm, the shared
    head) holding the exported ``model.layers.{L}.*`` tensors, on the HF model's last hidden
    state before its final norm: the names mean what DeepSeek-V3's mean."""
    transformers = pytest.importorskip("transformers")
    layers = pytest.importorskip("transformers.modeling_layers")
    from _parity import agree, exact_copy
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    from fastpar.models.mtp import tokens
    from fastpar.moe.layer import aux_loss_scale
    from fastpar.parity import reduction_length
    from fastpar.tolerance import nudge

    cfg = DeepSeekConfig(**HF, mtp_depth=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*build_deepseek(cfg))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms start at one: move them, so a swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.add_(0.1 * torch.randn(b.shape, generator=g))
    hf_state = to_hf(dict(model.state_dict()), cfg)
    config = transformers.AutoConfig.for_model(**hf_config(cfg))
    hf = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    main = {k: v for k, v in hf_state.items() if not is_mtp_name(k, cfg)}
    hf.load_state_dict(main, strict=True)
    prefix = f"model.layers.{cfg.layers}."
    norm = ds.DeepseekV3RMSNorm
    mtp = layers.MtpLayer(config, ds.DeepseekV3DecoderLayer, norm, cfg.layers)
    mtp.eval()
    rename = {
        "shared_head.norm.": "post_norm.",
        "enorm.": "enorm.",
        "hnorm.": "hnorm.",
        "eh_proj.": "eh_proj.",
    }
    theirs = {}
    for k, v in hf_state.items():
        if not k.startswith(prefix) or k.endswith(("embed_tokens.weight", "head.weight")):
            continue
        rest = k[len(prefix) :]
        head = next((a for a in rename if rest.startswith(a)), None)
        theirs[rename[head] + rest[len(head) :] if head else "mtp_block." + rest] = v
    mtp.load_state_dict(theirs, strict=True)
    t = cfg.seq_len
    ids = torch.randint(0, cfg.vocab_size, (2, t), generator=torch.Generator().manual_seed(2))
    seen = {}
    hook = hf.model.norm.register_forward_hook(lambda m, args, out: seen.update(h=args[0]))
    with torch.no_grad(), aux_loss_scale(None):
        hf(ids)
        hook.remove()
        pos = torch.arange(t - 1).expand(2, -1)
        e = hf.model.embed_tokens(ids[:, 1:])
        mask = torch.full((t - 1, t - 1), float("-inf")).triu(1)[None, None].expand(2, 1, -1, -1)
        rope = hf.model.rotary_emb(e, position_ids=pos)
        out = mtp(e, seen["h"][:, :-1], rope, mask, pos, None)
        want = hf.lm_head(out)  # [2, t - 1, vocab]
        model.train()
        twin = exact_copy(model).float()
        nudge(twin, seed=1)
        runs = []
        for m in (model, twin, exact_copy(model)):
            with tokens(ids):
                runs.append(m(ids).depths[0].view(2, t, -1)[:, : t - 1, : cfg.vocab_size])
        length = reduction_length(model, ids)
        agree(want, runs[:2], runs[2], "MtpLayer's depth-1 logits", length=length)
