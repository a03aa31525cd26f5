"""LoRA adapters (policy/adapters.py): equivalence with the base and the merged model, adapter checkpoints
with their base by reference, exact resume, the weight push's merged tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rubricem_core import scaffold
from rubricem_core.config import LoraSettings
from rubricem_core.policy.loading import PolicyLoadError, load_for_training, load_policy, servable_dir
from rubricem_core.rollout.weight_transfer import ModelWeights
from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy
from rubricem_core.training import CheckpointError, TrainerConfig, make_trainer
from rubricem_core.training.adapters import ADAPTER_WEIGHTS, AdapterDisabled, is_adapter_dir, merged_state_dict
from tests.tiny_models import one_thread  # noqa: F401 (an autouse fixture)

pytest.importorskip("peft")

LORA = LoraSettings(rank=4, alpha=8)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    texts = [scaffold.system_prompt(), scaffold.EXAMPLE_TRACE] * 4
    spec = TinyPolicySpec(vocab_size=600, hidden_size=32, n_layers=2, n_heads=2, n_kv_heads=1, seed=0)
    return build_tiny_policy(texts, tmp_path_factory.mktemp("lora") / "policy", spec)


def ids(seed: int = 0, n: int = 3, length: int = 24) -> torch.Tensor:
    return torch.randint(5, 500, (n, length), generator=torch.Generator().manual_seed(seed))


def lm_loss(model, batch):
    out = model(input_ids=batch, labels=batch)
    return out.loss, {"n_tokens": float(batch.numel())}


def trainer_config(**kw) -> TrainerConfig:
    return TrainerConfig(lr=1e-2, total_steps=10, device="cpu", **kw)


def adapter_step(base: Path, out: Path, seed: int):
    """(trainer, checkpoint): fresh adapters over ``base``, one step on batch ``seed``, saved to ``out``."""
    model, tok = load_for_training(base, "float32", trainer_config(), lora=LORA)
    trainer = make_trainer(model, trainer_config())
    trainer.step([ids(seed)], lm_loss)
    return trainer, trainer.save(out, tokenizer=tok)


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Non-zero B matrices, so the adapter changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_a_fresh_adapter_computes_the_base_model_exactly(base_dir):
    base, _ = load_policy(base_dir)
    wrapped, _ = load_for_training(base_dir, "float32", trainer_config(), lora=LORA)
    x = ids()
    assert torch.equal(wrapped(input_ids=x).logits, base(input_ids=x).logits)
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # all-linear: attention and MLP projections of every layer, never the output head
    assert {n.split(".")[-4] for n in trainable} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def test_merged_weights_give_the_adapter_models_logits(base_dir):
    wrapped, _ = load_for_training(base_dir, "float32", trainer_config(), lora=LORA)
    perturb(wrapped)
    merged = merged_state_dict(wrapped)
    plain, _ = load_policy(base_dir)
    assert set(merged) == set(plain.state_dict())  # the base's own names: what engines load
    plain.load_state_dict(merged)
    x = ids(1)
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=x).logits, wrapped(input_ids=x).logits, atol=1e-5)
        # the base is untouched by merging, and the adapter switched off is the base again
        reference, _ = load_policy(base_dir)
        assert torch.equal(AdapterDisabled(wrapped)(input_ids=x).logits, reference(input_ids=x).logits)
    # the weight push announces and sends the same names and tensors
    source = ModelWeights(wrapped)
    sent = dict(iter(source))
    assert [m.name for m in source.metadata()] == list(sent) or len(source.metadata()) >= len(sent)
    for name, tensor in merged.items():
        assert torch.equal(sent[name], tensor)


@pytest.mark.parametrize("kind", ["torch"])
def test_adapter_checkpoint_resumes_exactly_and_loads_merged(base_dir, tmp_path, kind):
    x = [ids(s) for s in range(4)]

    def trainer():
        model, tok = load_for_training(base_dir, "float32", trainer_config(backend=kind), lora=LORA)
        return make_trainer(model, trainer_config(backend=kind)), tok

    straight, tok = trainer()
    for batch in x:
        straight.step([batch], lm_loss)

    first, _ = trainer()
    for batch in x[:2]:
        first.step([batch], lm_loss)
    ckpt = first.save(tmp_path / "ckpt", tokenizer=tok)
    assert is_adapter_dir(ckpt) and not (ckpt / "model.safetensors").exists()
    meta = json.loads((ckpt / "checkpoint.json").read_text())["adapter"]
    assert meta["rank"] == 4 and Path(ckpt, meta["base"]).resolve() == base_dir.resolve()
    full_bytes = (base_dir / "model.safetensors").stat().st_size
    assert (ckpt / ADAPTER_WEIGHTS).stat().st_size < full_bytes / 3

    resumed, _ = trainer()
    resumed.load(ckpt)
    for batch in x[2:]:
        resumed.step([batch], lm_loss)
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name

    # evaluation and the HF engine read the checkpoint as a plain merged model
    merged, _ = load_policy(ckpt)
    assert not hasattr(merged, "peft_config")
    with torch.no_grad():
        expected = first.model(input_ids=x[0]).logits
        assert torch.allclose(merged(input_ids=x[0]).logits, expected, atol=1e-5)

    # a directory-loading engine (vLLM) gets a merged copy, written once
    served = servable_dir(ckpt)
    assert served != ckpt and (served / "config.json").is_file()
    again = AutoModelForCausalLM.from_pretrained(served)
    with torch.no_grad():
        assert torch.allclose(again(input_ids=x[0]).logits, expected, atol=1e-5)
    stamp = (served / "model.safetensors").stat().st_mtime_ns
    assert servable_dir(ckpt) == served and (served / "model.safetensors").stat().st_mtime_ns == stamp
    assert servable_dir(base_dir) == base_dir


def test_an_adapter_over_an_adapter_loads_through_its_chain(base_dir, tmp_path):
    """RL's adapter trains over SFT's merged adapter policy: both named by reference."""
    sft_trainer, sft_ckpt = adapter_step(base_dir, tmp_path / "sft", 0)
    rl_trainer, rl_ckpt = adapter_step(sft_ckpt, tmp_path / "rl", 1)
    x = ids(3)
    with torch.no_grad():
        # the RL reference (adapter off) is the SFT policy
        assert torch.allclose(
            AdapterDisabled(rl_trainer.model)(input_ids=x).logits, sft_trainer.model(input_ids=x).logits, atol=1e-5
        )
    loaded, _ = load_policy(rl_ckpt)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, rl_trainer.model(input_ids=x).logits, atol=1e-5)


def test_a_missing_or_changed_base_is_refused_by_name(base_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(base_dir, base)
    model, tok = load_for_training(base, "float32", trainer_config(), lora=LORA)
    ckpt = make_trainer(model, trainer_config()).save(tmp_path / "ckpt", tokenizer=tok)
    shutil.rmtree(base)
    with pytest.raises(PolicyLoadError, match="base model is missing"):
        load_policy(ckpt)

    sft, _ = load_for_training(base_dir, "float32", trainer_config(), lora=LORA)
    sft_ckpt = make_trainer(sft, trainer_config()).save(tmp_path / "sft", tokenizer=tok)
    rl, _ = load_for_training(sft_ckpt, "float32", trainer_config(), lora=LORA)
    rl_ckpt = make_trainer(rl, trainer_config()).save(tmp_path / "rl", tokenizer=tok)
    # the SFT checkpoint is saved again (a rerun): the RL adapter was trained on another base
    sft2 = make_trainer(sft, trainer_config())
    sft2.step([ids(0)], lm_loss)
    sft2.save(sft_ckpt, tokenizer=tok)
    with pytest.raises(PolicyLoadError, match="changed after the adapter was trained"):
        load_policy(rl_ckpt)


def test_resuming_an_adapter_checkpoint_without_adapters_is_refused(base_dir, tmp_path):
    model, tok = load_for_training(base_dir, "float32", trainer_config(), lora=LORA)
    ckpt = make_trainer(model, trainer_config()).save(tmp_path / "ckpt", tokenizer=tok)
    full, _ = load_for_training(base_dir, "float32", trainer_config())
    with pytest.raises(CheckpointError, match="policy.lora"):
        make_trainer(full, trainer_config()).load(ckpt)


def test_only_the_adapter_has_optimizer_state(base_dir):
    model, _ = load_for_training(base_dir, "float32", trainer_config(), lora=LORA)
    trainer = make_trainer(model, trainer_config())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.step([ids(0)], lm_loss)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    held = sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"])
    assert held == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert held < sum(p.numel() for p in model.parameters()) / 5


def test_export_writes_a_merged_directory_and_a_peft_adapter_that_agree(base_dir, tmp_path):
    from peft import PeftModel

    from rubricem_core.export import export_checkpoint

    _, sft_ckpt = adapter_step(base_dir, tmp_path / "sft", 0)
    rl_trainer, rl_ckpt = adapter_step(sft_ckpt, tmp_path / "rl", 1)

    done = export_checkpoint(rl_ckpt, tmp_path / "out")
    assert sorted(p.name for p in done.adapter.iterdir()) == sorted(
        [
            "adapter_config.json",
            "adapter_model.safetensors",
            "chat_template.jinja",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert not (done.merged / "trainer_state.pt").exists()
    x = ids(5)
    with torch.no_grad():
        want = rl_trainer.model(input_ids=x).logits
        merged = AutoModelForCausalLM.from_pretrained(done.merged)  # what vllm serve loads
        assert torch.allclose(merged(input_ids=x).logits, want, atol=1e-5)
        # peft alone, by the base name the adapter carries (SFT's merged copy: RL trained over it)
        base = AutoModelForCausalLM.from_pretrained(
            json.loads((done.adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
        )
        assert torch.allclose(PeftModel.from_pretrained(base, done.adapter)(input_ids=x).logits, want, atol=1e-5)
    with pytest.raises(FileExistsError):
        export_checkpoint(rl_ckpt, tmp_path / "out")  # never over an earlier export
