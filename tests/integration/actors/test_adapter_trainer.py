"""The service's trainer on the tiny model: adapters that learn, stay apart, and come back from disk."""

import pytest
import torch

from rlpost.actors.adapters import AdamParams, AdapterSpec, AdapterTrainer, Datum

pytestmark = pytest.mark.integration

SEQUENCE = [5, 6, 7, 8, 9, 10, 11, 12]
ADAM = AdamParams(learning_rate=1e-2)


def _datum(tokens=SEQUENCE) -> Datum:
    return Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(len(tokens) - 1)})


def _rl_datum(tokens=SEQUENCE) -> Datum:
    n = len(tokens) - 1
    return Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "logprobs": torch.full((n,), -6.0),
                               "advantages": torch.linspace(-1.0, 1.0, n)})  # fmt: skip


def _adapter(trainer: AdapterTrainer, model_id: str) -> dict[str, torch.Tensor]:
    return trainer.adapter_state(model_id)[1]


@pytest.fixture(scope="module")
def trainer(tiny_model_path):
    return AdapterTrainer(str(tiny_model_path))


def test_cross_entropy_steps_lower_the_loss_and_forward_only_changes_nothing(trainer):
    trainer.create("sft", AdapterSpec(rank=8, seed=0))
    losses = []
    for _ in range(4):
        losses.append(trainer.forward_backward("sft", [_datum()], "cross_entropy")["metrics"]["loss:sum"])
        trainer.optim_step("sft", ADAM)
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.7 * losses[0]
    before = _adapter(trainer, "sft")
    out = trainer.forward_backward("sft", [_datum()], "cross_entropy", backward=False)
    assert out["loss_fn_outputs"][0]["logprobs"].shape == (len(SEQUENCE) - 1,)
    assert all(p.grad is None for p in trainer._parameters("sft"))
    assert all(torch.equal(before[k], v) for k, v in _adapter(trainer, "sft").items())
    trainer.remove("sft")


def test_interleaved_models_end_as_each_does_alone(trainer):
    """Two models' forward_backward and optim_step calls interleaved give each the adapter it gets
    alone: exactly (separate parameters, separate optimizers, the same arithmetic)."""
    trainer.create("alone", AdapterSpec(rank=8, seed=1))
    for _ in range(3):
        trainer.forward_backward("alone", [_datum()], "cross_entropy")
        trainer.optim_step("alone", ADAM)
    alone = _adapter(trainer, "alone")
    trainer.remove("alone")

    trainer.create("first", AdapterSpec(rank=8, seed=1))
    trainer.create("second", AdapterSpec(rank=4, seed=2, train_mlp=False))
    for _ in range(3):
        trainer.forward_backward("first", [_datum()], "cross_entropy")
        trainer.forward_backward("second", [_rl_datum()], "ppo")
        trainer.optim_step("second", AdamParams(learning_rate=5e-2))
        trainer.optim_step("first", ADAM)
    together = _adapter(trainer, "first")
    assert together.keys() == alone.keys()
    assert all(torch.equal(together[name], alone[name]) for name in alone)
    assert trainer.info("second")["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    trainer.remove("first")
    trainer.remove("second")


def test_a_saved_model_resumes_with_its_optimizer_as_if_never_stopped(trainer, tmp_path):
    trainer.create("saved", AdapterSpec(rank=8, seed=3))
    trainer.forward_backward("saved", [_datum()], "cross_entropy")
    trainer.optim_step("saved", ADAM)
    trainer.save("saved", tmp_path / "ckpt", with_optimizer=True)
    trainer.forward_backward("saved", [_datum()], "cross_entropy")
    trainer.optim_step("saved", ADAM)
    uninterrupted = _adapter(trainer, "saved")
    trainer.remove("saved")

    info = trainer.load("resumed", tmp_path / "ckpt", with_optimizer=True)
    assert info["step"] == 1 and info["lora"]["rank"] == 8
    trainer.forward_backward("resumed", [_datum()], "cross_entropy")
    trainer.optim_step("resumed", ADAM)
    resumed = _adapter(trainer, "resumed")
    assert all(torch.allclose(resumed[k], uninterrupted[k], atol=1e-6) for k in uninterrupted)
    trainer.remove("resumed")


def test_bad_requests_name_what_is_wrong(trainer):
    trainer.create("bad", AdapterSpec(rank=8))
    vocab = trainer.vocab_size
    with pytest.raises(ValueError, match=f"outside the vocabulary \\[0, {vocab}\\)"):
        trainer.forward_backward("bad", [_datum([1, 2, vocab + 3])], "cross_entropy")
    short = Datum([1, 2, 3], {"target_tokens": torch.tensor([2, 3]), "weights": torch.ones(2)})
    with pytest.raises(ValueError, match="target_tokens: shape \\(2,\\), where the input has 3 tokens"):
        trainer.forward_backward("bad", [short], "cross_entropy")
    with pytest.raises(ValueError, match="unknown loss 'dpo'"):
        trainer.forward_backward("bad", [_datum()], "dpo")
    with pytest.raises(KeyError, match="no model 'nobody'"):
        trainer.optim_step("nobody", ADAM)
    with pytest.raises(ValueError, match="outside 1..64"):
        trainer.create("huge", AdapterSpec(rank=128))
    with pytest.raises(ValueError, match="without 'lora'"):
        trainer.create("my.lora", AdapterSpec(rank=8))
    trainer.remove("bad")


def test_models_parked_in_memory_and_on_disk_come_back_as_they_left(tiny_model_path, tmp_path):
    """One model in the trainer's model and one parked in memory: three models' steps interleaved,
    each parked between its forward_backward and its optim_step (its gradient pending), the
    oldest written to a file, end with exactly the adapters each gets alone; a removed parked
    model leaves no file behind."""
    alone = {}
    single = AdapterTrainer(str(tiny_model_path))
    specs = {"m-a": AdapterSpec(rank=8, seed=1), "m-b": AdapterSpec(rank=4, seed=2), "m-c": AdapterSpec(rank=8, seed=3)}
    for name, spec in specs.items():
        single.create(name, spec)
        for _ in range(2):
            single.forward_backward(name, [_datum()], "cross_entropy")
            single.optim_step(name, ADAM)
        alone[name] = _adapter(single, name)

    parking = AdapterTrainer(str(tiny_model_path), max_resident=1, max_parked_in_memory=1, spill_dir=str(tmp_path))
    for name, spec in specs.items():
        parking.create(name, spec)
    for _ in range(2):
        for name in specs:
            parking.forward_backward(name, [_datum()], "cross_entropy")
        for name in specs:
            parking.optim_step(name, ADAM)
    memory = parking.memory()
    assert (memory["resident"], memory["in_memory"], memory["on_disk"]) == (1, 1, 1)
    assert memory["spilled"] > 0 and memory["unparked"] > 0
    assert len(list(tmp_path.rglob("*.pt"))) == 1
    for name in specs:
        together = _adapter(parking, name)
        assert together.keys() == alone[name].keys()
        assert all(torch.equal(together[k], alone[name][k]) for k in together), name
    on_disk = next(name for name, p in parking.parked.items() if p.path is not None)
    parking.remove(on_disk)
    assert not list(tmp_path.rglob("*.pt")) and parking.memory()["on_disk"] == 0
