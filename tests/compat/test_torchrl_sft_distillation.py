"""TorchRL's SFTLoss and DistillationLoss tests (``test/llm/test_llm_objectives.py``: ``TestSFT``,
``TestDistillation``) and the two losses' docstring examples, run on rlpost.

The calls are TorchRL's with rlpost's imports and the offline tiny model (its tokenizer, the
trained tiny model as the student or reference, and a freshly initialised copy as a different
teacher) instead of OPT models and the OPT tokenizer. Where TorchRL checks shapes only, the port
also checks values against the tiny model's own log-probs.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from tensordict.nn import TensorDictModule

from rlpost.algo import k3_kl_token_estimate
from rlpost.data import History
from rlpost.envs import RetrieveLogProb
from rlpost.objectives import DistillationLoss, DistillationLossOutput, SFTLoss, SFTLossOutput
from rlpost.objectives.distillation import _distillation_loss
from rlpost.policies import ChatHistory, Text, TransformersWrapper

pytestmark = pytest.mark.compat

CHATS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "I'm doing well, thank you!"},
    ],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "I'm doing well, thank you very much!"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def other_model(tiny_model_path):
    """A teacher that differs from the student: the tiny architecture, freshly initialised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_path)).eval()


def history_wrapper(model, tokenizer, **kwargs):
    return TransformersWrapper(
        model, tokenizer=tokenizer, generate=False, chat_template_name="qwen", input_mode="history",
        pad_output=False, **kwargs,
    )  # fmt: skip


@pytest.fixture
def sft_data(tokenizer):
    """TorchRL's ``TestSFT.data``: two chats as a lazy stack with text, history and next."""
    history = History.from_chats(CHATS)
    assert history.shape == (2, 3)
    text = history[:, :-1].apply_chat_template(
        tokenizer=tokenizer, chat_template_name="qwen", add_generation_prompt=True
    )
    full_text = history.apply_chat_template(tokenizer=tokenizer, chat_template_name="qwen", add_generation_prompt=False)
    text_response = [txt[len(txt_start) :] for txt, txt_start in zip(full_text, text)]
    td = TensorDict(
        text=Text(prompt=text, response=text_response, full=full_text),
        history=ChatHistory(full=history, prompt=history[..., :-1], response=history[..., -1:]),
        next=TensorDict(
            reward=torch.randn(2, 1), done=torch.zeros(2, dtype=torch.bool), history=ChatHistory(prompt=history)
        ),
        batch_size=(2,),
    )
    return lazy_stack(list(td.unbind(0)))


@pytest.fixture
def distill_data():
    """TorchRL's ``TestDistillation.data``."""
    history = History.from_chats(CHATS)
    td = TensorDict(
        history=ChatHistory(full=history, prompt=history[..., :-1], response=history[..., -1:]),
        next=TensorDict(done=torch.zeros(2, dtype=torch.bool), history=ChatHistory(prompt=history)),
        batch_size=(2,),
    )
    return lazy_stack(list(td.unbind(0)))


def assistant_log_probs(model, tokenizer, chat) -> torch.Tensor:
    """The model's log-probs of one chat's assistant tokens (the hand-made reference)."""
    rendered = History.from_chats([chat])[0].apply_chat_template(
        tokenizer=tokenizer, chat_template_name="qwen", add_generation_prompt=False, return_assistant_tokens_mask=True
    )
    ids, mask = rendered["input_ids"], rendered["assistant_masks"].bool()
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
    lp = torch.cat([torch.zeros(1), torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)])
    return lp[mask]


# -------------------------------------------------------------------------------------- SFT


@pytest.mark.parametrize("loss_function", ["sft", "minor_sft"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize_by_seq_length", [True, False])
@pytest.mark.parametrize("kl_to_ref_coeff", [None, 0.1])
def test_sft(loss_function, reduction, normalize_by_seq_length, kl_to_ref_coeff, sft_data, hf_model, tokenizer):
    """TorchRL's ``TestSFT.test_sft``, plus the value of plain SFT from the tiny model."""
    policy_train = history_wrapper(hf_model, tokenizer)
    loss = SFTLoss(
        actor_network=policy_train,
        tokenizer=tokenizer,
        reduction=reduction,
        normalize_by_seq_length=normalize_by_seq_length,
        kl_to_ref_coeff=kl_to_ref_coeff if loss_function != "minor_sft" else None,
        loss_function=loss_function,
        beta=0.1,
        tokenizer_kwargs={"chat_template_name": "qwen"},
    )
    td = sft_data
    if kl_to_ref_coeff is not None or loss_function == "minor_sft":
        policy_ref = history_wrapper(hf_model, tokenizer, return_log_probs=True)
        transform = RetrieveLogProb(
            policy_ref,
            assistant_only=True,
            tokenizer_kwargs={"chat_template_name": "qwen"},
            tokenizer=tokenizer,
            log_probs_full_key=("ref_log_probs", "full"),
        )
        with torch.no_grad():
            transform(td)
    loss_vals = loss(td)
    assert isinstance(loss_vals, SFTLossOutput)
    if kl_to_ref_coeff is not None and loss_function != "minor_sft":
        assert loss_vals.loss_kl_to_ref.shape == ()
        assert loss_vals.kl_to_ref.shape == ()
        # the reference is the model itself: no KL
        assert loss_vals.kl_to_ref.item() == pytest.approx(0.0, abs=1e-5)
    assert loss_vals.loss_sft.shape == ((2,) if reduction == "none" else ())
    assert loss_vals.sum(reduce=True).shape == ()
    per_row = []
    for chat in CHATS:
        lp = assistant_log_probs(hf_model, tokenizer, chat)
        per_row.append(lp.mean() if normalize_by_seq_length else lp.sum())
    ll = torch.stack(per_row)
    if loss_function == "sft":
        expected = {"mean": -ll.mean(), "sum": -ll.sum(), "none": -ll}[reduction]
    else:  # the reference is the model: log sigmoid(0) per row
        value = torch.full((2,), -torch.nn.functional.logsigmoid(torch.zeros(())).item())
        expected = {"mean": value.mean(), "sum": value.sum(), "none": value}[reduction]
    torch.testing.assert_close(loss_vals.loss_sft.detach(), expected, rtol=1e-4, atol=1e-4)


def test_sft_assistant_only(sft_data, hf_model, tokenizer):
    """TorchRL's ``TestSFT.test_sft_assistant_only``: the reference transform returns its input,
    and the loss with a KL to it runs (and backpropagates)."""
    policy_train = TransformersWrapper(hf_model, tokenizer=tokenizer, generate=False, chat_template_name="qwen")
    policy_ref = TransformersWrapper(
        hf_model, tokenizer=tokenizer, generate=False, return_log_probs=True, chat_template_name="qwen"
    )
    transform = RetrieveLogProb(
        policy_ref,
        assistant_only=True,
        tokenizer_kwargs={"chat_template_name": "qwen"},
        tokenizer=tokenizer,
        log_probs_full_key=("ref_log_probs", "full"),
    )
    td = transform(sft_data)
    assert td is sft_data
    loss = SFTLoss(
        actor_network=policy_train,
        tokenizer=tokenizer,
        reduction="mean",
        normalize_by_seq_length=True,
        kl_to_ref_coeff=0.1,
        tokenizer_kwargs={"chat_template_name": "qwen"},
    )
    out = loss(td)
    out.sum(reduce=True).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in hf_model.parameters())
    hf_model.zero_grad(set_to_none=True)


def test_sft_docstring_example(tokenizer, hf_model):
    """SFTLoss's docstring example, with the text fields it builds by hand. Its policies pass
    ``from_text=True``, which TorchRL's own TransformersWrapper rejects at ae9719f (a stale
    docstring); the port builds them in history mode, the mode the loss feeds them. Its
    RetrieveLogProb gets ``log_probs_full_key=("ref_log_probs", "full")``: without it the
    reference's log-probs go to the model's own key, in TorchRL as in rlpost, and the example's
    ``"ref_log_probs" in data["next"]`` fails in TorchRL too. Its ``history=history`` entries
    are ``ChatHistory(full=history)``: the loss reads ``("history", "full")`` (TorchRL's default
    key too)."""
    history = History.from_chats(
        [
            [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello, how are you?"},
                {"role": "assistant", "content": "I'm doing well, thank you!"},
            ],
            [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What's the weather like?"},
                {"role": "assistant", "content": "I can't check the weather for you."},
            ],
        ]
    )
    policy_train = history_wrapper(hf_model, tokenizer)
    policy_ref = history_wrapper(hf_model, tokenizer, return_log_probs=True)
    transform = RetrieveLogProb(
        policy_ref,
        assistant_only=True,
        tokenizer_kwargs={"chat_template_name": "qwen"},
        tokenizer=tokenizer,
        log_probs_full_key=("ref_log_probs", "full"),
    )
    text = history[:, :-1].apply_chat_template(
        tokenizer=tokenizer, chat_template_name="qwen", add_generation_prompt=True
    )
    text_response = history.apply_chat_template(
        tokenizer=tokenizer, chat_template_name="qwen", add_generation_prompt=False
    )
    text_response = [txt[len(txt_start) :] for txt, txt_start in zip(text_response, text)]
    td = TensorDict(
        text=text,
        text_response=text_response,
        history=ChatHistory(full=history),
        next=TensorDict(
            reward=torch.randn(2, 1), done=torch.zeros(2, dtype=torch.bool), history=ChatHistory(full=history)
        ),
        batch_size=(2,),
    )
    data = lazy_stack(list(td.unbind(0)))
    data = transform(data)
    assert "ref_log_probs" in data["next"].keys()
    loss = SFTLoss(
        actor_network=policy_train,
        tokenizer=tokenizer,
        reduction="mean",
        normalize_by_seq_length=True,
        kl_to_ref_coeff=0.1,
        tokenizer_kwargs={"chat_template_name": "qwen"},
        loss_function="sft",
    )
    loss_vals = loss(data)
    assert torch.isfinite(loss_vals.loss_sft) and loss_vals.loss_sft.item() > 0
    assert loss_vals.loss_kl_to_ref.item() == pytest.approx(0.0, abs=1e-5)


# ----------------------------------------------------------------------------- distillation


def write_teacher_log_probs(td, model, tokenizer, log_probs_full_key=("teacher_log_probs", "full")):
    """TorchRL's ``TestDistillation._write_teacher_log_probs``."""
    teacher = history_wrapper(model, tokenizer, return_log_probs=True)
    transform = RetrieveLogProb(
        teacher,
        assistant_only=True,
        tokenizer_kwargs={"chat_template_name": "qwen"},
        tokenizer=tokenizer,
        log_probs_full_key=log_probs_full_key,
    )
    with torch.no_grad():
        transform(td)
    return td


def test_k3_kl_token_estimate():
    log_prob = torch.full((4,), -1.0)
    torch.testing.assert_close(k3_kl_token_estimate(log_prob, log_prob), torch.zeros(4))
    kl = k3_kl_token_estimate(torch.randn(64), torch.randn(64))
    assert kl.shape == (64,) and (kl >= 0).all()
    with pytest.raises(ValueError, match="same shape"):
        k3_kl_token_estimate(torch.zeros(3), torch.zeros(4))


def test_k3_kl_matches_closed_form():
    student = torch.tensor([-1.0, -2.0, -0.3])
    teacher = torch.tensor([-0.5, -2.5, -0.1])
    diff = teacher - student
    torch.testing.assert_close(k3_kl_token_estimate(teacher, student), diff.expm1() - diff)


def test_gradient_descends_toward_teacher():
    torch.manual_seed(0)
    teacher = torch.randn(64)
    student = torch.randn(64, requires_grad=True)
    kl_before = k3_kl_token_estimate(teacher, student).sum()
    kl_before.backward()
    with torch.no_grad():
        stepped = student - 0.1 * student.grad
    assert k3_kl_token_estimate(teacher, stepped).sum() < kl_before


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_distillation_loss_reduction_unit(reduction):
    summed_kl = torch.tensor([1.0, 2.0, 3.0])
    expected = {"mean": summed_kl.mean(), "sum": summed_kl.sum(), "none": summed_kl}[reduction]
    torch.testing.assert_close(_distillation_loss(summed_kl, reduction), expected)
    with pytest.raises(ValueError, match="Invalid reduction"):
        _distillation_loss(summed_kl, "not-a-reduction")


def test_distillation_invalid_direction():
    with pytest.raises(ValueError, match="kl_direction"):
        DistillationLoss(actor_network=None, kl_direction="sideways")
    with pytest.raises(ValueError, match="reduction"):
        DistillationLoss(actor_network=None, reduction="average")


def test_distillation_empty_sequence_in_multidimensional_batch_raises():
    mask = torch.ones(2, 2, 3, dtype=torch.bool)
    mask[0, 1] = False
    data = TensorDict(
        {
            ("history", "full"): torch.full((2, 2, 3), -1.0),
            ("masks", "all_attention_mask"): mask,
            ("masks", "all_assistant_mask"): mask,
            ("next", "teacher_log_probs", "full"): torch.full((2, 2, 3), -2.0),
        },
        batch_size=(2, 2),
    )
    student = TensorDictModule(torch.nn.Identity(), in_keys=[("history", "full")], out_keys=[("log_probs", "full")])
    with pytest.raises(ValueError, match="Some sequences"):
        DistillationLoss(actor_network=student)(data)


def test_distillation_multidimensional_batch_values():
    """Beyond TorchRL: a [2, 2] batch of full masks gives one k3 value per row, in the batch's shape."""
    mask = torch.ones(2, 2, 3, dtype=torch.bool)
    data = TensorDict(
        {
            ("history", "full"): torch.full((2, 2, 3), -1.0),
            ("masks", "all_attention_mask"): mask,
            ("masks", "all_assistant_mask"): mask,
            ("next", "teacher_log_probs", "full"): torch.full((2, 2, 3), -2.0),
        },
        batch_size=(2, 2),
    )
    student = TensorDictModule(torch.nn.Identity(), in_keys=[("history", "full")], out_keys=[("log_probs", "full")])
    out = DistillationLoss(actor_network=student, reduction="none")(data)
    expected = torch.expm1(torch.tensor(-1.0)) + 1.0  # k3 with d = -2 - (-1)
    torch.testing.assert_close(out.loss_distill, torch.full((2, 2), expected.item()))


@pytest.mark.parametrize("kl_direction", ["reverse", "forward"])
def test_distillation_loss(distill_data, kl_direction, hf_model, other_model, tokenizer):
    student = history_wrapper(hf_model, tokenizer)
    td = distill_data.clone()
    write_teacher_log_probs(td, other_model, tokenizer)
    assert ("next", "teacher_log_probs", "full") in td.keys(True)
    loss_fn = DistillationLoss(
        actor_network=student,
        tokenizer=tokenizer,
        kl_direction=kl_direction,
        tokenizer_kwargs={"chat_template_name": "qwen"},
    )
    loss_vals = loss_fn(td)
    assert isinstance(loss_vals, DistillationLossOutput)
    assert loss_vals.loss_distill.shape == () and loss_vals.kl_to_teacher.shape == ()
    assert torch.isfinite(loss_vals.loss_distill) and loss_vals.loss_distill.requires_grad
    assert not loss_vals.kl_to_teacher.requires_grad
    # the value, from the two models' own log-probs of the assistant tokens
    rows = []
    for chat in CHATS:
        s, t = assistant_log_probs(hf_model, tokenizer, chat), assistant_log_probs(other_model, tokenizer, chat)
        rows.append((k3_kl_token_estimate(t, s) if kl_direction == "reverse" else k3_kl_token_estimate(s, t)).mean())
    assert loss_vals.loss_distill.item() == pytest.approx(torch.stack(rows).mean().item(), rel=1e-3)
    loss_vals.loss_distill.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in hf_model.parameters())
    hf_model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kl_direction", ["reverse", "forward"])
def test_distillation_loss_zero_when_teacher_is_student(distill_data, kl_direction, hf_model, tokenizer):
    student = history_wrapper(hf_model, tokenizer)
    td = distill_data.clone()
    write_teacher_log_probs(td, hf_model, tokenizer)
    loss_fn = DistillationLoss(
        actor_network=student, tokenizer=tokenizer, kl_direction=kl_direction,
        tokenizer_kwargs={"chat_template_name": "qwen"},
    )  # fmt: skip
    torch.testing.assert_close(loss_fn(td).loss_distill, torch.zeros(()), atol=1e-5, rtol=0)


def test_distillation_loss_reduction_and_normalization(distill_data, hf_model, other_model, tokenizer):
    student = history_wrapper(hf_model, tokenizer)
    td = distill_data.clone()
    write_teacher_log_probs(td, other_model, tokenizer)
    outputs = {}
    for reduction in ("none", "mean", "sum"):
        loss_fn = DistillationLoss(
            actor_network=student, tokenizer=tokenizer, reduction=reduction,
            tokenizer_kwargs={"chat_template_name": "qwen"},
        )  # fmt: skip
        outputs[reduction] = loss_fn(td).loss_distill
    assert outputs["none"].shape == (2,)
    torch.testing.assert_close(outputs["mean"], outputs["none"].mean())
    torch.testing.assert_close(outputs["sum"], outputs["none"].sum())
    unnormalized = DistillationLoss(
        actor_network=student, tokenizer=tokenizer, reduction="none", normalize_by_seq_length=False,
        tokenizer_kwargs={"chat_template_name": "qwen"},
    )(td).loss_distill  # fmt: skip
    assert (unnormalized >= outputs["none"] - 1e-6).all()


def test_distillation_loss_custom_teacher_key(distill_data, hf_model, other_model, tokenizer):
    student = history_wrapper(hf_model, tokenizer)
    td = distill_data.clone()
    write_teacher_log_probs(td, other_model, tokenizer, log_probs_full_key=("kd_log_probs", "full"))
    loss_fn = DistillationLoss(
        actor_network=student, tokenizer=tokenizer, tokenizer_kwargs={"chat_template_name": "qwen"}
    )
    loss_fn.set_keys(teacher_log_prob=("next", "kd_log_probs", "full"))
    assert torch.isfinite(loss_fn(td).loss_distill)


def test_distillation_loss_assistant_only_mismatch_raises(distill_data, hf_model, other_model, tokenizer):
    student = history_wrapper(hf_model, tokenizer)
    td = distill_data.clone()
    write_teacher_log_probs(td, other_model, tokenizer)
    loss_fn = DistillationLoss(
        actor_network=student, tokenizer=tokenizer, assistant_only=False,
        tokenizer_kwargs={"chat_template_name": "qwen"},
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="assistant_only"):
        loss_fn(td)


def test_distillation_loss_missing_teacher_raises(distill_data, hf_model, tokenizer):
    student = history_wrapper(hf_model, tokenizer)
    loss_fn = DistillationLoss(
        actor_network=student, tokenizer=tokenizer, tokenizer_kwargs={"chat_template_name": "qwen"}
    )
    with pytest.raises(KeyError, match="Teacher log-probs"):
        loss_fn(distill_data.clone())
