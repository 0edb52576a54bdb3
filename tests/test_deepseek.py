"""The fastpar DeepSeek (multi-head latent attention + DeepSeekMoE) against Hugging Face's
``DeepseekV3ForCausalLM`` (logits, loss and every gradient, the weights mapped both ways, low-rank
query on and off, YaRN on; HF's weights at TP 2 x EP 2 too) and against its single-process
self under tensor / sequence parallelism (every parameter's gradient on every rank), with the
check shown to fail when the rotary key's TP region is removed; ``fastpar.verify --model
deepseek`` (TP x DP x EP, and with PP and SP); a checkpoint trained at dp x tp x pp x ep
exported and loaded by from_pretrained.

Judged as tests/test_models_llama.py judges the Llama (``fastpar.tolerance``'s rule): against
fastpar's single-process model in float64, with the fp32 model and its twin (every weight one
ulp away) as the measure of rounding; against HF, HF's fp32 run is the one judged."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _flags import tiny_config
from _mesh import make_mesh
from _parity import agree, exact_copy, local_slice

from fastpar.checkpoint import import_state_dict
from fastpar.comm import gather_from_region
from fastpar.models import DeepSeekConfig, build_deepseek, deepseek_loss
from fastpar.models.deepseek_hf import from_hf, hf_config, to_hf
from fastpar.moe.layer import aux_loss_scale
from fastpar.nn.marks import param_layout
from fastpar.parity import reduction_length
from fastpar.testing import run_ranks
from fastpar.tolerance import nudge

ROUTING = dict(router_score="sigmoid", expert_bias=True, aux_loss="none")
# odd sizes: v_head_dim != q/k head dim, rope != nope, vocab not a multiple of TP
VARIANTS = {
    "qlora-yarn-interleaved-groups-shared": dict(
        vocab_size=61,
        hidden=32,
        heads=4,
        ffn=40,
        q_lora_rank=12,
        kv_lora_rank=10,
        qk_rope_head_dim=4,
        qk_nope_head_dim=6,
        v_head_dim=5,
        first_k_dense=1,
        num_experts=4,
        top_k=2,
        moe_ffn=8,
        router_groups=2,
        router_group_topk=1,
        shared_expert_ffn=16,
        routed_scaling_factor=2.5,
        yarn_factor=2.0,
        yarn_original_seq_len=8,
        yarn_mscale=0.7,
        yarn_mscale_all_dim=1.0,
        **ROUTING,
    ),
    "noq-yarn-halves-tied-raw-topk": dict(
        vocab_size=59,
        hidden=24,
        heads=2,
        ffn=30,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=6,
        qk_nope_head_dim=4,
        v_head_dim=7,
        rope_interleave=False,
        tie_embeddings=True,
        first_k_dense=0,
        num_experts=6,
        top_k=3,
        moe_ffn=6,
        norm_topk_prob=False,
        yarn_factor=4.0,
        yarn_original_seq_len=4,
        yarn_mscale_all_dim=0.5,
        **ROUTING,
    ),
    "qlora-plain-rope-no-bias-two-dense": dict(
        vocab_size=53,
        hidden=24,
        heads=4,
        ffn=20,
        q_lora_rank=8,
        kv_lora_rank=6,
        qk_rope_head_dim=2,
        qk_nope_head_dim=6,
        v_head_dim=4,
        first_k_dense=2,
        num_experts=4,
        top_k=2,
        moe_ffn=6,
        router_score="sigmoid",
        aux_loss="none",
        rope_theta=5e5,
        norm_eps=1e-5,
    ),
}


def _perturb_(model: torch.nn.Module, seed: int) -> None:
    """Norms start at one, routers near-uniform and the expert bias at zero: move them, so a
    swapped or missing norm, router or bias shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif "router" in name or name.endswith("mlp.gate.weight"):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                b.add_(0.1 * torch.randn(b.shape, generator=g))


def _fastpar_model(cfg: DeepSeekConfig, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*build_deepseek(cfg))
    _perturb_(model, seed + 1)
    return model


def _three(model: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    twin = exact_copy(model).float()
    nudge(twin, seed=1)
    return model, twin, exact_copy(model)


def _agree(actual, runs, what: str, length: int):
    return agree(actual, list(runs[:2]), runs[2], what, length=length)


def _hf_model(cfg_dict: dict):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**cfg_dict)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )
    return model.float().eval()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and the routers' expert_bias buffers, by global name."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, and zeros for each expert_bias (a buffer: no gradient)."""
    out = {k: p.grad for k, p in model.named_parameters()}
    out.update({k: torch.zeros_like(b) for k, b in model.named_buffers() if "expert_bias" in k})
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_and_every_gradient_equal_hf(name):
    cfg = DeepSeekConfig(layers=3, seq_len=16, **VARIANTS[name])
    ours = _fastpar_model(cfg)
    hf = _hf_model(hf_config(cfg))
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    hf.load_state_dict(to_hf(_state(ours), cfg), strict=True)
    torch.manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (3, 13))
    targets = torch.randint(0, cfg.vocab_size, (3, 13))
    length = reduction_length(ours, ids)
    logits, losses, grads = [], [], []
    for model in _three(ours):
        with aux_loss_scale(None):  # HF's loss has no router aux loss
            out = model(ids)
        loss = deepseek_loss(out, targets, cfg)
        loss.backward()
        logits.append(out.detach().view(3, 13, -1))
        losses.append(loss.detach())
        grads.append(to_hf(_grads(model), cfg))
    want = hf(ids).logits
    _agree(want.detach(), logits, "HF's logits", length)
    want_loss = torch.nn.functional.cross_entropy(want.flatten(0, 1), targets.flatten())
    _agree(want_loss.detach(), losses, "HF's loss", length)
    want_loss.backward()
    hf_params = dict(hf.named_parameters(remove_duplicate=False))
    assert set(hf_params) <= set(grads[0])
    for k in hf_params:
        if hf_params[k].numel() == 0:  # n_shared_experts = 0: zero-width projections
            continue
        _agree(hf_params[k].grad, [g[k] for g in grads], f"HF's gradient of {k}", length)


def test_yarn_and_interleave_change_the_function():
    """The variants above would pass vacuously if YaRN or the interleaved layout did nothing:
    each changes the logits of the same weights."""
    cfg = DeepSeekConfig(layers=2, seq_len=16, **VARIANTS["qlora-yarn-interleaved-groups-shared"])
    model = _fastpar_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids)
        for change in (
            dict(
                yarn_factor=None,
                yarn_original_seq_len=None,
                yarn_mscale=1.0,
                yarn_mscale_all_dim=0.0,
            ),
            dict(rope_interleave=False),
        ):
            other = torch.nn.Sequential(*build_deepseek(dataclasses.replace(cfg, **change)))
            other.load_state_dict(model.state_dict())
            assert (other(ids) - base).abs().max() > 1e-3, change


@pytest.mark.parametrize("name", list(VARIANTS))
def test_from_hf_loads_an_hf_model_and_maps_back_bit_for_bit(name):
    cfg = DeepSeekConfig(layers=3, seq_len=16, **VARIANTS[name])
    torch.manual_seed(3)
    hf = _hf_model(hf_config(cfg))
    _perturb_(hf, 4)
    hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
    got_cfg, state = from_hf(hf_state, hf.config.to_dict())
    assert hf_config(got_cfg) == hf_config(cfg)
    model = torch.nn.Sequential(*build_deepseek(got_cfg))
    model.load_state_dict(state, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad(), aux_loss_scale(None):
        runs = [m(ids).view(2, 11, -1) for m in _three(model)]
        _agree(hf(ids).logits, runs, "HF's logits", reduction_length(model, ids))
    back = to_hf(state, got_cfg)
    assert set(back) == set(hf_state)
    for k, v in back.items():
        assert torch.equal(v, hf_state[k]), k


def test_hf_mapping_refuses_what_hf_does_not_compute():
    base = dict(layers=3, seq_len=16, **VARIANTS["qlora-plain-rope-no-bias-two-dense"])
    refused = {
        "moe_every=2 has no HF export": dict(moe_every=2, first_k_dense=0),
        "router_score='softmax' has no HF export: DeepSeek-V3 routes by sigmoid": dict(
            router_score="softmax"
        ),
        "capacity_factor=1.25 has no HF export": dict(capacity_factor=1.25),
        "shared_expert_ffn=7 has no HF export": dict(shared_expert_ffn=7),
        "groups of at least 2 experts": dict(router_groups=4, router_group_topk=2),
    }
    for message, change in refused.items():
        cfg = DeepSeekConfig(**{**base, **change})
        with pytest.raises(ValueError, match=message):
            hf_config(cfg)
        with pytest.raises(ValueError, match=message):
            to_hf({}, cfg)
    cfg = DeepSeekConfig(**base)
    state = _state(_fastpar_model(cfg))
    with pytest.raises(ValueError, match=r"have no HF name.*\['9.extra'\]"):
        to_hf({**state, "9.extra": torch.zeros(1)}, cfg)
    hf_state, config = to_hf(state, cfg), hf_config(cfg)
    bad = {
        "rope_type 'llama3' is not supported": {
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
        },
        "attention_bias=True is not supported": {"attention_bias": True},
        "num_key_value_heads=2 is not supported": {"num_key_value_heads": 2},
        "hidden_act='gelu' is not supported": {"hidden_act": "gelu"},
        "model_type 'llama' is not 'deepseek_v3'": {"model_type": "llama"},
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            from_hf(hf_state, {**config, **change})
    with pytest.raises(ValueError, match=r"1 tensors have no fastpar name"):
        from_hf({**hf_state, "model.layers.3.mlp.gate.weight": torch.zeros(1)}, config)


@pytest.mark.parametrize(
    "kwargs,tp,message",
    [
        (dict(heads=6), 4, "heads 6 are not divisible by tp 4"),
        (dict(qk_rope_head_dim=5), 1, "qk_rope_head_dim 5 must be even"),
        (dict(q_lora_rank=0), 1, "q_lora_rank must be >= 1, or None"),
        (dict(ffn=50, first_k_dense=1), 4, "ffn 50 of the dense blocks is not divisible by tp 4"),
        (dict(yarn_mscale_all_dim=1.0), 1, "the yarn_\\* options need YaRN on"),
        (dict(yarn_factor=-2.0), 1, "yarn_factor -2.0 must be a positive finite number"),
        (dict(first_k_dense=-1), 1, "first_k_dense must be >= 0"),
        (dict(first_k_dense=4, layers=4), 1, None),  # all dense: fine at ep 1
    ],
)
def test_config_errors_name_the_value_and_the_fix(kwargs, tp, message):
    cfg = DeepSeekConfig(**kwargs)
    if message is None:
        cfg.check(tp=tp)
        with pytest.raises(ValueError, match=r"ep=2 needs MoE layers.*first_k_dense 4"):
            cfg.check(ep=2)
        return
    with pytest.raises(ValueError, match=message):
        cfg.check(tp=tp)


# -- tensor / sequence parallel: every rank against the single-process model -----------------
def _local(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    layout = param_layout(p)
    if layout is None or layout.kind == "replicated":
        return full
    return local_slice(full, p, layout.fused)


def _single_process(cfg: DeepSeekConfig):
    """The initial weights, moved weights, a batch, and the fp32 / twin / float64 runs' logits,
    losses and gradients of the single-process model; the longest reduction."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*build_deepseek(cfg))
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    _perturb_(model, 1)
    state = _state(model)
    torch.manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    logits, losses, grads = [], [], []
    for m in _three(model):
        out = m(ids)
        loss = deepseek_loss(out, targets, cfg)
        loss.backward()
        logits.append(out.detach())
        losses.append(loss.detach())
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    return initial, state, (ids, targets), (logits, losses, grads), reduction_length(model, ids)


def _tp_mismatches(cfg, tp, initial, state, batch, want, length) -> list[str]:
    """Run the TP model on this rank: initial weights bit for bit and the logits and loss must
    agree (assert); returns the names of the parameters whose gradient does not."""
    mesh = make_mesh(tp=tp)
    torch.manual_seed(0)
    par = torch.nn.Sequential(*build_deepseek(cfg, mesh))
    params = dict(par.named_parameters())
    assert list(params) == list(initial)
    for name, p in params.items():
        assert torch.equal(p.detach(), _local(initial[name], p)), f"initial {name}"
    with torch.no_grad():
        for name, b in par.named_buffers():
            if name in state:
                b.copy_(state[name])
    import_state_dict({k: v for k, v in state.items() if k in params}, params)
    (ids, targets), (ref_logits, ref_losses, ref_grads) = batch, want
    rank = mesh.tp_rank
    logits = par(ids)
    full = gather_from_region(logits, mesh.tp_group, dim=-1)[:, : cfg.vocab_size]
    _agree(full, ref_logits, f"logits on TP rank {rank}", length)
    loss = deepseek_loss(logits, targets, cfg, mesh)
    _agree(loss, ref_losses, f"loss on TP rank {rank}", length)
    loss.backward()
    bad = []
    for name, p in params.items():
        assert p.grad is not None, f"no gradient for {name}"
        try:
            _agree(p.grad, [_local(g[name], p) for g in ref_grads], name, length)
        except AssertionError:
            bad.append(name)
    return bad


def _tp_parity(*args) -> None:
    bad = _tp_mismatches(*args)
    assert not bad, f"gradients that disagree on TP rank {dist.get_rank()}: {bad}"


def _tp_parity_without_the_k_pe_region(*args) -> list[str]:
    """The same with the rotary key's copy-to-region removed (identity both ways)."""
    import fastpar.models.mla as mla

    mla.copy_to_region = lambda x, group=None: x  # this forked rank only
    return _tp_mismatches(*args)


BASE = dict(
    vocab_size=53,
    seq_len=8,
    hidden=24,
    heads=4,
    ffn=20,
    q_lora_rank=10,
    kv_lora_rank=8,
    qk_rope_head_dim=4,
    qk_nope_head_dim=6,
    v_head_dim=5,
    layers=2,
    first_k_dense=1,
    num_experts=4,
    top_k=2,
    moe_ffn=6,
    router_score="sigmoid",
    expert_bias=True,
    router_groups=2,
    router_group_topk=1,
    shared_expert_ffn=8,
    routed_scaling_factor=2.0,
    aux_loss="sequence",
    yarn_factor=2.0,
    yarn_original_seq_len=4,
    yarn_mscale_all_dim=1.0,
)
TP_CASES = {
    "qlora-tp2": (dict(), 2),
    "qlora-sp-tp2": (dict(sequence_parallel=True), 2),
    "noq-halves-tied-tp2": (dict(q_lora_rank=None, rope_interleave=False, tie_embeddings=True), 2),
    "qlora-tp4": (dict(), 4),
    "noq-sp-tp4": (dict(q_lora_rank=None, sequence_parallel=True), 4),
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_equals_single_process_on_every_rank(case):
    kwargs, tp = TP_CASES[case]
    cfg = DeepSeekConfig(**{**BASE, **kwargs})
    run_ranks(_tp_parity, tp, cfg, tp, *_single_process(cfg))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "sp-tp2"])
def test_without_the_rotary_key_region_the_gradients_disagree(sp):
    """k_pe (one activation broadcast into every local head) without its copy-to-region:
    logits and loss still agree, but each rank's kv_a (the replicated down projection holding
    k_pe's rows) gets only its own heads' gradient — the check must name it on every rank."""
    cfg = DeepSeekConfig(**{**BASE, "sequence_parallel": sp})
    results = run_ranks(_tp_parity_without_the_k_pe_region, 2, cfg, 2, *_single_process(cfg))
    for bad in results:
        assert any(name.endswith("attn.kv_a.weight") for name in bad), bad


# -- the trainer and fastpar.verify -------------------------------------------------------------
SMALL = tiny_config(steps=3, layers=3)
DEEPSEEK_ROUTING = dict(
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


@pytest.mark.parametrize(
    "layout",
    [
        # (tests/test_deepseek_parallel.py runs tp2 x pp2 x dp2 x ep2 with MTP in the CPU tier)
        pytest.param(dict(tp=2, dp=2, ep=2, pp=1, zero=1), marks=pytest.mark.slow),
        pytest.param(
            dict(tp=2, dp=2, ep=2, pp=2, zero=1, sequence_parallel=True), marks=pytest.mark.slow
        ),
    ],
    ids=["tp2-dp2-ep2-z1", "tp2-pp2-dp2-ep2-sp-z1"],
)
def test_verify_deepseek_agrees(layout):
    """``fastpar.verify --model deepseek``: the trainer's run equals the single-process model
    (losses, grad norms, every parameter and expert bias after 3 steps)."""
    from fastpar.train import TrainConfig
    from fastpar.verify import compare

    cfg = TrainConfig(model_type="deepseek", **SMALL, **DEEPSEEK_ROUTING, **layout)
    assert cfg.moe_every == 1 and cfg.model().is_moe(1) and not cfg.model().is_moe(0)
    ok, text = compare(cfg)
    assert ok, text
    assert text.endswith("AGREE")


def test_trainer_flags_of_the_other_models_are_refused():
    from fastpar.train import TrainConfig

    for kwargs, message in [
        (dict(model_type="llama", kv_lora_rank=16), "--kv-lora-rank is a DeepSeek option"),
        (dict(model_type="gpt", yarn_factor=2.0), "--yarn-factor is a DeepSeek option"),
        (dict(model_type="deepseek", kv_heads=2), "--kv-heads is a Llama option"),
        (
            dict(model_type="deepseek", cp=2, cp_attention="all-to-all", heads=2),
            "--cp-attention all-to-all scatters this rank's 1 query heads",
        ),
        (dict(model_type="deepseek", heads=3), "heads 3 are not divisible by tp 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            TrainConfig(**{**SMALL, "tp": 2, "pp": 1, "dp": 2, "ep": 2, **kwargs}).check()


@pytest.mark.slow  # (test_deepseek_parallel.py exports a pp 2 checkpoint with MTP in the CPU tier)
def test_a_checkpoint_trained_at_dp_tp_pp_ep_exports_to_hf(tmp_path):
    """Trained at dp 2 x tp 2 x pp 2 x ep 2 with DeepSeek-V3 routing (the expert bias moved by
    the steps), exported by ``python -m fastpar.export``'s code and loaded by transformers'
    from_pretrained (its default experts implementation): the same logits as the
    single-process fastpar model holding the checkpoint's tensors, expert biases included."""
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    from fastpar.export import export, fastpar_model
    from fastpar.train import TrainConfig, launch

    ckpt = tmp_path / "ckpt"
    cfg = TrainConfig(
        model_type="deepseek",
        **{**SMALL, "steps": 2},
        **DEEPSEEK_ROUTING,
        tp=2,
        pp=2,
        dp=2,
        ep=2,
        checkpoint_dir=str(ckpt),
        save_every=2,
    )
    launch(cfg)
    _, state, config = export(str(ckpt / "step_000002"), str(tmp_path / "hf"))
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert any(state[k].abs().max() > 0 for k in state if k.endswith("expert_bias"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    )
    ours = fastpar_model(cfg, state).model
    ids = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), aux_loss_scale(None):
        runs = [m(ids).view(2, 16, -1) for m in _three(ours)]
        _agree(hf(ids).logits, runs, "from_pretrained's logits", reduction_length(ours, ids))


def _hf_weights_at_tp2_ep2(config, hf_state, batch, runs, length) -> None:
    """HF's weights in a TP 2 x EP 2 (x DP 2) fastpar model, every rank on the same batch:
    logits, loss and every gradient against the single-process model holding them (an
    expert's gradient sums both EP ranks' tokens: twice the single-process one)."""
    from fastpar.checkpoint.state import localize
    from fastpar.mesh.placement import is_expert

    mesh = make_mesh(tp=2, ep=2, dp=2)
    cfg, state = from_hf(hf_state, config)
    par = torch.nn.Sequential(*build_deepseek(cfg, mesh))
    params = dict(par.named_parameters())
    import_state_dict(state, params)
    with torch.no_grad():
        for name, b in par.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(state[name])
    (ids, targets), (logits, losses, grads) = batch, runs
    with aux_loss_scale(None):
        out = par(ids)
    full = gather_from_region(out, mesh.tp_group, dim=-1)[:, : cfg.vocab_size]
    _agree(full, logits, f"logits on rank {dist.get_rank()}", length)
    loss = deepseek_loss(out, targets, cfg, mesh)
    _agree(loss, losses, f"loss on rank {dist.get_rank()}", length)
    loss.backward()
    for name, p in params.items():
        scale = 2 if is_expert(p) else 1
        want = [localize(scale * g[name], p) for g in grads]
        _agree(p.grad, want, f"grad of {name} on rank {dist.get_rank()}", length)


def test_hf_weights_at_tp2_ep2_give_hf_logits_and_gradients():
    cfg = DeepSeekConfig(layers=3, seq_len=16, **VARIANTS["qlora-yarn-interleaved-groups-shared"])
    torch.manual_seed(2)
    hf = _hf_model(hf_config(cfg))
    _perturb_(hf, 3)
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    got_cfg, state = from_hf(hf_state, hf.config.to_dict())
    single = torch.nn.Sequential(*build_deepseek(got_cfg))
    single.load_state_dict(state, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    length = reduction_length(single, ids)
    logits, losses, grads = [], [], []
    for m in _three(single):
        with aux_loss_scale(None):
            out = m(ids)
        loss = deepseek_loss(out, targets, got_cfg)
        loss.backward()
        logits.append(out.detach())
        losses.append(loss.detach())
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    want = hf(ids).logits
    _agree(want.detach().flatten(0, 1), logits, "HF's logits", length)
    torch.nn.functional.cross_entropy(want.flatten(0, 1), targets.flatten()).backward()
    zeros = {k: torch.zeros_like(b) for k, b in single.named_buffers() if "expert_bias" in k}
    mapped = [to_hf({**g, **zeros}, got_cfg) for g in grads]
    for k, p in hf.named_parameters():
        if p.numel():
            _agree(p.grad, [g[k] for g in mapped], f"HF's gradient of {k}", length)
    runs = (logits, losses, grads)
    run_ranks(
        _hf_weights_at_tp2_ep2, 4, hf.config.to_dict(), hf_state, (ids, targets), runs, length
    )
