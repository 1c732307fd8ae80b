"""Adam-mini (lowmemopt.AdamMini) against adam-mini's Adam_mini on a tiny LLaMA: the name rules and every block kind
at 32 bits bit for bit, the name sets users extend, 8- and 4-bit m with fp32 block moments, safetensors resume and
format conversion. (The common suite, on unnamed tensors: tests/optim_info.py; FSDP2: tests/dist_worker.py.)"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import lowmemopt

adam_mini = pytest.importorskip("adam_mini")
transformers = pytest.importorskip("transformers")

KW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, dim=64, n_heads=4, n_kv_heads=2)


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attention_bias=True,
    )
    return transformers.LlamaForCausalLM(config)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (4, 16), generator=gen) for _ in range(start + steps)]
    for x in batches[start:]:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def reference(model: torch.nn.Module, **kw) -> torch.optim.Optimizer:
    with contextlib.redirect_stdout(io.StringIO()):  # (it prints every block it finds)
        return adam_mini.Adam_mini(model.named_parameters(), verbose=False, **{**KW, **kw})


def ours(model: torch.nn.Module, **kw) -> lowmemopt.AdamMini:
    return lowmemopt.AdamMini(model.named_parameters(), verbose=False, **{**KW, **kw})


def test_block_partition_of_a_llama():
    """Embeddings, the head, v, o and the MLP per output neuron; q and k per head; norms one block; biases Adam."""
    model = tiny_llama()
    opt = ours(model)
    blocks = {g["name"]: g["block"] for g in opt.param_groups}
    assert blocks["model.embed_tokens.weight"] == blocks["lm_head.weight"] == "neuron"
    attn = "model.layers.0.self_attn"
    assert blocks[f"{attn}.q_proj.weight"] == blocks[f"{attn}.k_proj.weight"] == "head"
    for name in ("v_proj", "o_proj"):
        assert blocks[f"model.layers.0.self_attn.{name}.weight"] == "neuron"
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert blocks[f"model.layers.1.mlp.{name}.weight"] == "neuron"
    assert blocks["model.norm.weight"] == blocks["model.layers.0.input_layernorm.weight"] == "tensor"
    assert blocks["model.layers.0.self_attn.q_proj.bias"] == "element"
    wd = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert wd["model.norm.weight"] == wd["model.layers.0.self_attn.q_proj.bias"] == 0.0 and wd["lm_head.weight"] == 0.1
    train(model, opt, 1)
    attn = model.model.layers[0].self_attn
    assert opt.state[attn.k_proj.weight]["exp_avg_sq_mean"].shape == (2, 1)  # 2 KV heads of 64 * 64 / 4 elements
    assert opt.state[attn.q_proj.weight]["exp_avg_sq_mean"].shape == (4, 1)
    assert opt.state[model.model.norm.weight]["exp_avg_sq_mean"].shape == ()
    assert opt.state[attn.q_proj.bias]["exp_avg_sq"].shape == attn.q_proj.bias.shape
    assert opt.state[model.lm_head.weight]["exp_avg_sq_mean"].dtype == torch.float32


@pytest.mark.parametrize("kw", [{}, dict(weight_decay=0.0, betas=(0.8, 0.95), eps=1e-6)])
def test_equals_adam_mini_bit_for_bit(kw):
    a, b = tiny_llama(), tiny_llama()
    ref, opt = reference(a, **kw), ours(b, **kw)
    train(a, ref, 6)
    train(b, opt, 6)
    bad = [name for (name, p), q in zip(a.named_parameters(), b.parameters()) if not torch.equal(p, q)]
    assert not bad, bad
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(ref.state[p]["m"].view(q.shape), opt.state[q]["exp_avg"])  # (its q / k m: [heads, -1])


def test_name_sets_users_extend():
    """A model whose attention is named otherwise: adding its keywords to the sets before the first step places the
    blocks as the reference does with the same additions."""

    def model():
        torch.manual_seed(0)
        linear = torch.nn.Linear
        return torch.nn.ModuleDict(dict(c_q=linear(8, 8), c_k=linear(8, 8), proj=linear(8, 3)))

    def steps(m, opt):
        for t in range(4):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(t))
            m["proj"](m["c_q"](x) * m["c_k"](x)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    a, b = model(), model()
    with contextlib.redirect_stdout(io.StringIO()):
        ref = adam_mini.Adam_mini(a.named_parameters(), lr=1e-2, dim=8, n_heads=2, verbose=False)
    opt = lowmemopt.AdamMini(b.named_parameters(), lr=1e-2, dim=8, n_heads=2, verbose=False)
    for o in (ref, opt):
        o.wqk_names.update({"c_q", "c_k"})
        o.mlp_names.add("proj")
    steps(a, ref)
    steps(b, opt)
    assert [g["block"] for g in opt.param_groups] == ["head", "element", "head", "element", "neuron", "element"]
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_quantized_m_and_fp32_block_moments():
    """8 / 4 bits: m in codes, the block second moments fp32 at their block shapes; ~1 byte per parameter at 8 bits
    plus 4 per block; the trajectory close to 32-bit's."""
    runs = {}
    for bits in (32, 8, 4):
        model = tiny_llama()
        opt = ours(model, state_bits=bits, min_quant_numel=256, block_size=64 if bits == 8 else 32)
        train(model, opt, 8)
        runs[bits] = (model, opt)
    numel = sum(p.numel() for p in runs[8][0].parameters())
    for bits in (8, 4):
        model, opt = runs[bits]
        head = model.lm_head.weight
        st = opt.state[head]
        assert st["exp_avg.codes" if bits == 8 else "exp_avg.nibbles"].dtype == torch.uint8
        assert st["exp_avg_sq_mean"].dtype == torch.float32 and st["exp_avg_sq_mean"].shape == (128, 1)
        drift = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), runs[32][0].parameters()))
        assert drift < 8 * 1e-2 * 0.5, (bits, drift)  # well under the 8 steps' travel of lr per step
    per_param = runs[8][1].state_nbytes() / numel
    assert 1.0 < per_param < 1.3, per_param


def test_safetensors_resume_and_conversion(tmp_path):
    """save_state / load_state by parameter name: a fresh optimizer resumes bit for bit, and 32-bit state loads into
    an 8-bit optimizer (m re-encoded, the block moments kept)."""
    full_model = tiny_llama()
    train(full_model, ours(full_model), 6)
    model = tiny_llama()
    opt = ours(model)
    train(model, opt, 3)
    lowmemopt.save_state(opt, tmp_path / "opt.safetensors", model=model)
    fresh = ours(model)
    lowmemopt.load_state(fresh, tmp_path / "opt.safetensors", model=model)
    train(model, fresh, 3, start=3)
    for p, q in zip(model.parameters(), full_model.parameters()):
        assert torch.equal(p, q)
    small = ours(model, state_bits=8, min_quant_numel=256, block_size=64)
    lowmemopt.load_state(small, tmp_path / "opt.safetensors", model=model)
    st, st32 = small.state[model.lm_head.weight], opt.state[model.lm_head.weight]
    assert st["exp_avg.codes"].dtype == torch.uint8 and torch.equal(st["exp_avg_sq_mean"], st32["exp_avg_sq_mean"])
    train(model, small, 1, start=6)


def test_bad_inputs():
    model = tiny_llama()
    with pytest.raises(TypeError, match="named parameters"):
        lowmemopt.AdamMini([3], verbose=False)
    with pytest.raises(ValueError, match="is not a whole number"):
        lowmemopt.AdamMini(model.named_parameters(), dim=64, n_heads=5, verbose=False)
    with pytest.raises(ValueError, match="not whole heads"):  # (4096 elements are not k heads of 576)
        lowmemopt.AdamMini(model.named_parameters(), dim=48, n_heads=4, verbose=False)
    with pytest.raises(ValueError, match="Invalid n_kv_heads"):
        lowmemopt.AdamMini(model.named_parameters(), dim=64, n_heads=4, n_kv_heads=3, verbose=False)


def test_verbose_reports_the_blocks_found(capsys):
    opt = lowmemopt.AdamMini(torch.nn.Linear(3, 2).named_parameters())
    opt.param_groups[0]["params"][0].grad = torch.ones(2, 3)
    opt.step()
    err = capsys.readouterr().err
    assert "Adam-mini found" in err and "optimizer.embd_names" in err
